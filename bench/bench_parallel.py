#!/usr/bin/env python3
"""Pipeline- and data-parallel training steps, private (dpclip) vs plain, one
process per device.

    python3 bench/bench_parallel.py --mode pipeline --socket S              # 2 GPUs, 1 daemon
    python3 bench/bench_parallel.py --mode pipeline --daemons 2 --socket A,B  # a daemon per GPU
    python3 bench/bench_parallel.py --mode pipeline --socket S --microbatches 8 \
        --schedule 1f1b --repeat 5                                          # 1F1B, M = 8
    python3 bench/bench_parallel.py --mode ddp --socket S                   # 4 GPUs
    python3 bench/bench_parallel.py --mode ddp_pipeline --socket S          # 2 replicas x 2 stages
    python3 bench/bench_parallel.py --mode pipeline --socket S --check      # exactness first
    python3 bench/bench_parallel.py --mode pipeline --socket S --microbatches 8 --trace
        # each rank's ops in time (with dpclipd --log-level debug: bench/step_timeline.py)
    python3 bench/bench_parallel.py --mode ddp --socket S --device cpu --blocks 2 --d 128 \
        --heads 4 --vocab 1000 --seq 64 --batch 4 --steps 3                 # CPU smoke test

Model: bench_torch_step.py's GPT-2-small-like GPT (12 blocks, d=768, 12
heads, vocab 32000, T=1024, untied head), B=8 samples per replica and
micro-batch, SGD, bf16 autocast (--precision fp32: none). Rank r runs on
cuda:r (NCCL; gloo on the CPU); NCCL_NVLS_ENABLE=0 is set here for every
rank.

Modes (replicas x stages):
  pipeline      1 x 2: stage 0 holds the embeddings and the first half of
                the blocks, stage 1 the rest, the final LayerNorm and the
                head; the activations (f32 residual stream) and their
                gradients go by torch.distributed point-to-point ops.
                dpclip: make_private(norm_group=WORLD), flat clipping across
                the stages (the group's norms reduced in the daemon with
                --daemons 1, exchanged between the daemons through NCCL with
                --daemons 2). Plain: the same pipeline, autograd's gradients.
                Micro-batches (--microbatches M, pipeline only; default 1:
                one batch a step, the stages one after the other): a logical
                step is M micro-batches of B samples run under --schedule,
                1f1b (stage 0 one forward ahead, then each stage a forward
                and a backward in turn) or gpipe (every forward, then every
                backward, the last first), then one optimizer step. Plain:
                PyTorch gradient accumulation, each micro-batch's mean loss
                divided by M. dpclip: each micro-batch's own mean loss, each
                forward/backward one micro-batch of the logical step (the
                daemon sums its per-sample norms over the stages, then clips
                and accumulates), step() the commit: noise added and charged
                once, divided by the expected logical batch M x B. On NCCL
                the activations and the gradients go through a process
                group each (on one, 1F1B's crossing sends would wait for
                each other).
  ddp           N x 1 (--world, 4): plain is torch DistributedDataParallel;
                dpclip is make_private's data parallelism (no DDP wrapper:
                each rank's own session, rank 0 alone noises, the clipped
                sums all-reduced and gated after the step; asynchronous GPU
                steps).
  ddp_pipeline  2 x 2: two replicas of the pipeline, each its own norm group
                (ranks 0,1 and 2,3); plain wraps each stage in DDP over the
                ranks holding that stage.

Sockets: --socket S (every rank's daemon) or one per rank, comma-separated
(--daemons = their count; rank r uses the r-th: its GPU's daemon).

Each of --repeat rounds (5) times plain, then dpclip:
--warmup logical steps, then --steps, each step's time taken between CUDA
events recorded on the stream at each step's start (no host
synchronisation between steps; wall clock on the CPU). Each rank's median
step; a round's time is its slowest rank's; a mode's time is its median
round. During the timed steps each rank samples its GPU's used memory
(torch.cuda.mem_get_info: every process on it, the trainer and the daemon;
bench_accumulate.DeviceMemory) every 5 ms: device_peak_mib, with
device_base_mib before the model was built. JSON lines on stdout (rank 0),
progress on stderr: one per mode (every rank's figures of the median round,
tokens_per_s of the logical batch), then the ratio: time_ratio (the
medians'), time_ratio_median, _best and _worst (of the rounds' dpclip /
plain, paired by round) and mem_ratio (the largest over the GPUs of each
GPU's whole-device peak, dpclip / plain, over every round; device_peak_mib
lists each GPU's). Every line has microbatches, schedule and logical_batch
(the samples of one logical step over the replicas: the expected batch
dpclip divides by). For dpclip with a norm group, each rank's figures
include, per step (medians): daemon_call_ms (optimizer.step()'s round trip
to the daemon: engine.last_timing["run_ms"], with micro-batches the
commit's), and from the daemon's reply to it (engine.last_timing's daemon
figures) group_wait_ms (from this member's norms being in to the group's
totals: a later stage's includes waiting for the earlier stage's backward),
group_exchange_ms (of it, the daemons' NCCL exchange) and
daemon_compute_ms; daemon_compute_step_ms is the daemon's compute of every
micro-batch of the step (engine.compute_ns_total); micro_batches_held_peak
the most micro-batches the rank held in flight at once (sent, their tensors
alive until their replies are collected; the ratio line: each rank's most
over the rounds). The ratio line's
reduction_ms is the group's smallest group_wait_ms (across daemons the
member that arrives last, stage 0 of a pipeline, waits only for the
reduction itself; on one daemon over several GPUs its wait also holds its
own norm pass, which waits on the GPU for its backward: there the step
ratio is the measure), reduction_share its share of the step, and
last_member_daemon_call_ms that member's whole daemon call (the private
step's part of the critical path: reduction, clipped sums, noise).

--check (any mode), before the timing: noise off, fp32 (bf16 autocast with
--check-bf16, against the same f64 reference: default --tol 5e-2), TF32 off in the
trainers, one logical step on the fixed batch with C between the middle
per-sample norms; rank 0 first computes the reference, the unsplit model on
one device over the whole logical batch (the replicas' union, M x B samples
each), each sample's gradient by its own backward, clipped and summed in
f64, divided by the expected logical batch (MEAN). Every rank compares its
parameters' .grad after the engine's step (max over parameters of
max|got - want| / max|want|) and its per-sample norms; one JSON line.
The daemon clips by norms raised by their rounding bound e (docs/design.md:
up to 5e-3 where per-sample gradients are kept in bf16), and in phases by a
margin, so its gradients differ from the rule's by about e on their own.
The check therefore takes the two apart, and exits 1 unless all three hold:
- the per-sample norms within --tol of the reference's (default 5e-3 on
  CUDA, the daemon's f32 clipped sums run in TF32; 1e-3 on the CPU);
- every coefficient at most the rule's, and below it by at most
  COEF_SHORTFALL_MAX, relative (coefs_max_rel_shortfall);
- max_rel_err_given_coefs within --tol: the gradients against the same
  reference summed with the daemon's own coefficients (the sums' arithmetic
  alone).
max_rel_err (against the rule's coefficients) and coefs_max_abs_err are
reported as well.
"""
import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL starts, in every rank (spawn inherits it)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from device_memory import DeviceMemory  # noqa: E402
from bench_torch_step import GPT, peak_mb, reset_peak, sync, token_batch  # noqa: E402
from dpclip._fsdp import trace_add, trace_mark  # noqa: E402 (as bench_fsdp's --trace)
from dpclip.pipeline import schedule  # noqa: E402
from dpclip.torch import PrivacyEngine  # noqa: E402

