#!/bin/sh
# Quick start: install what is missing, build, start dpclipd in the foreground
# on a socket in a temporary runtime directory, and train the example model
# privately through it (CPU backend): examples/train_mlp.c, or with --python
# examples/train_transformer.py (PyTorch). Other arguments go to the trainer.
#
# The PyTorch example runs with /usr/bin/python3: scripts/deps.sh installs
# Debian's python3-torch, which only that python imports (a python3 from pyenv
# or a venv earlier on PATH has no torch). $DPCLIP_PYTHON names another.
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
./build/dpclipd --socket "$sock" --ledger-dir "$rundir/ledger" --ready-fd 3 3>"$ready" &
daemon=$!
cleanup() { kill -TERM "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; rm -rf "$rundir"; }
trap cleanup EXIT INT TERM
read -r line <"$ready"
[ "$line" = READY ] || { echo "dpclipd did not start" >&2; exit 1; }

if [ "$python" = 1 ]; then
    # the checkout's package and build/libdpclip.so (the package's own search)
    PYTHONPATH="$root/python" "$py" examples/train_transformer.py --socket "$sock" "$@"
else
    ./build/train_mlp --socket "$sock" "$@"
fi
