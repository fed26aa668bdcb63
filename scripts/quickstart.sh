#!/bin/sh
# Quick start: install what is missing, build, start dpclipd in the foreground
# on a socket in a temporary runtime directory, and train the example model
# privately through it (CPU backend): examples/train_mlp.c, or with --python
# examples/train_transformer.py (PyTorch). Other arguments go to the trainer.
#
# The PyTorch example runs with /usr/bin/python3: scripts/deps.sh installs
# Debian's python3-torch, which only that python imports (a python3 from pyenv
# or a venv earlier on PATH has no torch). $DPCLIP_PYTHON names another.
#
# DPCLIP_MPS=1: dpclipd and the trainer share a CUDA MPS control daemon: the
# one already running (its pipe in $CUDA_MPS_PIPE_DIRECTORY, default
# /tmp/nvidia-mps), or, where a GPU and nvidia-cuda-mps-control are found,
# one of the run's own (its pipe in the run's temporary directory, so no
# other process of the machine uses it), stopped at the end. dpclipd's log
# says whether MPS is active. Without MPS every trainer<->daemon hand-off on a GPU
# is a context switch (docs/gpu.md, "MPS"); on the CPU it changes nothing.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=0
if [ "${1:-}" = --python ]; then python=1; shift; fi
py=${DPCLIP_PYTHON:-/usr/bin/python3}
sh scripts/deps.sh
sh scripts/build.sh build
if [ "$python" = 1 ] && ! "$py" -c "import torch" 2>/dev/null; then
    echo "quickstart: $py cannot import torch (Debian's python3-torch is for /usr/bin/python3;" \
         "set DPCLIP_PYTHON to a python3 that has torch)" >&2
    exit 1
fi

rundir=$(mktemp -d /tmp/dpclip.XXXXXX)
sock="$rundir/dpclipd.sock"
ready="$rundir/ready"
mkfifo "$ready"
mps=""
daemon=""
cleanup() {
    if [ -n "$daemon" ]; then kill -TERM "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
    if [ -n "$mps" ]; then echo quit | "$mps" >/dev/null 2>&1 || true; fi
    rm -rf "$rundir"
}
trap cleanup EXIT INT TERM
if [ "${DPCLIP_MPS:-0}" = 1 ]; then
    control=$(command -v nvidia-cuda-mps-control || true)
    running=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
    if [ -e "$running/control" ]; then
        export CUDA_MPS_PIPE_DIRECTORY="$running"
        echo "quickstart: using the CUDA MPS control daemon already running ($running)" >&2
    elif [ -z "$control" ] || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "quickstart: DPCLIP_MPS=1, but no GPU or no nvidia-cuda-mps-control here: running without MPS" >&2
    else
        export CUDA_MPS_PIPE_DIRECTORY="$rundir/mps" CUDA_MPS_LOG_DIRECTORY="$rundir/mps-log"
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if "$control" -d; then
            mps=$control
            echo "quickstart: started a CUDA MPS control daemon for this run ($CUDA_MPS_PIPE_DIRECTORY)" >&2
        else
            echo "quickstart: nvidia-cuda-mps-control -d failed: running without MPS" >&2
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
    fi
fi
./build/dpclipd --socket "$sock" --ledger-dir "$rundir/ledger" --ready-fd 3 3>"$ready" &
daemon=$!
read -r line <"$ready"
[ "$line" = READY ] || { echo "dpclipd did not start" >&2; exit 1; }

if [ "$python" = 1 ]; then
    # the checkout's package and build/libdpclip.so (the package's own search)
    PYTHONPATH="$root/python" "$py" examples/train_transformer.py --socket "$sock" "$@"
else
    ./build/train_mlp --socket "$sock" "$@"
fi
