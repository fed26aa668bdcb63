#!/usr/bin/env python3
"""FSDP2 (fully_shard) training step on several ranks: non-private, dpclip
and Opacus's FSDP ghost clipping; and a correctness check of dpclip's
sharded step against one GPU.

    build/dpclipd --socket S --ledger-dir "" &    # one daemon serves every GPU
    python3 bench/bench_fsdp.py --socket S                       # GPT-2-small-like
    python3 bench/bench_fsdp.py --socket S --model llama1b --world 4 --opacus
    python3 bench/bench_fsdp.py --socket S --model llama1b --world 4 --seq 512 --check
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
the clipping and noise steps' wall time), then one of ratios: the slowest
rank's time and the largest peak of each mode against the plain step's,
with dpclip's targets (1.15x in time and in memory).

--check: 3 steps at sigma 0 with fixed batches (step s: a global batch of
world x B samples from seed 1000 + s; rank r takes rows r*B..(r+1)*B), SGD at
lr 1; then the parameters, gathered whole, against one process on one GPU
(cuda:0) training the unsharded model with dpclip on the whole global batch.
Under bf16 that process keeps f32 master weights and steps a bf16 copy,
as FSDP's MixedPrecisionPolicy does. Printed: the largest absolute
difference of a parameter; per tensor, against its update (the reference's
change over the steps), the largest element's difference over the largest
update, and the L2 norm of the difference over the update's (the check:
every tensor within 5e-2 in bf16, 5e-3 in fp32; --check-tol); all updates'
L2 difference; the losses. The exit status is 1 outside the tolerance, or
where nothing moved. The one-GPU process holds the global batch's
activations: T=2048 with 16 Llama samples does not fit an 80 GB GPU;
--seq 512 does.

Where torch has no fully_shard (< 2.4), and with --device cpu (gloo), the
same private steps run on plain models (make_private(sharded_noise=True))
against a data-parallel step that all-reduces autograd's gradients ("ddp"):
a smoke test of the script, not the measurement; Opacus is skipped there.
Progress goes to stderr.
"""
import argparse
import datetime
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_torch_step import MODELS, RMSNorm, peak_mb, reset_peak, sync, token_batch  # noqa: E402
from bench_torch_step import build as make_model  # noqa: E402
from dpclip.torch import PrivacyEngine, register  # noqa: E402

TARGET = {"time": 1.15, "peak": 1.15}  # dpclip over the plain FSDP2 step
LR = 1e-4
CHECK_STEPS = 3
CHECK_LR = 1.0  # updates well above the f32 master weights' rounding
CHECK_TOL = {"bf16": 5e-2, "fp32": 5e-3}
# the run's start, for the progress lines (spawned ranks inherit it)
T0 = float(os.environ.setdefault("BENCH_FSDP_T0", repr(time.time())))


