"""Relative position biases shared by the batch (issue 41; dpclip._relbias):
an attention named T5Attention, built here as transformers' T5 builds it (a
bias per head looked up from [q, k] position buckets, added to every
sample's scores with the mask), trained exactly against the per-sample f64
reference (sigma 0, flat clipping, C between the middle norms; the table's
gradient is a sum over the query-key pairs of each bucket); one that lays
its bias out otherwise is refused by the first-step check, naming it."""
import pytest
import torch
import torch.nn as nn

from dpclip.torch import UnsupportedModuleError
from models import DEVICES, exact_step, per_sample_losses, private, prose, reference

B, T, D, H, NB = 6, 9, 16, 2, 8


class T5Attention(nn.Module):
    """T5's self-attention shape: q, k, v, o without biases, scores unscaled,
    plus the relative bias of the position buckets (clamped distances)."""

    def __init__(self, layout="t5"):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.has_relative_attention_bias = True
        self.relative_attention_bias = nn.Embedding(NB, H)
        self.layout = layout

    def compute_bias(self, query_length, key_length, device=None):
        dev = self.relative_attention_bias.weight.device
        ctx = torch.arange(query_length, device=dev)[:, None]
        mem = torch.arange(key_length, device=dev)[None, :]
        buckets = torch.clamp(mem - ctx + NB // 2, 0, NB - 1)
        values = self.relative_attention_bias(buckets)  # [q, k, h]
        perm = [2, 0, 1] if self.layout == "t5" else [2, 1, 0]  # "swapped": k and q exchanged
        return values.permute(perm).unsqueeze(0)

    def forward(self, x, mask):
        n, t, _ = x.shape

        def heads(y):
            return y.view(n, t, H, D // H).transpose(1, 2)
        scores = heads(self.q(x)) @ heads(self.k(x)).transpose(-1, -2)
        scores = scores + (self.compute_bias(t, t) + mask)
        a = torch.softmax(scores, -1) @ heads(self.v(x))
        return self.o(a.transpose(1, 2).reshape(n, t, D))


class TinyT5(nn.Module):
    def __init__(self, V, layout="t5"):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = T5Attention(layout)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        causal = torch.triu(torch.full((T, T), -1e4, device=idx.device), 1)[None, None]
        h = h + self.attn(self.norm(h), causal.expand(idx.shape[0], 1, T, T))
        return self.head(h)


@pytest.mark.parametrize("device", DEVICES)
def test_relative_bias_exact(daemon, device):
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    model = TinyT5(V)
    want, _, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    assert float(want["attn.relative_attention_bias.weight"].abs().max()) > 0
    # (exact_step: no parameter, the table neither, got a gradient from autograd)
    engine, model = exact_step(daemon, model, "seq", (x,), y, device)
    engine.close()
    assert "compute_bias" not in vars(model.attn)


def test_other_layout_refused_at_first_step(daemon):
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model, opt = private(daemon, TinyT5(V, layout="swapped"), 1.0, B)
    per_sample_losses("seq", model(x), y).mean().backward()
    with pytest.raises(UnsupportedModuleError,
                       match=r"attn.relative_attention_bias \(T5Attention\)"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    engine.close()
