"""dpclip.torch.register: normalization layers of other libraries trained
as RMSNorm / LayerNorm, by class or by class name (Hugging Face's are
registered by name), the first-step check of what a registered module
computes, and the hints for modules that are not registered."""
import copy

import pytest
import torch
import torch.nn as nn

from dpclip.torch import PrivacyEngine, UnsupportedModuleError, reduce_loss, register
from dpclip import _registry
from models import per_sample_losses, prose, reference

B, T = 5, 10


class ScaleNorm(nn.Module):
    """An RMSNorm with its own names: scale, epsilon."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.2 * torch.randn(d))
        self.epsilon = 1e-5

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon) * self.scale


class OffsetRMSNorm(nn.Module):
    """Gemma's form: scaled by (1 + weight), eps in eps."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(0.2 * torch.randn(d))
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class CenteredNorm(nn.Module):
    """A LayerNorm with a gain g and shift s."""

    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(1 + 0.2 * torch.randn(d))
        self.s = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.g + self.s


class T5LayerNorm(nn.Module):
    """transformers' T5LayerNorm (registered by name in dpclip)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.2 * torch.randn(d))
        self.variance_epsilon = 1e-6

    def forward(self, h):
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


class Net(nn.Module):
    def __init__(self, V, norm, d=12):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc = nn.Linear(d, d)
        self.norm = norm
        self.head = nn.Linear(d, V)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.fc(self.emb(x)))))


def _run(daemon, model, inputs, y):
    plain = copy.deepcopy(model)
    want, ref_norms, coefs = reference(plain, "seq", inputs, y, 0.05, "sum", 1)
    assert (coefs < 1).all()
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.05,
        loss_reduction="sum")
    reduce_loss(per_sample_losses("seq", model(*inputs), y), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        err = float((p.grad.double() - want[n]).abs().max()) / float(want[n].abs().max())
        assert err < 2e-4, n
    assert float((engine.last_norms.double() - ref_norms).abs().max()) < 1e-4 * float(
        ref_norms.max())
    return engine


@pytest.mark.parametrize("cls,kw", [
    (ScaleNorm, dict(kind="rmsnorm", weight="scale", eps="epsilon")),
    (OffsetRMSNorm, dict(kind="rmsnorm", eps="eps", weight_offset=1.0)),
    (CenteredNorm, dict(kind="layernorm", weight="g", bias="s", eps=1e-5)),
])
def test_registered_class_trains(daemon, cls, kw):
    torch.manual_seed(0)
    inputs, y, V = prose(B, T)
    register(cls, **kw)
    engine = _run(daemon, Net(V, cls(12)), inputs, y)
    (norm,) = [l for l in engine._layers if l.name == "norm"]
    assert norm.kind == kw["kind"]
    engine.close()


class NormFirst(nn.Module):
    """The norm applied to the input features themselves, which need no
    gradient: its output needs one only through its weight."""

    def __init__(self, V, norm, d=12):
        super().__init__()
        self.norm = norm
        self.head = nn.Linear(d, V)

    def forward(self, x):
        return self.head(self.norm(x))


def test_rmsnorm_of_the_input_itself(daemon):
    torch.manual_seed(0)
    _, y, V = prose(B, T)
    register(ScaleNorm, kind="rmsnorm", weight="scale", eps="epsilon")
    _run(daemon, NormFirst(V, ScaleNorm(12)), (torch.randn(B, T, 12),), y).close()


def test_hugging_face_names_registered(daemon):
    """T5LayerNorm, by its name alone (no class object registered)."""
    torch.manual_seed(1)
    inputs, y, V = prose(B, T, seed=1)
    assert _registry.registered(T5LayerNorm)["kind"] == "rmsnorm"
    for name in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "T5LayerNorm",
                 "GemmaRMSNorm"):
        assert name in _registry._by_name, name
    _run(daemon, Net(V, T5LayerNorm(12)), inputs, y).close()


def test_registered_as_what_it_does_not_compute_is_refused(daemon):
    """A LayerNorm-like class registered as an RMSNorm: its first training
    forward compares the module's own output with the formula and refuses,
    naming the module and the kind."""

    class Mislabelled(CenteredNorm):
        pass

    register(Mislabelled, kind="rmsnorm", weight="g", eps=1e-5)
    torch.manual_seed(2)
    inputs, y, V = prose(B, T, seed=2)
    model = Net(V, Mislabelled(12))
    # (trainable, the shift an rmsnorm has no place for is refused at
    # make_private already: test_fail_closed)
    model.norm.s.requires_grad_(False)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    engine.make_private(module=model, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=B)
    with pytest.raises(UnsupportedModuleError) as ei:
        model(*inputs)
    msg = str(ei.value)
    assert "norm (Mislabelled)" in msg and "rmsnorm" in msg and "something else" in msg
    # outside training (no grad), the module's own forward runs: nothing to check
    with torch.no_grad():
        assert model(*inputs).shape == (B, T, V)
    engine.close()


def test_registration_errors(daemon):
    with pytest.raises(ValueError, match="kind"):
        register(ScaleNorm, kind="batchnorm")
    with pytest.raises(ValueError, match="bias"):
        register(ScaleNorm, kind="rmsnorm", bias="b")
    with pytest.raises(ValueError, match="cls"):
        register(42, kind="rmsnorm")

    class Unnamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    register(Unnamed, kind="rmsnorm", eps="nope")
    with pytest.raises(UnsupportedModuleError, match="eps='nope'"):
        PrivacyEngine(daemon.socket, allow_insecure_seed=True).make_private(
            module=nn.Sequential(Unnamed()), noise_multiplier=0.0, max_grad_norm=1.0)


def test_unregistered_norm_hint(daemon):
    class MyRMSNorm(ScaleNorm):
        pass

    with pytest.raises(UnsupportedModuleError, match=r"dpclip.torch.register\(MyRMSNorm"):
        PrivacyEngine(daemon.socket, allow_insecure_seed=True).make_private(
            module=nn.Sequential(MyRMSNorm(4)), noise_multiplier=0.0, max_grad_norm=1.0)


def test_check_allows_autocast_precision(daemon):
    """Under bf16 autocast the norm's input is bf16: the replacement runs in
    f32, LlamaRMSNorm's own forward rounds to bf16, and the check compares
    them at bf16's precision (not refused)."""
    from models import LlamaRMSNorm
    torch.manual_seed(4)
    inputs, y, V = prose(B, T, seed=4)
    model = Net(V, LlamaRMSNorm(12))
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
        loss_reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(*inputs)
    reduce_loss(per_sample_losses("seq", out.float(), y), "sum").backward()
    opt.step()
    assert model.norm.weight.grad is not None and float(model.norm.weight.grad.abs().sum()) > 0
    engine.close()
