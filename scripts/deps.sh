#!/bin/sh
# Installs the Debian packages dpclip needs to build and test, if any are
# missing. Needs root (or sudo) only when something must be installed.
set -eu

PKGS="gcc make cmake pkgconf libuv1-dev libprotobuf-c-dev protobuf-c-compiler \
libcmocka-dev libopenblas-dev"
# The node service: config file (inih), status endpoint (libmicrohttpd),
# systemd notify/socket activation (libsystemd), dpclipctl (libcurl, jansson);
# the status test parses /metrics with prometheus_client's own parser; the
# man page test renders the pages with groff; scripts/test.sh lints the
# Python code with flake8 (docs/lint.md; the package has no /usr/bin/flake8:
# it runs as python3 -m flake8).
PKGS="$PKGS libinih-dev libmicrohttpd-dev libsystemd-dev libcurl4-openssl-dev libjansson-dev \
python3 python3-prometheus-client groff-base python3-flake8"
# The fuzz targets (tests/fuzz) need clang's libFuzzer and sanitizer runtimes;
# scripts/test.sh checks the C/CUDA format with clang-format (14, .clang-format).
PKGS="$PKGS clang libclang-rt-14-dev clang-format"
# The Python package's tests need PyTorch from Debian; opt out with DPCLIP_NO_TORCH=1.
if [ "${DPCLIP_NO_TORCH:-0}" != 1 ] && [ -d "$(dirname "$0")/../python" ] && \
   [ -n "$(ls "$(dirname "$0")/../python" 2>/dev/null)" ]; then
    PKGS="$PKGS python3 python3-torch python3-pytest python3-venv python3-psutil"
    ZOO=1
fi

# The model zoo (python/tests/test_zoo.py, docs/models.md) needs Hugging Face
# transformers, which Debian does not package: pip installs it into .venv-zoo
# in the repository (--system-site-packages: it sees Debian's torch 1.13,
# hence the pin, 4.45.x being a release that supports it), never into the
# system Python. PEFT (the zoo's adapters) goes beside it without its
# dependencies (it would upgrade Debian's torch, a pre-release to pip; its
# others are transformers' and python3-psutil). Where PyPI is unreachable it
# says so and the zoo ctest reports skipped; this script never fails for it.
zoo_venv() {
    repo=$(cd "$(dirname "$0")/.." && pwd)
    venv="$repo/.venv-zoo"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import transformers" 2>/dev/null; then
        "$venv/bin/python" -c "import peft" 2>/dev/null || zoo_peft "$venv"
        return 0
    fi
    why=""
    if [ ! -x "$venv/bin/python" ]; then
        why=$(/usr/bin/python3 -m venv --system-site-packages "$venv" 2>&1) ||
            { echo "zoo: transformers not installed (venv: $(echo "$why" | tail -n 1));" \
                   "the zoo tests will be skipped"; return 0; }
    fi
    echo "dpclip: installing transformers 4.45.x into .venv-zoo (the model zoo tests)"
    why=$("$venv/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 \
            'transformers>=4.45,<4.46' 2>&1) ||
        { echo "zoo: transformers not installed ($(echo "$why" | tail -n 1));" \
               "the zoo tests will be skipped"; return 0; }
    zoo_peft "$venv"
    return 0
}

zoo_peft() {
    echo "dpclip: installing peft 0.13.2 into .venv-zoo (the zoo's adapters)"
    why=$("$1/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 \
            --no-deps 'peft==0.13.2' 'accelerate==0.34.2' 2>&1) ||
        echo "zoo: peft not installed ($(echo "$why" | tail -n 1)); the zoo runs without" \
             "its adapter rows"
    return 0
}

missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        missing="$missing $p"
done
if [ -z "$missing" ]; then
    [ "${ZOO:-0}" = 1 ] && zoo_venv
    exit 0
fi

echo "dpclip: installing Debian packages:$missing"
echo "dpclip: (a few hundred MB; 1-5 minutes on a fresh machine, mostly python3-torch and clang)"
SUDO=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "dpclip: need root to install:$missing" >&2; exit 1; }
    SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
# A fresh machine's unattended-upgrades often holds the dpkg lock for its
# first minutes: wait for it (up to 10 minutes) rather than fail.
lock="-o DPkg::Lock::Timeout=600"
# shellcheck disable=SC2086
$SUDO apt-get $lock update -qq
# shellcheck disable=SC2086
$SUDO apt-get $lock install -y -qq --no-install-recommends $missing >/dev/null
echo "dpclip: installed:$missing"
[ "${ZOO:-0}" = 1 ] && zoo_venv
exit 0
