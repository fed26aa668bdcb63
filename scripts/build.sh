#!/bin/sh
# Configure and build one build tree: scripts/build.sh DIR [cmake options...]
set -eu
dir=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S "$root" -B "$dir" -DDPCLIP_WERROR=ON "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j"$jobs"
