#!/bin/sh
# Norm groups on the GPU: GPT-2-small's layers split over 2 and 4 members of
# one daemon, then over two daemons on the same GPU linked through NCCL.
# Two daemons on one GPU is a test setting: each gets its own NCCL_HOSTID, so
# NCCL takes them for two hosts and uses its socket transport (over lo).
#   bench/run_cuda_group.sh [BUILD_DIR] [bench_cuda_group options...]
# DPCLIPD_ARGS: more daemon options (e.g. --set groups.fuse=false for the
# phased path); DPCLIP_NO_MPS=1 skips the run under MPS.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-"$root/build"}
[ $# -gt 0 ] && shift
export NCCL_NVLS_ENABLE=0
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
rundir=$(mktemp -d /tmp/dpclip-group.XXXXXX)
pids=""
trap 'for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done; rm -rf "$rundir"' EXIT

start() { # start NAME
    mkfifo "$rundir/$1.ready"
    NCCL_HOSTID="dpclip-bench-$1" "$build/dpclipd" --socket "$rundir/$1.sock" --ledger-dir "" \
        --ready-fd 3 --workers 1 --log-level warn ${DPCLIPD_ARGS:-} 3>"$rundir/$1.ready" 2>"$rundir/$1.log" &
    pids="$pids $!"
    read -r line <"$rundir/$1.ready"
    [ "$line" = READY ] || { echo "dpclipd $1 did not start" >&2; cat "$rundir/$1.log" >&2; exit 1; }
}
run() {
    start a
    start b
    "$build/bench_cuda_group" --socket "$rundir/a.sock" --socket2 "$rundir/b.sock" "$@"
    for p in $pids; do kill -TERM "$p"; wait "$p" || true; done
    pids=""
    cat "$rundir/a.log" "$rundir/b.log" >&2
    rm -f "$rundir"/*
}
run "$@"
# Under MPS the two daemons' kernels share the GPU: NCCL's waiting kernel in
# one daemon no longer holds the GPU while the other computes its norms.
if [ -z "${DPCLIP_NO_MPS:-}" ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY="$rundir.mps" CUDA_MPS_LOG_DIRECTORY="$rundir.mpslog"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        sleep 1
        run "$@"
        echo quit | nvidia-cuda-mps-control
    fi
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
fi
