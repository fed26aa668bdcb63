#!/bin/sh
# Runs one libFuzzer target for a bounded time from seeds written now:
#   run.sh FUZZER SEEDS TARGET SECONDS WORKDIR [libFuzzer flags...]
# FUZZER empty or missing: the build found no clang with libFuzzer, so the
# test exits 77, which ctest reports as skipped (SKIP_RETURN_CODE), never
# as passed. A crash, leak, sanitizer report, hang (-timeout) or oracle
# failure fails the test; the input is kept in WORKDIR/crashes/.
set -eu
fuzzer=$1 seeds=$2 target=$3 secs=$4 work=$5
shift 5
if [ -z "$fuzzer" ] || [ ! -x "$fuzzer" ]; then
    echo "fuzz_$target: not built (needs clang with libFuzzer, e.g. Debian's clang); skipped"
    exit 77
fi
rm -rf "$work"
mkdir -p "$work/corpus" "$work/crashes"
"$seeds" "$target" "$work/corpus"
# libFuzzer's own exit codes for a crash (77) and a hang (70) would read as
# "skipped" and as something else: make every failure 1.
exec "$fuzzer" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
    -error_exitcode=1 -timeout_exitcode=1 -print_final_stats=1 \
    -artifact_prefix="$work/crashes/" "$@" "$work/corpus"
