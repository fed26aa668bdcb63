#!/bin/sh
# GPT-2-small ClipStep through dpclipd on the GPU, without and then with the
# CUDA MPS control daemon (when nvidia-cuda-mps-control exists).
#   bench/run_cuda_step.sh [BUILD_DIR] [bench_cuda_step options...]
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-"$root/build"}
[ $# -gt 0 ] && shift

run_one() {
    rundir=$(mktemp -d /tmp/dpclip-cuda.XXXXXX)
    mkfifo "$rundir/ready"
    "$build/dpclipd" --socket "$rundir/d.sock" --ledger-dir "" --ready-fd 3 --workers 1 --log-level debug \
        3>"$rundir/ready" 2>"$rundir/log" &
    daemon=$!
    read -r line <"$rundir/ready"
    [ "$line" = READY ] || { echo "dpclipd did not start" >&2; exit 1; }
    t0=$(date +%s.%N)
    cpu0=$(awk '{ print $14 + $15 }' "/proc/$daemon/stat" 2>/dev/null || echo 0)
    "$build/bench_cuda_step" --socket "$rundir/d.sock" "$@" || true
    # What the daemon's polling costs: its CPU time while the benchmark ran
    # (the benchmark's own start-up included) over that wall time, in cores.
    if [ -r "/proc/$daemon/stat" ]; then
        awk -v t0="$t0" -v t1="$(date +%s.%N)" -v hz="$(getconf CLK_TCK)" -v c0="$cpu0" \
            '{ cpu = ($14 + $15 - c0) / hz; printf "{\"bench\":\"cuda_step_daemon_cpu\",\"cpu_s\":%.2f,\"wall_s\":%.2f,\"cores\":%.3f}\n", cpu, t1 - t0, cpu / (t1 - t0) }' \
            "/proc/$daemon/stat"
    fi
    kill -TERM "$daemon"; wait "$daemon" || true
    # The daemon's own phase timing of the last steps (debug log).
    grep -E 'warn|error|: step ' "$rundir/log" | tail -n 3 >&2
    rm -rf "$rundir"
}

run_one "$@"
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXXXX)
    export CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXXXX)
    if nvidia-cuda-mps-control -d; then
        sleep 1
        run_one "$@"
        echo quit | nvidia-cuda-mps-control
        sleep 1
    else
        echo '{"bench":"cuda_step","mps":"could not start nvidia-cuda-mps-control"}'
    fi
else
    echo '{"bench":"cuda_step","mps":"nvidia-cuda-mps-control not installed"}'
fi
