# shellcheck shell=sh disable=SC2154,SC2317
# Shared by bench/run_step_rows.sh and bench/run_parallel_rows.sh (sourced,
# after they set $me, $build and $rundir): fresh daemons for each row, the
# rows' JSON lines tagged, and an MPS control daemon of the run's own.
# (SC2154: those, $rows, $plain and $mps are the sourcing script's;
# SC2317: mps_stop is redefined once MPS runs.)

daemons=""

# daemon_start SOCKET [GPU]: one dpclipd on SOCKET, seeing only GPU where
# given (one daemon per GPU; each its own NCCL host id, so that two on one
# GPU would still take NCCL's socket transport), ready before it returns.
daemon_start() {
    rm -f "$rundir/ready"
    mkfifo "$rundir/ready"
    if [ -n "${2:-}" ]; then
        CUDA_VISIBLE_DEVICES=$2 NCCL_HOSTID="$me-$$-$2" "$build/dpclipd" --socket "$1" \
            --ledger-dir "" --ready-fd 3 --log-level info 3>"$rundir/ready" \
            2>>"$rundir/daemon.log" &
    else
        "$build/dpclipd" --socket "$1" --ledger-dir "" --ready-fd 3 --log-level info \
            3>"$rundir/ready" 2>>"$rundir/daemon.log" &
    fi
    daemons="$daemons $!"
    read -r line <"$rundir/ready" || line=""
    if [ "$line" != READY ]; then
        echo "$me: dpclipd did not start" >&2
        cat "$rundir/daemon.log" >&2
        exit 1
    fi
}

daemons_stop() {
    for pid in $daemons; do
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    daemons=""
}

# tag ROW MPS: the JSON lines of stdin with the row and MPS added
tag() {
    sed -n "s/^{/{\"row\": \"$1\", \"mps\": $2, /p"
}

# row_end ROW MPS STATUS: the row's bench output ($rundir/out) tagged, its
# daemons stopped, and a failure said on stdout (a JSON line) and stderr
# (its stderr's end, $rundir/err), which sets failed=1
row_end() {
    tag "$1" "$2" <"$rundir/out"
    daemons_stop
    if [ "$3" != 0 ]; then
        echo "{\"row\": \"$1\", \"mps\": $2, \"failed\": $3}"
        echo "$me: row $1 (MPS $2) failed with status $3:" >&2
        tail -n 20 "$rundir/err" >&2
        failed=1
    fi
}

# rows_run: run_row (the sourcing script's) for every row of $rows without
# MPS unless $plain is 0, then under MPS unless $mps is 0; exits 1 if any
# row failed, else 0
rows_run() {
    failed=0
    if [ "$plain" = 1 ]; then
        for row in $(echo "$rows" | tr , ' '); do run_row "$row" false; done
    fi
    [ "$mps" = 1 ] || exit "$failed"
    mps_start || exit "$failed"
    for row in $(echo "$rows" | tr , ' '); do run_row "$row" true; done
    exit "$failed"
}

mps_stop() { :; }

# mps_start: an MPS control daemon of this run's own, which the trainers and
# the daemons share through the pipe directory in their environment; false
# (with a "skipped" line) where there is none to start.
mps_start() {
    control=$(command -v nvidia-cuda-mps-control || true)
    if [ -z "$control" ]; then
        echo '{"mps": true, "skipped": "nvidia-cuda-mps-control not installed"}'
        return 1
    fi
    CUDA_MPS_PIPE_DIRECTORY="$rundir/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$rundir/mps-log"
    export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! "$control" -d; then
        echo '{"mps": true, "skipped": "nvidia-cuda-mps-control -d failed"}'
        return 1
    fi
    mps_stop() { echo quit | "$control" >/dev/null 2>&1 || true; }
    sleep 1
}
