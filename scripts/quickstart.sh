#!/bin/sh
# Quick start: install what is missing, build, start dpclipd in the foreground
# on a socket in a temporary runtime directory, and train the example model
# privately through it (CPU backend).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sh scripts/deps.sh
sh scripts/build.sh build

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

./build/train_mlp --socket "$sock" "$@"
