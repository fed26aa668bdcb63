"""Raw weights passed to F.linear by the module itself (dpclip._linfn,
issue 41): transformers 5 keeps a mixture of experts' router as a bare
weight [E, d] and its experts as 3-D parameters [E, p, d], each expert a
call F.linear(rows routed to it, W[e]). Trained exactly against the
per-sample f64 reference (sigma 0, flat clipping, C between the middle
norms): each (parameter, expert) pair is a Linear over its rows. The
structure is written out here (no transformers needed); any other use of
such a weight is refused by name, and nothing is written."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from models import DEVICES, exact_step, per_sample_losses, private, prose

B, T, D, E, I_, K = 6, 7, 16, 4, 24, 2


class TopKRouter(nn.Module):
    """A router with a bare weight: softmax over experts, the top k kept,
    renormalized in place; it returns its logits too (the first-step
    check must not count the gradient they pass to the weights twice)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) * 0.3)

    def forward(self, h):
        logits = F.linear(h.reshape(-1, D), self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, K, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, idx


class Experts(nn.Module):
    """E experts as two 3-D parameters: expert e is a gated MLP on the rows
    routed to it, F.linear(rows, W[e]) each."""

    def __init__(self, misuse=False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I_, D) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, D, I_) * 0.2)
        self.misuse = misuse

    def forward(self, h, idx, weights):
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(idx, num_classes=E).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for e in hit:
            e = e[0]
            pos, tok = torch.where(mask[e])
            rows = h[tok]
            if self.misuse:  # a matmul with the transposed view: no F.linear
                gate, up = (rows @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            else:
                gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, y * weights[tok, pos, None])
        return out


HAS_GMM = (getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)) is not None


def by_groups(x, w, offs):
    ends = offs.tolist()
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


def py_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """A grouped product in Python, dispatched like torch's own (through
    __torch_function__, all five arguments positional as F.grouped_mm passes
    them to torch._grouped_mm): where torch has none (before 2.8), the test
    installs it as torch._grouped_mm so that the capture runs there too."""
    if has_torch_function((a, b)):
        return handle_torch_function(py_grouped_mm, (a, b), a, b, offs, bias, out_dtype)
    return by_groups(a, b, offs)


def grouped(x, w, offs):
    """x [S, d] @ w [E, d, p] by groups of rows (offs: their ends): the
    grouped product torch has (or the test installed), else group by group
    (the float64 reference)."""
    gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gmm is not None and x.dtype != torch.float64:
        return gmm(x, w, offs=offs)
    return by_groups(x, w, offs)


class GroupedExperts(Experts):
    """The same experts computed as transformers 5's grouped_mm kernel does:
    the (token, choice) rows sorted by expert, one grouped product per
    projection against the transposed 3-D parameter, masked_fill on the
    rows, the routing weights, the rows put back in order and summed."""

    def forward(self, h, idx, weights):
        k = idx.shape[-1]
        ids, perm = torch.sort(idx.reshape(-1))
        rows = h[perm // k]
        rows.masked_fill_(torch.zeros_like(rows[:, :1], dtype=torch.bool), 0.0)
        offs = torch.cumsum(torch.bincount(ids, minlength=E), 0, dtype=torch.int32)
        up = grouped(rows.to(self.gate_up_proj.dtype), self.gate_up_proj.transpose(-2, -1), offs)
        gate, up = up.chunk(2, dim=-1)
        y = grouped(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs)
        y = y * weights.reshape(-1)[perm].unsqueeze(-1)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[back].view(-1, k, D).sum(1)


class MoELM(nn.Module):
    def __init__(self, V, misuse=False, experts=Experts):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.gate = TopKRouter()
        self.experts = experts(misuse)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x)
        rows = h.view(-1, D)
        _, weights, idx = self.gate(rows)
        moe = self.experts(rows, idx, weights.to(rows.dtype)).view(h.shape)
        return self.head(h + moe)


