#!/bin/sh
# The README's multi-GPU table in one command: each row's bench against
# fresh dpclipd(s) (a daemon still holding one row's workspace would count
# in the next one's memory), without MPS and then under an MPS control
# daemon of the run's own, so that a lent multi-GPU machine's time goes on
# measuring, not on setting up.
#
#   bench/run_parallel_rows.sh [BUILD_DIR] [--rows LIST] [--repeat N]
#                              [--no-mps | --mps-only] [--timeout S] [--cpu]
#
# Rows (LIST is comma-separated; default every one; bf16 autocast; each
# against the same layout without privacy, the modes taking turns):
#   ddp2, ddp4          GPT-2-small-like, 2 / 4 data-parallel ranks, one
#                       daemon, against DDP        (bench_parallel.py --mode ddp)
#   pipe                GPT-2-small-like, 2 pipeline stages on 2 GPUs, one
#                       daemon, 1F1B, 8 micro-batches of 8
#   pipe_gpipe          the same, GPipe
#   pipe_daemons        the same, 1F1B, one daemon per GPU (norms exchanged
#                       over NCCL)
#   pipe_step           the same, one batch a step (the exchange's time from
#                       the last member's arrival: reduction_ms)
#   fsdp2, fsdp4        Llama-1B-like, FSDP2 over 2 / 4 GPUs, B=4 a rank,
#                       T=2048                    (bench_fsdp.py)
#   fsdp_logical2, fsdp_logical4
#                       GPT-2-small-like, FSDP2 over 2 / 4 GPUs, logical
#                       batch 512 in micro-batches of 8
# A row that needs more GPUs than the machine has says so ("skipped"), as
# does a row of one daemon per GPU under --cpu; one that fails or runs past
# --timeout seconds (default 300; it is killed) says so ("failed": its
# status, its stderr's end on stderr), the other rows go on, and the
# script's status is 1. Each bench's JSON lines are printed with "row" and
# "mps" added.
# --mps-only: the MPS half alone. --cpu: tiny models on gloo ranks on the
# CPU, no MPS (a smoke test of this script).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build"
case "${1:-}" in -*|"") ;; *) build=$1; shift ;; esac
all=ddp2,ddp4,pipe,pipe_gpipe,pipe_daemons,pipe_step,fsdp2,fsdp4,fsdp_logical2,fsdp_logical4
rows=$all
repeat=5
limit=300
mps=1
plain=1
cpu=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rows) rows=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --timeout) limit=$2; shift 2 ;;
        --no-mps) mps=0; shift ;;
        --mps-only) plain=0; shift ;;
        --cpu) cpu=1; mps=0; shift ;;
        *) echo "run_parallel_rows.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
for row in $(echo "$rows" | tr , ' '); do
    case ",$all," in
        *",$row,"*) ;;
        *) echo "run_parallel_rows.sh: unknown row $row (rows: $all)" >&2; exit 2 ;;
    esac
done
if [ "$mps" = 0 ] && [ "$plain" = 0 ]; then
    echo "run_parallel_rows.sh: --mps-only with --no-mps (or --cpu) leaves no rows to run" >&2
    exit 2
fi
py=${DPCLIP_PYTHON:-python3}
me=run_parallel_rows.sh
[ -x "$build/dpclipd" ] || { echo "$me: no $build/dpclipd (build first)" >&2; exit 1; }
export DPCLIP_LIBRARY="${DPCLIP_LIBRARY:-$build/libdpclip.so}"
export PYTHONUNBUFFERED=1
# NVLink multicast off: NCCL's NVLS needs what lent machines may not give
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
rundir=$(mktemp -d /tmp/dpclip-prows.XXXXXX)
. "$root/bench/rows_lib.sh"
trap 'daemons_stop; mps_stop; rm -rf "$rundir"' EXIT INT TERM

if [ "$cpu" = 1 ]; then
    gpus=0
    dev="--device cpu --precision fp32"
    par="$dev --blocks 2 --d 32 --heads 2 --vocab 67 --seq 12 --batch 2 --warmup 1 --steps 1"
    fsdp="$dev --blocks 1 --d 32 --heads 2 --ffn 64 --vocab 67 --seq 12 --batch 2"
    fsdp="$fsdp --warmup 1 --steps 1"
    mb=4 logical=16 micro=2
else
    gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    par="" fsdp="" mb=8 logical=512 micro=8
fi

# run_row ROW MPS: one row's bench against daemons of its own
run_row() {
    row=$1
    need=2 per_gpu=0
    case "$row" in
        ddp4|fsdp4|fsdp_logical4) need=4 ;;
        pipe_daemons|pipe_step) per_gpu=1 ;;
    esac
    if [ "$cpu" = 1 ] && [ "$per_gpu" = 1 ]; then
        echo "{\"row\": \"$row\", \"mps\": $2, \"skipped\": \"one daemon per GPU: no GPUs\"}"
        return 0
    fi
    if [ "$cpu" = 0 ] && [ "$gpus" -lt "$need" ]; then
        echo "{\"row\": \"$row\", \"mps\": $2, \"skipped\": \"needs $need GPUs, $gpus found\"}"
        return 0
    fi
    sock="$rundir/$row.$2.sock"
    if [ "$per_gpu" = 1 ]; then
        daemon_start "$sock.0" 0
        daemon_start "$sock.1" 1
        sock="$sock.0,$sock.1"
    else
        daemon_start "$sock"
    fi
    bp="$root/bench/bench_parallel.py --socket $sock --repeat $repeat $par"
    bf="$root/bench/bench_fsdp.py --socket $sock --repeat $repeat $fsdp"
    case "$row" in
        ddp2) cmd="$bp --mode ddp --world 2" ;;
        ddp4) cmd="$bp --mode ddp --world 4" ;;
        pipe) cmd="$bp --mode pipeline --daemons 1 --microbatches $mb" ;;
        pipe_gpipe) cmd="$bp --mode pipeline --daemons 1 --microbatches $mb --schedule gpipe" ;;
        pipe_daemons) cmd="$bp --mode pipeline --daemons 2 --microbatches $mb" ;;
        pipe_step) cmd="$bp --mode pipeline --daemons 2" ;;
        fsdp2) cmd="$bf --model llama1b --world 2" ;;
        fsdp4) cmd="$bf --model llama1b --world 4" ;;
        fsdp_logical2) cmd="$bf --model gpt --world 2 --logical $logical --micro $micro" ;;
        fsdp_logical4) cmd="$bf --model gpt --world 4 --logical $logical --micro $micro" ;;
    esac
    rc=0
    # (word splitting of $cmd is wanted: paths under $root hold no blanks)
    # shellcheck disable=SC2086
    timeout -s KILL "$limit" "$py" $cmd >"$rundir/out" 2>"$rundir/err" || rc=$?
    row_end "$row" "$2" "$rc"
}

rows_run
