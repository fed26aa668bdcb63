"""The first-step check (dpclip._verify): a module whose replacement
computes something else, or whose per-sample gradient rule differs from
autograd's through the module's own code, is refused by name before
anything is sent or updated; make_private(check_first_step=False) turns it
off; it runs once per layer.

The faults are injected into dpclip's own layers (a replacement forward
that drops the bias; a capture that loses the embedding's output scale, as
the GemmaTextScaledWordEmbedding bug of issue 38 did): the package before
the check trained through both without a word."""
import copy

import pytest
import torch
import torch.nn as nn

from dpclip import _layers, _verify
from dpclip.torch import PrivacyEngine, UnsupportedModuleError, reduce_loss
from models import GemmaLike, per_sample_losses, prose

B, T = 5, 8


def _engine(daemon, model, **kw):
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", **kw)
    return engine, model, opt


def _gemma(seed=0):
    torch.manual_seed(seed)
    inputs, y, V = prose(B, T, seed=seed)
    model = GemmaLike(V)
    model.down_proj = nn.Linear(24, 16)  # no registration needed
    return model, inputs, y


def test_replacement_that_computes_something_else_refused_at_forward(daemon, monkeypatch):
    real = _layers._LinearFn.forward

    def no_bias(ctx, x, weight, bias, layer):  # a replacement that drops the bias
        return real(ctx, x, weight, None, layer)

    monkeypatch.setattr(_layers._LinearFn, "forward", staticmethod(no_bias))
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    nn.init.normal_(model[0].bias)
    engine, model, opt = _engine(daemon, model)
    with pytest.raises(UnsupportedModuleError) as ei:
        model(torch.randn(B, 4))
    msg = str(ei.value)
    assert "module 0 (Linear)" in msg and "computes something else" in msg, msg
    engine.close()


def _lose_embedding_scale(monkeypatch):
    """The embedding's capture sees the gradient w.r.t. the scaled output,
    not w.r.t. the lookup: the scale is missing from the norms and sums."""
    real = _layers._Layer.capture

    def capture(self, inp, g, pass_id):
        if isinstance(self, _layers._EmbeddingLayer) and self.name == "embed_tokens":
            g = g / float(self.module.embed_scale)
        real(self, inp, g, pass_id)

    monkeypatch.setattr(_layers._Layer, "capture", capture)


def test_wrong_per_sample_rule_refused_at_first_step(daemon, monkeypatch):
    _lose_embedding_scale(monkeypatch)
    model, inputs, y = _gemma()
    engine, model, opt = _engine(daemon, model)
    before = copy.deepcopy(model.state_dict())
    reduce_loss(per_sample_losses("seq", model(*inputs), y), "sum").backward()
    with pytest.raises(UnsupportedModuleError) as ei:
        opt.step()
    msg = str(ei.value)
    assert "module embed_tokens (GemmaTextScaledWordEmbedding)" in msg, msg
    assert "parameter embed_tokens.weight" in msg and "per-sample gradient" in msg, msg
    assert "Nothing was sent" in msg
    # nothing released: no daemon step, no parameter moved
    assert engine.steps == 0 and engine.last_norms is None
    for n, v in model.state_dict().items():
        assert torch.equal(v, before[n]), n
    engine.close()


def test_check_can_be_turned_off(daemon, monkeypatch):
    """check_first_step=False: the same faulty rule trains (the check was
    what refused it)."""
    _lose_embedding_scale(monkeypatch)
    model, inputs, y = _gemma()
    engine, model, opt = _engine(daemon, model, check_first_step=False)
    reduce_loss(per_sample_losses("seq", model(*inputs), y), "sum").backward()
    opt.step()
    assert engine.steps == 1
    engine.close()


def test_check_runs_once_per_layer(daemon, monkeypatch):
    """Every layer is checked at the first step that captured it, and only
    then; a layer unused at first is checked when first used."""
    calls = []
    real = _verify._reference_grads
    monkeypatch.setattr(_verify, "_reference_grads",
                        lambda layer, *a: calls.append(layer.name) or real(layer, *a))

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 6)
            self.ln = nn.LayerNorm(6)
            self.a = nn.Linear(6, 2)
            self.b = nn.Linear(6, 2)

        def forward(self, x, head):
            return getattr(self, head)(self.ln(torch.tanh(self.body(x))))

    engine, model, opt = _engine(daemon, TwoHeads())
    for head, want in (("a", ["body", "ln", "a"]), ("a", []), ("b", ["b"]), ("b", [])):
        opt.zero_grad()
        model(torch.randn(B, 4), head).sum().backward()
        opt.step()
        assert calls == want, (head, calls)
        calls.clear()
    assert all(l.verify is None for l in engine._layers)
    engine.close()