LAYOUTS = {"pipeline": (1, 2), "ddp": (None, 1), "ddp_pipeline": (2, 2)}  # (replicas, stages)


def log(msg):
    print("bench_parallel: " + msg, file=sys.stderr, flush=True)


class Stage(nn.Module):
    """One of two pipeline stages cut from a GPT (its modules, not copies)."""

    def __init__(self, g, stage):
        super().__init__()
        k = len(g.blocks) // 2
        self.first = stage == 0
        if self.first:
            self.tok, self.pos = g.tok, g.pos
            self.blocks = nn.ModuleList(g.blocks[:k])
        else:
            self.blocks = nn.ModuleList(g.blocks[k:])
            self.ln, self.head = g.ln, g.head

    def forward(self, h):
        if self.first:  # as GPT.forward
            B, T = h.shape
            pos = torch.arange(T, device=h.device).unsqueeze(0).repeat(B, 1)
            h = self.tok(h) + self.pos(pos)
        for b in self.blocks:
            h = b(h)
        return h if self.first else self.head(self.ln(h))


def build_part(args, stages, stage, device):
    """This rank's part of the GPT (seed 0, as bench_torch_step) and its
    parameters' names in the whole model."""
    torch.manual_seed(0)
    whole = GPT(args.vocab, args.seq, args.d, args.blocks, args.heads)
    names = {id(p): n for n, p in whole.named_parameters()}
    part = whole if stages == 1 else Stage(whole, stage)
    return part.to(device), [names[id(p)] for p in part.parameters()]


