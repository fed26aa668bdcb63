#!/bin/sh
# GPT-2-small ClipStep through dpclipd on the GPU, without and then with the
# CUDA MPS control daemon (when nvidia-cuda-mps-control exists).
#   bench/run_cuda_step.sh [BUILD_DIR] [bench_cuda_step options...]
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-"$root/build"}
[ $# -gt 0 ] && shift

run_one() {
    rd=$(mktemp -d /tmp/dpclip-cuda.XXXXXX)
    mkfifo "$rd/ready"
    "$build/dpclipd" --socket "$rd/d.sock" --ledger-dir "" --ready-fd 3 --workers 1 --log-level debug \
        3>"$rd/ready" 2>"$rd/log" &
    daemon=$!
    read -r line <"$rd/ready"
    [ "$line" = READY ] || { echo "dpclipd did not start" >&2; exit 1; }
    t0=$(date +%s.%N)
    cpu0=$(awk '{ print $14 + $15 }' "/proc/$daemon/stat" 2>/dev/null || echo 0)
    "$build/bench_cuda_step" --socket "$rd/d.sock" "$@" || true
    # What the daemon's polling costs: its CPU time while the benchmark ran
    # (the benchmark's own start-up included) over that wall time, in cores.
    if [ -r "/proc/$daemon/stat" ]; then
        awk -v t0="$t0" -v t1="$(date +%s.%N)" -v hz="$(getconf CLK_TCK)" -v c0="$cpu0" \
            '{ cpu = ($14 + $15 - c0) / hz; printf "{\"bench\":\"cuda_step_daemon_cpu\",\"cpu_s\":%.2f,\"wall_s\":%.2f,\"cores\":%.3f}\n", cpu, t1 - t0, cpu / (t1 - t0) }' \
            "/proc/$daemon/stat"
    fi
    kill -TERM "$daemon"; wait "$daemon" || true
    # The daemon's own phase timing of the last steps (debug log).
    grep -E 'warn|error|: step ' "$rd/log" | tail -n 3 >&2
    rm -rf "$rd"
}

run_one "$@"
# then under an MPS control daemon of this run's own (rows_lib.sh's)
# shellcheck disable=SC2034 # (rows_lib.sh's)
me=run_cuda_step
rundir=$(mktemp -d /tmp/dpclip-mps.XXXXXX)
. "$root/bench/rows_lib.sh"
if mps_start; then
    run_one "$@"
    mps_stop
    sleep 1
fi
rm -rf "$rundir"
