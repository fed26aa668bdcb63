#!/usr/bin/env python3
"""Private vs non-private training step of Hugging Face models.

    python3 bench/bench_hf_step.py --socket S                        # every model, H100
    python3 bench/bench_hf_step.py --socket S --models mixtral,vit   # some of them
    python3 bench/bench_hf_step.py --socket S --tiny --steps 2 --warmup 1 --repeat 2
                                                                     # CPU smoke test

Models, built from configs (nothing downloaded), dropout off:
- gpt2: GPT2LMHeadModel from GPT2Config() (124M: Conv1D projections, learned
  positions, lm_head tied to wte), B8 T1024;
- llama: a Llama-3.2-1B-shaped LlamaForCausalLM (grouped-query attention:
  32 heads, 8 key/value heads; d 2048, 16 layers, vocabulary 128256, tied),
  B4 T1024;
- mixtral: a MixtralForCausalLM of 8 experts, top 2 (d 1024, 8 layers,
  experts of 2048, 16 heads over 4 key/value heads, vocabulary 32000),
  B8 T512: under transformers 5 a bare router weight and 3-D expert
  parameters (dpclip._linfn), under 4 per-expert Linears;
- vit: ViT-Base/16 (ViTForImageClassification, 224x224, 1000 classes),
  B128 (DeiT-B's batch per GPU: 1024 over 8).
--batch overrides a model's batch; --experts names transformers 5's
experts kernel for every mode (default: the model's own choice, grouped_mm
where torch has it; dpclip runs the eager code it wraps).
--tiny shrinks each to a few layers for a CPU smoke test.

For each model, in one process: plain autograd and dpclip (the model
unmodified, asynchronous steps) built once each and timed in --repeat
rounds of --steps steps that take turns (which goes first alternates),
bf16 autocast, AdamW. One JSON line per mode (median round, every round),
then the ratio line: median/median, best and worst rounds, with the
target (1.10x). Then Opacus's ghost clipping alone (where it is importable;
an error line where it is not or where it refuses the model), fewer
rounds. Memory: each mode built alone afterwards, two steps, the device's
used memory (every process: trainer plus daemon, torch.cuda.mem_get_info
sampled on a thread) above what was in use before, plus for dpclip the
workspace the daemon already held (its status socket's
dpclip_gpu_workspace_bytes; said where it has none); its ratio to plain."""
import argparse
import contextlib
import gc
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

import daemon_phases  # noqa: E402
from bench_torch_step import pick_device  # noqa: E402
from device_memory import DeviceMemory  # noqa: E402 (the device's used memory, sampled)
from dpclip.torch import PrivacyEngine  # noqa: E402

TARGET = 1.10


# --- the models ---------------------------------------------------------------------------

def _eager(config):
    config._attn_implementation = "sdpa" if hasattr(F, "scaled_dot_product_attention") \
        else "eager"
    return config


def gpt2(tf, tiny):
    kw = dict(vocab_size=500, n_positions=64, n_embd=64, n_layer=2, n_head=2) if tiny else {}
    return tf.GPT2LMHeadModel(_eager(tf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0, **kw))), "lm", (8, 1024)


def llama(tf, tiny):
    kw = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
              max_position_embeddings=2048, tie_word_embeddings=True)
    if tiny:
        kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
    return tf.LlamaForCausalLM(_eager(tf.LlamaConfig(**kw))), "lm", (4, 1024)


def mixtral(tf, tiny):
    kw = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
              num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048)
    if tiny:
        kw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                  num_local_experts=4)
    return tf.MixtralForCausalLM(_eager(tf.MixtralConfig(
        router_jitter_noise=0.0, output_router_logits=False, sliding_window=None,
        **kw))), "lm", (8, 512)


def vit(tf, tiny):
    kw = dict(image_size=224, patch_size=16, num_labels=1000)
    if tiny:
        kw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, num_labels=10)
    return tf.ViTForImageClassification(_eager(tf.ViTConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw))), "image", (128, 0)


MODELS = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral, "vit": vit}