def union_batch(args, replicas, device):
    """token_batch's fixed tokens for every replica's logical batch:
    replica i takes rows [i*M*B, (i+1)*M*B), its micro-batch j the B rows
    from i*M*B + j*B (one replica, one micro-batch: token_batch's batch)."""
    return token_batch(args, device, batch=args.batch * args.microbatches * replicas)


class Rank:
    """This process's place: replica and stage, its peers and groups."""

    def __init__(self, rank, world, args, sockets):
        self.rank, self.world, self.args = rank, world, args
        self.R, self.S = world // LAYOUTS[args.mode][1], LAYOUTS[args.mode][1]
        self.replica, self.stage = rank // self.S, rank % self.S
        self.peer = self.replica * self.S + 1 - self.stage
        self.socket = sockets[rank] if len(sockets) > 1 else sockets[0]
        self.device = torch.device("cuda", gpu_of(args, rank)) if args.device == "cuda" \
            else torch.device("cpu")
        # new_group is a collective of every rank, in one order
        pipes = [dist.new_group([i * self.S + s for s in range(self.S)]) for i in range(self.R)] \
            if self.S > 1 and self.R > 1 else None
        dps = [dist.new_group([i * self.S + s for i in range(self.R)]) for s in range(self.S)] \
            if self.S > 1 and self.R > 1 else None
        self.pipe = None if self.S == 1 else (pipes[self.replica] if pipes else dist.group.WORLD)
        self.dp = dps[self.stage] if dps else None  # plain DDP's group (None: every rank)
        # NCCL: a group per direction of each pipeline (activations, gradients; see Link)
        links = [(dist.new_group([i * self.S + s for s in range(self.S)]),
                  dist.new_group([i * self.S + s for s in range(self.S)])) for i in range(self.R)] \
            if self.S > 1 and args.device == "cuda" else None
        self.links = links[self.replica] if links else (None, None)
        x, y = union_batch(args, self.R, self.device)
        n = args.batch * args.microbatches
        self.x, self.y = x[self.replica * n:(self.replica + 1) * n], \
            y[self.replica * n:(self.replica + 1) * n]


class Link:
    """One logical step's transfers with the other stage of the pipeline:
    isend (waited for at finish) and recv. NCCL runs a communicator's sends
    and receives in order on one stream, and a send may wait on the device
    for its receive: under 1F1B stage 0 sends h1, then receives g0, while
    stage 1 sends g0, then receives h1, and on one communicator each send
    would wait for the other. So NCCL pipelines take a process group per
    direction (Rank.links: activations, gradients), as
    python/tests/accum_worker.py's do, each in the same order on both
    stages. Waiting on an NCCL op makes the compute stream wait, not the
    host. gloo: the default group (through host memory, no such stream)."""

    def __init__(self, peer, send_group, recv_group):
        self.peer, self.send_group, self.recv_group = peer, send_group, recv_group
        self.sent = []  # (work, tensor): kept until finish

    def send(self, t):
        self.sent.append((dist.isend(t, self.peer, group=self.send_group), t))

    def recv(self, t):
        dist.recv(t, self.peer, group=self.recv_group)
        return t

    def finish(self):
        for work, _ in self.sent:
            work.wait()
        self.sent = []


TRACED = 3  # --trace's steps a round


