#!/bin/sh
# Norm groups on the GPU: GPT-2-small's layers split over 2 and 4 members of
# one daemon, then over two daemons on the same GPU linked through NCCL.
# Two daemons on one GPU is a test setting: each gets its own NCCL_HOSTID, so
# NCCL takes them for two hosts and uses its socket transport (over lo).
# On a host with 2 or more GPUs (nvidia-smi -L, or DPCLIP_BENCH_GPUS=N; the
# entries of CUDA_VISIBLE_DEVICES when it is set), then also:
#  - two daemons, one per GPU (CUDA_VISIBLE_DEVICES=0 and =1), no NCCL_HOSTID:
#    NCCL sees two GPUs of one host and links them by P2P/NVLink;
#  - one daemon serving the first N GPUs (N at most 4), the members' buffers
#    spread over them: the group reduced inside that daemon.
#   bench/run_cuda_group.sh [BUILD_DIR] [bench_cuda_group options...]
# DPCLIPD_ARGS: more daemon options (e.g. --set groups.fuse=false for the
# phased path); DPCLIP_NO_MPS=1 skips the run under MPS.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-"$root/build"}
[ $# -gt 0 ] && shift
export NCCL_NVLS_ENABLE=0
# NCCL's bootstrap over loopback: every daemon is on this host
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
rundir=$(mktemp -d /tmp/dpclip-group.XXXXXX)
pids=""
trap 'for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done; rm -rf "$rundir"' EXIT

# The GPUs this script may use: CUDA_VISIBLE_DEVICES's entries when it is
# set (the bench and the daemons must agree on them), else 0..N-1 for
# DPCLIP_BENCH_GPUS=N or nvidia-smi's count.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    visible=$CUDA_VISIBLE_DEVICES
else
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    visible=$(seq -s, 0 $((${DPCLIP_BENCH_GPUS:-${n:-0}} - 1)))
fi
count=$(printf '%s\n' "$visible" | tr ',' '\n' | grep -c . || true)
gpus=${DPCLIP_BENCH_GPUS:-$count}
if [ "$gpus" -gt "$count" ]; then gpus=$count; fi
if [ "$gpus" -gt 4 ]; then gpus=4; fi # the bench splits over 4 members at most
gpu_list() { # gpu_list FIRST LAST: those entries of $visible, comma-separated
    printf '%s' "$visible" | cut -d, -f"$(($1 + 1))-$(($2 + 1))"
}

start() { # start NAME HOSTID [CUDA_VISIBLE_DEVICES]; an empty HOSTID sets none
    mkfifo "$rundir/$1.ready"
    (
        if [ -n "$2" ]; then export NCCL_HOSTID="$2"; else unset NCCL_HOSTID; fi
        if [ -n "${3:-}" ]; then export CUDA_VISIBLE_DEVICES="$3"; fi
        # shellcheck disable=SC2086 # DPCLIPD_ARGS: several options, split on purpose
        exec "$build/dpclipd" --socket "$rundir/$1.sock" --ledger-dir "" \
            --ready-fd 3 --workers 1 --log-level warn ${DPCLIPD_ARGS:-}
    ) 3>"$rundir/$1.ready" 2>"$rundir/$1.log" &
    pids="$pids $!"
    read -r line <"$rundir/$1.ready"
    [ "$line" = READY ] || { echo "dpclipd $1 did not start" >&2; cat "$rundir/$1.log" >&2; exit 1; }
}
failed=0
bench() { # a layout that fails is reported, and the others still run
    "$build/bench_cuda_group" "$@" || { echo "bench_cuda_group $*: failed" >&2; failed=1; }
}
stop() { # every daemon started, then their logs
    for p in $pids; do kill -TERM "$p"; wait "$p" || true; done
    pids=""
    cat "$rundir"/*.log >&2
    rm -f "$rundir"/*
}
run() {
    start a dpclip-bench-a
    start b dpclip-bench-b
    bench --socket "$rundir/a.sock" --socket2 "$rundir/b.sock" "$@"
    stop
}
# Without MPS only: each daemon has a GPU of its own here (MPS was for two
# daemons sharing one), and the one daemon serves its GPUs alone.
run_gpus() {
    start a "" "$(gpu_list 0 0)"
    start b "" "$(gpu_list 1 1)"
    bench --gpus 2 --socket "$rundir/a.sock" --socket2 "$rundir/b.sock" "$@"
    stop
    start c "" "$(gpu_list 0 $((gpus - 1)))"
    bench --gpus "$gpus" --socket "$rundir/c.sock" "$@"
    stop
}
run "$@"
if [ "$gpus" -ge 2 ]; then
    run_gpus "$@"
fi
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
exit "$failed"
