"""Small models with every supported layer kind, and the naive reference:
explicit per-sample gradients, one sample at a time through autograd, in
double precision. The model-parallel ones: SeqModel cut into two pipeline
stages, and a LayerNorm + Linear split by the Linear's output features
over a tensor-parallel group (the LayerNorm held whole by every rank)."""
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


class Stage0(nn.Module):
    """SeqModel's first pipeline stage: tokens [B, T] -> hidden [B, T, d]."""

    def __init__(self, V=11, T=6, d=16, h=24):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        return h + self.fc2(torch.tanh(self.fc1(self.ln(h))))


class Stage1(nn.Module):
    """SeqModel's second stage: hidden [B, T, d] -> logits [B, T, V]."""

    def __init__(self, V=11, d=16):
        super().__init__()
        self.norm2 = _norm(d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, h):
        h = self.norm2(h)
        return self.head(self.shared(torch.tanh(self.shared(h))))


def pipeline_model():
    """The whole model; its [k] is pipeline stage k."""
    return nn.Sequential(Stage0(), Stage1())


class TPModel(nn.Module):
    """Features [B, T, d] -> logits [B, T, p]: a LayerNorm, then a Linear
    that TPShard splits by output features."""

    def __init__(self, d=8, p=10):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, p)

    def forward(self, x):
        return self.fc(self.ln(x))


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group
    (each rank's Linear slice gives part of its input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _GatherFromGroup(torch.autograd.Function):
    """Concatenates the ranks' output features; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.rank = torch.distributed.get_rank(group)
        ctx.size = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(y) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, y.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.size, -1)[ctx.rank].contiguous(), None


class TPShard(nn.Module):
    """This rank's part of a TPModel over `group`: the whole LayerNorm (a
    copy on every rank) and rows [k * p / size, (k + 1) * p / size) of the
    Linear, as a plain nn.Linear."""

    def __init__(self, whole, group):
        super().__init__()
        k, n = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        self.group = group
        self.ln = copy.deepcopy(whole.ln)
        p = whole.fc.out_features // n
        self.fc = nn.Linear(whole.fc.in_features, p)
        with torch.no_grad():
            self.fc.weight.copy_(whole.fc.weight[k * p:(k + 1) * p])
            self.fc.bias.copy_(whole.fc.bias[k * p:(k + 1) * p])

    def forward(self, x):
        h = _CopyToGroup.apply(self.ln(x), self.group)
        return _GatherFromGroup.apply(self.fc(h), self.group)


def tp_data(B, T=3, d=8, p=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, d, generator=g) * torch.linspace(0.3, 3.0, B).view(B, 1, 1) + 0.5
    y = torch.randint(0, p, (B, T), generator=g)
    return (x,), y


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


def reference(model, kind, inputs, y, C, reduction, expected, only=None):
    """(grads by parameter name, norms [B], coefs [B]) of DP-SGD without
    noise: each sample's full gradient (all trainable parameters, or those
    named in `only`) built explicitly in double precision, clipped to C,
    summed, divided by `expected` for a mean loss."""
    ref = copy.deepcopy(model).double()
    named = [(n, p) for n, p in ref.named_parameters()
             if p.requires_grad and (only is None or n in only)]
    names = [n for n, _ in named]
    params = [p for _, p in named]
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
