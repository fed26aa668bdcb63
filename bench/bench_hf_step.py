#!/usr/bin/env python3
"""Private vs non-private training step of Hugging Face's GPT-2 small.

    python3 bench/bench_hf_step.py --socket S                   # the issue's config, H100
    python3 bench/bench_hf_step.py --socket S --layers 2 --d 64 --heads 2 --vocab 500 \
        --seq 32 --batch 2 --steps 2 --warmup 1                   # smoke test

Default config: transformers' GPT2LMHeadModel from GPT2Config() (124M
parameters: 12 layers, n_embd 768, 12 heads, vocabulary 50257, lm_head tied
to wte), B=8, T=1024, bf16 autocast, AdamW, built from the config (nothing
downloaded). In one process, on the same model and batch: plain autograd,
dpclip (the model unmodified: Conv1D projections, broadcast positions and
the tied lm_head as they are, asynchronous steps), and Opacus's ghost
clipping where Opacus is importable (an error line where it is not, or
where it refuses the model). One JSON line per measurement, then one per
ratio against plain, with the issue's target (time 1.15x). Needs
transformers; a daemon with the CUDA backend for a GPU run. Peak memory is
torch.cuda.max_memory_allocated. Dropout is off so that the three compute
the same function."""
import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from dpclip.torch import PrivacyEngine  # noqa: E402


def gpt2(args, device):
    import transformers
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq,
                                     n_embd=args.d, n_layer=args.layers, n_head=args.heads,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if args.untied:  # for comparison: lm_head a weight of its own
        model.config.tie_word_embeddings = False
        model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach().clone())
    return model.to(device).train()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_mb(device):
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else \
        float("nan")


def make_opacus(model, opt, args):
    from opacus import PrivacyEngine as OpacusEngine  # optional: for the comparison only
    from torch.utils.data import DataLoader, TensorDataset
    dl = DataLoader(TensorDataset(torch.zeros(args.batch * 4, 1)), batch_size=args.batch)
    model, opt, criterion, _ = OpacusEngine().make_private(
        module=model, optimizer=opt, data_loader=dl, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
        poisson_sampling=False)
    return model, opt, criterion


def run(args, device, mode):
    """Times `steps` steps after `warmup`; (ms per step, peak MiB, extras)."""
    reset_peak(device)
    model = gpt2(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine = criterion = None
    extra = {}
    if mode == "dpclip":
        engine = PrivacyEngine(args.socket, client_name="bench_hf_step")
        model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=1.0,
                                            max_grad_norm=1.0, loss_reduction="mean",
                                            expected_batch_size=args.batch)
        extra["daemon_layers"] = len(engine._layers)
        extra["tied"] = [l.name for l in engine._layers if l.tie is not None]
    elif mode == "opacus":
        model, opt, criterion = make_opacus(model, opt, args)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        if criterion is not None:
            loss = criterion(logits.float().flatten(0, 1), y.flatten(), shape=logits.shape)
        else:
            # every sample has T tokens: the token mean is the mean over
            # samples of per-sample means (loss_reduction="mean")
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    sync(device)
    if engine is not None:
        engine.synchronize()
        compute0 = engine.compute_ns_total
        wait0 = engine.input_wait_ns_total
    phases = {}
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
        if engine is not None:  # the trainer's side: request, round trip, param.grad
            for k, v in engine.last_timing.items():
                phases[k] = phases.get(k, 0.0) + v / args.steps
    sync(device)
    extra.update({k: round(v, 3) for k, v in phases.items()})
    if engine is not None:
        engine.synchronize()
        extra["daemon_compute_ms"] = round((engine.compute_ns_total - compute0) / 1e6 /
                                           args.steps, 3)
        extra["daemon_input_wait_ms"] = round((engine.input_wait_ns_total - wait0) / 1e6 /
                                              args.steps, 3)
        extra["mps_active"] = bool(engine.client.info.mps_active)
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    extra["loss"] = round(float(loss.detach()), 4)
    mem = peak_mb(device)
    if engine is not None:
        engine.close()
    model = opt = engine = None  # freed (not del: see docs/lint.md, F821)
    reset_peak(device)
    return ms, mem, extra


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="dpclipd socket (default $DPCLIP_SOCKET)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fp32", dest="bf16", action="store_false", help="no bf16 autocast")
    ap.add_argument("--modes", default="plain,dpclip,opacus")
    ap.add_argument("--untied", action="store_true", help="lm_head not tied to wte")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    try:
        import transformers
    except ImportError:
        sys.exit("bench_hf_step.py needs transformers")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    config = {"model": "GPT2LMHeadModel", "layers": args.layers, "d": args.d,
              "heads": args.heads, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
              "steps": args.steps, "precision": "bf16" if args.bf16 else "fp32",
              "optimizer": "adamw", "tied": not args.untied,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__}
    res = {}
    modes = args.modes.split(",")
    for mode in modes:
        try:
            ms, mem, extra = run(args, device, mode)
        except Exception as e:  # one mode failing (Opacus refusing GPT-2) is a result too
            print(json.dumps({"bench": "hf_step", "mode": mode,
                              "error": "%s: %s" % (type(e).__name__, str(e)[:400]),
                              "config": config}), flush=True)
            continue
        res[mode] = (ms, mem)
        print(json.dumps({"bench": "hf_step", "mode": mode, "step_ms": round(ms, 3),
                          "peak_mem_mib": round(mem, 1), **extra, "config": config}),
              flush=True)
    if "plain" in res:
        for mode in modes:
            if mode != "plain" and mode in res:
                print(json.dumps({"bench": "hf_step", "ratio": "%s/plain" % mode,
                                  "time_ratio": round(res[mode][0] / res["plain"][0], 3),
                                  "mem_ratio": round(res[mode][1] / res["plain"][1], 3),
                                  "target": {"time_ratio": 1.15}}), flush=True)


if __name__ == "__main__":
    main()
