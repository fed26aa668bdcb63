#!/bin/sh
# The README's one-GPU table: each row's bench against a fresh dpclipd (a
# daemon still holding one model's workspace would count in the next one's
# memory), without MPS and then under the CUDA MPS control daemon.
#
#   bench/run_step_rows.sh [BUILD_DIR] [--rows LIST] [--repeat N] [--no-mps | --mps-only] [--cpu]
#
# Rows (LIST is comma-separated; default gpt,gpt_long,llama1b,hf_gpt2):
#   gpt       GPT-2-small-like, bf16, B=8, T=1024   (bench_torch_step.py)
#   gpt_long  the same, B=2, T=4096
#   llama1b   Llama-1B-like, bf16, B=4, T=2048
#   llama1b_nokept  the same against a daemon that keeps no per-sample
#             gradients (DPCLIP_CUDA_SGRAD=0: gpu.sample_grads_max 0)
#   hf_gpt2   Hugging Face GPT-2 small, AdamW       (bench_hf_step.py)
#   host      the trainer's host time per step, GPT-2 (bench_host_overhead.py)
# --mps-only: the MPS half alone (a run split to fit a time limit).
# --cpu: tiny models on the CPU, no MPS (a smoke test of this script).
# Each bench's JSON lines are printed with "row" and "mps" added; a row that
# cannot run says why in a line of its own ("skipped"), one that fails says
# so ("failed": its status, its stderr's end on stderr), the other rows go
# on, and the script's status is 1.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
case "${1:-}" in -*|"") ;; *) build=$1; shift ;; esac
rows=gpt,gpt_long,llama1b,hf_gpt2
repeat=5
mps=1
plain=1
cpu=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rows) rows=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --no-mps) mps=0; shift ;;
        --mps-only) plain=0; shift ;;
        --cpu) cpu=1; mps=0; shift ;;
        *) echo "run_step_rows.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ "$mps" = 0 ] && [ "$plain" = 0 ]; then
    echo "run_step_rows.sh: --mps-only with --no-mps (or --cpu) leaves no rows to run" >&2
    exit 2
fi
py=${DPCLIP_PYTHON:-python3}
me=run_step_rows.sh
[ -x "$build/dpclipd" ] || { echo "$me: no $build/dpclipd (build first)" >&2; exit 1; }
export DPCLIP_LIBRARY=${DPCLIP_LIBRARY:-$build/libdpclip.so}
export PYTHONUNBUFFERED=1
rundir=$(mktemp -d /tmp/dpclip-rows.XXXXXX)
. "$root/bench/rows_lib.sh"
trap 'daemons_stop; mps_stop; rm -rf "$rundir"' EXIT INT TERM

# run_row ROW MPS: one row's bench against a daemon of its own
run_row() {
    row=$1
    case "$row" in
        gpt) model=gpt; size="" ;;
        gpt_long) model=gpt; size="--batch 2 --seq 4096" ;;
        llama1b|llama1b_nokept) model=llama1b; size="" ;;
        hf_gpt2|host) model=$row; size="" ;;
        *) echo "run_step_rows.sh: unknown row $row" >&2; exit 2 ;;
    esac
    dev="" tiny="" precision="--precision bf16"
    if [ "$cpu" = 1 ]; then
        # the rows' models in miniature (gpt_long: fewer, longer sequences)
        dev="--device cpu" precision="--precision fp32"
        shape="--seq 12 --batch 3" steps=2
        [ "$row" = gpt_long ] && shape="--seq 24 --batch 2"
        [ "$row" = host ] && steps=3
        size="" tiny="--blocks 1 --d 32 --heads 2 --ffn 64 --vocab 67 $shape --steps $steps --warmup 1"
    fi
    if [ "$row" = hf_gpt2 ] && ! "$py" -c "import transformers" >/dev/null 2>&1; then
        echo "{\"row\": \"$row\", \"mps\": $2, \"skipped\": \"transformers is not importable by $py\"}"
        return 0
    fi
    sock="$rundir/$row.$2.sock"
    if [ "$row" = llama1b_nokept ]; then
        export DPCLIP_CUDA_SGRAD=0 # the daemon's alone: the bench reads no DPCLIP_CUDA_*
        daemon_start "$sock"
        unset DPCLIP_CUDA_SGRAD
    else
        daemon_start "$sock"
    fi
    rc=0
    case "$row" in
        hf_gpt2)
            if [ "$cpu" = 1 ]; then hf="--tiny --device cpu --fp32 --steps 2 --warmup 1"; else hf=""; fi
            "$py" "$root/bench/bench_hf_step.py" --socket "$sock" --models gpt2 \
                --modes plain,dpclip --repeat "$repeat" $hf >"$rundir/out" 2>"$rundir/err" || rc=$? ;;
        host)
            "$py" "$root/bench/bench_host_overhead.py" --socket "$sock" --model gpt $dev $tiny \
                >"$rundir/out" 2>"$rundir/err" || rc=$? ;;
        *)
            "$py" "$root/bench/bench_torch_step.py" --socket "$sock" --model "$model" $size \
                $precision --repeat "$repeat" --no-sync $dev $tiny >"$rundir/out" 2>"$rundir/err" || rc=$? ;;
    esac
    row_end "$row" "$2" "$rc"
}

rows_run