def make_step(c, model, opt, amp, divide, marks=None):
    """One logical step: --microbatches micro-batches of --batch samples
    each, forward and backward (across the stages by point-to-point ops, in
    --schedule's order), then opt.step(). divide: each micro-batch's loss
    over M (plain accumulation; dpclip's daemon divides the logical step's
    clipped sum by the expected logical batch instead). marks (--trace): a
    list that each step appends (label, host time, CUDA event or None) to,
    at each op's start and the step's end."""
    a, B, M = c.args, c.args.batch, c.args.microbatches

    def at(what):
        if marks is not None:
            trace_mark(marks, what, c.device.type == "cuda")
    ops = schedule(a.schedule, 2, c.stage, M)

    def rows(i):
        return slice(i * B, (i + 1) * B)

    def fwd(inp):
        with torch.autocast(c.device.type, dtype=torch.bfloat16, enabled=amp):
            return model(inp)

    def loss_of(logits, i):  # the token mean: the mean over samples of their token means
        loss = F.cross_entropy(logits.float().flatten(0, 1), c.y[rows(i)].flatten())
        return loss / M if divide else loss

    def step():
        opt.zero_grad(set_to_none=True)
        if c.S == 1:
            for i in range(M):
                at("FB%d" % i)  # a replica's whole micro-batch
                loss_of(fwd(c.x[rows(i)]), i).backward()
            at("step")
            opt.step()
            at("end")
            return
        acts, grads = c.links
        link = Link(c.peer, *((acts, grads) if c.stage == 0 else (grads, acts)))
        outs, ins, losses = {}, {}, {}
        for op, i in ops:
            at("%s%d" % (op, i))
            if c.stage == 0 and op == "F":
                outs[i] = fwd(c.x[rows(i)])
                link.send(outs[i].detach().float().contiguous())
            elif c.stage == 0:
                g = link.recv(torch.empty(outs[i].shape, dtype=torch.float32, device=c.device))
                h = outs.pop(i)
                h.backward(g.to(h.dtype))
            elif op == "F":
                h = link.recv(torch.empty(B, a.seq, a.d, dtype=torch.float32, device=c.device))
                ins[i] = h.requires_grad_(True)
                losses[i] = loss_of(fwd(ins[i]), i)
            else:
                losses.pop(i).backward()
                link.send(ins.pop(i).grad.contiguous())
        link.finish()
        at("step")
        opt.step()  # dpclip: the commit, which waits in the daemon for the other stage's
        at("end")
    return step


def private(c, model, sigma, C, lr):
    engine = PrivacyEngine(c.socket, client_name="bench_parallel")
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        noise_multiplier=sigma, max_grad_norm=C, loss_reduction="mean",
        expected_batch_size=logical_batch(c.args, c.R), norm_group=c.pipe)
    return engine, model, opt


def logical_batch(args, replicas):
    return replicas * args.microbatches * args.batch


def mark(device):
    if device.type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def between(a, b):
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def run(c, mode):
    """Times --steps logical steps of `mode` (plain or dpclip) after
    --warmup; a dict."""
    a, dev = c.args, c.device
    reset_peak(dev)
    base = DeviceMemory(dev).used()
    model, _ = build_part(a, c.S, c.stage, dev)
    engine = None
    if mode == "plain":
        if c.R > 1:
            model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                        process_group=c.dp)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    else:
        engine, model, opt = private(c, model, 1.0, 1.0, 1e-4)
    step = make_step(c, model, opt, a.precision == "bf16", divide=mode == "plain")
    for _ in range(a.warmup):
        step()
    sync(dev)
    grouped = engine is not None and engine.norm_group is not None and not engine.asynchronous
    if engine is not None:
        engine.synchronize()
        c0, w0 = engine.compute_ns_total, engine.input_wait_ns_total
    stats = {}

    def add(k, v):
        stats.setdefault(k, []).append(v)
    marks = []
    with DeviceMemory(dev) as mem:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            marks.append(mark(dev))
            step()
            if engine is not None:
                for k, v in engine.last_timing.items():
                    if grouped or not k.startswith("group_"):
                        add({"run_ms": "daemon_call_ms",
                             "compute_ms": "daemon_compute_ms"}.get(k, k), v)
        marks.append(mark(dev))
        sync(dev)
        wall = (time.perf_counter() - t0) * 1e3 / a.steps
    times = [between(marks[i], marks[i + 1]) for i in range(a.steps)]
    out = {"rank": c.rank, "replica": c.replica, "stage": c.stage,
           "step_ms": round(statistics.median(times), 3), "mean_ms": round(wall, 3)}
    if engine is not None:
        engine.synchronize()
        out.update({k: round(statistics.median(v), 3) for k, v in stats.items()})
        # every micro-batch's compute (last_timing's is the commit's alone)
        per_step = round((engine.compute_ns_total - c0) / 1e6 / a.steps, 3)
        if grouped:
            out["daemon_compute_step_ms"] = per_step
        else:  # asynchronous steps: the daemon's totals
            out["daemon_compute_ms"] = per_step
            out["daemon_input_wait_ms"] = round(
                (engine.input_wait_ns_total - w0) / 1e6 / a.steps, 3)
        out["daemons_in_group"] = engine.norm_group.daemons if engine.norm_group else 0
        out["micro_batches_held_peak"] = engine.micro_batches_held_peak
    out["peak_mem_mib"] = round(peak_mb(dev), 1)
    if dev.type == "cuda":  # the whole GPU: this trainer, the daemon, anything else on it
        out["device_peak_mib"] = round(mem.peak / 2**20, 1)
        out["device_base_mib"] = round(base / 2**20, 1)
    if a.trace:  # after every figure above, which these steps leave alone
        out["trace"] = trace_steps(c, model, opt, mode)
    if engine is not None:
        engine.close()
    del model, opt, engine, step
    reset_peak(dev)
    return out