def log(msg):
    print("bench_fsdp [%6.1f s] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


def fsdp2_api():
    """(fully_shard, MixedPrecisionPolicy), or None before torch 2.4."""
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard", "MixedPrecisionPolicy"])
            return m.fully_shard, m.MixedPrecisionPolicy
        except Exception:  # pylint: disable=broad-except
            continue
    return None


def policy(args):
    """The MixedPrecisionPolicy of --precision (None for fp32)."""
    if args.precision != "bf16":
        return None
    return fsdp2_api()[1](param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


# --- per process ---------------------------------------------------------------------

def init_rank(rank, world, init_file, args, timeout_s):
    """This rank's device and FSDP2 mesh (None without fully_shard or on
    the CPU), the process group initialized."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cpu")
    if args.device == "cuda":
        if torch.cuda.device_count() >= world:
            device = torch.device("cuda", rank)  # a GPU each: NCCL finds NVLink
        else:
            device = torch.device("cuda", 0)
            # NCCL refuses two ranks of one host on one GPU: a host id each
            os.environ["NCCL_HOSTID"] = "bench-fsdp-%d" % rank
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    mesh = None
    if device.type == "cuda" and fsdp2_api() is not None:
        # pylint: disable=import-outside-toplevel
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world,))  # keeps the device set above
    return device, mesh


def prepare(args):
    """What every process does first: dpclip learns the Llama's RMSNorm;
    returns the model's initial state (seed 0, on the CPU)."""
    if args.model == "llama1b":
        register(RMSNorm, kind="rmsnorm", weight="weight", eps="eps")
    torch.manual_seed(0)
    return make_model(args).state_dict()


def fresh_model(args, device, init):
    """A model on device holding init's weights."""
    if hasattr(torch.device, "__enter__"):  # torch >= 2.0: no second initialization
        with torch.device("meta"):
            model = make_model(args)
        model = model.to_empty(device=device)
    else:
        model = make_model(args).to(device)
    model.load_state_dict(init)
    return model


def shard(model, mesh, args):
    """fully_shard on each block, then the root (nothing without a mesh)."""
    if mesh is None:
        return model
    fully_shard = fsdp2_api()[0]
    kw = {"mesh": mesh}
    if policy(args) is not None:
        kw["mp_policy"] = policy(args)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


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


def private(args, model, world, sharded_noise, sigma, lr):
    """(engine, model, optimizer): dpclip's make_private over SGD at lr."""
    engine = PrivacyEngine(args.socket, client_name="bench_fsdp", job_id=args.job_id)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        noise_multiplier=sigma, max_grad_norm=1.0, loss_reduction="mean",
        expected_batch_size=args.batch * world, sharded_noise=sharded_noise)
    return engine, model, opt


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


def global_batch(args, world, step):
    """The check's global batch of a step: world * B samples."""
    return token_batch(args, torch.device("cpu"), seed=1000 + step, batch=world * args.batch)


def seq_loss(logits, y):
    # every sample has T tokens: the token mean is the mean of per-sample means
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


# --- timing --------------------------------------------------------------------------

def timed_run(args, rank, world, device, mesh, init, mode, own_norms=True):
    """Times `steps` steps after `warmup`; a dict for the JSON line."""
    reset_peak(device)
    model = fresh_model(args, device, init)
    engine = criterion = None
    if mode == "opacus":
        model, opt, criterion = make_opacus(args, model, rank, world, own_norms)
    else:
        model = shard(model, mesh, args)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if mode == "dpclip":
            engine, model, opt = private(args, model, world, mesh is None, 1.0, LR)
    x, y = token_batch(args, device, seed=1 + rank)  # the timing's fixed batch of this rank
    parts = {"reduce_scatter_ms": 0.0, "clip_ms": 0.0, "noise_ms": 0.0}
    extra = {}

    def step(timed, measure=False):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        if criterion is not None:
            # shape: Opacus turns the B*T token losses into B per-sample means
            loss = criterion(logits.float().flatten(0, 1), y.flatten(), shape=logits.shape)
        else:
            loss = seq_loss(logits, y)
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
    dist.barrier(**({"device_ids": [device.index]} if device.type == "cuda" else {}))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(True)
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    peak = peak_mb(device)
    step(False, measure=True)
    out = {"bench": "fsdp", "model": args.model, "rank": rank, "world": world, "mode": mode,
           "fully_shard": mesh is not None, "precision": args.precision,
           "device": str(device), "ms_per_step": round(ms, 3), "peak_mib": round(peak, 1),
           **extra}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    if mode == "opacus" and not own_norms:
        out["rmsnorm"] = "torch.nn.RMSNorm"
    if engine is not None:
        sh = engine._shards  # pylint: disable=protected-access
        esz = torch.empty(0, dtype=sh.dtype).element_size()
        # the sums' memory: up to two slots of the largest bucket, against the
        # whole local sum a single sums step would hold
        buckets = len(sh._buckets)  # pylint: disable=protected-access
        out["sums_slots_mib"] = round(min(2, buckets) * sh.widest * esz / 2 ** 20, 1)
        out["whole_sum_mib"] = round(sh.full_n * esz / 2 ** 20, 1)
        out["buckets"] = buckets
        for k, v in parts.items():
            out[k] = round(v / args.steps, 3)
        out["reduce_scatter_share"] = round(out["reduce_scatter_ms"] / ms, 4)
        out["epsilon"] = engine.last_epsilon
        engine.close()
    return out


def merged(rounds):
    """A rank's line for a mode: its median round, every round's time, the
    largest peak."""
    ordered = sorted(rounds, key=lambda r: r["ms_per_step"])
    out = dict(ordered[len(ordered) // 2])
    out["ms_runs"] = [r["ms_per_step"] for r in ordered]
    out["peak_mib"] = max(r["peak_mib"] for r in rounds)
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
                    log("round %d/%d %s: %.1f ms/step, peak %.0f MiB (rank 0)"
                        % (rnd + 1, args.repeat, mode, res["ms_per_step"], res["peak_mib"]))
                write_lines(path, [merged(runs[m]) for m in modes if runs[m]])
    finally:
        dist.destroy_process_group()


# --- the check -----------------------------------------------------------------------

def check_rank(rank, world, init_file, args, out_dir):
    """CHECK_STEPS dpclip steps at sigma 0 on this rank's rows of each
    global batch; rank 0 saves the parameters, gathered whole, and the
    global mean loss of each step."""
    init = prepare(args)
    device, mesh = init_rank(rank, world, init_file, args, 600)
    if rank == 0:
        log("check: rank 0's initial model built, process group up on %s" % device)
    try:
        model = shard(fresh_model(args, device, init), mesh, args)
        engine, model, opt = private(args, model, world, mesh is None, 0.0, CHECK_LR)
        losses = []
        for s in range(CHECK_STEPS):
            xs, ys = global_batch(args, world, s)
            rows = slice(rank * args.batch, (rank + 1) * args.batch)
            opt.zero_grad(set_to_none=True)
            loss = seq_loss(model(xs[rows].to(device)), ys[rows].to(device))
            loss.backward()
            opt.step()
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            if rank == 0:
                log("check: step %d/%d, loss %.5f" % (s + 1, CHECK_STEPS, losses[-1]))
        engine.close()
        # What the module holds after the steps: a parameter that is not the
        # sharded one FSDP steps (an unsharded copy left registered) is
        # reported, and read as the optimizer's after reshard().
        held = {n: "%s/%s" % (type(p).__name__, str(p.dtype).replace("torch.", ""))
                for n, p in model.named_parameters()}
        if hasattr(model, "reshard"):
            model.reshard()
        final = {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if rank == 0:
                    final[n] = whole.float().cpu()
        if rank == 0:
            torch.save({"final": final, "losses": losses, "held": held},
                       os.path.join(out_dir, "check.pt"))
    finally:
        dist.destroy_process_group()


def check_reference(_, world, args, out_dir, mixed):
    """One process, one device: the unsharded model, dpclip on each whole
    global batch. mixed (bf16 under FSDP): f32 master weights stepped with
    the gradient of a bf16 copy, as MixedPrecisionPolicy does."""
    init = prepare(args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    master = fresh_model(args, device, init)
    work = fresh_model(args, device, init).to(torch.bfloat16) if mixed else master
    engine, work, opt = private(args, work, world, False, 0.0, 0.0 if mixed else CHECK_LR)
    losses = []
    for s in range(CHECK_STEPS):
        xs, ys = global_batch(args, world, s)
        opt.zero_grad(set_to_none=True)
        loss = seq_loss(work(xs.to(device)), ys.to(device))
        loss.backward()
        opt.step()
        if mixed:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pm.add_(pw.grad.float(), alpha=-CHECK_LR)
                    pw.copy_(pm)
        losses.append(float(loss))
        log("check reference: step %d/%d, loss %.5f" % (s + 1, CHECK_STEPS, losses[-1]))
    engine.close()
    final = {n: p.detach().float().cpu() for n, p in master.named_parameters()}
    torch.save({"init": init, "final": final, "losses": losses},
               os.path.join(out_dir, "reference.pt"))


def compare(ref, got):
    """The parameters' differences: the largest absolute one; per tensor,
    relative to the tensor's update (its reference's change over the
    steps), the largest element's against the largest update and, the
    check, the difference's L2 norm against the update's (robust to an
    element whose update is rounding alone); and all updates' L2."""
    out = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "max_rel_param": None,
           "max_tensor_l2_rel_diff": 0.0, "l2_worst_param": None, "max_abs_update": 0.0}
    num = den = 0.0
    per = {}
    for n, p0 in ref["init"].items():
        pr, pf = ref["final"][n].double(), got["final"][n].double()
        upd = pr - p0.double()
        diff = (pf - pr).abs()
        d, scale = float(diff.max()), float(upd.abs().max())
        dd, uu = float((diff ** 2).sum()), float((upd ** 2).sum())
        rels = (("max_rel_diff", "max_rel_param", d / scale if scale > 0 else
                 (0.0 if d == 0 else math.inf)),
                ("max_tensor_l2_rel_diff", "l2_worst_param", math.sqrt(dd / uu) if uu > 0 else
                 (0.0 if dd == 0 else math.inf)))
        for key, worst, rel in rels:
            if out[worst] is None or rel > out[key]:
                out[key], out[worst] = rel, n
        per[n] = math.sqrt(dd / uu) if uu > 0 else (0.0 if dd == 0 else math.inf)
        out["max_abs_diff"] = max(out["max_abs_diff"], d)
        out["max_abs_update"] = max(out["max_abs_update"], scale)
        num += dd
        den += uu
    out["update_l2_rel_diff"] = math.sqrt(num / den) if den > 0 else math.inf
    out["l2_rel_diff_top"] = {n: round(v, 6) for n, v in sorted(
        per.items(), key=lambda kv: -kv[1])[:5]}
    return out


# --- the main process ---------------------------------------------------------------

def spawn(fn, nprocs, args, deadline_s=None):
    """fn(i, *args) in nprocs spawned processes; None when every one exited
    0, else why not (the others are ended: join does, as does the deadline)."""
    ctx = mp.start_processes(fn, nprocs=nprocs, join=False, start_method="spawn", args=args)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=10):
            if end is not None and time.monotonic() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                return "timed out after %d s" % deadline_s
    except Exception as e:  # pylint: disable=broad-except
        text = [line for line in str(e).strip().splitlines() if line.strip()]
        return "%s: %s" % (type(e).__name__, text[-1] if text else "")
    return None


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
    if opacus is not None:
        out["opacus_over_plain_time"] = round(opacus[0] / plain[0], 3)
        out["opacus_over_plain_peak"] = round(opacus[1] / plain[1], 3)
    return out


def timing(args, out_dir, sharded):
    log("timing: %d ranks, %s, rounds of %s" % (
        args.world, placement(args), "fsdp and dpclip" if sharded else "ddp and dpclip"))
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
        if not sharded:
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


def check(args, out_dir, sharded):
    precision = args.precision if sharded else "fp32"  # no policy without fully_shard
    tol = args.check_tol if args.check_tol is not None else CHECK_TOL[precision]
    log("check: the reference, one process on %s, %d samples a step"
        % ("cuda:0" if args.device == "cuda" else "the CPU", args.world * args.batch))
    why = spawn(check_reference, 1, (args.world, args, out_dir, precision == "bf16"))
    if why is None:
        log("check: %d ranks, %s" % (args.world, placement(args)))
        why = spawn(check_rank, args.world, (
            args.world, os.path.join(out_dir, "init_check"), args, out_dir))
        if why is not None:
            why = "the ranks: " + why
    else:
        why = "the reference: " + why
    if why is not None:
        log("check failed: %s" % why)
        print(json.dumps({"bench": "fsdp", "check": True, "passed": False, "error": why}),
              flush=True)
        return 1
    log("check: comparing")
    ref = torch.load(os.path.join(out_dir, "reference.pt"))
    got = torch.load(os.path.join(out_dir, "check.pt"))
    res = compare(ref, got)
    kinds = set(got.get("held", {}).values())
    if sharded and len(kinds) > 1:  # every parameter should be a sharded f32 DTensor
        res["held_after_steps"] = {k: sorted(n for n, v in got["held"].items() if v == k)[:4]
                                   for k in sorted(kinds)}
    ok = res["max_tensor_l2_rel_diff"] <= tol and res["max_abs_update"] > 0
    print(json.dumps({
        "bench": "fsdp", "check": True, "model": args.model, "world": args.world,
        "batch_per_rank": args.batch, "seq": args.seq, "steps": CHECK_STEPS, "lr": CHECK_LR,
        "sigma": 0.0, "fully_shard": sharded, "precision": precision,
        **{k: (round(v, 9) if isinstance(v, float) else v) for k, v in res.items()},
        "losses": [round(v, 6) for v in got["losses"]],
        "reference_losses": [round(v, 6) for v in ref["losses"]],
        "tolerance": tol, "passed": ok}), flush=True)
    return 0 if ok else 1


def placement(args):
    """Where the ranks run, in words (init_rank decides alike)."""
    if args.device != "cuda":
        return "on the CPU (gloo)"
    if torch.cuda.device_count() >= args.world:
        return "a GPU each (cuda:0..%d)" % (args.world - 1)
    return "all on cuda:0 (a NCCL_HOSTID each)"


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
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of the modes, taken in turns; each rank's median is reported")
    ap.add_argument("--opacus", action="store_true",
                    help="also time Opacus's FSDP ghost clipping (skipped where it fails)")
    ap.add_argument("--opacus-timeout", type=int, default=900,
                    help="seconds Opacus's ranks may take before they are ended")
    ap.add_argument("--check", action="store_true",
                    help="instead of timing: %d steps at sigma 0 against one GPU" % CHECK_STEPS)
    ap.add_argument("--check-tol", type=float, default=None,
                    help="largest relative difference accepted (default: %s)"
                    % ", ".join("%g in %s" % (v, k) for k, v in CHECK_TOL.items()))
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        if k != "batch" and getattr(args, k) is None:
            setattr(args, k, v)
    if args.world is None:
        args.world = max(2, torch.cuda.device_count() if args.device == "cuda" else 0)
    sharded = args.device == "cuda" and fsdp2_api() is not None
    keys = ("model", "blocks", "d", "heads", "ffn", "vocab", "seq", "batch", "world",
            "precision", "warmup", "steps", "repeat")
    config = {k: getattr(args, k) for k in keys}
    config.update(device=args.device, gpus=torch.cuda.device_count(),
                  placement=placement(args), fully_shard=sharded, torch=torch.__version__)
    print(json.dumps({"bench": "fsdp", "config": config}), flush=True)
    out_dir = tempfile.mkdtemp(prefix="bench_fsdp.")
    try:
        rc = check(args, out_dir, sharded) if args.check else timing(args, out_dir, sharded)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    log("done")
    sys.exit(rc)


if __name__ == "__main__":
    main()