def batch_for(c, task, B, T, tiny, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    if task == "lm":
        V = c.vocab_size
        T = 32 if tiny else T
        x = torch.randint(0, V, (B, T), generator=g)
        return {"input_ids": x.to(device)}, torch.randint(0, V, (B, T), generator=g).to(device)
    x = torch.randn((B, c.num_channels, c.image_size, c.image_size), generator=g)
    return {"pixel_values": x.to(device)}, \
        torch.randint(0, c.num_labels, (B,), generator=g).to(device)


# --- one mode -----------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_opacus(model, opt, B):
    from opacus import PrivacyEngine as OpacusEngine  # optional: for the comparison only
    from torch.utils.data import DataLoader, TensorDataset
    dl = DataLoader(TensorDataset(torch.zeros(B * 4, 1)), batch_size=B)
    model, opt, criterion, _ = OpacusEngine().make_private(
        module=model, optimizer=opt, data_loader=dl, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
        poisson_sampling=False)
    return model, opt, criterion


class Mode:
    """One mode's model, optimizer and step (`name`: plain, dpclip, opacus)."""

    def __init__(self, args, device, name, spec):
        import transformers as tf
        self.name, self.device, self.engine = name, device, None
        torch.manual_seed(0)
        # built on the device where torch can (2.x: a device is a context)
        where = device if hasattr(device, "__enter__") else contextlib.nullcontext()
        with where:
            model, task, (B, T) = MODELS[spec](tf, args.tiny)
        if args.experts:
            model.config._experts_implementation = args.experts
        B = args.batch or (2 if args.tiny else B)
        model = model.to(device).train()
        config = model.config  # (Opacus's wrapper hides it)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        criterion = None
        if name == "dpclip":
            self.engine = PrivacyEngine(args.socket, client_name="bench_hf_step")
            model, opt, _ = self.engine.make_private(
                module=model, optimizer=opt, noise_multiplier=1.0, max_grad_norm=1.0,
                loss_reduction="mean", expected_batch_size=B)
        elif name == "opacus":
            model, opt, criterion = make_opacus(model, opt, B)
        self.model, self.opt, self.criterion = model, opt, criterion
        self.inputs, self.y = batch_for(config, task, B, T, args.tiny, device)
        self.experts = getattr(config, "_experts_implementation", None)
        self.bf16, self.task = args.bf16, task
        self.shape = (B, self.y.shape[1] if task == "lm" else 0)
        self.phases, self.steps_timed = {}, 0
        self.compute_ns = self.wait_ns = 0

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(**self.inputs).logits
        shape = logits.shape
        logits = logits.float().flatten(0, -2)
        if self.criterion is not None:
            kw = {"shape": shape} if len(shape) == 3 else {}  # per-sample over tokens
            loss = self.criterion(logits, self.y.flatten(), **kw)
        else:
            # every sample has T tokens: the token mean is the mean over
            # samples of per-sample means (loss_reduction="mean")
            loss = F.cross_entropy(logits, self.y.flatten())
        loss.backward()
        self.opt.step()
        return loss

    def timed(self, steps):
        """ms per step over `steps` steps."""
        e = self.engine
        if e is not None:
            e.synchronize()
            c0, w0 = e.compute_ns_total, e.input_wait_ns_total
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.loss = self.step()
            if e is not None:
                for k, v in e.last_timing.items():
                    self.phases[k] = self.phases.get(k, 0.0) + v
        sync(self.device)
        ms = (time.perf_counter() - t0) * 1e3 / steps
        if e is not None:
            e.synchronize()
            self.compute_ns += e.compute_ns_total - c0
            self.wait_ns += e.input_wait_ns_total - w0
        self.steps_timed += steps
        return ms

    def extra(self):
        out = {"loss": round(float(self.loss.detach()), 4)}
        e, n = self.engine, max(self.steps_timed, 1)
        if e is not None:
            out.update({k: round(v / n, 3) for k, v in self.phases.items()})
            out["daemon_compute_ms"] = round(self.compute_ns / 1e6 / n, 3)
            out["daemon_input_wait_ms"] = round(self.wait_ns / 1e6 / n, 3)
            out["daemon_layers"] = len(e._layers)
            out["mps_active"] = bool(e.client.info.mps_active)
        return out

    def close(self):
        if self.engine is not None:
            self.engine.close()
        self.model = self.opt = self.engine = self.criterion = None


def why(e):
    return "%s: %s" % (type(e).__name__, str(e)[:400])


# --- one model ----------------------------------------------------------------------------

def bench_model(args, device, spec, emit):
    import transformers
    head = {"bench": "hf_step", "model": spec, "precision": "bf16" if args.bf16 else "fp32",
            "optimizer": "adamw", "tiny": args.tiny,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}
    modes, rounds = {}, {"plain": [], "dpclip": []}
    stage = "plain"
    try:
        for name in ("plain", "dpclip"):
            stage = name
            modes[name] = Mode(args, device, name, spec)
            for _ in range(args.warmup):
                modes[name].step()
        head["batch"], head["seq"] = modes["plain"].shape
        if modes["plain"].experts is not None:  # transformers 5's MoE kernel, as plain ran it
            head["experts_implementation"] = modes["plain"].experts
        head["params_m"] = round(sum(p.numel() for p in modes["plain"].model.parameters())
                                 / 1e6, 1)
        for r in range(args.repeat):  # the modes take turns; which goes first alternates
            for name in (("plain", "dpclip") if r % 2 == 0 else ("dpclip", "plain")):
                rounds[name].append(modes[name].timed(args.steps))
    except Exception as e:  # dpclip refusing a model is a result too
        emit(dict(head, mode=stage, error=why(e)))
        for m in modes.values():
            m.close()
        return
    med = {n: statistics.median(v) for n, v in rounds.items()}
    for name in ("plain", "dpclip"):
        emit(dict(head, mode=name, step_ms=round(med[name], 3),
                  rounds_ms=[round(v, 3) for v in rounds[name]], **modes[name].extra()))
        modes[name].close()
    modes.clear()
    free(device)
    ratios = sorted(d / p for d, p in zip(rounds["dpclip"], rounds["plain"]))
    ratio = dict(head, ratio="dpclip/plain", time_ratio=round(med["dpclip"] / med["plain"], 3),
                 time_ratio_best_round=round(ratios[0], 3),
                 time_ratio_worst_round=round(ratios[-1], 3),
                 time_ratio_median_round=round(statistics.median(ratios), 3),
                 rounds=len(ratios), target={"time_ratio": TARGET})
    op = None
    if "opacus" in args.modes.split(","):
        try:
            m = Mode(args, device, "opacus", spec)
            for _ in range(args.warmup):
                m.step()
            op = [m.timed(args.steps) for _ in range(args.opacus_repeat)]
            emit(dict(head, mode="opacus", step_ms=round(statistics.median(op), 3),
                      rounds_ms=[round(v, 3) for v in op], **m.extra()))
            m.close()
        except Exception as e:  # Opacus refusing the model is a result too
            emit(dict(head, mode="opacus", error=why(e)))
            op = None
        free(device)
    mem = memory(args, device, spec) if device.type == "cuda" else {}
    if "plain" in mem and "dpclip" in mem:
        ratio["device_mib"] = mem
        ratio["mem_ratio"] = round(mem["dpclip"] / mem["plain"], 3)
    emit(ratio)
    if op:
        emit(dict(head, ratio="opacus/plain",
                  time_ratio=round(statistics.median(op) / med["plain"], 3),
                  **({"mem_ratio": round(mem["opacus"] / mem["plain"], 3)}
                     if "opacus" in mem else {})))


def memory(args, device, spec):
    """MiB of device memory (every process) each mode uses above the start,
    built alone, over two steps."""
    out = {}
    for name in ("plain", "dpclip", "opacus"):
        if name == "opacus" and "opacus" not in args.modes.split(","):
            continue
        free(device)
        # the daemon's workspace outlives a session: what it already held
        # when this mode starts is not in the device's rise, so it is added
        # (from the daemon's status socket; None where it has none)
        held = daemon_phases.workspace_bytes(args.socket) if name == "dpclip" else 0
        try:
            with DeviceMemory(device) as dm:
                m = Mode(args, device, name, spec)
                for _ in range(2):
                    m.step()
                sync(device)
                m.close()
        except Exception:  # (reported with the timings)
            continue
        out[name] = round((dm.peak - dm.base + (held or 0)) / 2**20, 1)
        if held is None:
            out["dpclip_workspace_held"] = "not counted: no status socket"
    free(device)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="dpclipd socket (default $DPCLIP_SOCKET)")
    ap.add_argument("--models", default="gpt2,llama,mixtral,vit")
    ap.add_argument("--modes", default="plain,dpclip,opacus",
                    help="opacus is left out where not listed")
    ap.add_argument("--tiny", action="store_true", help="a few layers each (CPU smoke test)")
    ap.add_argument("--batch", type=int, default=0, help="default: each model's")
    ap.add_argument("--steps", type=int, default=5, help="steps a round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5, help="rounds per mode")
    ap.add_argument("--opacus-repeat", type=int, default=3)
    ap.add_argument("--experts", default=None, help="transformers 5's experts kernel (eager, "
                    "grouped_mm, ...) for every mode; default: the model's")
    ap.add_argument("--fp32", dest="bf16", action="store_false", help="no bf16 autocast")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("bench_hf_step.py needs transformers")
    device = pick_device(args.device)

    def emit(d):
        print(json.dumps(d), flush=True)

    for spec in args.models.split(","):
        if spec not in MODELS:
            sys.exit("--models: %r is not one of %s" % (spec, ", ".join(MODELS)))
    for spec in args.models.split(","):
        bench_model(args, device, spec, emit)


if __name__ == "__main__":
    main()
