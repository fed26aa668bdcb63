#!/usr/bin/env python3
"""Where the trainer's host time goes in a private step (issue 40: at most
0.3 ms on the critical path for 72 layers).

    python3 bench/bench_host_overhead.py --socket S                   # GPT-2-small-like, GPU
    python3 bench/bench_host_overhead.py --socket S --model llama1b
    python3 bench/bench_host_overhead.py --socket S --blocks 2 --d 64 --heads 2 --vocab 500 \
        --seq 32 --batch 2 --steps 3                                    # CPU smoke test

The model is bench_torch_step.py's (same flags), bf16 autocast on CUDA,
SGD, asynchronous steps. Around each of the package's stages of a step the
bench puts a host timer (wrapping the functions by name from outside, so
that the package itself carries no timing code), and prints one JSON line:
per step, in ms of host time, the whole optimizer.step() and its stages:
- collect: taking the previous asynchronous step's result (the
  bookkeeping), less
- wait: blocked until the daemon's reply to it came, and reading it
  (dpclip._lib.Client.wait): the GPU's time where it runs behind the host,
  not dpclip's host time;
- guard: the fail-closed check of autograd's gradients;
- plan: the step's parts from the layers' captures (dpclip._planner.plan,
  or a steady step's from the last one's template: Replanner);
- check: the first-step check (first steps only: dpclip._verify);
- refs: naming each tensor for the daemon (CUDA IPC registrations, or the
  host arena's copies);
- add_layers: the step's descriptors (ctypes) handed to libdpclip;
- rebind: a step of the last step's layout instead has its layers' inputs
  pointed at the new tensors, in one call (registrations included);
- count_batch: the step's batch size from the captures
  (dpclip._planner.batch_size; a steady step has its template's, under
  plan);
- wire: each part's tensors in the dtypes and layout the daemon reads
  (CUDA: dpclip._cuda._wire);
- events: the interprocess events of the step (CUDA: CudaIPC.events,
  readied);
- layout: whether the step's layout is the last one's, and the parts'
  descriptors' own bookkeeping (CUDA: CudaIPC._layers, less its refs,
  add_layers and rebind);
- drop: forgetting the step's captures (PrivacyEngine._drop);
- send: submitting the step and its early notice (or, blocking, the whole
  round trip);
- optimizer: the wrapped optimizer's own step (the update, as a plain
  step runs it: not dpclip's);
- the functions around those stages, each its own time less the stages
  it calls: wrapper (DPOptimizer.step: the optimizer's parameter list),
  mode (the one-process mode's step: collect, guard, commit, drop),
  commit (dpclip._accumulate's: which passes to send), whole (the engine's
  step of one pass: its plan, its result), run (the CUDA transport's send:
  the tensors' pointers, events, the outputs' binding), outputs (the
  outputs' buffers checked: _out_buffers), alias (param.grad set to
  each output: _alias), finish (a step's result taken: _finish);
- other: the rest of step(),
and staged_in_backward_ms: the plan staged as the layers capture, during
the backward (dpclip._planner.Replanner.stage): host time that runs while
the GPU's backward does, outside optimizer.step() and not in step_ms;
backward_ms: the host time of the backward call itself (autograd's
launches, the layers' capture hooks and that staging), for comparing the
host's whole work per step between versions;
and overhead_ms, dpclip's host time (step_ms less the optimizer's), and
overhead_less_wait_ms, that less the wait for the reply, and
before_submit_ms: from optimizer.step()'s call until the step is handed to
libdpclip to send (Step.submit or Step.run called): the host time that a GPU
done with the backward waits for before the daemon can start (what comes
after runs while the daemon's kernels do: see docs/gpu.md), and
before_submit_less_wait_ms, that less the wait for the last step's reply
(the critical path's host time: issue 40's target), with the number of
daemon layers (parts) and the per-part cost of plan, refs and add_layers.
A stage a transport does not have reads 0. The stages' timers cost host
time themselves (about a microsecond a call), which the totals include:
--bare times only the step, its submission and the wait (timers: "bare"),
for the totals without them."""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_torch_step import MODELS, build, pick_device, register_norms, sync  # noqa: E402
from bench_torch_step import token_batch  # noqa: E402
from dpclip import _cuda, _host, _lib, _planner, _verify  # noqa: E402
from dpclip.torch import PrivacyEngine  # noqa: E402

