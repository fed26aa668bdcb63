#!/bin/sh
# The whole test suite: install what is missing, build with warnings as
# errors and run every test; then rebuild with AddressSanitizer and
# UndefinedBehaviorSanitizer (CPU-only) and run them again.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sh scripts/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)

echo "== build (warnings are errors)"
sh scripts/build.sh build
echo "== tests"
(cd build && ctest --output-on-failure -j"$jobs")

echo "== build with ASan + UBSan (CPU backend)"
sh scripts/build.sh build-asan -DDPCLIP_SANITIZE=ON -DDPCLIP_CUDA=OFF
echo "== tests under ASan + UBSan"
(cd build-asan && ctest --output-on-failure -j"$jobs")