def trace_steps(c, model, opt, mode):
    """--trace: TRACED more steps with a mark at each op's start and at the
    step's end; label -> [host ms, GPU ms] from the step's start, averaged."""
    marks = []
    traced = make_step(c, model, opt, c.args.precision == "bf16", divide=mode == "plain",
                       marks=marks)
    trace = {}
    for _ in range(TRACED):
        del marks[:]
        traced()
        sync(c.device)
        trace_add(trace, marks)
    return {k: [round(h / TRACED, 2), round(g / TRACED, 2)] for k, (h, g) in trace.items()}


def reference(args, replicas, device, path, given=None):
    """The check's reference (rank 0): the unsplit model's per-sample
    clipped sum over the replicas' union of logical batches, in f64, over
    the expected logical batch; saved to path. given: the coefficients to
    clip by (the daemon's, in the union's order) instead of the rule's, so
    that the sum's arithmetic is measured apart from the coefficients' (its
    file then holds the sums alone)."""
    torch.manual_seed(0)
    m = GPT(args.vocab, args.seq, args.d, args.blocks, args.heads).to(device)
    params = list(m.named_parameters())
    x, y = union_batch(args, replicas, device)
    n = x.shape[0]

    def grads(b):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x[b:b + 1]).flatten(0, 1), y[b]).backward()
        return [p.grad for _, p in params]
    out = {}
    if given is None:
        norms = torch.tensor([math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads(b)))
                              for b in range(n)], dtype=torch.float64)
        s = sorted(norms.tolist())
        C = 0.5 * (s[n // 2 - 1] + s[n // 2]) if n > 1 else 0.5 * s[0]  # about half clip
        # a norm group across daemons clips in a phase of its own, by squared
        # norms raised by the daemon's re-measurement margin (1/1024:
        # daemon/protocol/step_pass.h); a stage's norm group on one daemon
        # runs each step fused, without it
        phased = LAYOUTS[args.mode][1] > 1 and \
            len(args.socket.split(",") if args.socket else [None]) > 1
        margin = 1.0 + 1.0 / 1024.0 if phased else 1.0
        coefs = (C / (norms * math.sqrt(margin) + 1e-6)).clamp(max=1.0)
        out = {"C": C, "norms": norms.float(), "clipped": int((coefs < 1).sum()),
               "coefs": coefs.float()}
    else:  # (no norms: the rule and C are the first reference's)
        coefs = given.double()
    acc = [torch.zeros(p.shape, dtype=torch.float64, device=device) for _, p in params]
    for b in range(n):
        for t, g in zip(acc, grads(b)):
            t.add_(g.double(), alpha=float(coefs[b]))
    out["grads"] = {name: (t / n).float().cpu() for (name, _), t in zip(params, acc)}
    torch.save(out, path)


# The largest relative shortfall of a coefficient from the rule's that the
# check accepts: the daemon's rounding bounds on these paths stay below 5e-3
# (docs/design.md's table), with the phases' margin (1/1024) under 6e-3.
COEF_SHORTFALL_MAX = 1e-2


def coef_verdict(got, want, slack):
    """(largest relative shortfall, whether any coefficient is above the
    rule's by more than slack, relative: want is f32-rounded from f64, and
    under --check-bf16 the trainer's gradients are bf16 ones)."""
    if got.shape != want.shape:
        return math.inf, True
    g, w = got.double().cpu(), want.double()
    above = bool((g > w * (1.0 + slack)).any())
    short = float(((w - g) / w.clamp(min=1e-30)).max()) if w.numel() else 0.0
    return max(short, 0.0), above


def check(c, out_dir, tol):
    """One private logical step (noise off, fp32) against the reference; a
    dict."""
    a = c.args
    if c.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    path = os.path.join(out_dir, "reference.pt")
    if c.rank == 0:
        log("check: the reference (%d samples, one backward each, twice)"
            % logical_batch(a, c.R))
        reference(a, c.R, c.device, path)
        reset_peak(c.device)  # frees its model and sums
    dist.barrier()
    ref = torch.load(path, map_location="cpu")
    model, names = build_part(a, c.S, c.stage, c.device)
    params = list(model.parameters())
    engine, model, opt = private(c, model, 0.0, ref["C"], 0.0)
    make_step(c, model, opt, amp=a.check_bf16, divide=False)()
    got_norms = engine.last_norms  # collects an asynchronous step; every micro-batch's, in order
    got_coefs = engine.last_coefs

    def worst_of(grads):
        err, worst = 0.0, ""
        for name, p in zip(names, params):
            want = grads[name].to(c.device)
            e = math.inf if p.grad is None else \
                float((p.grad.float() - want).abs().max()) / max(float(want.abs().max()), 1e-30)
            if e >= err:
                err, worst = e, name
        return err, worst
    err, worst = worst_of(ref["grads"])
    n = a.microbatches * a.batch
    want_n = ref["norms"][c.replica * n:(c.replica + 1) * n]
    n_err = math.inf if got_norms.shape != want_n.shape else \
        float((got_norms.float() - want_n).abs().max()) / float(want_n.abs().max())
    want_c = ref["coefs"][c.replica * n:(c.replica + 1) * n]
    c_err = math.inf if got_coefs.shape != want_c.shape else \
        float((got_coefs.float().cpu() - want_c).abs().max())
    c_short, c_above = coef_verdict(got_coefs, want_c, tol if a.check_bf16 else 1e-6)
    short_max = max(COEF_SHORTFALL_MAX, tol) if a.check_bf16 else COEF_SHORTFALL_MAX
    # the same sums with the daemon's own coefficients (each replica's, in the
    # union's order): the sums' arithmetic apart from the coefficients' rule
    every = gather((c.replica, got_coefs.tolist()))
    given_path = os.path.join(out_dir, "reference_given.pt")
    if c.rank == 0:
        union = [None] * c.R
        for r, cf in every:
            union[r] = cf
        reference(a, c.R, c.device, given_path,
                  given=torch.tensor([x for cf in union for x in cf], dtype=torch.float64))
    dist.barrier()
    err_given, _ = worst_of(torch.load(given_path, map_location="cpu")["grads"])
    engine.close()
    if c.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return {"rank": c.rank, "params": len(params), "max_rel_err": err, "worst_param": worst,
            "norms_max_rel_err": n_err, "coefs_max_abs_err": c_err,
            "coefs_max_rel_shortfall": c_short, "coefs_above_rule": c_above,
            "max_rel_err_given_coefs": err_given,
            "ok": n_err <= tol and err_given <= tol and not c_above
            and c_short <= short_max,
            "C": ref["C"], "clipped": ref["clipped"]}


def gather(obj):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def slowest(every):
    return max(r["step_ms"] for r in every)


def rank_main(rank, world, init_file, args, sockets, out_dir, config):
    """One rank (a spawned process): rank_body, then an exit that skips the
    interpreter's shutdown. Under torch 2.15 a gloo worker thread
    (ProcessGroupGloo::runLoop) could still drop a finished send's tensor
    then, taking the GIL during finalization: the thread exits inside a C++
    frame and std::terminate aborted the rank (SIGABRT) after a clean run,
    about one run in four of python/tests/test_bench_parallel.py. Its output
    is flushed first; an exception still ends the rank as before."""
    rank_body(rank, world, init_file, args, sockets, out_dir, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gpu_of(args, rank):
    """The GPU rank r runs on: cuda:r, or cuda:0 for every rank (--one-gpu)."""
    return 0 if args.one_gpu else rank


def rank_body(rank, world, init_file, args, sockets, out_dir, config):
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    if cuda:  # (not in the parent: it makes no CUDA context)
        if args.one_gpu:  # NCCL takes the ranks for hosts of their own (socket transport)
            os.environ["NCCL_HOSTID"] = "bench-parallel-%d" % rank
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(gpu_of(args, rank))
        torch.backends.cuda.matmul.allow_tf32 = True  # as bench_torch_step (fp32 runs)
        torch.backends.cudnn.allow_tf32 = True
        config = dict(config, device=torch.cuda.get_device_name(gpu_of(args, rank)),
                      nccl=nccl_version(), one_gpu=args.one_gpu)
    else:
        config = dict(config, device="cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method="file://" + init_file,
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        c = Rank(rank, world, args, sockets)
        head = {"bench": "parallel", "mode": args.mode, "daemons": len(sockets),
                "microbatches": args.microbatches, "schedule": args.schedule,
                "logical_batch": logical_batch(args, c.R)}
        if args.check:
            tol = args.tol if args.tol is not None else \
                (5e-2 if args.check_bf16 else 5e-3 if cuda else 1e-3)
            every = gather(check(c, out_dir, tol))
            ok = all(r["ok"] for r in every)
            if rank == 0:
                print(json.dumps(dict(head, check=True, ok=ok, tol=tol, C=every[0]["C"],
                                      clipped=every[0]["clipped"],
                                      samples=logical_batch(args, c.R),
                                      max_rel_err=max(r["max_rel_err"] for r in every),
                                      norms_max_rel_err=max(r["norms_max_rel_err"]
                                                            for r in every),
                                      coefs_max_abs_err=max(r["coefs_max_abs_err"]
                                                            for r in every),
                                      coefs_max_rel_shortfall=max(
                                          r["coefs_max_rel_shortfall"] for r in every),
                                      coefs_above_rule=any(r["coefs_above_rule"] for r in every),
                                      max_rel_err_given_coefs=max(
                                          r["max_rel_err_given_coefs"] for r in every),
                                      ranks=every, config=config)), flush=True)
                if not ok:
                    open(os.path.join(out_dir, "check_failed"), "w").close()
            if not ok:
                return
        rounds = {"plain": [], "dpclip": []}
        for rnd in range(args.repeat):
            for mode in rounds:
                every = gather(run(c, mode))
                rounds[mode].append(every)
                if rank == 0:
                    log("round %d/%d %s %s: %s ms (ranks %s)" % (
                        rnd + 1, args.repeat, args.mode, mode, slowest(every),
                        [r["step_ms"] for r in every]))
        if rank == 0:
            report(args, head, rounds, config)
    finally:
        dist.destroy_process_group()


def report(args, head, rounds, config):
    """Rank 0's JSON lines: each mode's median round, then the ratio."""
    tokens = head["logical_batch"] * args.seq  # a logical step's, over the replicas
    res, gpu_peaks = {}, {}
    for mode, rs in rounds.items():
        ordered = sorted(rs, key=slowest)
        med = ordered[len(ordered) // 2]
        res[mode] = med
        if "device_peak_mib" in rs[0][0]:  # each GPU's peak over the rounds (rank r: cuda:r)
            gpu_peaks[mode] = [max(e[r]["device_peak_mib"] for e in rs)
                               for r in range(len(rs[0]))]
        print(json.dumps(dict(head, run=mode, baseline=baseline(args.mode) if mode == "plain"
                              else None, precision=args.precision, step_ms=slowest(med),
                              tokens_per_s=round(tokens / slowest(med) * 1e3, 1),
                              step_ms_rounds=[slowest(e) for e in ordered],
                              device_peak_mib=gpu_peaks.get(mode), ranks=med,
                              config=config)), flush=True)
    t_plain, t_priv = slowest(res["plain"]), slowest(res["dpclip"])
    by_round = sorted(slowest(d) / slowest(p) for p, d in zip(rounds["plain"], rounds["dpclip"]))
    ratio = dict(head, ratio="dpclip/plain", precision=args.precision,
                 time_ratio=round(t_priv / t_plain, 3),
                 time_ratio_median=round(statistics.median(by_round), 3),
                 time_ratio_best=round(by_round[0], 3), time_ratio_worst=round(by_round[-1], 3),
                 plain_ms=t_plain, dpclip_ms=t_priv,
                 plain_tokens_per_s=round(tokens / t_plain * 1e3, 1),
                 dpclip_tokens_per_s=round(tokens / t_priv * 1e3, 1))
    if gpu_peaks:
        ratio.update(device_peak_mib=gpu_peaks, mem_ratio=round(max(
            d / p for p, d in zip(gpu_peaks["plain"], gpu_peaks["dpclip"])), 3))
    grouped = [r for r in res["dpclip"] if "group_wait_ms" in r]
    if grouped:  # the member that arrives last waits for the reduction alone
        last = min(grouped, key=lambda r: r["group_wait_ms"])
        ratio.update(reduction_ms=last["group_wait_ms"],
                     reduction_share=round(last["group_wait_ms"] / t_priv, 4),
                     exchange_ms=max(r["group_exchange_ms"] for r in grouped),
                     last_member_daemon_call_ms=last["daemon_call_ms"],
                     last_member_daemon_call_share=round(last["daemon_call_ms"] / t_priv, 4))
    ratio["daemon_call_ms_max"] = max(r.get("daemon_call_ms", 0.0) for r in res["dpclip"])
    # each rank's most micro-batches held at once, over every round
    ratio["micro_batches_held_peak"] = [max(e[r].get("micro_batches_held_peak", 0)
                                            for e in rounds["dpclip"])
                                        for r in range(len(rounds["dpclip"][0]))]
    print(json.dumps(ratio), flush=True)


def baseline(mode):
    return {"pipeline": "the same pipeline, autograd's gradients",
            "ddp": "DistributedDataParallel",
            "ddp_pipeline": "the same pipelines, each stage in DDP over its replicas"}[mode]


def nccl_version():
    v = torch.cuda.nccl.version()  # a tuple in torch 2.x, an int before
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(LAYOUTS), default="pipeline")
    ap.add_argument("--socket", default=os.environ.get("DPCLIP_SOCKET"),
                    help="dpclipd's socket, or one per rank comma-separated "
                         "(default $DPCLIP_SOCKET)")
    ap.add_argument("--daemons", type=int, default=None,
                    help="how many sockets --socket names (1, or one per rank)")
    ap.add_argument("--world", type=int, default=4, help="ddp: ranks (pipeline 2, "
                    "ddp_pipeline 4 always)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="samples per replica and micro-batch")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="micro-batches a logical step (pipeline only; 1: one batch a step)")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                    help="pipeline schedule of the micro-batches")
    ap.add_argument("--warmup", type=int, default=None, help="logical steps (5; 3 with "
                    "micro-batches)")
    ap.add_argument("--steps", type=int, default=None, help="timed logical steps a round "
                    "(20; 10 with micro-batches)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of plain then dpclip "
                    "(5: a median quoted is of at least five rounds)")
    ap.add_argument("--check", action="store_true", help="check exactness first (exit 1 if not)")
    ap.add_argument("--check-bf16", action="store_true",
                    help="the check's trainers under bf16 autocast, as the timed steps: the "
                    "daemon's bf16 paths (kept per-sample gradients), default --tol 5e-2")
    ap.add_argument("--tol", type=float, default=None)
    ap.add_argument("--trace", action="store_true",
                    help="after each round's timed steps, %d more with an event at each "
                    "op's start: each rank's line gets trace (label: [host ms, GPU ms] "
                    "from the step's start, averaged)" % TRACED)
    ap.add_argument("--one-gpu", action="store_true",
                    help="every rank on cuda:0, each with an NCCL_HOSTID of its own (NCCL's "
                    "socket transport): a test setting for --check on one GPU, whose "
                    "timings mean nothing (its daemons need an NCCL_HOSTID each too)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads per rank (0: the cores / the ranks)")
    args = ap.parse_args()
    R, S = LAYOUTS[args.mode]
    world = args.world if R is None else R * S
    sockets = args.socket.split(",") if args.socket else [None]
    if args.daemons is not None and args.daemons != len(sockets):
        ap.error("--daemons %d, but --socket names %d" % (args.daemons, len(sockets)))
    if len(sockets) not in (1, world):
        ap.error("--socket: one daemon for every rank, or one per rank (%d), not %d"
                 % (world, len(sockets)))
    if S > 1 and args.blocks < 2:
        ap.error("--blocks: a pipeline needs at least 2")
    if args.microbatches < 1:
        ap.error("--microbatches must be at least 1")
    # plain DDP has no place in these schedules (several forwards before a
    # backward; an all-reduce for each micro-batch without no_sync)
    if args.microbatches > 1 and args.mode != "pipeline":
        ap.error("--microbatches: --mode pipeline only")
    many = args.microbatches > 1
    for k, one, several in (("warmup", 5, 3), ("steps", 20, 10)):
        if getattr(args, k) is None:
            setattr(args, k, several if many else one)
    if args.steps < 1 or args.repeat < 1:
        ap.error("--steps and --repeat must be at least 1")
    if args.device == "cuda" and torch.cuda.device_count() < (1 if args.one_gpu else world):
        ap.error("%s needs %d GPUs, this machine has %d" % (args.mode, world,
                                                            torch.cuda.device_count()))
    config = {k: getattr(args, k) for k in ("blocks", "d", "heads", "vocab", "seq", "batch",
                                            "microbatches", "schedule", "warmup", "steps",
                                            "repeat")}
    config.update(world=world, replicas=world // S, stages=S, sockets=sockets,
                  precision=args.precision, torch=torch.__version__, optimizer="sgd")
    log("%s: %d ranks (%d replica(s) x %d stage(s)), %d daemon(s), %d micro-batch(es) "
        "(%s), %s" % (args.mode, world, world // S, S, len(sockets), args.microbatches,
                      args.schedule, args.device))
    out_dir = tempfile.mkdtemp(prefix="bench_parallel.")
    try:
        ctx = mp.start_processes(rank_main, nprocs=world, join=False, start_method="spawn",
                                 args=(world, os.path.join(out_dir, "init"), args, sockets,
                                       out_dir, config))
        while not ctx.join(timeout=600):
            pass
        failed = os.path.exists(os.path.join(out_dir, "check_failed"))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if failed:
        sys.exit("bench_parallel: --check failed (see its JSON line)")


if __name__ == "__main__":
    main()
