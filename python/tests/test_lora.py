"""LoRA / PEFT adapters: frozen base layers with trainable low-rank Linear
adapters (peft's lora.Linear structure, reproduced: the suite has no peft).
Only the adapters are sent to the daemon, their gradients match the
per-sample reference, and the frozen base layers are left as they are
(their forwards not replaced, nothing captured: autograd computes only
their input gradients)."""
import copy

import torch

from dpclip.torch import PrivacyEngine, reduce_loss
from models import (Conv1D, GPT2Like, LlamaLike, lorafy as _lorafy,
                    per_sample_losses, prose, reference)

B, T = 5, 10


def _check(daemon, model, inputs, y):
    base = {n: m for n, m in model.named_modules() if not any(
        p.requires_grad for p in m.parameters(recurse=False)) and
        any(True for _ in m.parameters(recurse=False))}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    want, norms, coefs = reference(copy.deepcopy(model), "seq", inputs, y, 0.02, "sum", 1)
    assert (coefs < 1).all()
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
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