def test_subclass_trained_as_its_base_is_caught(daemon, monkeypatch):
    """Had the classification regressed to training a subclass as its base
    class (the issue's bug), the check refuses the scaled embedding at its
    first forward, by name."""
    from dpclip import _registry
    monkeypatch.setattr(_registry, "_subclass",
                        lambda engine, name, m, base: _registry._as_base(engine, name, m, base))
    model, inputs, _ = _gemma()
    engine, model, opt = _engine(daemon, model)
    with pytest.raises(UnsupportedModuleError,
                       match=r"embed_tokens \(GemmaTextScaledWordEmbedding\).*something else"):
        model(*inputs)
    engine.close()


def _suite_models():
    """(name, model, inputs, per-sample loss) of every structure the suite
    trains: each layer kind, ties, positions shared by the batch, Conv1D,
    registered norms, convolutions (grouped too) and affine norms, the
    attention drop-in with bias_k/v, LoRA adapters."""
    from models import (BertLike, FlatModel, GPT2Like, LlamaLike, SeqModel, flat_data, lorafy,
                        seq_data)
    from test_conv import _net
    from test_mha import Attn
    torch.manual_seed(5)
    (x,), y, V = prose(B, T, seed=5)

    def seq(out, yy=y):
        return per_sample_losses("seq", out, yy)

    sx, sy = seq_data(B)
    fx, fy = flat_data(B)
    img = torch.randn(B, 4, 6, 6)
    yield "seq", SeqModel(), sx, lambda o: per_sample_losses("seq", o, sy)
    yield "flat", FlatModel(), fx, lambda o: per_sample_losses("flat", o, fy)
    yield "gpt2", GPT2Like(V, T=T), (x,), seq
    yield "llama", LlamaLike(V), (x,), seq
    yield "bert", BertLike(V, T=T), (x,), seq
    yield "conv", _net(nn.Conv2d(4, 4, 3, groups=2), (4, 6, 6), nn.GroupNorm(2, 4)), (img,), \
        lambda o: o.pow(2).sum(1)
    yield "mha", Attn(V, add_bias_kv=True), (x,), seq
    yield "lora", lorafy(LlamaLike(V), ["q_proj", "down_proj"]), (x,), seq


@pytest.mark.parametrize("which", ["seq", "flat", "gpt2", "llama", "bert", "conv", "mha",
                                   "lora"])
def test_every_layer_of_the_suites_models_checked(daemon, monkeypatch, which):
    """On every model structure the suite trains, the check runs on each
    layer at the first step (and accepts it: dpclip is exact there)."""
    calls = []
    real = _verify._reference_grads
    monkeypatch.setattr(_verify, "_reference_grads",
                        lambda layer, *a: calls.append(layer.name) or real(layer, *a))
    _, model, inputs, losses = [m for m in _suite_models() if m[0] == which][0]
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=0.1),
        noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum",
        replace_mha=(which == "mha"))
    losses(model(*inputs)).sum().backward()
    opt.step()
    assert sorted(calls) == sorted(l.name for l in engine._layers), calls
    assert all(l.verify is None for l in engine._layers)
    engine.close()


def test_attention_drop_in_checked_against_what_it_replaced(daemon, monkeypatch):
    """replace_mha: each DPMultiheadAttention is compared, at its first
    training forward, with the nn.MultiheadAttention it replaced; a drop-in
    that computes something else is refused by name."""
    from dpclip.torch import DPMultiheadAttention
    from test_mha import Attn
    torch.manual_seed(6)
    (x,), y, V = prose(B, T, seed=6)
    for faulty in (False, True):
        if faulty:
            real = DPMultiheadAttention._attend
            monkeypatch.setattr(DPMultiheadAttention, "_attend",
                                lambda self, *a, **k: (real(self, *a, **k)[0] * 1.01, None))
        model = Attn(V, dropout=0.1)  # the comparison runs in eval mode: no dropout
        engine, model, opt = _engine(daemon, model, replace_mha=True)
        assert model.attn._dp[6] is not None
        if faulty:
            with pytest.raises(UnsupportedModuleError,
                               match=r"attn \(DPMultiheadAttention\) replaced an nn.Multi"):
                model(x)
        else:
            per_sample_losses("seq", model(x), y).sum().backward()
            assert model.attn._dp[6] is None  # checked, once
            opt.step()
        engine.close()
