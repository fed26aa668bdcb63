"""transformers' GemmaForCausalLM trains exactly (issue 38): under
transformers 5 its token embedding is GemmaTextScaledWordEmbedding, an
nn.Embedding subclass that scales the lookup by sqrt(hidden), tied to
lm_head, with padding_idx; the package before trained it as a plain
embedding, norms ~30% low and embed_tokens.weight's gradient 71% off.

A tiny model from a config (2 layers, hidden 64, 4 heads, 1 key/value
head, head_dim 16, vocab 256; f32, eager attention), B = 4, sigma 0, flat
clipping, mean loss, C between the middle per-sample norms: the norms and
every param.grad against a per-sample f64 reference on an unmodified copy
(one backward per sample). On the GPU when there is one (the daemon's CUDA
backend multiplies f32 in TF32: hence 5e-3), else on the CPU. Skipped,
saying so, where transformers (with Gemma) cannot be imported."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is not installed: "
                                   "the Gemma test needs it (tests/models.GemmaLike covers "
                                   "the structure without it)")
if not hasattr(transformers, "GemmaForCausalLM"):
    pytest.skip("transformers %s has no GemmaForCausalLM" % transformers.__version__,
                allow_module_level=True)

from dpclip.torch import PrivacyEngine  # noqa: E402

B, T, V = 4, 12, 256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 5e-3 if DEVICE == "cuda" else 5e-4


def gemma():
    c = transformers.GemmaConfig(vocab_size=V, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=16, max_position_embeddings=T,
                                 pad_token_id=0, tie_word_embeddings=True)
    c._attn_implementation = "eager"  # the reference differentiates the same function
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(c)


def _losses(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    tok = F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def _reference(model, x, y, C, expected):
    """{name: clipped, summed, divided gradient}, norms [B]: one backward
    per sample through an f64 copy of the unmodified model."""
    ref = copy.deepcopy(model).double()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    per = []
    for b in range(B):
        loss = _losses(ref, x[b:b + 1], y[b:b + 1]).sum()
        gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        per.append([g if g is not None else torch.zeros_like(p) for g, (_, p) in zip(gs, named)])
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) for gs in per],
                         dtype=torch.float64)
    coefs = torch.clamp(C / (norms + 1e-6), max=1.0)
    want = {n: sum(float(coefs[b]) * per[b][i] for b in range(B)) / expected
            for i, (n, _) in enumerate(named)}
    return want, norms, coefs


def _scaled_embedding(model):
    """transformers 5's embedding where an older transformers has a plain
    nn.Embedding (whose model multiplies by sqrt(hidden) itself: the scale
    then counts twice, the same model for dpclip and the reference)."""
    from models import GemmaTextScaledWordEmbedding
    emb = model.model.embed_tokens
    if type(emb).__name__ != "GemmaTextScaledWordEmbedding":
        new = GemmaTextScaledWordEmbedding(V, 64, 0, embed_scale=64 ** 0.5)
        new.weight = emb.weight
        model.model.embed_tokens = new
    return model


@pytest.mark.parametrize("scaled", [False, True])
def test_gemma_for_causal_lm_exact(daemon, scaled):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = gemma()
    if scaled:
        model = _scaled_embedding(model)
    model = model.to(DEVICE)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, V, (B, T), generator=g)
    x[0, :3] = 0  # padding tokens
    y = torch.randint(0, V, (B, T), generator=g)
    x, y = x.to(DEVICE), y.to(DEVICE)
    _, norms0, _ = _reference(model, x, y, 1e9, 1)
    s = sorted(float(n) for n in norms0)
    C = 0.5 * (s[1] + s[2])
    want, norms, coefs = _reference(model, x, y, C, B)
    assert (coefs < 1).any() and (coefs == 1).any()

    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean", expected_batch_size=B,
        asynchronous=False)
    _losses(model, x, y).mean().backward()
    opt.step()
    got_norms = engine.last_norms.double()
    assert float((got_norms - norms.cpu()).abs().max()) <= RTOL * float(norms.max()), \
        (got_norms.tolist(), norms.tolist())
    for n, p in model.named_parameters():
        w = want[n]
        err = float((p.grad.double() - w).abs().max()) / float(w.abs().max())
        assert err < RTOL, (n, err)
    emb = [l for l in engine._layers if l.name == "model.embed_tokens"][0]
    assert [l.tie for l in engine._layers if l.name == "lm_head"] == [emb]
    if type(model.model.embed_tokens).__name__ == "GemmaTextScaledWordEmbedding":
        assert emb.via_super is torch.nn.Embedding  # through its super().forward
    engine.close()
