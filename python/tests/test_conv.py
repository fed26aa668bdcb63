"""dpclip._conv: nn.Conv1d / nn.Conv2d (stride, padding, dilation, groups,
padding modes, 'same', patch embeddings with kernel == stride) and the
per-channel affine norms (GroupNorm, InstanceNorm, BatchNorm in eval mode)
against the explicit per-sample reference."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip.torch import PrivacyEngine, UnsupportedModuleError, reduce_loss
from models import reference

B = 6


def _losses(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _check(daemon, model, x, y, steps=2, lr=0.3):
    """Each step's gradients against the reference (some samples clipped),
    with a learning rate so that the second step starts elsewhere."""
    plain = copy.deepcopy(model)
    _, n0, _ = reference(plain, "flat", (x,), y, 1e9, "sum", 1)
    s = sorted(float(v) for v in n0)
    C = 0.5 * (s[B // 2 - 1] + s[B // 2])
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                        max_grad_norm=C, loss_reduction="mean",
                                        expected_batch_size=B)
    for it in range(steps):
        plain.load_state_dict(model.state_dict())
        want, ref_norms, coefs = reference(plain, "flat", (x,), y, C, "mean", B)
        assert it > 0 or ((coefs < 1).any() and (coefs == 1).any())
        opt.zero_grad()
        reduce_loss(_losses(model(x), y), "mean").backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        # a gradient that is 0 in exact arithmetic (a conv bias before an
        # InstanceNorm) is compared at the scale of the others: its f32
        # rounding residue (2e-7 of the largest gradient under torch 2.15) is
        # no error
        floor = 1e-2 * max(float(w.abs().max()) for w in want.values())
        for n, p in model.named_parameters():
            scale = max(float(want[n].abs().max()), floor)
            err = float((p.grad.double() - want[n]).abs().max()) / scale
            assert err < 2e-4, (it, n, err)
        assert float(((engine.last_norms.double() - ref_norms).abs() / ref_norms).max()) < 1e-4
    return engine


class Conv2dNet(nn.Module):
    def __init__(self, conv, norm=None, classes=5):
        super().__init__()
        self.conv = conv
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, x):
        h = torch.tanh(self.norm(self.conv(x)))
        return self.fc(h.flatten(1))


def _net(conv, shape, norm=None, classes=5):
    """conv (-> norm) -> tanh -> Linear over the flattened features."""
    net = Conv2dNet(conv, norm, classes)
    with torch.no_grad():
        feat = net.norm(conv(torch.zeros((1,) + shape))).numel()
    net.fc = nn.Linear(feat, classes)
    return net


@pytest.mark.parametrize("kw", [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), dilation=2, padding=(2, 1), bias=False),
    dict(kernel_size=3, padding="same", padding_mode="reflect"),
    dict(kernel_size=4, padding="same"),  # asymmetric padding
    dict(kernel_size=2, padding=1, padding_mode="circular"),
    dict(kernel_size=4, stride=4),         # a patch embedding: no unfold
    dict(kernel_size=3, groups=2),         # block-diagonal: per-sample grads
    dict(kernel_size=3, groups=4, stride=2, padding=1),  # depthwise
])
def test_conv2d(daemon, kw):
    torch.manual_seed(0)
    x = torch.randn(B, 4, 8, 8) * torch.linspace(0.3, 2.0, B).view(B, 1, 1, 1)
    y = torch.randint(0, 5, (B,))
    cout = 4 if kw.get("groups") == 4 else 6
    _check(daemon, _net(nn.Conv2d(4, cout, **kw), (4, 8, 8)), x, y).close()


@pytest.mark.parametrize("kw", [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=5, stride=5),
    dict(kernel_size=3, dilation=2, groups=3, padding="same"),
])
def test_conv1d(daemon, kw):
    torch.manual_seed(1)
    x = torch.randn(B, 3, 20) * torch.linspace(0.3, 2.0, B).view(B, 1, 1)
    y = torch.randint(0, 5, (B,))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 6, **kw)
            with torch.no_grad():
                feat = self.conv(torch.zeros(1, 3, 20)).numel()
            self.fc = nn.Linear(feat, 5)

        def forward(self, x):
            return self.fc(torch.tanh(self.conv(x)).flatten(1))

    engine = _check(daemon, Net(), x, y)
    assert [l.kind for l in engine._layers] == ["conv", "linear"]
    engine.close()


def test_patch_embedding_needs_no_unfold(daemon, monkeypatch):
    """kernel == stride: the patches are the input reordered; F.unfold is
    not called."""
    calls = []
    real = F.unfold
    monkeypatch.setattr(F, "unfold", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(2)
    x = torch.randn(B, 3, 8, 8)
    y = torch.randint(0, 5, (B,))
    _check(daemon, _net(nn.Conv2d(3, 8, 4, stride=4), (3, 8, 8)), x, y, steps=1).close()
    assert not calls


@pytest.mark.parametrize("norm", ["group", "instance", "batch_eval"])
def test_affine_norms(daemon, norm):
    torch.manual_seed(3)
    x = torch.randn(B, 4, 6, 6) * torch.linspace(0.3, 2.0, B).view(B, 1, 1, 1) + 0.2
    y = torch.randint(0, 5, (B,))
    if norm == "group":
        n = nn.GroupNorm(2, 6)
    elif norm == "instance":
        n = nn.InstanceNorm2d(6, affine=True)
    else:
        n = nn.BatchNorm2d(6)
        n.running_mean.uniform_(-0.2, 0.2)
        n.running_var.uniform_(0.5, 2.0)
        n.eval()
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
        n.bias.uniform_(-0.3, 0.3)
    model = _net(nn.Conv2d(4, 6, 3, padding=1), (4, 6, 6), norm=n)
    if norm == "batch_eval":
        model.eval()  # dropout-free model; BatchNorm must stay in eval
    engine = _check(daemon, model, x, y)
    assert any(l.kind == "affine" for l in engine._layers)
    engine.close()


def test_batchnorm_in_training_still_refused(daemon):
    model = _net(nn.Conv2d(3, 4, 3), (3, 6, 6), norm=nn.BatchNorm2d(4))
    with pytest.raises(UnsupportedModuleError, match="mixes samples"):
        PrivacyEngine(daemon.socket, allow_insecure_seed=True).make_private(
            module=model, noise_multiplier=0.0, max_grad_norm=1.0)


def test_batchnorm1d_eval_on_features(daemon):
    """BatchNorm1d in eval mode on [B, C] features (no positions to sum)."""
    torch.manual_seed(5)
    x = torch.randn(B, 7) * torch.linspace(0.3, 2.0, B).view(B, 1)
    y = torch.randint(0, 5, (B,))
    bn = nn.BatchNorm1d(9)
    bn.running_mean.uniform_(-0.2, 0.2)
    bn.running_var.uniform_(0.5, 2.0)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.3, 0.3)
    model = nn.Sequential(nn.Linear(7, 9), bn, nn.Tanh(), nn.Linear(9, 5)).eval()
    _check(daemon, model, x, y).close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("groups", [1, 2])
def test_on_cuda(daemon, groups):
    """A convolution (a patch embedding when groups is 1, grouped else), a
    GroupNorm and a head on the GPU (the CUDA transport; TF32 products in
    the daemon), against the reference of a CPU copy."""
    torch.manual_seed(6)
    x = torch.randn(B, 4, 8, 8) * torch.linspace(0.3, 2.0, B).view(B, 1, 1, 1)
    y = torch.randint(0, 5, (B,))
    kw = dict(kernel_size=4, stride=4) if groups == 1 else dict(kernel_size=3, groups=2)
    model = _net(nn.Conv2d(4, 6, **kw), (4, 8, 8), norm=nn.GroupNorm(3, 6))
    want, _, _ = reference(copy.deepcopy(model), "flat", (x,), y, 0.05, "sum", 1)
    model = model.cuda()
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.05,
        loss_reduction="sum")
    reduce_loss(_losses(model(x.cuda()), y.cuda()), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        err = float((p.grad.double().cpu() - want[n]).abs().max()) / float(want[n].abs().max())
        assert err < 5e-3, (n, err)
    engine.close()
