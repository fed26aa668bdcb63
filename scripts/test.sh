#!/bin/sh
# The whole test suite: install what is missing, build with warnings as
# errors and run every test; then rebuild with AddressSanitizer and
# UndefinedBehaviorSanitizer (CPU-only) and run them again.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sh scripts/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)

# flake8 over the Python code (.flake8; docs/lint.md): a finding fails the
# suite. Debian's python3-flake8 (deps.sh) runs as python3 -m flake8; with no
# python3 that has it, the step is skipped rather than failed.
echo "== lint"
lint=""
for py in ${DPCLIP_PYTHON:-} /usr/bin/python3 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -m flake8 --version >/dev/null 2>&1; then
        lint="$py -m flake8"
        break
    fi
done
if [ -z "$lint" ] && command -v flake8 >/dev/null 2>&1; then
    lint=flake8
fi
if [ -n "$lint" ]; then
    $lint python bench examples scripts tests/*.py || { echo "lint: FAILED (flake8's findings above)" >&2; exit 1; }
    echo "lint: OK (flake8 $($lint --version | head -n 1 | cut -d" " -f1))"
else
    echo "lint: SKIPPED (flake8 not installed)"
fi

echo "== build (warnings are errors)"
sh scripts/build.sh build
echo "== tests"
(cd build && ctest --output-on-failure -j"$jobs")

echo "== build with ASan + UBSan (CPU backend)"
sh scripts/build.sh build-asan -DDPCLIP_SANITIZE=ON -DDPCLIP_CUDA=OFF
echo "== tests under ASan + UBSan"
(cd build-asan && ctest --output-on-failure -j"$jobs")
