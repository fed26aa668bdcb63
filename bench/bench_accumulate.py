#!/usr/bin/env python3
"""Large logical batches: private vs non-private training with gradient
accumulation (issue 39), throughput in tokens/s.

    python3 bench/bench_accumulate.py --socket S            # GPT-2-small-like, 512 in 8s
    python3 bench/bench_accumulate.py --socket S --opacus   # and Opacus 1.6's way, for the record
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

--opacus adds a third mode to the turns, Opacus 1.6's way: make_private
with grad_sample_mode="ghost" (ghost clipping: two backward passes a
micro-batch) and Poisson sampling over a TensorDataset of token samples
(the same ones first, --logical * 4 in all: sample rate 1/4, so a logical
batch is --logical samples only on average), BatchMemoryManager splitting
each logical batch into micro-batches of at most --micro, one optimizer
step a logical batch. Same model, seed and autocast where Opacus takes
bf16 (else fp32, and the line's "precision" says so). Its tokens/s count
the samples each timed logical step actually took. Opacus is slower, so it
runs in the first --opacus-rounds rounds (3) only, and no further round
starts once its rounds have taken --opacus-budget-s (150 s); its line
says how many ran. Then a second ratio line, opacus/plain. Where Opacus is
missing or fails, a line {"mode": "opacus", "skipped": why} and the other
modes go on.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_torch_step import MODELS, build, pick_device, register_norms, reset_peak, sync  # noqa: E402,E501
from bench_torch_step import token_batch  # noqa: E402
from device_memory import DeviceMemory  # noqa: E402

# Opacus's dataset holds this many logical batches' worth of samples, so its
# Poisson sampling has a rate of 1/OPACUS_POOL (at rate 1 every batch would
# be the whole dataset, the same size every step)
OPACUS_POOL = 4


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
    model = opt = engine = batches = None  # freed (not del: see docs/lint.md, F821)
    reset_peak(device)
    tokens = args.steps * args.logical * args.seq
    return tokens / secs, (mem.peak - base) / 2**20, extra


def run_opacus(args, device, amp):
    """Opacus 1.6's ghost clipping with BatchMemoryManager: tokens/s of
    `steps` logical steps after `warmup` (the tokens the Poisson batches
    held), device memory at peak (MiB, as run()'s), the timed logical
    batches' sizes."""
    from opacus import PrivacyEngine as OpacusEngine  # optional: for the record only
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)  # the model's weights as run()'s, then the sampler's draws
    reset_peak(device)
    base = DeviceMemory(device).used()
    model = build(args).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    # the other modes' samples first (the same seeds), on the device as theirs
    xs, ys = zip(*(token_batch(args, device, seed=1 + m, batch=args.micro)
                   for m in range(OPACUS_POOL * args.logical // args.micro)))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=args.logical)
    model, opt, criterion, loader = OpacusEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
        poisson_sampling=True)
    # The wrapped optimizer steps the SGD only at a logical batch's last
    # micro-batch: counting those steps marks the logical steps' ends.
    stepped = [0]
    opt.original_optimizer.register_step_post_hook(
        lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.micro,
                            optimizer=opt) as micro_loader:
        def micro_batches():  # epoch after epoch (OPACUS_POOL logical batches each)
            while True:
                for batch in micro_loader:
                    yield batch
        feed = micro_batches()

        def logical_step():
            """One logical batch, micro-batch by micro-batch: its samples."""
            start, samples = stepped[0], 0
            while stepped[0] == start:
                x, y = next(feed)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    logits = model(x)
                # shape: the B*T token losses become B per-sample means
                loss = criterion(logits.float().flatten(0, 1), y.flatten(), shape=logits.shape)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                samples += x.shape[0]
            return samples

        for _ in range(args.warmup):
            logical_step()
        sync(device)
        with DeviceMemory(device) as mem:
            t0 = time.perf_counter()
            sizes = [logical_step() for _ in range(args.steps)]
            sync(device)
            secs = time.perf_counter() - t0
        feed.close()
    # freed (not del: see docs/lint.md, F821)
    model = opt = criterion = loader = micro_loader = feed = xs = ys = None
    reset_peak(device)
    return sum(sizes) * args.seq / secs, (mem.peak - base) / 2**20, sizes


def why(e):
    return ("%s: %s" % (type(e).__name__, e)).strip()[:500]


def opacus_round(args, device, op):
    """One Opacus round into op (its rounds, or why it stopped). It never
    stops the other modes; a first round failing in bf16 is tried in fp32
    (Opacus may not take autocast), and the line says so."""
    tries = [True, False] if op["amp"] and not op["rounds"] else [op["amp"]]
    for amp in tries:
        err = None
        try:
            result = run_opacus(args, device, amp)
        except Exception as e:
            err = why(e)
        if err is None:
            op["rounds"].append(result)
            op["amp"] = amp
            return
        # out of the except block: its traceback's frames held the failed
        # round's tensors (an OOM would carry into the next modes' rounds)
        reset_peak(device)
        if amp and len(tries) > 1:
            op["notes"]["bf16_error"] = err
    op["stopped"] = ("fp32 too: " if len(tries) > 1 else "") + err


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
    ap.add_argument("--opacus", action="store_true",
                    help="also time Opacus 1.6 (ghost clipping, BatchMemoryManager)")
    ap.add_argument("--opacus-rounds", type=int, default=3,
                    help="Opacus takes its turn in this many of the first rounds (3)")
    ap.add_argument("--opacus-budget-s", type=float, default=150.0,
                    help="no Opacus round starts once its rounds took this long (150 s)")
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
    register_norms(args.model)
    device = pick_device(args.device)
    socket_path = args.socket or os.environ.get("DPCLIP_SOCKET")
    head = dict(bench="accumulate", model=args.model, logical=args.logical, micro=args.micro,
                seq=args.seq, device=str(device),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    rounds = {"plain": [], "dpclip": []}
    # Opacus's state: its rounds, why it stopped (or never ran), its precision
    op = dict(rounds=[], stopped=None, secs=0.0, amp=device.type == "cuda", notes={})
    if args.opacus:
        try:
            import opacus.utils.batch_memory_manager  # noqa: F401
        except Exception as e:  # missing, or not for this torch (1.6 needs 2.6)
            op["stopped"] = "opacus does not import: " + why(e)
    for r in range(args.rounds):
        for mode in ("plain", "dpclip"):
            tps, mem, extra = run(args, device, mode, socket_path)
            rounds[mode].append((tps, mem, extra))
        if args.opacus and op["stopped"] is None and r < args.opacus_rounds:
            if op["rounds"] and op["secs"] + op["secs"] / len(op["rounds"]) > args.opacus_budget_s:
                op["stopped"] = "budget: %d rounds took %.0f s of --opacus-budget-s %g" % (
                    len(op["rounds"]), op["secs"], args.opacus_budget_s)
                continue
            t0 = time.perf_counter()
            opacus_round(args, device, op)
            op["secs"] += time.perf_counter() - t0
            print("round %d/%d opacus: %s" % (r + 1, args.rounds, op["stopped"] or "%.1f tokens/s"
                                              % op["rounds"][-1][0]), file=sys.stderr, flush=True)
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
    print(json.dumps(dict(head, ratio="dpclip/plain",
                          time_ratio=round(med["plain"] / med["dpclip"], 3),
                          time_ratio_best=round(min(ratios), 3),
                          time_ratio_worst=round(max(ratios), 3),
                          mem_ratio=round(mem_d / mem_p, 3) if mem_p > 0 else None,
                          target={"time_ratio": 1.05})))
    if not args.opacus:
        return
    if not op["rounds"]:
        print(json.dumps(dict(head, run="opacus", mode="opacus",
                              skipped=op["stopped"] or "no round ran (--opacus-rounds 0)")))
        return
    import opacus
    tps = [t for t, _, _ in op["rounds"]]
    mem_o = max(m for _, m, _ in op["rounds"])
    precision = "bf16" if op["amp"] else "fp32"
    print(json.dumps(dict(head, run="opacus", mode="opacus", opacus=opacus.__version__,
                          grad_sample_mode="ghost", precision=precision,
                          tokens_per_s=round(statistics.median(tps), 1),
                          rounds=[round(t, 1) for t in tps],
                          rounds_run=len(tps), rounds_asked=min(args.opacus_rounds, args.rounds),
                          device_mem_mib=round(mem_o, 1), sample_rate=1 / OPACUS_POOL,
                          logical_sizes=[s for _, _, sizes in op["rounds"] for s in sizes],
                          stopped=op["stopped"], **op["notes"])))
    # each Opacus round against the plain round of the same turn
    ratios = [p / o for (p, _, _), (o, _, _) in zip(rounds["plain"], op["rounds"])]
    print(json.dumps(dict(head, ratio="opacus/plain", precision=precision,
                          time_ratio=round(med["plain"] / statistics.median(tps), 3),
                          time_ratio_best=round(min(ratios), 3),
                          time_ratio_worst=round(max(ratios), 3),
                          mem_ratio=round(mem_o / mem_p, 3) if mem_p > 0 else None)))


if __name__ == "__main__":
    main()
