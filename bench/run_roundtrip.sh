#!/bin/sh
# Round-trip benchmark: start ./build/dpclipd on a socket in a temporary
# directory (READY on fd 3, as scripts/quickstart.sh does), run
# bench_roundtrip against it, stop the daemon. Prints the benchmark's JSON.
#   bench/run_roundtrip.sh [BUILD_DIR] [bench_roundtrip options...]
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-"$root/build"}
[ $# -gt 0 ] && shift
[ -x "$build/dpclipd" ] && [ -x "$build/bench_roundtrip" ] ||
    { echo "build first: scripts/build.sh $build" >&2; exit 1; }

rundir=$(mktemp -d /tmp/dpclip-bench.XXXXXX)
sock="$rundir/dpclipd.sock"
ready="$rundir/ready"
mkfifo "$ready"
"$build/dpclipd" --socket "$sock" --ledger-dir "" --ready-fd 3 --log-level warn 3>"$ready" &
daemon=$!
cleanup() { kill -TERM "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; rm -rf "$rundir"; }
trap cleanup EXIT INT TERM
read -r line <"$ready"
[ "$line" = READY ] || { echo "dpclipd did not start" >&2; exit 1; }

"$build/bench_roundtrip" --socket "$sock" "$@"
