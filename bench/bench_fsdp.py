#!/usr/bin/env python3
"""FSDP2 (fully_shard) training step on several ranks: non-private, dpclip
and Opacus's FSDP ghost clipping; and a correctness check of dpclip's
sharded step against one GPU.

    build/dpclipd --socket S --ledger-dir "" &    # one daemon serves every GPU
    python3 bench/bench_fsdp.py --socket S                       # GPT-2-small-like
    python3 bench/bench_fsdp.py --socket S --model llama1b --world 4 --opacus
    python3 bench/bench_fsdp.py --socket S --model llama1b --world 4 --seq 512 --check
    python3 bench/bench_fsdp.py --socket S --world 2 --logical 512 --micro 8 --repeat 5
    python3 bench/bench_fsdp.py --socket S --device cpu --blocks 2 --d 128 --heads 4 \
        --vocab 1000 --seq 64 --batch 2 --steps 3                  # CPU smoke test

Models (bench_torch_step.py's; flags given win): --model gpt, GPT-2-small-like
(12 blocks, d=768, 12 heads, vocab 32000, T=1024, untied head); --model
llama1b, Llama-1B-like (16 blocks, d=2048, 32 heads, SwiGLU 8192, RMSNorm,
vocab 32000, T=2048). B=4 samples per rank, SGD, fully_shard on each block
and then the root, MixedPrecisionPolicy with bf16 parameters and reduction
(f32 master weights; --precision fp32 for none). The model is built once per
process on the CPU (seed 0) and copied into every run's fresh one.

Ranks (--world, default: the GPUs, at least 2) are processes: one GPU each
(cuda:rank, NCCL over NVLink) where there are as many GPUs, else all on GPU 0
with a distinct NCCL_HOSTID each (NCCL takes them for hosts of their own);
NVLink multicast (NVLS) is always off. One dpclipd serves every GPU.

Timing: "fsdp" is the plain FSDP2 step (autograd's weight gradients, FSDP's
reduce-scatter), "dpclip" the private one (input gradients only; per rank
one clipping step to dpclipd, one noise step for its shard, the
reduce-scatter of the clipped sums through the ranks' process group); they
take turns for --repeat rounds (each rank's median round is reported).
--opacus then runs Opacus's way in fresh processes: FSDP2Wrapper
(opacus.utils.fsdp_utils: fully_shard on every supported layer, then the
root, same policy) and make_private(grad_sample_mode="ghost_fsdp",
poisson_sampling=False, a DistributedSampler loader of B a rank). Where the
Llama's own RMSNorm fails there, it is retried once with torch's
nn.RMSNorm (the same function; the line says so); where Opacus is missing
or fails, a line {"mode": "opacus", "skipped": why} and the run goes on.
One JSON line per rank and mode (median time per step and every round's,
peak memory as torch.cuda.max_memory_allocated, the gradient phase's memory
above the forward's, for dpclip the reduce-scatter's device time and share,
and where its step's host time goes: clip_ms, the norm pass from step() to
its reply, the backward's tail on the GPU included; sums_ms, the buckets'
sums steps and reduce-scatters to the gate; write_ms, param.grad; step_ms,
the whole optimizer.step()), then one of ratios: the slowest
rank's time and the largest peak of each mode against the plain step's,
with dpclip's targets (1.15x in time and in memory).

--bucket N: elements per rank in one reduce-scatter bucket, and so in one
sums step to the daemon (dpclip._shards._BUCKET in every rank; default
dpclip._shards.bucket_size(world); the lines
count the buckets): fewer daemon steps against larger slots.

--check: 3 steps at sigma 0 with fixed batches, SGD at lr 1, the
parameters, gathered whole, against one process on one GPU training the
unsharded model with dpclip on the whole global batch (fsdp_check.py).

Gradient accumulation (--logical L, --micro N): a logical step is L samples
in all, L/world a rank, in micro-batches of N (fixed batches, a rank's own).
"fsdp": a backward on each micro-batch's loss times its share (1/k of k),
set_requires_gradient_sync(False) on all but the last (FSDP2 keeps the
unsharded gradients, no reduce-scatter), one optimizer step; "ddp" alike,
one all-reduce. "dpclip": a backward on each micro-batch's own mean loss,
expected batch L, then one step() (dpclip._accumulate: each micro-batch
accumulates in the daemon, no collective; the commit reduce-scatters once).
Steps are logical steps (--warmup 1, --steps 3 unless given); each line adds
tokens/s (L x T over the rank's median time) and the whole-device memory:
the GPU's used memory (cudaMemGetInfo: trainer, daemon, every process on
it) sampled every 5 ms during the timed steps, its peak and its peak over
the run's start (without --logical, over an untimed step after the timed
ones, as polling would cost the short steps' time: every run reports it).
The ratio line adds each round's slowest-rank time ratio
(median, best, worst) and that memory summed over the GPUs (each GPU's
largest peak over its ranks and rounds; one GPU shared by every rank counts
once), private / plain. The grad_phase figures are the last micro-batch's
backward and the step. Opacus is not run with --logical (a skipped line).

Where torch has no fully_shard (< 2.4), and with --device cpu (gloo), the
same private steps run on plain models (make_private(sharded_noise=True))
against a data-parallel step that all-reduces autograd's gradients ("ddp"):
a smoke test of the script, not the measurement; Opacus is skipped there.
Progress goes to stderr.
"""
import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from device_memory import DeviceMemory  # noqa: E402 (the device's used memory, sampled)
from bench_torch_step import MODELS, RMSNorm, peak_mb, reset_peak, sync, token_batch  # noqa: E402
from fsdp_common import (  # noqa: E402
    fresh_model, fsdp2_api, init_rank, log, placement, policy, prepare, private,
    seq_loss, shard, spawn)
