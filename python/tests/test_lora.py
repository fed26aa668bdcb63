"""LoRA / PEFT adapters: frozen base layers with trainable low-rank Linear
adapters (peft's lora.Linear structure, reproduced: the suite has no peft).
Only the adapters are sent to the daemon, their gradients match the
per-sample reference, and the frozen base layers are left as they are
(their forwards not replaced, nothing captured: autograd computes only
their input gradients)."""
import copy

import torch
import torch.nn as nn

from dpclip.torch import PrivacyEngine, reduce_loss
from models import Conv1D, GPT2Like, LlamaLike, per_sample_losses, prose, reference

B, T = 5, 10


class LoraLinear(nn.Module):
    """peft.tuners.lora.Linear's structure: base_layer, and per adapter a
    dropout, lora_A (in -> r) and lora_B (r -> out) Linears and a scaling."""

    def __init__(self, base, r=3, alpha=6, fan_in_fan_out=False):
        super().__init__()
        self.base_layer = base
        w = base.weight
        n_in, n_out = (w.shape[0], w.shape[1]) if fan_in_fan_out else (w.shape[1], w.shape[0])
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(n_in, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, n_out, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.3)  # peft starts it at 0
        self.scaling = {"default": alpha / r}

    def forward(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)
        for a in self.lora_A:
            result = result + self.lora_B[a](self.lora_A[a](self.lora_dropout[a](x))) * \
                self.scaling[a]
        return result


def _lorafy(model, names, **kw):
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, LoraLinear(getattr(holder, child), **kw))
    return model


def _check(daemon, model, inputs, y):
    base = {n: m for n, m in model.named_modules() if not any(
        p.requires_grad for p in m.parameters(recurse=False)) and
        any(True for _ in m.parameters(recurse=False))}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    want, norms, coefs = reference(copy.deepcopy(model), "seq", inputs, y, 0.02, "sum", 1)
    assert (coefs < 1).all()
    engine = PrivacyEngine(daemon.socket)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                        max_grad_norm=0.02, loss_reduction="sum")
    assert sorted(l.name for l in engine._layers) == sorted(
        n.rpartition(".")[0] for n in trainable)
    assert all("forward" not in m.__dict__ for m in base.values())  # frozen: untouched
    reduce_loss(per_sample_losses("seq", model(*inputs), y), "sum").backward()
    opt.step()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        err = float((p.grad.double() - want[n]).abs().max()) / float(want[n].abs().max())
        assert err < 2e-4, (n, err)
    assert float(((engine.last_norms.double() - norms).abs() / norms).max()) < 1e-4
    engine.close()


def test_lora_on_llama_like(daemon):
    torch.manual_seed(0)
    inputs, y, V = prose(B, T)
    model = _lorafy(LlamaLike(V, tied=True), ["q_proj", "v_proj", "down_proj"])
    _check(daemon, model, inputs, y)


def test_lora_on_conv1d_fan_in_fan_out(daemon):
    """GPT-2's Conv1D (weight [in, out]) as the frozen base, as peft wraps
    it with fan_in_fan_out; the tied embedding frozen too."""
    torch.manual_seed(1)
    inputs, y, V = prose(B, T, seed=1)
    model = GPT2Like(V, T=T)
    model = _lorafy(model, ["h.0.c_attn", "h.1.c_fc"], fan_in_fan_out=True)
    assert isinstance(model.h[0].c_attn.base_layer, Conv1D)
    _check(daemon, model, inputs, y)
