#!/usr/bin/env python3
"""FSDP2 (fully_shard) training step, private vs non-private, two ranks on
one GPU.

    python3 bench/bench_fsdp.py --socket S                    # the issue's config
    python3 bench/bench_fsdp.py --socket S --blocks 2 --d 128 --heads 4 \
        --vocab 1000 --seq 64 --batch 2 --steps 3               # smaller

Default config: bench_torch_step.py's GPT-2-small-like model (12 blocks,
d=768, 12 heads, vocab 32000, T=1024, untied head), B=4 per rank, SGD,
fully_shard on each block and then the root, MixedPrecisionPolicy with bf16
parameters and reduction (f32 master weights; --precision fp32 for none).
The ranks are processes on GPU 0 (NCCL, a distinct NCCL_HOSTID each, NVLink
multicast off): "fsdp" is the plain FSDP2 step (autograd's weight
gradients, FSDP's reduce-scatter), "dpclip" the private one (input
gradients only; per rank one clipping step to dpclipd, one noise step for
its shard, the reduce-scatter of the clipped sums through the ranks'
process group). One JSON line per rank and mode (time per step, peak
memory as torch.cuda.max_memory_allocated, and for dpclip the
reduce-scatter's device time and its share of the step, the clipping and
noise steps' wall time), then one with rank 0's ratios against the target
peak (1.15x FSDP's). Where torch has no fully_shard (< 2.4) it runs the
same private steps on plain models (make_private(sharded_noise=True))
against a data-parallel step that all-reduces autograd's gradients, and so
does --device cpu (gloo): a smoke test of the script, not the measurement.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_torch_step import GPT, peak_mb, reset_peak, sync  # noqa: E402
from dpclip.torch import PrivacyEngine  # noqa: E402

PEAK_TARGET = 1.15


def fsdp2_api():
    """(fully_shard, MixedPrecisionPolicy), or None before torch 2.4."""
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard", "MixedPrecisionPolicy"])
            return m.fully_shard, m.MixedPrecisionPolicy
        except Exception:  # pylint: disable=broad-except
            continue
    return None


def build(args, device, mesh):
    """The model (seed 0), sharded per block and at the root under FSDP2."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seq, args.d, args.blocks, args.heads).to(device)
    api = fsdp2_api() if mesh is not None else None
    if api is not None:
        fully_shard, policy = api
        kw = {"mesh": mesh}
        if args.precision == "bf16":
            kw["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for b in model.blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
    return model


def run(args, rank, world, device, mesh, mode):
    """Times `steps` steps after `warmup`; a dict for the JSON line."""
    reset_peak(device)
    model = build(args, device, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine = None
    if mode == "dpclip":
        engine = PrivacyEngine(args.socket, client_name="bench_fsdp", job_id=args.job_id)
        model, opt, _ = engine.make_private(
            module=model, optimizer=opt, noise_multiplier=1.0, max_grad_norm=1.0,
            loss_reduction="mean", expected_batch_size=args.batch * world,
            sharded_noise=mesh is None)
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    parts = {"reduce_scatter_ms": 0.0, "clip_ms": 0.0, "noise_ms": 0.0}

    extra = {}

    def step(timed, measure=False):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        # every sample has T tokens: the token mean is the mean of per-sample means
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if measure and device.type == "cuda":
            # what the gradient's phase (backward and step) holds above the
            # forward's memory: FSDP's unsharded gradients one layer group at
            # a time, dpclip's sums one bucket at a time
            sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        if mode == "ddp":  # the plain data-parallel step, without fully_shard
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        if measure and device.type == "cuda":
            sync(device)
            extra["grad_phase_extra_mib"] = round(
                (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20, 1)
        if timed and engine is not None:
            sh = engine._shards  # pylint: disable=protected-access
            parts["reduce_scatter_ms"] += sh.reduce_scatter_ms()
            parts["clip_ms"] += sh.timing["clip_ms"]
            parts["noise_ms"] += sh.timing["noise_ms"]

    for _ in range(args.warmup):
        step(False)
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(True)
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    peak = peak_mb(device)
    step(False, measure=True)
    out = {"bench": "fsdp", "rank": rank, "world": world, "mode": mode,
           "fully_shard": mesh is not None, "precision": args.precision,
           "device": str(device), "ms_per_step": round(ms, 3),
           "peak_mib": round(peak, 1), **extra}
    if engine is not None:
        sh = engine._shards  # pylint: disable=protected-access
        esz = torch.empty(0, dtype=sh.dtype).element_size()
        # the sums' memory: up to two slots of the largest bucket, against the
        # whole local sum a single sums step would hold
        out["sums_slots_mib"] = round(min(2, len(sh._buckets)) * sh.widest * esz / 2 ** 20, 1)
        out["whole_sum_mib"] = round(sh.full_n * esz / 2 ** 20, 1)
        out["buckets"] = len(sh._buckets)  # pylint: disable=protected-access
        for k, v in parts.items():
            out[k] = round(v / args.steps, 3)
        out["reduce_scatter_share"] = round(out["reduce_scatter_ms"] / ms, 4)
        out["epsilon"] = engine.last_epsilon
        engine.close()
    return out


def rank_main(rank, world, init_file, args, out_dir):
    os.environ["NCCL_HOSTID"] = "bench-fsdp-%d" % rank  # NCCL takes the ranks for two hosts
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="file://" + init_file,
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        device = torch.device("cuda:0" if cuda else "cpu")
        mesh = None
        if cuda and fsdp2_api() is not None:
            # pylint: disable=import-outside-toplevel
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cuda", (world,))  # keeps the device set above
        lines = [run(args, rank, world, device, mesh, "fsdp" if mesh is not None else "ddp"),
                 run(args, rank, world, device, mesh, "dpclip")]
        with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
            f.write("".join(json.dumps(l) + "\n" for l in lines))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="dpclipd's socket")
    ap.add_argument("--job-id", default=None, help="ledger account (default: a fresh one)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="samples per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    out_dir = tempfile.mkdtemp(prefix="bench_fsdp.")
    ctx = mp.start_processes(rank_main, nprocs=args.world, join=False, start_method="spawn",
                             args=(args.world, os.path.join(out_dir, "init"), args, out_dir))
    while not ctx.join(timeout=600):
        pass
    lines = []
    for r in range(args.world):
        with open(os.path.join(out_dir, "rank%d.json" % r)) as f:
            lines += [json.loads(l) for l in f]
    for l in lines:
        print(json.dumps(l), flush=True)
    plain, private = [l for l in lines if l["rank"] == 0]
    peak = max(l["peak_mib"] for l in lines if l["mode"] == "dpclip") / \
        max(l["peak_mib"] for l in lines if l["mode"] != "dpclip")
    print(json.dumps({"bench": "fsdp", "ratios": True, "baseline": plain["mode"],
                      "private_over_plain_time": round(private["ms_per_step"] /
                                                       plain["ms_per_step"], 3),
                      "reduce_scatter_share": private["reduce_scatter_share"],
                      "private_over_plain_peak": round(peak, 3), "peak_target": PEAK_TARGET,
                      "peak_within_target": peak <= PEAK_TARGET,
                      **({"grad_phase_extra_over_plain": round(
                          private["grad_phase_extra_mib"] / plain["grad_phase_extra_mib"], 3)}
                         if plain.get("grad_phase_extra_mib") else {})}), flush=True)


if __name__ == "__main__":
    main()
