"""Small models with every supported layer kind, and the naive reference:
explicit per-sample gradients, one sample at a time through autograd, in
double precision."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

HAS_RMSNORM = hasattr(nn, "RMSNorm")


def _norm(d):
    return nn.RMSNorm(d, eps=1e-5) if HAS_RMSNORM else nn.LayerNorm(d)


class SeqModel(nn.Module):
    """Tokens [B, T] -> logits [B, T, V]: token and position embeddings
    (padding_idx, repeated tokens), LayerNorm, an MLP, RMSNorm where torch
    has it, a Linear applied twice (captured twice per pass) and a head."""

    def __init__(self, V=11, T=6, d=16, h=24):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.norm2 = _norm(d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        h = self.norm2(h)
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h)


class FlatModel(nn.Module):
    """Features [B, F] and a category [B] -> logits [B, C]: every layer sees
    2D input. One frozen Linear (no gradient, not sent)."""

    def __init__(self, F_=10, cats=5, e=6, d=12, classes=4):
        super().__init__()
        self.cat = nn.Embedding(cats, e)
        self.frozen = nn.Linear(F_, F_)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(F_ + e, d)
        self.ln = nn.LayerNorm(d)
        self.norm2 = _norm(d)
        self.out = nn.Linear(d, classes)

    def forward(self, x, c):
        h = torch.cat([torch.tanh(self.frozen(x)), self.cat(c)], 1)
        h = torch.tanh(self.ln(self.fc1(h)))
        return self.out(self.norm2(h))


def seq_data(B, T=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    x[0, :2] = 0  # some padding
    x[1, :] = 3   # a sample of one repeated token
    y = torch.randint(0, V, (B, T), generator=g)
    return (x,), y


def flat_data(B, F_=10, cats=5, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, F_, generator=g) * torch.linspace(0.2, 3.0, B).unsqueeze(1)
    c = torch.randint(0, cats, (B,), generator=g)
    y = torch.randint(0, classes, (B,), generator=g)
    return (x, c), y


def per_sample_losses(kind, out, y):
    if kind == "seq":
        tok = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                              reduction="none").view(y.shape)
        return tok.mean(1)
    return F.cross_entropy(out, y, reduction="none")


def reference(model, kind, inputs, y, C, reduction, expected):
    """(grads by parameter name, norms [B], coefs [B]) of DP-SGD without
    noise: each sample's full gradient (all trainable parameters) built
    explicitly in double precision, clipped to C, summed, divided by
    `expected` for a mean loss."""
    ref = copy.deepcopy(model).double()
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    params = [p for p in ref.parameters() if p.requires_grad]
    B = y.shape[0]
    per = []
    for b in range(B):
        xb = tuple(t[b:b + 1].double() if t.is_floating_point() else t[b:b + 1] for t in inputs)
        loss = per_sample_losses(kind, ref(*xb), y[b:b + 1]).sum()
        per.append(torch.autograd.grad(loss, params, allow_unused=True))
    per = [[g if g is not None else torch.zeros_like(p) for g, p in zip(gs, params)]
           for gs in per]
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) for gs in per],
                         dtype=torch.float64)
    coefs = torch.clamp(C / (norms + 1e-6), max=1.0)
    out = {}
    for i, n in enumerate(names):
        s = sum(coefs[b] * per[b][i] for b in range(B))
        out[n] = s / expected if reduction == "mean" else s
    return out, norms, coefs
