"""Flattened tokens (dpclip._rows, issue 41): modules that get a sequence as
rows [B*T, d] (OPT's decoder reshapes before its final LayerNorm and MLP)
are trained exactly where each row's sample is proved from the autograd
graph, against the per-sample f64 reference (sigma 0, flat clipping, C
between the middle norms); rows in another order (token-major, gathered)
are refused by name, never trained as if sample-major. sample_rows itself:
what it proves and what stops it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip._rows import sample_rows
from dpclip.torch import PrivacyEngine
from models import between, max_rel, per_sample_losses, prose, reference

B, T, D = 6, 7, 16


class FlatMLP(nn.Module):
    """A token embedding, then OPT's layer shape: the hidden states
    reshaped to rows, LayerNorm, fc1, ReLU, fc2, the residual, and back;
    `order` flattens them otherwise (to be refused)."""

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
            perm = torch.arange(shape[0] * shape[1]).flip(0)
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


def _engine(daemon, model, C):
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean", expected_batch_size=B)
    return engine, model, opt


def test_flattened_tokens_exact(daemon):
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=3)
    model = FlatMLP(V)
    _, norms0, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    C = between(norms0)
    want, ref_norms, coefs = reference(model, "seq", (x,), y, C, "mean", B)
    assert (coefs < 1).any() and (coefs == 1).any()
    engine, model, opt = _engine(daemon, model, C)
    per_sample_losses("seq", model(x), y).mean().backward()
    opt.step()
    for n, p in model.named_parameters():
        assert p.grad is not None and max_rel(p.grad, want[n]) < 2e-4, n
    assert max_rel(engine.last_norms, ref_norms) < 1e-4
    assert all(l.verify is None for l in engine._layers), "a layer left unchecked"
    assert {l.name: l.per for l in engine._layers}["fc2"] == T
    engine.close()


@pytest.mark.parametrize("order", ["token", "gather"])
def test_other_row_orders_refused(daemon, order):
    """Token-major rows or shuffled ones: their samples are not provable, so
    the modules on them are taken as batch-first, whose batch the step
    refuses, naming the module; nothing is sent or written."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=3)
    engine, model, opt = _engine(daemon, FlatMLP(V, order), 1.0)
    per_sample_losses("seq", model(x), y).mean().backward()
    with pytest.raises(ValueError, match=r"module norm saw a batch of \(%d,\)" % (B * T)):
        opt.step()
    assert all(p.grad is None for p in model.parameters())
    engine.close()


def test_sample_rows_proves_and_stops():
    h = torch.randn(B, T, D, requires_grad=True) * 1.0
    rows = h.reshape(-1, D)
    w = nn.Parameter(torch.randn(D))
    assert sample_rows(rows) == B
    assert sample_rows(torch.relu(rows) * 2.0 + w) == B               # elementwise, a parameter
    assert sample_rows(torch.tanh(rows) * torch.sigmoid(rows)) == B   # two proved branches
    assert sample_rows(h.flatten(0, 1)) == B
    assert sample_rows(h.detach().reshape(-1, D)) == B                # no graph: the view
    assert sample_rows(h.transpose(0, 1).reshape(-1, D)) == T         # the source's leading size
    assert sample_rows(rows[torch.randperm(B * T)]) is None           # gathered
    assert sample_rows(rows - rows.mean(0, keepdim=True)) is None     # mixed over the batch
    assert sample_rows(rows @ torch.randn(D, D)) is None              # an unknown op
    assert sample_rows(h.reshape(B * T, D)[: B * T - 1]) is None      # a slice
    assert sample_rows(h) is None                                     # batch-first already