@pytest.mark.parametrize("device", DEVICES)
def test_router_and_3d_experts_exact(daemon, device):
    """Every parameter (the bare router weight, each expert's slice of the
    3-D parameters) matches the per-sample reference; the per-sample rows
    of each expert are padded, the experts no token reached send zeros."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model = exact_step(daemon, MoELM(V), "seq", (x,), y, device)
    kinds = {l.name: type(l).__name__ for l in engine._layers}
    assert kinds["gate"] == kinds["experts"] == "LinFnLayer"
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["torch", "python"])
def test_grouped_product_experts_exact(daemon, device, impl, monkeypatch):
    """transformers 5's grouped_mm experts: the grouped products captured as
    they run (GroupedLinFn), each expert's rows placed per sample; every
    parameter matches the per-sample reference. impl: torch's grouped
    product (2.8 and later), or one in Python installed in its place."""
    if impl == "torch" and not HAS_GMM:
        pytest.skip("torch has no grouped product (2.8 and later)")
    if impl == "python":
        monkeypatch.delattr(F, "grouped_mm", raising=False)
        monkeypatch.setattr(torch, "_grouped_mm", py_grouped_mm, raising=False)
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model = exact_step(daemon, MoELM(V, experts=GroupedExperts), "seq", (x,), y, device)
    engine.close()


def test_other_use_refused(daemon):
    """An expert weight used through a matmul (not F.linear): refused at the
    first forward, naming the module and the function; no gradient."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model, opt = private(daemon, MoELM(V, misuse=True), 1.0, B)
    with pytest.raises(Exception, match=r"module experts .* uses its parameters "
                                        r"\(gate_up_proj, down_proj\) through"):
        per_sample_losses("seq", model(x), y).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    engine.close()


def test_gathered_copy_refused(daemon):
    """A parameter gathered row by row (a bias per routed row, W[idx] with
    a tensor of indices: a copy, as GPT-OSS's experts take their biases) is
    refused at the first forward, naming the module; no gradient."""

    class GatheredBias(Experts):
        def __init__(self, misuse=False):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(E, D))

        def forward(self, h, idx, weights):
            first = F.linear(h, self.gate_up_proj[0])[:, :D]  # (a use dpclip trains)
            return first + self.bias[idx[:, 0]]

    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model, opt = private(daemon, MoELM(V, experts=GatheredBias), 1.0, B)
    try:  # torch 2 shows the mode the indexing: refused at the forward
        per_sample_losses("seq", model(x), y).mean().backward()
    except Exception as e:  # pylint: disable=broad-except
        assert re.search(r"module experts .* through __getitem__ \(a copy", str(e)), e
    else:  # torch 1.13 indexes a Parameter unseen: autograd's gradient, refused
        with pytest.raises(Exception, match=r"experts\.bias"):
            opt.step()
    assert all(p.grad is None for n, p in model.named_parameters() if n != "experts.bias")
    engine.close()


def test_token_major_rows_refused(daemon):
    """Rows whose samples are not provable (token-major: a transpose before
    the reshape) are refused naming the module, never taken as sample-major."""

    class TokenMajor(MoELM):
        def forward(self, x):
            h = self.emb(x)
            rows = h.transpose(0, 1).reshape(-1, D)
            _, weights, idx = self.gate(rows)
            return self.head(h + self.experts(rows, idx, weights).view(T, B, D).transpose(0, 1))

    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model, opt = private(daemon, TokenMajor(V), 1.0, B)
    with pytest.raises(Exception, match=r"module gate .* whose samples dpclip cannot prove"):
        model(x)
    engine.close()


def test_first_step_check_catches_misplaced_rows(daemon, monkeypatch):
    """The first-step check compares the rows as placed for the daemon with
    each sample's own rows: rows given to the wrong sample (a broken
    placement, simulated) are refused before anything is sent."""
    from dpclip import _linfn, _rows

    place = _rows.to_batch

    def shifted(x, sid, B):
        return place(x, (sid + 1) % B, B)

    monkeypatch.setattr(_linfn._rows, "to_batch", shifted)
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=5)
    engine, model, opt = private(daemon, MoELM(V), 1.0, B)
    per_sample_losses("seq", model(x), y).mean().backward()
    with pytest.raises(Exception, match=r"first-step check: module (gate|experts) .* "
                                        r"differs from autograd's through F.linear"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    engine.close()
