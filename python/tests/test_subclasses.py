"""Subclasses of the layers dpclip trains, with a forward of their own
(issue 38): Gemma's structures from plain modules (transformers 5's
GemmaTextScaledWordEmbedding scales its lookup by sqrt(hidden), is tied to
lm_head and has a padding_idx; GemmaRMSNorm scales by (1 + w); a Linear
subclass adds a constant), OPT's learned positions (an index offset), each
exact against the per-sample f64 reference (sigma 0, flat clipping, C
between the middle norms: half the samples clipped); and the subclasses
dpclip does not know, refused at make_private by name.

The package before this change trained the tied scaled embedding not at
all (its own forward ran; the daemon's output for the shared weight, the
lm_head's use alone, replaced its gradient), with norms low, as the
issue's GemmaForCausalLM under transformers 5."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip.torch import PrivacyEngine, UnsupportedModuleError, register
from models import (GemmaLike, GemmaTextScaledWordEmbedding, OffsetLinear, OPTLike,
                    exact_step, prose)

B, T = 6, 10


def _exact(daemon, model, inputs, y, reduction="mean", **kw):
    """make_private and one step (models.exact_step over an expected batch
    of B + 1, on the CPU). Returns the engine."""
    return exact_step(daemon, model, "seq", inputs, y, "cpu", reduction=reduction,
                      expected=B + 1, **kw)[0]


def _prose_with_padding(seed):
    inputs, y, V = prose(B, T, seed=seed)
    x = inputs[0].clone()
    x[0, :3] = 0  # padding_idx
    x[1, :] = x[1, 0]  # one token repeated: its row's gradient sums T positions
    return (x,), y, V


def test_gemma_like_exact(daemon):
    """The scaled embedding (tied to lm_head, padding_idx 0) trained through
    its super().forward: the scale enters the norms and the clipped sum
    (the output gradient the daemon sees is scale times the incoming one);
    GemmaRMSNorm by its name, (1 + w); OffsetLinear registered."""
    register(OffsetLinear, kind="subclass")
    torch.manual_seed(0)
    inputs, y, V = _prose_with_padding(0)
    model = GemmaLike(V)
    engine = _exact(daemon, model, inputs, y)
    layers = {l.name: l for l in engine._layers}
    emb = layers["embed_tokens"]
    assert emb.via_super is nn.Embedding and layers["lm_head"].tie is emb
    assert layers["down_proj"].via_super is nn.Linear
    assert layers["norm"].kind == "rmsnorm" and layers["norm"].offset == 1.0
    # detach gives the modules their own classes back
    engine.close()
    assert type(model.embed_tokens) is GemmaTextScaledWordEmbedding
    assert type(model.down_proj) is OffsetLinear
    assert "forward" not in vars(model.embed_tokens)


def test_gemma_like_sum_loss_and_second_step(daemon):
    register(OffsetLinear, kind="subclass")
    torch.manual_seed(1)
    inputs, y, V = _prose_with_padding(1)
    engine = _exact(daemon, GemmaLike(V), inputs, y, reduction="sum")
    engine.close()


def test_opt_learned_positions_exact(daemon):
    """OPT's positions: indices from the mask plus an offset of 2, in its
    own forward; trained through its super().forward call."""
    torch.manual_seed(2)
    inputs, y, V = prose(B, T, seed=2)
    x = inputs[0].clone()
    x[0, :4] = 0  # left padding moves that sample's positions
    engine = _exact(daemon, OPTLike(V, T), (x,), y)
    pos = [l for l in engine._layers if l.name == "embed_positions"][0]
    assert pos.via_super is nn.Embedding
    engine.close()


class AddLinear(nn.Linear):
    """Adds one to its product, computed without super().forward."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + 1.0


class MyScaledEmbedding(nn.Embedding):
    """Gemma's transform under a name dpclip does not know."""

    def forward(self, x):
        return super().forward(x) * 4.0


def test_unknown_subclasses_refused_by_name(daemon):
    torch.manual_seed(3)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = MyScaledEmbedding(12, 8, padding_idx=0)
            self.head = nn.Linear(8, 12, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.embed(x))

    for model, name, cls, base in (
            (Tied(), "embed", "MyScaledEmbedding", "Embedding"),  # tied: hid before
            (nn.Sequential(nn.Linear(4, 4), AddLinear(4, 3)), "1", "AddLinear", "Linear")):
        with pytest.raises(UnsupportedModuleError) as ei:
            PrivacyEngine(daemon.socket, allow_insecure_seed=True).make_private(
                module=model, noise_multiplier=0.0, max_grad_norm=1.0)
        msg = str(ei.value)
        assert "module %s (%s) subclasses nn.%s" % (name, cls, base) in msg, msg
        assert "dpclip.torch.register(%s, kind='subclass')" % cls in msg, msg
    # frozen, a subclass trains nothing: fine
    model = nn.Sequential(nn.Linear(4, 4), AddLinear(4, 3))
    model[1].requires_grad_(False)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    engine.make_private(module=model, noise_multiplier=0.0, max_grad_norm=1.0)
    assert [l.name for l in engine._layers] == ["0"]
    engine.close()


def test_registered_subclass_that_bypasses_super_refused(daemon):
    """A subclass registered as kind="subclass" whose forward uses the
    weight itself: autograd's gradient of it is refused at step() (the
    first-step check sees dpclip's layer capture nothing for it), nothing
    updated."""
    register(AddLinear, kind="subclass")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), AddLinear(4, 3))
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum")
    before = copy.deepcopy(model.state_dict())
    model(torch.randn(B, 4)).sum().backward()
    with pytest.raises((RuntimeError, ValueError), match=r"2\.weight"):
        opt.step()
    for n, v in model.state_dict().items():
        assert torch.equal(v, before[n]), n
    engine.close()


def test_register_subclass_needs_a_supported_base():
    class NotALayer(nn.Module):
        pass

    with pytest.raises(ValueError, match="kind='subclass'"):
        register(NotALayer, kind="subclass")
    with pytest.raises(ValueError, match="kind='same'"):
        register(NotALayer, kind="same")


class MatmulLinear(nn.Linear):
    """transformers' FalconLinear: nn.Linear's function in code of its own."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return 2 * (x @ self.weight.T) + self.bias


def test_same_function_subclass_exact(daemon):
    """Registered kind="same", a subclass whose forward computes its base's
    function is trained as the base, exact against the f64 reference; one
    whose forward computes something else is refused at its first
    forward, naming it, before anything is sent."""
    register(MatmulLinear, kind="same")
    torch.manual_seed(5)
    inputs, y, V = prose(B, T, seed=2)
    model = nn.Sequential(nn.Embedding(V, 8), MatmulLinear(8, 8), nn.Tanh(), nn.Linear(8, V))
    engine = _exact(daemon, model, inputs, y)
    assert {l.name: l for l in engine._layers}["1"].what.startswith("an nn.Linear")
    engine.close()
    register(DoubledLinear, kind="same")
    model = nn.Sequential(nn.Embedding(V, 8), DoubledLinear(8, 8), nn.Tanh(), nn.Linear(8, V))
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=B)
    with pytest.raises(UnsupportedModuleError, match=r"module 1 \(DoubledLinear\)"):
        model(*inputs)
    engine.close()
