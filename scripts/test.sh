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

# clang-format over the C/C++/CUDA code (.clang-format; docs/lint.md): a
# file it would change fails the suite. Debian 12's clang-format is 14, the
# version the configuration is written for; with none installed the step is
# skipped rather than failed. Generated code (protobuf-c) lives in build*/.
echo "== format"
if command -v clang-format >/dev/null 2>&1; then
    if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        cfiles=$(git -C "$root" ls-files '*.c' '*.h' '*.cu' '*.cuh')
    else
        cfiles=$(find . -path './build*' -prune -o -type f \
            \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print | sed 's|^\./||' | sort)
    fi
    bad=""
    for f in $cfiles; do
        clang-format --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad="$bad $f"
    done
    if [ -n "$bad" ]; then
        for f in $bad; do
            clang-format --style=file --dry-run "$f" 2>&1 | head -n 20 >&2
        done
        echo "format: FAILED: clang-format would change:$bad" >&2
        echo "format: fix with: clang-format -i$bad   (then check the diff)" >&2
        exit 1
    fi
    echo "format: OK ($(clang-format --version | sed 's/.*version \([0-9.]*\).*/clang-format \1/'), $(echo "$cfiles" | wc -l) files)"
else
    echo "format: SKIPPED (clang-format not installed)"
fi

echo "== build (warnings are errors)"
sh scripts/build.sh build
echo "== tests"
(cd build && ctest --output-on-failure -j"$jobs")

echo "== build with ASan + UBSan (CPU backend)"
sh scripts/build.sh build-asan -DDPCLIP_SANITIZE=ON -DDPCLIP_CUDA=OFF
echo "== tests under ASan + UBSan"
(cd build-asan && ctest --output-on-failure -j"$jobs")
