#!/usr/bin/python3
"""Train a small Hugging Face GPT-2 (GPT2LMHeadModel, built from a config:
nothing is downloaded) with DP-SGD through dpclipd, unmodified: its Conv1D
projections, its position embeddings broadcast over the batch and its
lm_head tied to the token embedding are all trained exactly.

    /usr/bin/python3 examples/train_hf_gpt2.py                 # starts build/dpclipd itself
    /usr/bin/python3 examples/train_hf_gpt2.py --logical-batch 1024 --physical-batch 16
    /usr/bin/python3 examples/train_hf_gpt2.py --socket /run/dpclip/dpclipd.sock --layers 4

Needs transformers (it exits with status 2 saying so where it is missing).
The corpus is the prose under examples/data/, as bytes (a vocabulary of
256: no tokenizer to download). Each training sample (the unit of privacy)
is one window of --seq bytes; the logical batches are Poisson samples of
expected size --logical-batch (DP-SGD needs large ones: the noise on the
mean gradient is sigma * C / B), each split into micro-batches of at most
--physical-batch windows that go through the model one at a time
(engine.logical_batches, dpclip's BatchMemoryManager): one optimizer step,
one draw of noise and one charge per logical batch. Prints the loss,
epsilon (the daemon's ledger) and tokens/s, with a progress bar of the
logical steps where tqdm is installed. Runs on the GPU when there is one
(bf16 autocast), else on the CPU (--device to choose).

Without --socket a daemon is started from this checkout's build/dpclipd (or
$DPCLIPD) on a temporary socket, and stopped at the end."""
import argparse
import glob
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout

# dpclip first: without torch it says which python3 has it
from dpclip.torch import PrivacyEngine, sequence_cross_entropy  # noqa: E402
from dpclip.data import DPDataLoader  # noqa: E402

import torch  # noqa: E402

try:
    import transformers  # noqa: E402
except ImportError:
    sys.stderr.write(
        "train_hf_gpt2.py needs transformers. With Debian's python3-torch (1.13), which pip\n"
        "may not install into, use a venv that sees it and a transformers that supports it:\n"
        "  /usr/bin/python3 -m venv --system-site-packages ~/.venv/dpclip-hf\n"
        "  ~/.venv/dpclip-hf/bin/pip install 'transformers<4.46'\n"
        "  ~/.venv/dpclip-hf/bin/python examples/train_hf_gpt2.py ...\n"
        "(transformers 5 needs torch >= 2.6). examples/train_transformer.py trains a\n"
        "GPT-like model without it.\n")
    sys.exit(2)

try:
    from tqdm import tqdm  # noqa: E402
except ImportError:
    tqdm = None


