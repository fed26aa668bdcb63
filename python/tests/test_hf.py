"""Real Hugging Face models train unmodified (the GPU machine: transformers
5 and torch 2.x with torch.func; skipped where either is missing).

GPT2LMHeadModel (Conv1D, positions broadcast over the batch, lm_head tied
to wte), LlamaForCausalLM tied and untied (LlamaRMSNorm by its registered
name) and BertForMaskedLM (decoder tied to the word embeddings, its bias a
parameter of the prediction head), built from small configs (no download),
plus LoRA adapters on the Llama model. A few private steps each without
noise, on the GPU when there is one (the daemon's CUDA backend, TF32 for
f32 products: hence 5e-3), else on the CPU; after every step each
param.grad is checked against a per-sample f32 reference from torch.func
(functional_call and grad, one sample at a time, on a copy of the model
that dpclip does not touch), clipped at a threshold between the middle
per-sample norms and summed."""
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
func = pytest.importorskip("torch.func")

from dpclip.torch import PrivacyEngine  # noqa: E402
from models import lorafy, prose  # noqa: E402

B, T = 4, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 5e-3 if DEVICE == "cuda" else 5e-4


def _eager(config):
    """Eager attention: the reference differentiates the same function."""
    config._attn_implementation = "eager"
    return config


def gpt2(V):
    c = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(_eager(c))


def llama(V, tied):
    c = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=T,
                                 tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(_eager(c))


def bert(V):
    c = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=48,
                                max_position_embeddings=T, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.BertForMaskedLM(_eager(c))


def _losses(model, x, y):
    """Each sample's mean token cross-entropy of the model's logits."""
    logits = model(input_ids=x).logits
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                          reduction="none")
    return tok.view(y.shape).mean(1)


def _per_sample(ref, x, y):
    """Per-sample gradients {name: [B, ...]} of the trainable parameters of
    ref (tied ones once, under their first name), one sample at a time."""
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in ref.named_parameters() if not p.requires_grad}
    buffers = dict(ref.named_buffers())

    def loss(ps, xb, yb):
        state = {**frozen, **buffers, **ps}
        out = func.functional_call(ref, state, (), {"input_ids": xb}, tie_weights=True)
        logits = out.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), yb.reshape(-1))

    grads = [func.grad(loss)(params, x[b:b + 1], y[b:b + 1]) for b in range(x.shape[0])]
    return {n: torch.stack([g[n] for g in grads]) for n in names}


def _reference(ref, x, y, C):
    per = _per_sample(ref, x, y)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))
    coefs = torch.clamp(C / (norms + 1e-6), max=1.0)
    return {n: torch.einsum("b,b...->...", coefs, g) for n, g in per.items()}, norms


def _train(daemon, model, steps=3, lr=0.05, seed=0):
    torch.manual_seed(seed)
    (x,), y, V = prose(B, T, seed=seed)
    x, y = x.to(DEVICE), y.to(DEVICE)
    model = model.to(DEVICE).train()
    ref = copy.deepcopy(model)  # dpclip never touches it
    _, n0 = _reference(ref, x, y, 1e9)
    s = sorted(n0.tolist())
    C = 0.5 * (s[B // 2 - 1] + s[B // 2])
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                        max_grad_norm=C, loss_reduction="sum")
    for it in range(steps):
        ref.load_state_dict(model.state_dict())
        want, norms = _reference(ref, x, y, C)
        opt.zero_grad()
        _losses(model, x, y).sum().backward()
        opt.step()
        floor = 1e-3 * max(float(w.abs().max()) for w in want.values())
        named = dict(model.named_parameters())
        for n, w in want.items():
            g = named[n].grad
            assert g is not None, n
            err = float((g.float() - w).abs().max()) / max(float(w.abs().max()), floor)
            assert err < RTOL, (it, n, err)
        got = engine.last_norms.to(norms.device)
        assert float(((got - norms).abs() / norms).max()) < RTOL, it
    return engine


def test_gpt2(daemon):
    _, _, V = prose(1, 1)
    model = gpt2(V)
    assert model.lm_head.weight is model.transformer.wte.weight
    engine = _train(daemon, model)
    kinds = {type(l).__name__ for l in engine._layers}
    assert "_HFConv1DLayer" in kinds
    assert [l.name for l in engine._layers if l.tie is not None] == ["lm_head"]
    engine.close()


@pytest.mark.parametrize("tied", [True, False])
def test_llama(daemon, tied):
    _, _, V = prose(1, 1)
    model = llama(V, tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    engine = _train(daemon, model, seed=1)
    assert any(l.kind == "rmsnorm" for l in engine._layers)
    engine.close()


def test_bert(daemon):
    _, _, V = prose(1, 1)
    model = bert(V)
    engine = _train(daemon, model, seed=2)
    assert any(l.tie is not None for l in engine._layers)
    engine.close()


def test_llama_lora(daemon):
    """LoRA on q_proj and v_proj of every layer, the rest frozen: peft's
    adapters where peft is installed, else models.LoraLinear (its
    structure). Only the adapters are trained and sent."""
    _, _, V = prose(1, 1)
    model = llama(V, True)
    try:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights="gaussian"))
    except ImportError:
        names = [n for n, _ in model.named_modules() if n.endswith(("q_proj", "v_proj"))]
        model = lorafy(model, names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    engine = _train(daemon, model, seed=3)
    assert all("lora_" in l.name for l in engine._layers)
    engine.close()
