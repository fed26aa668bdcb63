#!/usr/bin/python3
"""Train a small character-level transformer language model with DP-SGD
through dpclipd.

    dpclipd --socket /tmp/d.sock &
    /usr/bin/python3 examples/train_transformer.py --socket /tmp/d.sock --epochs 3

(/usr/bin/python3: the python that Debian's python3-torch, which
scripts/deps.sh installs, is for; scripts/quickstart.sh --python runs this.)

The corpus is the prose under examples/data/. Each training sample (the
unit of privacy) is one window of --seq characters (windows overlap with
stride --stride); batches are Poisson samples with expected size --batch.
The daemon computes per-sample norms, clips to --clip, adds Gaussian noise
(--sigma) and writes the private gradient; autograd computes input gradients
only. Uses CUDA when available (--device cpu to force the CPU).
"""
import argparse
import contextlib
import glob
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout

# dpclip first: without torch it says which python3 has it
from dpclip.torch import PrivacyEngine, sequence_cross_entropy  # noqa: E402
from dpclip.data import DPDataLoader  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block built from the layers dpclip supports:
    attention is a Linear for q, k, v, the attention product (no
    parameters) and a Linear projection."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def attention(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab, seq, d=128, layers=2, heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        # untied, with a bias (tied ones work too: see train_hf_gpt2.py)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        B, T = x.shape
        # Positions as [B, T] indices: every module sees the sample dimension first.
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def load_corpus(path):
    files = sorted(glob.glob(os.path.join(path, "*.txt"))) if os.path.isdir(path) else [path]
    if not files:
        sys.exit("no .txt files under %s" % path)
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


class Windows(torch.utils.data.Dataset):
    def __init__(self, ids, seq, stride):
        self.ids, self.seq = ids, seq
        self.starts = list(range(0, len(ids) - seq - 1, stride))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        chunk = self.ids[s:s + self.seq + 1]
        return chunk[:-1], chunk[1:]


@torch.no_grad()
def evaluate(model, data, device, seq, batches=20):
    model.eval()
    losses = []
    for i in range(0, min(len(data) - seq - 1, batches * 16 * seq), 16 * seq):
        xs = torch.stack([data[j:j + seq] for j in range(i, i + 16 * seq, seq)
                          if j + seq + 1 <= len(data)])
        ys = torch.stack([data[j + 1:j + seq + 1] for j in range(i, i + 16 * seq, seq)
                          if j + seq + 1 <= len(data)])
        logits = model(xs.to(device))
        losses.append(float(F.cross_entropy(logits.flatten(0, 1), ys.to(device).flatten())))
    model.train()
    return sum(losses) / max(len(losses), 1)


@torch.no_grad()
def sample(model, itos, stoi, prompt, n, seq, device, temperature=0.8):
    model.eval()
    ids = [stoi.get(c, 0) for c in prompt]
    g = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(n):
        x = torch.tensor([ids[-seq:]], device=device)
        p = F.softmax(model(x)[0, -1].float().cpu() / temperature, -1)
        ids.append(int(torch.multinomial(p, 1, generator=g)))
    model.train()
    return "".join(itos[i] for i in ids)


def report(engine, epoch, train_loss, held_loss, clipped, seconds):
    eps = engine.last_epsilon
    print("epoch %d: train loss %.3f, held-out loss %.3f, clipped %.0f%% of samples, %.1f s%s"
          % (epoch, train_loss, held_loss, 100.0 * clipped, seconds,
             ", epsilon %.2f" % eps if eps and math.isfinite(eps) else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="dpclipd socket (default $DPCLIP_SOCKET)")
    ap.add_argument("--corpus", default=os.path.join(HERE, "data"))
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=0.8, help="noise multiplier")
    ap.add_argument("--clip", type=float, default=1.0, help="max per-sample gradient norm C")
    ap.add_argument("--batch", type=int, default=64, help="expected (Poisson) batch size")
    ap.add_argument("--physical-batch", type=int, default=0, help="run each batch as "
                    "micro-batches of at most this many windows, one optimizer step per batch "
                    "(gradient accumulation; 0: the whole batch at once)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation (the batches "
                    "are drawn from a generator seeded from os.urandom)")
    ap.add_argument("--secure", action="store_true", help="draw the batches from os.urandom "
                    "itself (dpclip.data's secure_mode)")
    ap.add_argument("--delta", type=float, default=1e-5, help="delta epsilon is reported at")
    ap.add_argument("--job", default=None, help="job id for the daemon's privacy ledger "
                    "(default: a fresh one per run, printed)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    text = load_corpus(args.corpus)
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    train, held = ids[:split], ids[split:]
    ds = Windows(train, args.seq, args.stride)
    loader = DPDataLoader(ds, sample_rate=args.batch / len(ds), secure_mode=args.secure)

    model = CharLM(len(itos), args.seq, args.d, args.layers, args.heads).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = PrivacyEngine(args.socket, client_name="train_transformer", job_id=args.job)
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=args.sigma,
                                             max_grad_norm=args.clip, loss_reduction="mean",
                                             target_delta=args.delta)
    nparams = sum(p.numel() for p in model.parameters())
    print("corpus %d chars, vocab %d, %d training windows, model %.2fM params, device %s, "
          "daemon %s" % (len(text), len(itos), len(ds), nparams / 1e6, device,
                         engine.client.info.daemon_version.decode()))
    print("DP-SGD: sigma %.2f, C %.2f, expected batch %d (sample rate %.4f), %d steps/epoch"
          % (args.sigma, args.clip, engine.expected_batch_size, loader.sample_rate, len(loader)))
    print("epoch 0: held-out loss %.3f" % evaluate(model, held, device, args.seq))
    use_amp = device.type == "cuda"
    # --physical-batch: each Poisson batch as micro-batches, the optimizer
    # stepping (noise and charge once) at each batch's end
    batches = engine.logical_batches(loader, max_physical_batch_size=args.physical_batch) \
        if args.physical_batch else contextlib.nullcontext(loader)
    with batches as micro_batches:
        for epoch in range(1, args.epochs + 1):
            t0, tot, n, clipped, seen = time.time(), 0.0, 0, 0, 0
            for x, y in micro_batches:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                    logits = model(x)
                loss = sequence_cross_entropy(logits, y, reduction="mean")
                loss.backward()
                committed = engine.steps
                opt.step()
                if x.shape[0]:
                    tot += float(loss) * x.shape[0]
                    n += x.shape[0]
                if engine.steps > committed:  # a step taken: its samples' coefficients
                    clipped += int((engine.last_coefs < 1).sum())
                    seen += engine.last_coefs.numel()
            report(engine, epoch, tot / max(n, 1), evaluate(model, held, device, args.seq),
                   clipped / max(seen, 1), time.time() - t0)
    eps = engine.last_epsilon
    eps = engine.last_epsilon
    if eps and math.isfinite(eps):
        print("privacy: epsilon %.2f at delta %.1e after %d steps (the daemon's ledger for this "
              "job)" % (eps, engine.last_delta, engine.steps))
    else:
        print("privacy: the daemon reported no finite epsilon (%r) after %d steps at sigma %.2f, "
              "sample rate %.4f" % (eps, engine.steps, args.sigma, loader.sample_rate))
    print("sample: %r" % sample(model, itos, stoi, "The ", 120, args.seq, device))
    engine.close()


if __name__ == "__main__":
    main()
