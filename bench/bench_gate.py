#!/usr/bin/env python3
"""The data-parallel gate's all-reduce of a step's gradients (dpclip._gate),
in place over the CUDA transport's output arena against gathering each
bucket into a copy and scattering it back (what it did before), one rank
per GPU.

    python3 bench/bench_gate.py --world 2                 # GPT-2-small-like, 2 GPUs (NCCL)
    python3 bench/bench_gate.py --world 4
    python3 bench/bench_gate.py --device cpu --world 2 --d 64 --blocks 1 --vocab 100  # gloo

The gradients are the parameters' of bench_torch_step.py's GPT (f32, as
bf16 autocast over f32 weights has them), laid out as the CUDA transport
lays its outputs (dpclip._outputs._out_buffers: one arena, in the outputs'
order, param.grad views of it). Each of --repeat rounds times --steps
reduce() calls of each way, the ways taking turns, between device
synchronisations, on every rank; rank 0 prints one JSON line per way
(median ms of the rounds, the slowest rank's, with every round) and one of
their ratio (in_place/gathered), with the host time of the call alone
(queued, not run)."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_torch_step import MODELS, build  # noqa: E402
from dpclip import _cuda, _gate  # noqa: E402
from dpclip._layers import Out  # noqa: E402


class _Client:
    """_out_buffers' registrations, which no daemon takes here."""

    def register_cuda(self, ptr):
        return 0, 0


def arena_params(args, device):
    """The model's parameters, their gradients views of one arena."""
    model = build(args).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    outs = [Out(p) for p in params]
    _cuda._out_buffers(_Client(), outs, device)
    for o in outs:
        o.param.grad = o.alias
        o.alias.normal_()
    return params


def rank_main(rank, args, init):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="file://" + init,
                            rank=rank, world_size=args.world)
    try:
        params = arena_params(args, device)
        gate = _gate.Gate(args.world)
        span = _gate.span

        def gathered(grads):
            return None

        def timed(way):
            _gate.span = span if way == "in_place" else gathered
            ok = torch.ones(1, device=device)
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            host = 0.0
            for _ in range(args.steps):
                h0 = time.perf_counter()
                gate.reduce(params, ok.clone(), None, 1, False)
                host += time.perf_counter() - h0
            sync()
            return ((time.perf_counter() - t0) * 1e3 / args.steps, host * 1e3 / args.steps)

        for way in ("in_place", "gathered"):  # warm-up
            timed(way)
        rounds = {"in_place": [], "gathered": []}
        for _ in range(args.repeat):
            for way in ("gathered", "in_place"):
                rounds[way].append(timed(way))
        _gate.span = span
        mine = torch.tensor([[r[0] for r in rounds[w]] for w in ("in_place", "gathered")],
                            dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(args.world)]
        dist.all_gather(every, mine)
        if rank == 0:
            bks = _gate.grad_buckets(params)
            ends = sum(len(b) == 1 or span([p.grad for p in b]) is not None for b in bks)
            slowest = torch.stack(every).amax(0).tolist()  # [way][round]: the slowest rank's
            res = {}
            for i, w in enumerate(("in_place", "gathered")):
                res[w] = statistics.median(slowest[i])
                print(json.dumps({
                    "bench": "gate", "way": w, "world": args.world, "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if cuda else None,
                    "params": len(params), "elems": sum(p.numel() for p in params),
                    "buckets": len(bks), "buckets_end_to_end": ends,
                    "ms": round(res[w], 4), "ms_rounds": [round(x, 4) for x in slowest[i]],
                    "host_ms": round(statistics.median(r[1] for r in rounds[w]), 4)}),
                    flush=True)
            per = sorted(a / b for a, b in zip(slowest[0], slowest[1]))
            print(json.dumps({"bench": "gate", "ratio": "in_place/gathered", "world": args.world,
                              "time_ratio": round(res["in_place"] / res["gathered"], 3),
                              "round_ratios": [round(x, 3) for x in per],
                              "saved_ms": round(res["gathered"] - res["in_place"], 4)}),
                  flush=True)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    for k in ("blocks", "d", "heads", "vocab", "seq", "ffn"):
        ap.add_argument("--" + k, type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(json.dumps({"bench": "gate", "skipped": "%d GPUs for --world %d" % (
            torch.cuda.device_count(), args.world)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "init")), nprocs=args.world)


if __name__ == "__main__":
    main()
