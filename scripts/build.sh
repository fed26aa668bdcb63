#!/bin/sh
# Configure and build one build tree: scripts/build.sh DIR [cmake options...]
# The CUDA backend is built when nvcc is found (about 3 minutes, against 40 s
# without it); DPCLIP_CUDA=OFF in the environment skips it.
set -eu
dir=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S "$root" -B "$dir" -DDPCLIP_WERROR=ON ${DPCLIP_CUDA:+-DDPCLIP_CUDA=$DPCLIP_CUDA} "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j"$jobs"
