"""Flattened tokens (dpclip._rows, issue 41): modules that get a sequence as
rows [B*T, d] (OPT's decoder reshapes before its final LayerNorm and MLP)
are trained exactly where each row's sample is proved from the autograd
graph (reshaped, or picked by an index as a mixture of experts' router
does), against the per-sample f64 reference (sigma 0, flat clipping, C
between the middle norms); rows whose samples are not provable
(token-major) are refused by name, never trained as if sample-major. row_samples itself:
what it proves and what stops it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip._rows import row_samples
from models import DEVICES, exact_step, per_sample_losses, private, prose

B, T, D = 6, 7, 16


class FlatMLP(nn.Module):
    """A token embedding, then OPT's layer shape: the hidden states
    reshaped to rows, LayerNorm, fc1, ReLU, fc2, the residual, and back;
    `order` flattens them otherwise: "gather" shuffles the rows by an index
    (exact), "token" transposes first (refused)."""

    def __init__(self, V, order="sample"):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)
        self.head = nn.Linear(D, V)
        self.order = order

    def forward(self, idx):
        h = self.emb(idx)
        shape = h.shape
        if self.order == "token":  # [T, B] order: rows token-major
            rows = h.transpose(0, 1).reshape(-1, D)
        elif self.order == "gather":  # rows shuffled
            perm = torch.arange(shape[0] * shape[1], device=idx.device).flip(0)
            rows = h.reshape(-1, D)[perm]
        else:
            rows = h.reshape(-1, D)
        z = self.fc2(F.relu(self.fc1(self.norm(rows))))
        out = rows + z
        if self.order == "token":
            out = out.view(shape[1], shape[0], D).transpose(0, 1)
        elif self.order == "gather":
            out = out[torch.argsort(perm)]
        return self.head(out.reshape(shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["sample", "gather"])
def test_flattened_tokens_exact(daemon, order, device):
    """Sample-major rows (reshaped), and rows picked by an index (shuffled,
    as a router's): each row's sample is known, so both are exact."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=3)
    engine, _ = exact_step(daemon, FlatMLP(V, order), "seq", (x,), y, device)
    sid = {l.name: l.sid for l in engine._layers}["fc2"]
    want_sid = torch.arange(B).repeat_interleave(T)
    assert torch.equal(sid.cpu(), want_sid if order == "sample" else want_sid.flip(0))
    engine.close()


def test_token_major_rows_refused(daemon):
    """Token-major rows (a transpose, then a reshape): their samples are not
    provable, so the modules on them are taken as batch-first, whose batch
    the step refuses, naming the module; nothing is sent or written."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=3)
    engine, model, opt = private(daemon, FlatMLP(V, "token"), 1.0, B)
    per_sample_losses("seq", model(x), y).mean().backward()
    with pytest.raises(ValueError, match=r"module norm saw a batch of \(%d,\)" % (B * T)):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    engine.close()


def _major(n, T):
    return torch.arange(n).repeat_interleave(T)


def test_row_samples_proves_and_stops():
    h = torch.randn(B, T, D, requires_grad=True) * 1.0
    rows = h.reshape(-1, D)
    w = nn.Parameter(torch.randn(D))
    same = _major(B, T)
    assert row_samples(rows, None) is None  # the pass's batch not known yet
    for got in (row_samples(rows, B),
                row_samples(torch.relu(rows) * 2.0 + w, B),              # elementwise, a parameter
                row_samples(torch.tanh(rows) * torch.sigmoid(rows), B),  # two proved branches
                row_samples(h.flatten(0, 1), B),
                row_samples(h.detach().reshape(-1, D), B)):              # no graph: the view
        assert got is not None and torch.equal(got, same)
    # rows picked by an index (a mixture of experts' routing): each keeps its sample
    pick = torch.tensor([3, 0, 40, 41, 17])
    for picked in (rows[pick], rows[None, pick].reshape(-1, D),
                   torch.index_select(rows, 0, pick), torch.relu(rows[pick]) * 3):
        assert torch.equal(row_samples(picked, B), same[pick])
    assert row_samples(h.transpose(0, 1).reshape(-1, D), B) is None     # the leading size is T
    assert row_samples(rows - rows.mean(0, keepdim=True), B) is None    # mixed over the batch
    assert row_samples(rows @ torch.randn(D, D), B) is None             # an unknown op
    assert row_samples(torch.sort(rows, 0)[0], B) is None               # reordered by value
    assert row_samples(rows[pick] + rows[pick.flip(0)], B) is None      # two maps disagree
    assert row_samples(h.reshape(B * T // 2, 2 * D), B) is None         # rows of two tokens
    # columns of each row (a gated MLP's halves); one token of each sample
    gate, up = torch.relu(rows[pick]).chunk(2, dim=-1)
    assert torch.equal(row_samples(gate * up, B), same[pick])
    assert torch.equal(row_samples(rows[pick][:, : D // 2], B), same[pick])
    assert torch.equal(row_samples(h[:, 0], B), torch.arange(B))         # a pooled [B, d]
    assert row_samples(rows[:B], B) is None                              # rows sliced: T's first
    assert row_samples(h[0], B) is None                                  # one sample's tokens


class Experts(nn.Module):
    """A top-1 mixture of two experts over flattened tokens, as Mixtral
    routes (its router a Linear on the rows, each expert a Linear on the rows
    routed to it, scaled by the router's weight, added back by index);
    `empty` routes every token to expert 0, so that expert 1 gets no row."""

    def __init__(self, V, empty=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.gate = nn.Linear(D, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, V)
        self.empty = empty

    def forward(self, idx):
        h = self.emb(idx)
        rows = h.view(-1, D)
        w = torch.softmax(self.gate(rows), -1)
        top = torch.zeros_like(w[:, 0], dtype=torch.long) if self.empty else w.argmax(-1)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            (sel,) = torch.where(top == e)
            y = torch.tanh(expert(rows[None, sel].reshape(-1, D))) * w[sel, e, None]
            out = out.index_add(0, sel, y)
        return self.head((rows + out).view(h.shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", [False, True])
def test_mixture_of_experts_exact(daemon, empty, device):
    torch.manual_seed(1)
    (x,), y, V = prose(B, T, seed=4)
    engine, _ = exact_step(daemon, Experts(V, empty), "seq", (x,), y, device)
    engine.close()


class FirstRows(nn.Module):
    """An 'expert' Linear that gets the rows of one token id (picked by an
    index, as a router picks), its output added back at those rows; the
    batch holds that id B times, all in sample 0. raw=True holds its weight
    bare and calls F.linear itself (dpclip._linfn) instead of an nn.Linear."""

    def __init__(self, V, raw=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.raw = raw
        if raw:
            self.expert = RawExpert()
        else:
            self.expert = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.emb(idx)
        rows = h.reshape(-1, D)
        pick = (idx.reshape(-1) == self.emb.num_embeddings - 1).nonzero().squeeze(1)
        out = rows.index_add(0, pick, torch.tanh(self.expert(rows[pick])))
        return self.head(out.view(h.shape))


class RawExpert(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):
        return F.linear(x, self.weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("raw", [False, True])
def test_batch_many_rows_of_one_sample_exact(daemon, device, raw):
    """B rows are not the batch unless their map says so: B rows an index
    picked from one sample are that sample's (taking them as one a sample
    gave every sample a share of sample 0's gradient)."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=3)
    assert T > B
    x = x.clone()
    x[x == V - 1] = 1
    x[0, :B] = V - 1  # the routed id: B rows, all sample 0's
    engine, _ = exact_step(daemon, FirstRows(V, raw), "seq", (x,), y, device)
    engine.close()
