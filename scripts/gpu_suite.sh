#!/bin/sh
# The GPU suite (CONTRIBUTING.md, "The GPU suite") in parts that each fit a
# time limit, one line of result per part, so that a run cut short says
# which part it did not finish instead of looking like a hang in the middle
# of one long pytest run.
#
#   scripts/gpu_suite.sh [BUILD_DIR] [--list] [--only PART,...] [--timeout S]
#
# Parts (in order): ctest (the GPU ctests), then each Python test file that
# runs on CUDA: cuda, cuda_flag, outputs, planner, accumulate,
# accumulate_parallel, fsdp, fsdp_accumulate. Each part runs under its own
# limit (--timeout, default 300 s); its line says "passed", "failed" (its
# output's end follows on stderr) or "timed out", with its counts and
# seconds. The status is 1 if any part failed or timed out. Without a GPU
# the parts run as they would anywhere and report their skips (the CUDA
# tests skip themselves).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
case "${1:-}" in -*|"") ;; *) build=$1; shift ;; esac
parts="ctest cuda cuda_flag outputs planner accumulate accumulate_parallel fsdp fsdp_accumulate"
only=""
limit=300
list=0
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=$(echo "$2" | tr , ' '); shift 2 ;;
        --timeout) limit=$2; shift 2 ;;
        --list) list=1; shift ;;
        *) echo "gpu_suite.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ "$list" = 1 ]; then
    echo "$parts" | tr ' ' '\n'
    exit 0
fi
for p in $only; do
    case " $parts " in *" $p "*) ;; *) echo "gpu_suite.sh: no part $p (--list)" >&2; exit 2 ;; esac
done
[ -n "$only" ] && parts=$only
[ -x "$build/dpclipd" ] || { echo "gpu_suite.sh: no $build/dpclipd (build first)" >&2; exit 1; }
py=${DPCLIP_PYTHON:-python3}
# A sanitizer runtime preloaded for Python (the suite's ASan run) goes to
# the parts' Python alone: procps' pkill hung with it preloaded
preload=${LD_PRELOAD:-}
unset LD_PRELOAD
export DPCLIPD="${DPCLIPD:-$build/dpclipd}"
export DPCLIP_LIBRARY="${DPCLIP_LIBRARY:-$build/libdpclip.so}"
export NCCL_NVLS_ENABLE=0
# the parts' temporary files (their daemons' sockets) in a folder of this
# run's, so that a part cut short has its own daemons stopped, no one else's
scratch=$(mktemp -d /tmp/dpclip-gpu-suite.XXXXXX)
log=$scratch/log
trap 'rm -rf "$scratch"' EXIT INT TERM

# counts WORD: the number before WORD in the part's summary line, or 0
counts() {
    n=$(grep -oE "\b[0-9]+ $1" "$log" | tail -n 1 | cut -d' ' -f1)
    echo "${n:-0}"
}

failed=0
for part in $parts; do
    t0=$(date +%s)
    rc=0
    if [ "$part" = ctest ]; then
        (cd "$build" && timeout -s KILL "$limit" ctest -R 'cuda|gpu|group|logical|hostile' \
            --output-on-failure) >"$log" 2>&1 || rc=$?
        passed=$(grep -cE "Test +#[0-9]+: .* Passed" "$log" || true)
        skipped=$(grep -cE "Test +#[0-9]+: .*Skipped" "$log" || true)
        bad=$(grep -cE "Test +#[0-9]+: .*(Failed|Timeout|Exception)" "$log" || true)
    else
        TMPDIR=$scratch timeout -s KILL "$limit" env ${preload:+LD_PRELOAD=$preload} \
            "$py" -m pytest -q -rfE --tb=short -p no:cacheprovider \
            "$root/python/tests/test_$part.py" >"$log" 2>&1 || rc=$?
        passed=$(counts passed)
        skipped=$(counts skipped)
        bad=$(($(counts failed) + $(counts error)))
    fi
    secs=$(($(date +%s) - t0))
    if [ "$rc" = 137 ] || [ "$rc" = 124 ]; then
        state="timed out"
        if [ "$part" != ctest ]; then  # the dots of pytest's progress lines so far
            passed=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' "$log" | tr -cd . | wc -c)
        fi
        # a killed pytest leaves its fixtures' daemons behind
        pkill -9 -f -- "--socket $scratch/" 2>/dev/null || true
    elif [ "$rc" = 0 ] || { [ "$part" != ctest ] && [ "$rc" = 5 ]; }; then
        state=passed  # (pytest's 5: every test deselected or none collected)
    else
        state=failed
    fi
    echo "{\"part\": \"$part\", \"result\": \"$state\", \"passed\": $passed, \"skipped\": $skipped," \
         "\"failed\": $bad, \"seconds\": $secs, \"limit\": $limit}"
    if [ "$state" != passed ]; then
        failed=1
        # each failure's header and error lines first: a long warnings
        # summary can push them out of the output's end
        echo "gpu_suite.sh: part $part $state (status $rc); its failures' errors:" >&2
        grep -E '^(E |_{3,} .* _{3,}$)' "$log" | head -n 80 >&2 || true
        echo "gpu_suite.sh: part $part: its output's end:" >&2
        tail -n 30 "$log" >&2
    fi
done
exit "$failed"
