#!/usr/bin/env python3
"""Large logical batches: private vs non-private training with gradient
accumulation (issue 39), throughput in tokens/s.

    python3 bench/bench_accumulate.py --socket S                       # GPT-2-small-like, 512 in 8s
    python3 bench/bench_accumulate.py --socket S --model llama1b --logical 256 --micro 4
    python3 bench/bench_accumulate.py --socket S --blocks 2 --d 128 --heads 4 --vocab 1000 \\
        --seq 64 --logical 16 --micro 4 --rounds 2 --steps 1 --device cpu   # CPU smoke test

One logical step is --logical samples in micro-batches of --micro: the
non-private run calls backward() on each micro-batch's mean loss divided by
the number of micro-batches, then one optimizer step (plain PyTorch
accumulation); the private run (dpclip) calls backward() on each
micro-batch's own mean loss (each micro-batch a ClipStep of the logical
step; the daemon accumulates the clipped sums and adds the noise once at
optimizer.step(): docs/protocol.md, "Logical steps"). The same model (same
seed), bf16 autocast, SGD. The modes take turns for --rounds rounds (5), each
--steps logical steps after a warm-up; one JSON line per mode (the median
round's tokens/s, every round's), then the ratio line: time ratio of the
medians (private / plain), its best and worst rounds, and whole-device
memory: the GPU's used memory (cudaMemGetInfo: the trainer and the daemon,
every process on the device) sampled every 5 ms during the timed steps, its
peak over the run's start, private / plain.
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_torch_step import MODELS, RMSNorm, build, reset_peak, sync, token_batch  # noqa: E402


class DeviceMemory:
    """The device's used memory (all processes), sampled on a thread."""

    def __init__(self, device):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def used(self):
        if self.device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def __enter__(self):
        self.base = self.used()
        self.peak = self.base
        if self.device.type == "cuda":
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.used())


def run(args, device, mode, socket_path):
    """Tokens/s of `steps` logical steps after `warmup`, the device memory
    used at peak (MiB, over the device's before the model), extra facts."""
    torch.manual_seed(0)
    reset_peak(device)
    base = DeviceMemory(device).used()
    model = build(args).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine = None
    micro = args.logical // args.micro
    if mode == "dpclip":
        from dpclip.torch import PrivacyEngine
        engine = PrivacyEngine(socket_path, client_name="bench_accumulate")
        model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=1.0,
                                            max_grad_norm=1.0, loss_reduction="mean",
                                            expected_batch_size=args.logical)
    batches = [token_batch(args, device, seed=1 + m, batch=args.micro) for m in range(micro)]

    def logical_step():
        opt.zero_grad(set_to_none=True)
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            # plain accumulation averages over the logical batch by hand; the
            # daemon divides the committed sum by the expected logical batch
            (loss if engine is not None else loss / micro).backward()
        opt.step()

    for _ in range(args.warmup):
        logical_step()
    sync(device)
    with DeviceMemory(device) as mem:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logical_step()
        sync(device)
        if engine is not None:
            engine.synchronize()
        secs = time.perf_counter() - t0
    extra = {}
    if engine is not None:
        extra["epsilon"] = engine.last_epsilon
        extra["mps_active"] = bool(engine.client.info.mps_active)
        engine.close()
    del model, opt, engine, batches
    reset_peak(device)
    tokens = args.steps * args.logical * args.seq
    return tokens / secs, (mem.peak - base) / 2**20, extra


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="dpclipd socket (default $DPCLIP_SOCKET)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    for k in ("blocks", "d", "heads", "vocab", "seq", "ffn"):
        ap.add_argument("--" + k, type=int, default=None, help="default: the model's")
    ap.add_argument("--logical", type=int, default=None,
                    help="samples a logical step (default 512, llama1b 256)")
    ap.add_argument("--micro", type=int, default=None,
                    help="samples a micro-batch (default 8, llama1b 4)")
    ap.add_argument("--steps", type=int, default=2, help="timed logical steps a round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.logical is None:
        args.logical = 256 if args.model == "llama1b" else 512
    if args.micro is None:
        args.micro = 4 if args.model == "llama1b" else 8
    if args.logical % args.micro:
        ap.error("--logical must be a multiple of --micro")
    if args.model == "llama1b":
        from dpclip.torch import register
        register(RMSNorm, kind="rmsnorm", weight="weight", eps="eps")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    socket_path = args.socket or os.environ.get("DPCLIP_SOCKET")
    head = dict(bench="accumulate", model=args.model, logical=args.logical, micro=args.micro,
                seq=args.seq, device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    rounds = {"plain": [], "dpclip": []}
    for r in range(args.rounds):
        for mode in ("plain", "dpclip"):
            tps, mem, extra = run(args, device, mode, socket_path)
            rounds[mode].append((tps, mem, extra))
    med = {}
    for mode, rs in rounds.items():
        tps = [t for t, _, _ in rs]
        med[mode] = statistics.median(tps)
        print(json.dumps(dict(head, run=mode, tokens_per_s=round(med[mode], 1),
                              rounds=[round(t, 1) for t in tps],
                              device_mem_mib=round(max(m for _, m, _ in rs), 1),
                              **rs[-1][2])))
    ratios = [p / d for (p, _, _), (d, _, _) in zip(rounds["plain"], rounds["dpclip"])]
    mem_p = max(m for _, m, _ in rounds["plain"])
    mem_d = max(m for _, m, _ in rounds["dpclip"])
    print(json.dumps(dict(head, ratio="dpclip/plain", time_ratio=round(med["plain"] / med["dpclip"], 3),
                          time_ratio_best=round(min(ratios), 3),
                          time_ratio_worst=round(max(ratios), 3),
                          mem_ratio=round(mem_d / mem_p, 3) if mem_p > 0 else None,
                          target={"time_ratio": 1.05})))


if __name__ == "__main__":
    main()
