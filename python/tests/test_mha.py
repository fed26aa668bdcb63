"""dpclip._mha: DPMultiheadAttention computes nn.MultiheadAttention's
function with its parameters under their names, and trains through dpclip
(make_private(..., replace_mha=True)) against the per-sample reference."""
import copy

import pytest
import torch
import torch.nn as nn

from dpclip.torch import (DPMultiheadAttention, PrivacyEngine, UnsupportedModuleError,
                          reduce_loss, replace_mha)
from models import per_sample_losses, prose, reference

B, T = 5, 9

CONFIGS = [
    dict(),
    dict(batch_first=True),
    dict(bias=False, dropout=0.0),
    dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
    dict(kdim=6, vdim=10, batch_first=True),
]


@pytest.mark.parametrize("kw", CONFIGS)
def test_same_function_and_names(kw):
    """Outputs and attention weights match nn.MultiheadAttention's (masks,
    key padding, averaged or per-head weights), and the state_dict keys are
    the same."""
    torch.manual_seed(0)
    E, H = 8, 2
    mha = nn.MultiheadAttention(E, H, **kw).eval()
    dp = DPMultiheadAttention.from_module(mha)
    assert list(dp.state_dict()) == list(mha.state_dict())
    assert all(p is q for p, q in zip(dp.parameters(), mha.parameters()))
    bf = kw.get("batch_first", False)
    L, S = 4, 6

    def seq(n, d):
        return torch.randn(B, n, d) if bf else torch.randn(n, B, d)

    q = seq(L, E)
    k, v = seq(S, kw.get("kdim") or E), seq(S, kw.get("vdim") or E)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -2:] = True
    masks = [dict(), dict(key_padding_mask=kpm),
             dict(attn_mask=torch.randn(L, S)),
             dict(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), key_padding_mask=kpm),
             dict(need_weights=True, average_attn_weights=False)]
    for m in masks:
        want = mha(q, k, v, **m)
        got = dp(q, k, v, **m)
        assert torch.allclose(got[0], want[0], atol=1e-5), m
        if want[1] is not None:
            assert torch.allclose(got[1], want[1], atol=1e-5), m


def test_unbatched_input():
    mha = nn.MultiheadAttention(8, 2).eval()
    dp = DPMultiheadAttention.from_module(mha)
    x = torch.randn(4, 8)
    assert torch.allclose(dp(x, x, x)[0], mha(x, x, x)[0], atol=1e-5)


class Attn(nn.Module):
    def __init__(self, V, E=12, cross=False, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.attn = nn.MultiheadAttention(E, 3, batch_first=True, **kw)
        self.cross = cross
        self.head = nn.Linear(E, V)

    def forward(self, x):
        h = self.emb(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        kv = torch.flip(h, [1]) if self.cross else h
        a, _ = self.attn(h, kv, kv, attn_mask=mask, need_weights=False)
        return self.head(torch.tanh(h + a))


@pytest.mark.parametrize("kw", [dict(), dict(cross=True), dict(add_bias_kv=True)])
def test_trains_against_reference(daemon, kw):
    torch.manual_seed(1)
    inputs, y, V = prose(B, T, seed=1)
    model = Attn(V, **kw)
    params = list(model.parameters())
    want, norms, coefs = reference(copy.deepcopy(model), "seq", inputs, y, 0.03, "sum", 1)
    assert (coefs < 1).all()
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                        max_grad_norm=0.03, loss_reduction="sum",
                                        replace_mha=True)
    assert type(model.attn) is DPMultiheadAttention
    assert list(model.parameters()) == params  # the optimizer's parameter objects
    reduce_loss(per_sample_losses("seq", model(*inputs), y), "sum").backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    for n, p in model.named_parameters():
        err = float((p.grad.double() - want[n]).abs().max()) / float(want[n].abs().max())
        assert err < 2e-4, (n, err)
    assert float(((engine.last_norms.double() - norms).abs() / norms).max()) < 1e-4
    names = [l.name for l in engine._layers]
    assert "attn.q_proj" in names and "attn.out_proj" in names
    engine.close()


def test_refused_without_replace_and_copyable(daemon):
    torch.manual_seed(2)
    _, _, V = prose(2, 4)
    model = Attn(V)
    with pytest.raises(UnsupportedModuleError, match="replace_mha=True"):
        PrivacyEngine(daemon.socket, allow_insecure_seed=True).make_private(
            module=model, noise_multiplier=0.0, max_grad_norm=1.0)
    assert replace_mha(model) == 1 and replace_mha(model) == 0
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    engine.make_private(module=model, noise_multiplier=0.0, max_grad_norm=1.0)
    clone = copy.deepcopy(model)  # never copies the engine
    assert all(s is None for s in clone.attn._dp)
    x = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        assert torch.allclose(clone(x), model(x))
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda(daemon):
    """DPMultiheadAttention on the GPU (the CUDA transport) against the
    reference of a CPU copy."""
    torch.manual_seed(3)
    inputs, y, V = prose(B, T, seed=3)
    model = Attn(V, cross=True)
    want, _, _ = reference(copy.deepcopy(model), "seq", inputs, y, 0.03, "sum", 1)
    model = model.cuda()
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.03,
        loss_reduction="sum", replace_mha=True)
    reduce_loss(per_sample_losses("seq", model(inputs[0].cuda()), y.cuda()), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        err = float((p.grad.double().cpu() - want[n]).abs().max()) / float(want[n].abs().max())
        assert err < 5e-3, (n, err)
    engine.close()
