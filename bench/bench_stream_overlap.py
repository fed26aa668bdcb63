#!/usr/bin/env python3
"""How much a layer-by-layer streamed step could gain, measured in one
process (issue 14's "worth trying": the trainer sends each layer as its
backward finishes, the daemon computes its norms while the backward goes on).

    python3 bench/bench_stream_overlap.py                 # GPT-2-small-like, bf16
    python3 bench/bench_stream_overlap.py --model llama1b

The daemon's phases are stood in for by work of the same size, so that the
two schedules can be compared without building the protocol first:
  norms       one dW GEMM per Linear layer (the daemon's norms take 0.91-1.05x
              of it, bench_cuda_norms step), and
  clipped sum one dW GEMM per layer again, written into param.grad, then
  noise       one randn_like add per Linear parameter.
Modes, on the same model and batch (models from bench_torch_step.py):
  plain     autograd as PyTorch does it (input and weight gradients);
  serial    input gradients only, then norms, clipped sum, noise: today's
            single-frame step, whose daemon work runs after the backward;
  streamed  the norms of each layer are queued on a second stream as soon as
            its backward has made the output gradient, the clipped sum waits
            for all of them.
Streams of one process overlap at least as well as two processes under MPS
(no time slicing, one context), so streamed/serial bounds what streaming can
win from below. Prints one JSON line per mode, then the ratios.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch_step import MODELS, build, token_batch  # noqa: E402


class Recorder:
    """The (input, output grad) pairs of one backward, and where the
    streamed mode queues their norms."""

    def __init__(self, side):
        self.pairs = []
        self.side = side  # a torch.cuda.Stream in streamed mode, else None
        self.norms = []

    def add(self, x, g):
        self.pairs.append((x, g))
        if self.side is None:
            return
        ev = torch.cuda.Event()
        ev.record()
        self.side.wait_event(ev)
        # No record_stream: the pairs live until the next step, after the
        # main stream has waited for the side one (as a trainer keeps its
        # tensors until the daemon's done event).
        with torch.cuda.stream(self.side):
            self.norms.append(dw_gemm(x, g))


def dw_gemm(x, g):
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _Linear(torch.autograd.Function):
    """F.linear whose backward makes the input gradient only and records
    (input, output grad), as dpclip's own does."""

    @staticmethod
    def forward(ctx, x, w, b, rec):
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        xc = x if dt is None or x.dtype == dt else x.to(dt)
        wc = w if dt is None or w.dtype == dt else w.to(dt)
        bc = b if b is None or dt is None or b.dtype == dt else b.to(dt)
        ctx.save_for_backward(xc, wc)
        ctx.rec, ctx.x_dtype = rec, x.dtype
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, gy):
        xc, wc = ctx.saved_tensors
        gx = (gy @ wc).to(ctx.x_dtype)
        # detached: xc may be the previous layer's output, whose grad_fn
        # leads back to this node (a cycle through the graph gc cannot free)
        ctx.rec.add(xc.detach(), gy.detach())
        return gx, None, None, None


def run(args, mode, precision):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build(args).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    side = torch.cuda.Stream(priority=args.priority) if mode == "streamed" else None
    box = {}
    if mode != "plain":
        for m in linears:
            m.forward = (lambda x, m=m: _Linear.apply(x, m.weight, m.bias, box["rec"]))
    x, y = token_batch(args, dev)
    amp = precision == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        box["rec"] = rec = Recorder(side)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        if mode != "plain":
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            else:
                rec.norms = [dw_gemm(a, b) for a, b in rec.pairs]
            # autograd meets the layers last to first: pair i is linears[-1 - i]
            for (a, b), m in zip(rec.pairs, reversed(linears)):
                m.weight.grad = dw_gemm(a, b).to(m.weight.dtype)
                m.weight.grad.add_(torch.randn_like(m.weight.grad))
                if m.bias is not None:
                    m.bias.grad = b.reshape(-1, b.shape[-1]).sum(0).to(m.bias.dtype)
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**20
    box.clear()
    for m in linears:  # the lambdas make cycles: break them, free the model now
        m.__dict__.pop("forward", None)
    model = opt = linears = None  # freed (not del: see docs/lint.md, F821)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return ms, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--precision", default="bf16", help="comma list of bf16, fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--priority", type=int, default=0,
                    help="the norms stream's priority (0: the lowest, as the daemon's)")
    args = ap.parse_args()
    for k, v in MODELS[args.model].items():
        setattr(args, k, v)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "stream_overlap", "skipped": "no CUDA device"}))
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    for precision in args.precision.split(","):
        ms = {}
        for mode in ("plain", "serial", "streamed"):
            ms[mode], peak = run(args, mode, precision)
            print(json.dumps({"bench": "stream_overlap", "model": args.model,
                              "precision": precision, "mode": mode,
                              "step_ms": round(ms[mode], 3), "peak_mem_mib": round(peak)}),
                  flush=True)
        print(json.dumps({"bench": "stream_overlap", "model": args.model, "precision": precision,
                          "serial_over_plain": round(ms["serial"] / ms["plain"], 3),
                          "streamed_over_plain": round(ms["streamed"] / ms["plain"], 3),
                          "streamed_over_serial": round(ms["streamed"] / ms["serial"], 3),
                          "norms_hidden_ms": round(ms["serial"] - ms["streamed"], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
