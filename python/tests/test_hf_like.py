"""Hugging Face's structures without transformers (models.py reproduces
them): Conv1D recognised by its structure, LlamaRMSNorm by its registered
name, tied input and output embeddings, positions broadcast over the batch
and a prediction head that owns its decoder's bias. Each against the
explicit per-sample reference (f64), on windows of the prose in
examples/data."""
import copy

import pytest
import torch
import torch.nn as nn

from dpclip.torch import PrivacyEngine, UnsupportedModuleError, reduce_loss
from models import (BertLike, Conv1D, GPT2Like, LlamaLike, per_sample_losses, prose,
                    reference)
from models import between as _between, max_rel as _max_rel

B, T = 6, 12


def _check_step(daemon, model, inputs, y, reduction="mean", lr=0.0, steps=1):
    """make_private, `steps` steps; after each, every parameter's gradient
    against the reference at the parameters of that step, and the norms.
    C sits between the middle per-sample norms, so that some samples are
    clipped and some are not."""
    _, norms0, _ = reference(model, "seq", inputs, y, 1e9, "sum", 1)
    C = _between(norms0)
    plain = copy.deepcopy(model)  # the reference's model (the engine replaces forwards)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                        max_grad_norm=C, loss_reduction=reduction,
                                        expected_batch_size=B + 1)
    for it in range(steps):
        plain.load_state_dict(model.state_dict())
        want, ref_norms, coefs = reference(plain, "seq", inputs, y, C, reduction, B + 1)
        assert (coefs < 1).any() or it > 0
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", model(*inputs), y), reduction).backward()
        assert all(p.grad is None for p in model.parameters()), "autograd made a weight grad"
        opt.step()
        floor = 1e-4 * max(float(w.abs().max()) for w in want.values())
        for n, p in model.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, n
            assert _max_rel(p.grad, want[n], floor) < 2e-4, (it, n)
        assert _max_rel(engine.last_norms, ref_norms) < 1e-4, it
    return engine


def test_conv1d_by_structure(daemon):
    """transformers' Conv1D (weight [in, out]) trains as a Linear: a model of
    Conv1Ds alone, no transformers import."""
    torch.manual_seed(0)
    inputs, y, V = prose(B, T)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, 12)
            self.fc = Conv1D(20, 12)
            self.out = Conv1D(V, 20)

        def forward(self, x):
            return self.out(torch.tanh(self.fc(self.emb(x))))

    engine = _check_step(daemon, M(), inputs, y, lr=0.3, steps=2)
    assert [l.name for l in engine._layers] == ["emb", "fc", "out"]
    engine.close()


def test_conv1d_lookalike_that_computes_something_else_is_refused(daemon):
    """A module named Conv1D with Conv1D's structure but another forward:
    refused on its first forward, naming it."""

    class Conv1D(nn.Module):  # noqa: F811  (same name, different function)
        def __init__(self):
            super().__init__()
            self.nf = 4
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = nn.Parameter(torch.zeros(4))

        def forward(self, x):
            return torch.relu(x @ self.weight + self.bias)

    model = nn.Sequential(nn.Linear(3, 3), Conv1D())
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    engine.make_private(module=model, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4)
    with pytest.raises(UnsupportedModuleError, match=r"1 \(Conv1D\).*computes something else"):
        model(torch.randn(4, 3) - 2.0)
    engine.close()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_like_tied_lm_head(daemon, reduction):
    """GPT-2's structure: Conv1D projections, positions [1, T] broadcast over
    the batch, lm_head tied to wte (the shared weight's gradient is both
    uses', its norm has their cross term)."""
    torch.manual_seed(1)
    inputs, y, V = prose(B, T, seed=1)
    model = GPT2Like(V, T=T)
    assert model.lm_head.weight is model.wte.weight
    engine = _check_step(daemon, model, inputs, y, reduction, lr=0.5, steps=2)
    tied = [l for l in engine._layers if l.tie is not None]
    assert [l.name for l in tied] == ["lm_head"] and tied[0].tie.name == "wte"
    engine.close()


@pytest.mark.parametrize("tied", [True, False])
def test_llama_like(daemon, tied):
    """Llama's structure: LlamaRMSNorm (registered by class name), bias-free
    Linears, lm_head tied to embed_tokens or not."""
    torch.manual_seed(2)
    inputs, y, V = prose(B, T, seed=2)
    model = LlamaLike(V, tied=tied)
    engine = _check_step(daemon, model, inputs, y, lr=0.5, steps=2)
    kinds = {l.name: l.kind for l in engine._layers}
    assert kinds["input_layernorm"] == "rmsnorm" and kinds["norm"] == "rmsnorm"
    engine.close()


def test_bert_like_embeddings_and_tied_decoder(daemon):
    """BERT's structure: word, position ([1, T] buffer) and token-type
    embeddings, LayerNorms, a decoder tied to the word embeddings whose bias
    is a parameter of the prediction head."""
    torch.manual_seed(3)
    inputs, y, V = prose(B, T, seed=3)
    x = inputs[0].clone()
    x[0, :3] = 0  # padding
    engine = _check_step(daemon, BertLike(V, T=T), (x,), y, lr=0.5, steps=2)
    engine.close()


def test_tied_weights_under_data_parallel_counted_once(daemon):
    """The engine's parameter list (what data parallelism all-reduces) holds
    a tied weight once."""
    from dpclip import _planner
    inputs, y, V = prose(2, 4)
    model = GPT2Like(V, T=4)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    engine.make_private(module=model, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=2)
    ps = _planner.params(engine._layers)
    assert len(ps) == len({id(p) for p in ps}) == len(list(model.parameters()))
    engine.close()


def test_gpt2_example_without_transformers_says_so(tmp_path):
    """examples/train_hf_gpt2.py needs transformers: where it cannot be
    imported, the example exits with status 2 and says so (a stand-in
    module that fails to import hides an installed one)."""
    import os
    import subprocess
    import sys
    from conftest import REPO
    (tmp_path / "transformers.py").write_text("raise ImportError('hidden by the test')\n")
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_hf_gpt2.py")],
                       env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "needs transformers" in p.stderr