STAGES = ("collect", "wait", "guard", "plan", "check", "refs", "add_layers", "rebind", "send",
          "optimizer", "count_batch", "wire", "events", "layout", "drop", "wrapper", "mode",
          "commit", "whole", "run", "outputs", "alias", "finish")


class Timers:
    """Host time per stage, summed over the steps timed (nested stages are
    subtracted from their caller's: refs run inside add_layers)."""

    def __init__(self):
        self.ms = {s: 0.0 for s in STAGES}
        self.calls = {s: 0 for s in STAGES}
        self.on = False
        self._stack = []
        self.step_t0 = None  # this step's optimizer.step() call (perf_counter)
        self.before_submit = 0.0  # ms, summed over the steps timed
        self.backward = False  # in a timed step's backward
        self.staged = 0.0  # ms of staging in the timed steps' backwards

    def mark_submit(self, t):
        """A step's first submission at t (perf_counter): its time since
        optimizer.step() was called counts once."""
        if self.on and self.step_t0 is not None:
            self.before_submit += (t - self.step_t0) * 1e3
            self.step_t0 = None

    def wrap(self, owner, name, stage, submits=False):
        """owner.name timed as stage (submits: a call hands the step to
        libdpclip to send: mark_submit)."""
        fn = getattr(owner, name, None)
        if fn is None:
            return
        timers = self

        def timed(*args, **kwargs):
            if not timers.on:
                return fn(*args, **kwargs)
            timers._stack.append(0.0)
            t0 = time.perf_counter()
            if submits:
                timers.mark_submit(t0)
            try:
                return fn(*args, **kwargs)
            finally:
                dt = (time.perf_counter() - t0) * 1e3
                inner = timers._stack.pop()
                timers.ms[stage] += dt - inner
                timers.calls[stage] += 1
                if timers._stack:
                    timers._stack[-1] += dt

        setattr(owner, name, timed)

    def wrap_backward(self, owner, name):
        """owner.name timed where called during a timed step's backward."""
        fn = getattr(owner, name, None)
        if fn is None:
            return
        timers = self

        def timed(*args, **kwargs):
            if not timers.backward:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.staged += (time.perf_counter() - t0) * 1e3

        setattr(owner, name, timed)


def install_bare(t):
    """Only what before_submit_ms and the wait need (--bare): the stages'
    own timers cost host time too, which the breakdown's total includes."""
    t.wrap(_lib.Client, "wait", "wait")
    t.wrap(_lib.Step, "submit", "send", submits=True)
    t.wrap(_lib.Step, "run", "send", submits=True)