import fsdp_check  # noqa: E402
from dpclip import _cuda, _fsdp, _shards  # noqa: E402

TARGET = {"time": 1.15, "peak": 1.15}  # dpclip over the plain FSDP2 step
LR = 1e-4
TRACED = 3  # --trace's steps


# --- per process ---------------------------------------------------------------------

def torch_rmsnorms(model):
    """Each of the model's own RMSNorms replaced by torch's nn.RMSNorm of the
    same weight and eps (the class Opacus has a per-sample gradient for)."""
    for m in list(model.modules()):
        for name, c in list(m.named_children()):
            if isinstance(c, RMSNorm):
                n = nn.RMSNorm(c.weight.shape[0], eps=c.eps, device=c.weight.device,
                               dtype=c.weight.dtype)
                with torch.no_grad():
                    n.weight.copy_(c.weight)
                setattr(m, name, n)


def make_opacus(args, model, rank, world, own_norms):
    """(model, optimizer, criterion): Opacus 1.6's FSDP2 ghost clipping, its
    documented way (examples/fsdp_llama3.py): FSDP2Wrapper, then
    make_private with a loader of B samples a rank (expected batch size B)."""
    # pylint: disable=import-outside-toplevel
    from opacus import PrivacyEngine as OpacusEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    for msg in ("Secure RNG turned off", "Full backward hook is firing"):  # once a rank: noise
        warnings.filterwarnings("ignore", message=msg)
    if not own_norms:
        torch_rmsnorms(model)
    mp_policy = policy(args)
    model = FSDP2Wrapper(model, **({"mp_policy": mp_policy} if mp_policy is not None else {}))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = TensorDataset(torch.zeros(args.batch * world, 1))
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=False))
    model, opt, criterion, _ = OpacusEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost_fsdp",
        poisson_sampling=False)
    if opt.expected_batch_size != args.batch:
        raise RuntimeError("Opacus's expected batch size is %s, not B=%d"
                           % (opt.expected_batch_size, args.batch))
    return model, opt, criterion


# --- timing --------------------------------------------------------------------------

