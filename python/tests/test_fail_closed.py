"""Fail closed at step(): every parameter the optimizer updates got its
gradient from this step's daemon output, or step() refuses, naming the
parameter, and nothing moves (issue 38).

Each case runs with sigma = 1e6 and C = 1e-3: a gradient from the daemon
would be noise of std 1e3 (1e3 / B with a mean loss), so a parameter that
moves by lr times its plain autograd gradient (about 1) took a gradient
that was neither clipped nor noised. The package before this check applied
each of these plain gradients."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpclip.torch import PrivacyEngine, UnclippedGradientError, UnsupportedModuleError

SIGMA, C, B = 1e6, 1e-3, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc(self.emb(x).mean(1))))


def _private(daemon, model, opt=None):
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    opt = opt or torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=SIGMA,
                                        max_grad_norm=C, loss_reduction="sum")
    return engine, model, opt


def _x():
    return torch.randint(0, 10, (B, 5), generator=torch.Generator().manual_seed(0))


def _refused(opt, params, match):
    """opt.step() raises UnclippedGradientError matching `match`, and no
    parameter moved."""
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=match) as ei:
        opt.step()
    assert isinstance(ei.value, UnclippedGradientError)
    assert "no parameter was updated" in str(ei.value)
    for b, p in zip(before, params):
        assert torch.equal(b, p.detach())


def test_extra_parameter_on_supported_module_refused_at_make_private(daemon):
    model = Net()
    model.fc.gain = nn.Parameter(torch.ones(6))  # used by the parent, say
    with pytest.raises(UnsupportedModuleError, match=r"fc \(Linear\).*\(gain\)"):
        _private(daemon, model)


def test_extra_parameter_used_by_parent_refused_at_step(daemon):
    """A parameter put on a trained Linear after make_private, used by its
    parent: its gradient is autograd's."""

    class Parent(Net):
        def forward(self, x):
            h = torch.tanh(self.fc(self.emb(x).mean(1)))
            return self.fc2(h * self.fc.gain if hasattr(self.fc, "gain") else h)

    model = Parent()
    engine, model, opt = _private(daemon, model)
    model.fc.gain = nn.Parameter(torch.ones(6))
    opt.add_param_group({"params": [model.fc.gain]})
    F.cross_entropy(model(_x()), torch.zeros(B, dtype=torch.long), reduction="sum").backward()
    assert model.fc.gain.grad is not None and float(model.fc.gain.grad.abs().max()) > 0
    _refused(opt, list(model.parameters()), r"fc\.gain .*did not compute")
    engine.close()


def test_extra_parameter_used_by_forward_hook_refused_at_step(daemon):
    model = Net()
    engine, model, opt = _private(daemon, model)
    model.fc2.scale = nn.Parameter(torch.full((3,), 2.0))
    model.fc2.register_forward_hook(lambda m, i, out: out * m.scale)
    opt.add_param_group({"params": [model.fc2.scale]})
    model(_x()).sum().backward()
    _refused(opt, list(model.parameters()), r"fc2\.scale")
    engine.close()


def test_frozen_at_make_private_then_unfrozen_refused(daemon):
    model = Net()
    model.fc2.requires_grad_(False)
    engine, model, opt = _private(daemon, model)  # the optimizer holds fc2's too
    model.fc2.requires_grad_(True)
    model(_x()).sum().backward()
    assert model.fc2.weight.grad is not None
    _refused(opt, list(model.parameters()), r"fc2\.weight, fc2\.bias")
    engine.close()


def test_optimizer_parameter_outside_module_refused(daemon):
    model = Net()
    temperature = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD(list(model.parameters()) + [temperature], lr=1.0)
    engine, model, opt = _private(daemon, model, opt)
    (model(_x()) / temperature).sum().backward()
    _refused(opt, list(model.parameters()) + [temperature], r"shape \(1,\).*not in the module")
    engine.close()


def test_trained_weight_used_outside_its_module_refused(daemon):
    """emb.weight is trained by the daemon through emb; F.linear(h,
    emb.weight) is a second use autograd differentiates, whose gradient the
    daemon's output would replace (lost, not clipped)."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            return F.linear(torch.tanh(self.fc(self.emb(x))), self.emb.weight)

    model = Tied()
    engine, model, opt = _private(daemon, model)
    model(_x()).sum().backward()
    _refused(opt, list(model.parameters()), r"emb\.weight.*received a gradient from autograd")
    # the refusal is not sticky: after zero_grad, a step without that use is taken
    opt.zero_grad()
    torch.tanh(model.fc(model.emb(_x()))).sum().backward()
    opt.step()
    assert engine.steps == 1
    engine.close()


def test_plain_step_still_taken(daemon):
    """The checks pass an ordinary step: every parameter's gradient is the
    daemon's (noise of std sigma * C here)."""
    model = Net()
    engine, model, opt = _private(daemon, copy.deepcopy(model))
    model(_x()).sum().backward()
    opt.step()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert float(flat.std()) > 100.0  # the noise, not a plain gradient
    engine.close()


def test_hook_called_without_a_gradient_marks_nothing():
    """Newer torches (2.x) call a leaf's tensor hooks with None where a
    backward gave it no gradient, which book-keeping's layers do for every
    weight: that is no use outside the module (on the GPU machine's torch
    2.11 every private step was refused before this). A real gradient still
    marks it."""
    from dpclip._guard import Guard
    p = nn.Parameter(torch.ones(3))
    guard = Guard([p], hooks=False)
    mark = guard._marker(p)  # pylint: disable=protected-access
    mark(None)
    guard.check(None, [p])  # nothing marked, and p is the guard's own
    mark(torch.ones(3))
    with pytest.raises(UnclippedGradientError, match="received a gradient from autograd"):
        guard.check(None, [p])


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)

    def forward(self, x, stray=False):
        h = torch.tanh(self.fc(self.emb(x)))
        return F.linear(h, self.emb.weight) if stray else h


@pytest.mark.parametrize("where", [0, 2])
def test_a_plain_gradient_in_any_micro_batch_refuses_the_logical_step(daemon, where):
    """Gradient accumulation: an autograd gradient into a trained weight in
    one micro-batch of three (the first, already sent, or the last) refuses
    the logical step at step(), naming the parameter; nothing moves."""
    model = _Tied()
    engine, model, opt = _private(daemon, model)
    for k in range(3):
        model(_x(), stray=k == where).sum().backward()
    _refused(opt, list(model.parameters()), r"emb\.weight.*received a gradient from autograd")
    assert engine.steps == 0
    engine.close()


def test_a_foreign_gradient_refuses_the_logical_step(daemon):
    """A parameter the engine does not train holding a gradient at the
    commit of a logical step of two micro-batches: refused by name."""
    model = Net()
    extra = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD(list(model.parameters()) + [extra], lr=1.0)
    engine, model, opt = _private(daemon, model, opt)
    for _ in range(2):
        (model(_x()).sum() + extra.sum()).backward()
    _refused(opt, list(model.parameters()) + [extra], r"hold.*a gradient that dpclip did not")
    engine.close()