def install(t):
    """Each stage's function wrapped where the package calls it from."""
    t.wrap(PrivacyEngine, "synchronize", "collect")
    t.wrap(_lib.Client, "wait", "wait")  # (inside synchronize: taken out of collect)
    from dpclip import _guard
    t.wrap(_guard.Guard, "check", "guard")
    t.wrap(_planner, "plan", "plan")
    t.wrap(_planner.Replanner, "plan", "plan")
    t.wrap(_planner.Replanner, "steady", "plan")  # (a steady step's: from the last one's template)
    t.wrap_backward(_planner.Replanner, "stage")
    t.wrap(_verify, "check_step", "check")
    for mod in (_cuda, _host, _planner):  # the transports import add_layers by name
        t.wrap(mod, "add_layers", "add_layers")
    t.wrap(_cuda.CudaIPC, "ref", "refs")
    t.wrap(_lib.Client, "register_cuda", "refs")
    t.wrap(_host.HostArena, "stage", "refs")
    t.wrap(_lib.Step, "rebind_cuda", "rebind")
    t.wrap(_lib.Step, "rebind", "rebind")  # (refs resolved as the plan was staged)
    t.wrap(_lib.Step, "submit", "send", submits=True)
    t.wrap(_lib.Step, "run", "send", submits=True)
    t.wrap(_lib.Client, "wait_enqueued", "send")
    t.wrap(_planner, "batch_size", "count_batch")
    t.wrap(_cuda, "_wire", "wire")
    t.wrap(_cuda.CudaIPC, "events", "events")
    t.wrap(_cuda.CudaIPC, "readied", "events")
    t.wrap(_cuda.CudaIPC, "_layers", "layout")
    t.wrap(PrivacyEngine, "_drop", "drop")
    from dpclip import _accumulate, _modes, _optimizer
    t.wrap(_optimizer.DPOptimizer, "step", "wrapper")
    t.wrap(_modes.Local, "step", "mode")
    t.wrap(_accumulate.Accumulator, "commit", "commit")
    t.wrap(PrivacyEngine, "_step_whole", "whole")
    t.wrap(_cuda.CudaIPC, "run", "run")
    t.wrap(_host.HostArena, "run", "run")
    t.wrap(_cuda, "_out_buffers", "outputs")
    t.wrap(_cuda, "_alias", "alias")
    t.wrap(PrivacyEngine, "_finish", "finish")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="dpclipd socket (default $DPCLIP_SOCKET)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    for k in ("blocks", "d", "heads", "vocab", "seq", "batch", "ffn"):
        ap.add_argument("--" + k, type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-rebind", action="store_true",
                    help="build every step's layers again (the CUDA transport's old path), "
                         "to compare")
    ap.add_argument("--bare", action="store_true",
                    help="time only the step, its submission and the wait for the last "
                         "reply (no per-stage timers, whose own cost the breakdown "
                         "includes): the stages read 0")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile optimizer.step() of the timed steps (cProfile) and "
                         "print its N costliest functions by own time to stderr (the "
                         "profiler's overhead inflates the JSON line's times: compare runs "
                         "without it)")
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    device = pick_device(args.device)
    register_norms(args.model)
    if args.no_rebind:
        build_layers = _cuda.CudaIPC._layers

        def rebuild(self, *a):
            self._bound = None
            return build_layers(self, *a)
        _cuda.CudaIPC._layers = rebuild
    t = Timers()
    (install_bare if args.bare else install)(t)
    torch.manual_seed(0)
    model = build(args).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine = PrivacyEngine(args.socket, client_name="bench_host_overhead")
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=1.0,
                                        max_grad_norm=1.0, expected_batch_size=args.batch)
    t.wrap(opt.original_optimizer, "step", "optimizer")
    x, y = token_batch(args, device)
    bf16 = device.type == "cuda"
    step_ms = backward_ms = 0.0
    prof = cProfile.Profile() if args.profile > 0 else None

    def step(timed):
        nonlocal step_ms, backward_ms
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        t.backward = timed
        tb = time.perf_counter()
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        if timed:
            backward_ms += (time.perf_counter() - tb) * 1e3
        t.backward = False
        t.on = timed
        t0 = time.perf_counter()
        t.step_t0 = t0
        if timed and prof is not None:
            prof.runcall(opt.step)
        else:
            opt.step()
        if timed:
            step_ms += (time.perf_counter() - t0) * 1e3
        t.on = False

    for _ in range(args.warmup):
        step(False)
    sync(device)
    for _ in range(args.steps):
        step(True)
    sync(device)
    engine.synchronize()
    n = args.steps
    parts = len(_planner.plan(engine._layers, 0).parts)  # (t is off: not timed)
    per = {s: round(v / n, 4) for s, v in t.ms.items()}
    out = {"bench": "host_overhead", "model": args.model, "device": str(device),
           "path": "build" if args.no_rebind else "rebind", "timers": "bare" if args.bare
           else "stages",
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "batch": args.batch, "seq": args.seq, "layers": len(engine._layers),
           "parts": parts, "steps": n, "step_ms": round(step_ms / n, 4), **per,
           "other": round(step_ms / n - sum(per.values()), 4),
           "overhead_ms": round(step_ms / n - per["optimizer"], 4),
           "overhead_less_wait_ms": round(step_ms / n - per["optimizer"] - per["wait"], 4),
           "before_submit_ms": round(t.before_submit / n, 4),
           "before_submit_less_wait_ms": round((t.before_submit - t.ms["wait"]) / n, 4),
           "staged_in_backward_ms": round(t.staged / n, 4),
           "backward_ms": round(backward_ms / n, 4),
           "per_part_us": {s: round(per[s] * 1e3 / max(parts, 1), 2)
                           for s in ("plan", "refs", "add_layers")},
           "target_ms": 0.3, "mps_active": bool(engine.client.info.mps_active)}
    print(json.dumps(out), flush=True)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
    engine.close()


if __name__ == "__main__":
    main()