class Windows(torch.utils.data.Dataset):
    """Windows of seq + 1 bytes, every `stride`: (input, next bytes)."""

    def __init__(self, ids, seq, stride):
        self.ids, self.seq = ids, seq
        self.starts = range(0, len(ids) - seq - 1, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return self.ids[s:s + self.seq], self.ids[s + 1:s + self.seq + 1]


def load_corpus(path):
    files = sorted(glob.glob(os.path.join(path, "*.txt"))) if os.path.isdir(path) else [path]
    if not files:
        sys.exit("no .txt files under %s" % path)
    data = b"\n\n".join(open(f, "rb").read() for f in files)
    return torch.tensor(list(data), dtype=torch.long)


def start_daemon(rundir):
    """build/dpclipd (or $DPCLIPD) on a socket in rundir; returns (process,
    socket) once it reported READY."""
    exe = os.environ.get("DPCLIPD") or os.path.join(os.path.dirname(HERE), "build", "dpclipd")
    sock = os.path.join(rundir, "dpclipd.sock")
    r, w = os.pipe()
    proc = subprocess.Popen([exe, "--socket", sock, "--ready-fd", str(w), "--ledger-dir",
                             os.path.join(rundir, "ledger"), "--log-level", "warn"],
                            pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        if f.readline() != "READY\n":
            proc.kill()
            sys.exit("%s did not start" % exe)
    return proc, sock


class Progress:
    """tqdm where installed, else a line every --log steps."""

    def __init__(self, total, every):
        self.bar = tqdm(total=total, unit="step", leave=False) if tqdm else None
        self.every, self.n = every, 0

    def update(self, text):
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.every and self.n % self.every == 0:
            print("  step %d: %s" % (self.n, text), flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="a running dpclipd's socket (default: start "
                    "build/dpclipd on a temporary one)")
    ap.add_argument("--corpus", default=os.path.join(HERE, "data"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: none)")
    ap.add_argument("--sigma", type=float, default=0.8, help="noise multiplier")
    ap.add_argument("--clip", type=float, default=1.0, help="max per-sample gradient norm C")
    ap.add_argument("--logical-batch", "--batch", dest="logical_batch", type=int, default=64,
                    help="expected (Poisson) logical batch size: one optimizer step each")
    ap.add_argument("--physical-batch", type=int, default=16,
                    help="most windows per micro-batch (forward and backward) of a logical batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--d", type=int, default=128, help="n_embd")
    ap.add_argument("--layers", type=int, default=2, help="n_layer")
    ap.add_argument("--heads", type=int, default=4, help="n_head")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--log", type=int, default=5,
                    help="without tqdm: a line every N logical steps")
    ap.add_argument("--delta", type=float, default=1e-5, help="delta epsilon is reported at")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation")
    args = ap.parse_args()

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    ids = load_corpus(args.corpus)
    ds = Windows(ids, args.seq, args.stride)
    loader = DPDataLoader(ds, sample_rate=min(1.0, args.logical_batch / len(ds)))
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.d,
                                     n_layer=args.layers, n_head=args.heads)
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    proc = None
    rundir = tempfile.TemporaryDirectory(prefix="dpclip-gpt2.")
    socket = args.socket
    if socket is None:
        proc, socket = start_daemon(rundir.name)
    try:
        engine = PrivacyEngine(socket, client_name="train_hf_gpt2")
        model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                                 data_loader=loader,
                                                 noise_multiplier=args.sigma,
                                                 max_grad_norm=args.clip, loss_reduction="mean",
                                                 target_delta=args.delta)
        tied = [l.name for l in engine._layers if l.tie is not None]
        print("GPT-2 from a config: %.2fM parameters, %d layers sent to the daemon (%s tied to "
              "%s), device %s; %d windows of %d bytes, sigma %.2f, C %.2f, expected logical "
              "batch %d in micro-batches of at most %d"
              % (sum(p.numel() for p in model.parameters()) / 1e6, len(engine._layers),
                 ", ".join(tied) or "none", engine._layers[0].name, device, len(ds), args.seq,
                 args.sigma, args.clip, engine.expected_batch_size, args.physical_batch),
              flush=True)
        use_amp = device.type == "cuda"
        steps = 0
        with engine.logical_batches(loader, max_physical_batch_size=args.physical_batch) \
                as batches:
            for epoch in range(1, args.epochs + 1):
                t0, tot, n, tokens = time.time(), 0.0, 0, 0
                bar = Progress(len(loader), args.log)
                for x, y in batches:  # micro-batches; optimizer.step() commits each logical batch
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    opt.zero_grad()  # (a no-op inside a logical batch)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                        logits = model(input_ids=x).logits
                    # the micro-batch's own mean: the daemon divides by the logical batch
                    loss = sequence_cross_entropy(logits.float(), y, reduction="mean")
                    loss.backward()
                    committed = engine.steps
                    opt.step()
                    tokens += x.numel()
                    if x.shape[0]:
                        tot += float(loss) * x.shape[0]
                        n += x.shape[0]
                    if engine.steps == committed:
                        continue  # the logical batch goes on
                    steps += 1
                    eps = engine.last_epsilon
                    bar.update("loss %.3f, epsilon %s, %.0f tokens/s" % (
                        tot / max(n, 1), "%.2f" % eps if math.isfinite(eps) else "inf",
                        tokens / max(time.time() - t0, 1e-9)))
                    if args.steps and steps >= args.steps:
                        break
                bar.close()
                engine.synchronize()
                dt = time.time() - t0
                eps = engine.last_epsilon
                print("epoch %d: loss %.3f, epsilon %s, %.0f tokens/s (%d logical steps of "
                      "%.0f windows on average, %.1f s)"
                      % (epoch, tot / max(n, 1), "%.2f" % eps if math.isfinite(eps) else "inf",
                         tokens / max(dt, 1e-9), bar.n, n / max(bar.n, 1), dt), flush=True)
                if args.steps and steps >= args.steps:
                    break
        print("privacy: epsilon %.2f at delta %.1e after %d steps (the daemon's ledger for job "
              "%s)" % (engine.last_epsilon, engine.last_delta, engine.steps, engine.job_id))
        engine.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        rundir.cleanup()


if __name__ == "__main__":
    main()