def timed_run(args, rank, world, device, mesh, init, mode, own_norms=True):
    """Times `steps` steps after `warmup`; a dict for the JSON line."""
    reset_peak(device)
    start = DeviceMemory(device).used()  # the GPU's used memory before the run's model
    model = fresh_model(args, device, init)
    engine = criterion = None
    if mode == "opacus":
        model, opt, criterion = make_opacus(args, model, rank, world, own_norms)
    else:
        model = shard(model, mesh, args)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if mode == "dpclip":
            engine, model, opt = private(args, model, world, mesh is None, 1.0, LR)
    if args.logical:  # this rank's fixed micro-batches: L / world samples in all
        k = args.logical // (world * args.micro)
        batches = [token_batch(args, device, seed=1 + rank + world * m, batch=args.micro)
                   for m in range(k)]
    else:
        batches = [token_batch(args, device, seed=1 + rank)]  # the timing's fixed batch
    no_sync = mode == "fsdp" and len(batches) > 1
    # dpclip's step, per rank (host wall time): clip_ms, the norm pass (from
    # step() to its reply: the backward's tail on the GPU included); sums_ms,
    # the buckets' sums steps and reduce-scatters to the gate's agreement;
    # write_ms, param.grad from the shards; step_ms, the whole opt.step()
    parts = {"reduce_scatter_ms": 0.0, "clip_ms": 0.0, "noise_ms": 0.0, "sums_ms": 0.0,
             "write_ms": 0.0, "step_ms": 0.0}
    extra = {}
    trace = {}  # --trace: label -> [host ms, GPU ms] from the step's start, summed

    def mark(marks, what):  # as the engine's steps mark theirs
        _fsdp.trace_mark(marks, what, device.type == "cuda")

    def step(timed, measure=False, traced=False):
        marks = [] if traced else None
        if traced:
            mark(marks, "step start")
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            if no_sync:  # FSDP2 reduce-scatters only after the last micro-batch
                model.set_requires_gradient_sync(last)
            logits = model(x)
            if criterion is not None:
                # shape: Opacus turns the B*T token losses into B per-sample means
                loss = criterion(logits.float().flatten(0, 1), y.flatten(), shape=logits.shape)
            else:
                loss = seq_loss(logits, y)
            if engine is None and len(batches) > 1:
                # plain accumulation: each micro-batch's share of the rank's
                # mean; dpclip takes each one's own mean (its size rescales it)
                loss = loss / len(batches)
            if measure and last and device.type == "cuda":
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
        if traced:
            mark(marks, "backward queued")
            if engine is not None:
                engine.mode.shards.trace = marks
        t_step = time.perf_counter()
        opt.step()
        t_step = time.perf_counter() - t_step
        if traced:
            if engine is not None:
                engine.mode.shards.trace = None
            mark(marks, "optimizer queued")
            sync(device)
            mark(marks, "step end")
            _fsdp.trace_add(trace, marks)
        if measure and device.type == "cuda":
            sync(device)
            extra["grad_phase_extra_mib"] = round(
                (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20, 1)
        if timed and engine is not None:
            sh = engine.mode.shards
            parts["reduce_scatter_ms"] += sh.reduce_scatter_ms()
            parts["clip_ms"] += sh.timing["clip_ms"]
            parts["noise_ms"] += sh.timing["noise_ms"]
            parts["sums_ms"] += sh.timing["sums_and_reduce_scatter_ms"]
            parts["write_ms"] += sh.timing["write_ms"]
            parts["step_ms"] += t_step * 1e3
            for k, v in sh.timing.items():
                if k.startswith("daemon_"):  # the daemon's own, where the transport reads it
                    parts[k] = parts.get(k, 0.0) + v

    # with --logical the last warm-up step is measured (a logical step is
    # long: no extra one); its grad_phase figures come before the timed steps
    early = bool(args.logical) and args.warmup > 0
    for w in range(args.warmup):
        step(False, measure=early and w == args.warmup - 1)
    sync(device)
    dist.barrier(**({"device_ids": [device.index]} if device.type == "cuda" else {}))
    with DeviceMemory(device if args.logical else torch.device("cpu")) as mem:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        sync(device)
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
    peak = peak_mb(device)
    if not early:
        # the whole device's memory (trainer and daemon) over an untimed
        # step: sampling it during the timed ones (a thread polling the
        # driver) would cost their time; a logical step's are long enough
        with DeviceMemory(device) as mem:
            step(False, measure=True)
    for _ in range(TRACED if args.trace else 0):
        step(False, traced=True)
    if trace:
        # where each step's time goes: for each mark, when the host got there
        # and when the GPU's stream did (ms from the step's start, mean);
        # a GPU time close to the host's: the stream had waited for the host
        extra["trace"] = {k: [round(h / TRACED, 2), round(g / TRACED, 2)]
                          for k, (h, g) in trace.items()}
    out = {"bench": "fsdp", "model": args.model, "rank": rank, "world": world, "mode": mode,
           "fully_shard": mesh is not None, "precision": args.precision,
           "device": str(device), "ms_per_step": round(ms, 3), "peak_mib": round(peak, 1),
           **extra}
    if args.logical:
        out.update(logical=args.logical, micro=args.micro, micro_batches=len(batches),
                   tokens_per_s=round(args.logical * args.seq / (ms / 1e3), 1))
    if device.type == "cuda":
        out.update(device_used_peak_mib=round(mem.peak / 2 ** 20, 1),
                   device_over_start_mib=round((mem.peak - start) / 2 ** 20, 1),
                   gpu=torch.cuda.get_device_name(device))
    if mode == "opacus" and not own_norms:
        out["rmsnorm"] = "torch.nn.RMSNorm"
    if engine is not None:
        sh = engine.mode.shards
        esz = torch.empty(0, dtype=sh.dtype).element_size()
        # the sums' memory: the slots (on the GPU up to three, the next
        # bucket's step queued, each of its buckets' widest; on the host one
        # of the widest bucket's size), against the
        # whole local sum a single sums step would hold
        buckets = len(sh._buckets)  # pylint: disable=protected-access
        slots = min(_cuda._SLOTS, buckets) if device.type == "cuda" else 1  # pylint: disable=W0212
        out["sums_slots_mib"] = round(sum(sh.slot_sizes(slots)) * esz / 2 ** 20, 1)
        out["whole_sum_mib"] = round(sh.full_n * esz / 2 ** 20, 1)
        out["buckets"] = buckets
        for k, v in parts.items():
            out[k] = round(v / args.steps, 3)
        out["reduce_scatter_share"] = round(out["reduce_scatter_ms"] / ms, 4)
        out["epsilon"] = engine.last_epsilon
        engine.close()
    return out


def merged(rounds):
    """A rank's line for a mode: its median round, every round's time
    (sorted, and in round order), the largest peaks."""
    ordered = sorted(rounds, key=lambda r: r["ms_per_step"])
    out = dict(ordered[len(ordered) // 2])
    out["ms_runs"] = [r["ms_per_step"] for r in ordered]
    out["ms_rounds"] = [r["ms_per_step"] for r in rounds]
    for k in ("peak_mib", "device_used_peak_mib", "device_over_start_mib"):
        if k in out:
            out[k] = max(r[k] for r in rounds)
    return out


def write_lines(path, lines):
    with open(path + ".tmp", "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    os.replace(path + ".tmp", path)


def timing_rank(rank, world, init_file, args, out_dir, opacus, own_norms):
    """The plain and dpclip modes in turns, or (opacus) Opacus's mode alone,
    whose failure is written as the rank's line ({"skipped": why})."""
    init = prepare(args)
    device, mesh = init_rank(rank, world, init_file, args, 300 if opacus else 600)
    if rank == 0:
        log("rank 0: initial model built, process group up on %s" % device)
    path = os.path.join(out_dir, "%s%d.json" % ("opacus" if opacus else "timing", rank))
    try:
        modes = ["opacus"] if opacus else ["fsdp" if mesh is not None else "ddp", "dpclip"]
        runs = {m: [] for m in modes}
        for rnd in range(args.repeat):
            for mode in modes:
                try:
                    res = timed_run(args, rank, world, device, mesh, init, mode, own_norms)
                except Exception as e:  # pylint: disable=broad-except
                    if opacus:  # the reason, for the main process's skipped line
                        write_lines(path, [{"bench": "fsdp", "rank": rank, "mode": mode,
                                            "skipped": "%s: %s" % (type(e).__name__, e)}])
                    raise
                runs[mode].append(res)
                if rank == 0:
                    log("round %d/%d %s: %.1f ms/step, peak %.0f MiB (rank 0)%s"
                        % (rnd + 1, args.repeat, mode, res["ms_per_step"], res["peak_mib"],
                           ", %.0f tokens/s, GPU used %.0f MiB" % (
                               res["tokens_per_s"], res.get("device_used_peak_mib", 0))
                           if args.logical else ""))
                write_lines(path, [merged(runs[m]) for m in modes if runs[m]])
    finally:
        dist.destroy_process_group()


# --- the main process ---------------------------------------------------------------

def read_lines(out_dir, prefix, world):
    lines = []
    for r in range(world):
        path = os.path.join(out_dir, "%s%d.json" % (prefix, r))
        if os.path.exists(path):
            with open(path) as f:
                lines += [json.loads(line) for line in f]
    return lines


def run_opacus(args, out_dir, why_not):
    """Opacus's mode in fresh processes (its own RMSNorm first, then
    torch's where the Llama's fails); its lines, or one skipped line."""
    if why_not is not None:
        return [{"bench": "fsdp", "mode": "opacus", "skipped": why_not}]
    failed = []
    for own_norms in [True] + ([False] if args.model == "llama1b" and
                               hasattr(nn, "RMSNorm") else []):
        log("opacus: %d ranks, ghost_fsdp%s" % (
            args.world, "" if own_norms else ", torch's nn.RMSNorm"))
        tag = "opacus" + ("" if own_norms else "_torch_rmsnorm")
        why = spawn(timing_rank, args.world, (
            args.world, os.path.join(out_dir, "init_" + tag), args, out_dir, True, own_norms),
            deadline_s=args.opacus_timeout)
        lines = read_lines(out_dir, "opacus", args.world)
        for r in range(args.world):
            path = os.path.join(out_dir, "opacus%d.json" % r)
            if os.path.exists(path):
                os.remove(path)
        skipped = [line["skipped"] for line in lines if "skipped" in line]
        if why is None and not skipped and len(lines) == args.world:
            for line in lines:
                if failed:
                    line["own_rmsnorm_failed"] = failed[0]
            return lines
        failed.append((skipped or [why or "no result from every rank"])[0])
        log("opacus failed: %s" % failed[-1])
        if why is not None and why.startswith("timed out"):
            break  # a hang: another try would hang as long
    return [{"bench": "fsdp", "mode": "opacus", "skipped": "; then ".join(failed)}]


def round_ratios(lines, baseline):
    """dpclip over the plain step, round by round (modes take turns, so a
    round's two runs are neighbours in time), each the slowest rank's: the
    median, best and worst."""
    def per_round(mode):
        got = [line["ms_rounds"] for line in lines
               if line.get("mode") == mode and "ms_rounds" in line]
        return [max(r) for r in zip(*got)]
    rs = sorted(d / p for p, d in zip(per_round(baseline), per_round("dpclip")))
    if not rs:
        return {}
    return {"time_ratio_median_round": round(rs[len(rs) // 2] if len(rs) % 2 else
                                             (rs[len(rs) // 2 - 1] + rs[len(rs) // 2]) / 2, 3),
            "time_ratio_best_round": round(rs[0], 3), "time_ratio_worst_round": round(rs[-1], 3)}


def device_memory(lines, mode):
    """A mode's used memory summed over the GPUs (each GPU's largest over
    its ranks: ranks sharing one GPU see the same memory), MiB: at peak,
    and at peak over the run's start. Per-GPU peaks of different moments:
    at most the sum's peak."""
    peak, over = {}, {}
    for line in lines:
        if line.get("mode") == mode and "device_used_peak_mib" in line:
            d = line["device"]
            peak[d] = max(peak.get(d, 0.0), line["device_used_peak_mib"])
            over[d] = max(over.get(d, 0.0), line["device_over_start_mib"])
    return round(sum(peak.values()), 1), round(sum(over.values()), 1)


def ratios(args, lines, baseline):
    """The ratio line: each mode's slowest rank's median time and largest
    peak against the plain step's (None without the plain step's)."""
    def of(mode):
        got = [line for line in lines if line.get("mode") == mode and "ms_per_step" in line]
        if not got:
            return None
        return (max(line["ms_per_step"] for line in got), max(line["peak_mib"] for line in got),
                next((line for line in got if line["rank"] == 0), got[0]))
    plain, private_, opacus = of(baseline), of("dpclip"), of("opacus")
    if plain is None:
        return None
    out = {"bench": "fsdp", "ratios": True, "model": args.model, "world": args.world,
           "precision": args.precision, "baseline": baseline,
           "time_target": TARGET["time"], "peak_target": TARGET["peak"]}
    if private_ is not None:
        t, m = private_[0] / plain[0], private_[1] / plain[1]
        out.update(private_over_plain_time=round(t, 3), private_over_plain_peak=round(m, 3),
                   time_within_target=t <= TARGET["time"], peak_within_target=m <= TARGET["peak"],
                   target_met=t <= TARGET["time"] and m <= TARGET["peak"],
                   reduce_scatter_share=private_[2]["reduce_scatter_share"])
        if plain[2].get("grad_phase_extra_mib"):
            out["grad_phase_extra_over_plain"] = round(
                private_[2]["grad_phase_extra_mib"] / plain[2]["grad_phase_extra_mib"], 3)
        out.update(round_ratios(lines, baseline))
    if args.logical:
        out.update(logical=args.logical, micro=args.micro)
        for mode, got in (("plain", plain), ("private", private_)):
            if got is not None:  # the slowest rank's median logical step
                out[mode + "_tokens_per_s"] = round(args.logical * args.seq / (got[0] / 1e3), 1)
    mem = {m: device_memory(lines, m) for m in (baseline, "dpclip")}
    if mem[baseline][0] > 0:  # measured (CUDA)
        out["device_used_peak_mib"] = {m: v[0] for m, v in mem.items()}
        out["device_over_start_mib"] = {m: v[1] for m, v in mem.items()}
        if private_ is not None:
            out["device_used_private_over_plain"] = round(
                mem["dpclip"][0] / mem[baseline][0], 3)
            if mem[baseline][1] > 0:
                out["device_over_start_private_over_plain"] = round(
                    mem["dpclip"][1] / mem[baseline][1], 3)
    if opacus is not None:
        out["opacus_over_plain_time"] = round(opacus[0] / plain[0], 3)
        out["opacus_over_plain_peak"] = round(opacus[1] / plain[1], 3)
    return out


def timing(args, out_dir, sharded):
    log("timing: %d ranks, %s, rounds of %s%s" % (
        args.world, placement(args), "fsdp and dpclip" if sharded else "ddp and dpclip",
        ", logical steps of %d in micro-batches of %d a rank" % (args.logical, args.micro)
        if args.logical else ""))
    why = spawn(timing_rank, args.world, (
        args.world, os.path.join(out_dir, "init_timing"), args, out_dir, False, True))
    lines = read_lines(out_dir, "timing", args.world)
    for line in lines:
        print(json.dumps(line), flush=True)
    if why is not None:  # reported; Opacus's processes are its own and still run
        log("timing failed: %s" % why)
        print(json.dumps({"bench": "fsdp", "error": why}), flush=True)
    if args.opacus:
        why_not = None
        if args.logical:
            why_not = ("gradient accumulation (--logical) is not wired for Opacus in this bench "
                       "(its ghost_fsdp step over several backwards is not run here)")
        elif not sharded:
            why_not = "Opacus's ghost_fsdp needs FSDP2 (fully_shard, torch >= 2.4) on CUDA"
        else:
            try:
                importlib.import_module("opacus")  # its failure, said once, up front
            except Exception as e:  # pylint: disable=broad-except
                why_not = "import opacus: %s: %s" % (type(e).__name__, e)
        for line in run_opacus(args, out_dir, why_not):
            lines.append(line)
            print(json.dumps(line), flush=True)
    res = ratios(args, lines, "fsdp" if sharded else "ddp")
    if res is not None:
        print(json.dumps(res), flush=True)
    return 0 if why is None else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="dpclipd's socket")
    ap.add_argument("--job-id", default=None, help="ledger account (default: a fresh one)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--world", type=int, default=None,
                    help="ranks (default: the GPUs, at least 2)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt",
                    help="gpt: GPT-2-small-like (the default); llama1b: Llama-1B-like")
    for k in ("blocks", "d", "heads", "vocab", "seq", "ffn"):
        ap.add_argument("--" + k, type=int, default=None, help="default: the model's")
    ap.add_argument("--batch", type=int, default=4, help="samples per rank")
    ap.add_argument("--logical", type=int, default=None,
                    help="samples a logical step over every rank (default: one batch a rank)")
    ap.add_argument("--micro", type=int, default=None,
                    help="with --logical: samples a rank's micro-batch (default: --batch)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2; logical steps: 1")
    ap.add_argument("--steps", type=int, default=None, help="default 5; logical steps: 3")
    ap.add_argument("--repeat", type=int, default=5,
                    help="rounds of the modes, taken in turns; each rank's median is reported "
                         "(5: a median quoted is of at least five rounds)")
    ap.add_argument("--opacus", action="store_true",
                    help="also time Opacus's FSDP ghost clipping (skipped where it fails)")
    ap.add_argument("--opacus-timeout", type=int, default=900,
                    help="seconds Opacus's ranks may take before they are ended")
    ap.add_argument("--check", action="store_true",
                    help="instead of timing: %d steps at sigma 0 against one GPU"
                    % fsdp_check.CHECK_STEPS)
    ap.add_argument("--bucket", type=int, default=None,
                    help="elements per rank in one reduce-scatter bucket, and so in one sums "
                    "step (default: dpclip's, dpclip._shards.bucket_size(world): 256M, less "
                    "past 2 ranks): fewer, larger buckets cost fewer daemon steps and more "
                    "memory")
    ap.add_argument("--trace", action="store_true",
                    help="after the timing, %d steps more, each rank's line giving where its "
                    "step's time went (host and GPU stream, ms from the step's start)" % TRACED)
    ap.add_argument("--check-tol", type=float, default=None,
                    help="largest relative difference accepted (default: %s)"
                    % ", ".join("%g in %s" % (v, k) for k, v in fsdp_check.CHECK_TOL.items()))
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        if k != "batch" and getattr(args, k) is None:
            setattr(args, k, v)
    if args.world is None:
        args.world = max(2, torch.cuda.device_count() if args.device == "cuda" else 0)
    if args.micro is not None and not args.logical:
        ap.error("--micro needs --logical (without it a step is one batch of --batch)")
    if args.micro is None:
        args.micro = args.batch
    if args.logical and args.logical % (args.world * args.micro):
        ap.error("--logical %d is not a multiple of --world x --micro (%d x %d): every rank "
                 "runs the same number of whole micro-batches" % (
                     args.logical, args.world, args.micro))
    # a logical step is many micro-batches: fewer of them
    args.warmup = args.warmup if args.warmup is not None else (1 if args.logical else 2)
    args.steps = args.steps if args.steps is not None else (3 if args.logical else 5)
    sharded = args.device == "cuda" and fsdp2_api() is not None
    keys = ("model", "blocks", "d", "heads", "ffn", "vocab", "seq", "batch", "logical", "micro",
            "world", "precision", "warmup", "steps", "repeat")
    config = {k: getattr(args, k) for k in keys}
    config["micro"] = args.micro if args.logical else None
    config["bucket"] = args.bucket or _shards.bucket_size(args.world)
    config.update(device=args.device, gpus=torch.cuda.device_count(),
                  placement=placement(args), fully_shard=sharded, torch=torch.__version__)
    print(json.dumps({"bench": "fsdp", "config": config}), flush=True)
    out_dir = tempfile.mkdtemp(prefix="bench_fsdp.")
    try:
        rc = (fsdp_check.check if args.check else timing)(args, out_dir, sharded)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    log("done")
    sys.exit(rc)


if __name__ == "__main__":
    main()
