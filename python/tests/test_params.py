"""Raw parameters used directly in a forward, broadcast over the batch
(issue 41; dpclip._params): a ViT-like image model whose embedding module
holds a class token [1, 1, d] and position embeddings [1, N + 1, d] as bare
nn.Parameters, exact against the per-sample f64 reference (sigma 0, flat
clipping, C between the middle norms), as is a layer-scale vector [d] on
tokens [B, T, d]; the ways such a parameter can be used that are not a
per-sample broadcast (a row for all, rows averaged, a vector against
pooled [B, d]) are each refused by the first-step check, naming the module,
before anything is sent; a scalar is refused at make_private, naming it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip.torch import PrivacyEngine, UnsupportedModuleError
from models import DEVICES, exact_step, private

B, D, P = 6, 16, 4  # samples, width, patches


class Tokens(nn.Module):
    """Patches to tokens, a class token prepended, positions added; `how`
    says how the class token enters ("expand": ViT's)."""

    def __init__(self, how="expand"):
        super().__init__()
        self.proj = nn.Linear(12, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.5)
        self.position_embeddings = nn.Parameter(torch.randn(1, P + 1, D) * 0.5)
        self.how = how

    def forward(self, patches):
        x = self.proj(patches)
        n = x.shape[0]
        if self.how == "first_row":  # every sample gets row 0: not per sample
            cls = self.cls_token[:1].expand(n, -1, -1)
        elif self.how == "mean":  # rows averaged: samples mixed
            cls = self.cls_token.mean(0, keepdim=True).expand(n, -1, -1)
        else:
            cls = self.cls_token.expand(n, -1, -1)
        return torch.cat([cls, x], 1) + self.position_embeddings


class TinyViT(nn.Module):
    def __init__(self, how="expand"):
        super().__init__()
        self.embeddings = Tokens(how)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, patches):
        h = self.embeddings(patches)
        h = h + torch.tanh(self.mlp(self.norm(h)))
        return self.head(h[:, 0])


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, P, 12, generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("device", DEVICES)
def test_class_token_and_positions_exact(daemon, device):
    torch.manual_seed(0)
    x, y = _data()
    # (exact_step: no parameter, cls_token neither, got a gradient from autograd)
    engine, model = exact_step(daemon, TinyViT(), "cls", (x,), y, device)
    # the module holds its own parameters again after each forward, and at close
    assert isinstance(model.embeddings._parameters["cls_token"], nn.Parameter)
    engine.close()
    assert "forward" not in vars(model.embeddings)


@pytest.mark.parametrize("how", ["first_row", "mean"])
def test_not_per_sample_refused_at_first_step(daemon, how):
    """Row 0 for every sample, or the rows averaged: the same values forward
    (every row is the parameter), but a sample's gradient would land in
    another's row. The first-step check refuses the module by name."""
    torch.manual_seed(0)
    model = TinyViT(how)
    x, y = _data()
    engine, model, opt = private(daemon, model, 1.0, B)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnsupportedModuleError, match=r"embeddings \(Tokens\)"):
        opt.step()
    assert model.embeddings.cls_token.grad is None
    engine.close()


class Scale(nn.Module):
    """A layer-scale: activations times a learned vector (or scalar)."""

    def __init__(self, shape):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, shape[0]) if shape else
                                  torch.tensor(1.3))

    def forward(self, x):
        return x * self.gamma


class Scaled(nn.Module):
    """Patches to tokens [B, P, D] (or pooled [B, D]), scaled, a head."""

    def __init__(self, shape=(D,), pooled=False):
        super().__init__()
        self.proj = nn.Linear(12, D)
        self.scale = Scale(shape)
        self.head = nn.Linear(D, 3)
        self.pooled = pooled

    def forward(self, patches):
        h = torch.tanh(self.proj(patches))
        h = self.scale(h.mean(1) if self.pooled else h)
        return self.head(h if self.pooled else h.mean(1))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_scale_vector_exact(daemon, device):
    """A vector [d] times tokens [B, T, d]: its per-sample copy is [B, 1, d]."""
    torch.manual_seed(0)
    x, y = _data()
    engine, _ = exact_step(daemon, Scaled(), "cls", (x,), y, device)
    engine.close()


def test_vector_against_pooled_rows_refused(daemon):
    """A vector times pooled features [B, d]: its copy [B, 1, d] would make
    the product [B, B, d], so the module's first training forward refuses,
    naming it."""
    x, y = _data()
    engine, model, opt = private(daemon, Scaled(pooled=True), 1.0, B)
    with pytest.raises(UnsupportedModuleError, match=r"module scale \(Scale\)"):
        model(x)
    engine.close()


def test_scalar_refused_by_name(daemon):
    """A learned scalar has no dimension to give a row per sample: refused at
    make_private, naming the parameter."""
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    with pytest.raises(UnsupportedModuleError, match="gamma"):
        engine.make_private(module=Scaled(()), optimizer=None, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=B)
    engine.close()
