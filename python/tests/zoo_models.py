"""The model zoo's architectures (issue 41): Hugging Face models built from
tiny configs (nothing downloaded), each with a batch of B samples and a
per-sample loss, and the float64 per-sample reference test_zoo.py checks
dpclip against.

Every builder returns (model, batch, loss): batch a dict of tensors with the
sample in dimension 0, loss(model, batch) a tensor [B] of per-sample losses
(each sample's mean over its tokens where there are tokens). Tiny configs:
hidden 32, 2 layers, 2-4 heads, vocabulary 128, 8 tokens, eager attention,
every dropout 0. Needs transformers (4.45.x with Debian's torch 1.13)."""
import contextlib
import copy
import math

import torch
import torch.nn.functional as F
import transformers as tf

try:  # PEFT's adapters (scripts/deps.sh installs peft into .venv-zoo beside transformers)
    import peft
except ImportError:
    peft = None

B, T, V, D = 4, 8, 128, 32


def _eager(config):
    """Eager attention: the reference differentiates the same function."""
    config._attn_implementation = "eager"
    return config


def _tokens(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, V, (B, T), generator=g)
    y = torch.randint(3, V, (B, T), generator=g)
    return x, y


def _spread(g, *shape):
    """Gaussian inputs, sample b scaled by 0.5..2: per-sample norms that
    differ, so that clipping at their median clips some and not others."""
    return torch.randn(B, *shape, generator=g) * torch.linspace(0.5, 2.0, B).view(
        B, *([1] * len(shape)))


def seq_ce(logits, y):
    """Each sample's mean token cross-entropy: [B]."""
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return tok.view(y.shape).mean(1)


def lm(make, cache=True):
    """A causal or masked LM on tokens: batch {input_ids, y}."""
    def build():
        torch.manual_seed(0)
        model = make()
        x, y = _tokens(1)
        kw = {"use_cache": False} if cache else {}

        def loss(m, b):
            return seq_ce(m(input_ids=b["input_ids"], **kw).logits, b["y"])
        return model, {"input_ids": x, "y": y}, loss
    return build


def seq2seq(make):
    """An encoder-decoder on tokens: the labels go in (the model shifts them
    into decoder inputs), the loss is the logits' mean token CE."""
    def build():
        torch.manual_seed(0)
        model = make()
        x, y = _tokens(1)

        def loss(m, b):
            out = m(input_ids=b["input_ids"], labels=b["y"], use_cache=False)
            return seq_ce(out.logits, b["y"])
        return model, {"input_ids": x, "y": y}, loss
    return build


_DECODER = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32)
_GQA = dict(_DECODER, num_key_value_heads=2)
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama():
    return tf.LlamaForCausalLM(_eager(tf.LlamaConfig(**_GQA, tie_word_embeddings=False)))


def mistral():
    return tf.MistralForCausalLM(_eager(tf.MistralConfig(**_GQA, sliding_window=None)))


def qwen2(tied):
    return lambda: tf.Qwen2ForCausalLM(_eager(tf.Qwen2Config(
        **_GQA, tie_word_embeddings=tied, use_sliding_window=False)))


def gemma():
    return tf.GemmaForCausalLM(_eager(tf.GemmaConfig(
        **_GQA, **_TOKENS, head_dim=8, hidden_activation="gelu_pytorch_tanh")))


def gemma2():
    return tf.Gemma2ForCausalLM(_eager(tf.Gemma2Config(
        **_GQA, **_TOKENS, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        hidden_activation="gelu_pytorch_tanh")))


def phi():
    return tf.PhiForCausalLM(_eager(tf.PhiConfig(
        **_DECODER, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0)))


def phi3():
    return tf.Phi3ForCausalLM(_eager(tf.Phi3Config(
        **_DECODER, **_TOKENS, num_key_value_heads=4, original_max_position_embeddings=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)))


def gpt2():
    return tf.GPT2LMHeadModel(_eager(tf.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=D, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)))


def gptneox():
    return tf.GPTNeoXForCausalLM(_eager(tf.GPTNeoXConfig(
        **_DECODER, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0)))


def opt():
    return tf.OPTForCausalLM(_eager(tf.OPTConfig(
        vocab_size=V, hidden_size=D, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=D, dropout=0.0, attention_dropout=0.0,
        layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)))


def falcon():
    return tf.FalconForCausalLM(_eager(tf.FalconConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
        alibi=False, bos_token_id=1, eos_token_id=2)))


def bloom():
    return tf.BloomForCausalLM(_eager(tf.BloomConfig(
        vocab_size=V, hidden_size=D, n_layer=2, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0, **_TOKENS)))


_ENCODER = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)


def bert():
    return tf.BertForMaskedLM(_eager(tf.BertConfig(**_ENCODER, pad_token_id=0)))


def roberta():
    return tf.RobertaForMaskedLM(_eager(tf.RobertaConfig(
        **_ENCODER, pad_token_id=1, bos_token_id=0, eos_token_id=2)))


def deberta_v2():
    return tf.DebertaV2ForMaskedLM(_eager(tf.DebertaV2Config(
        **_ENCODER, pad_token_id=0, relative_attention=True, position_buckets=8,
        max_relative_positions=16, pos_att_type=["p2c", "c2p"], position_biased_input=False,
        norm_rel_ebd="layer_norm", share_att_key=True)))


def t5():
    return tf.T5ForConditionalGeneration(_eager(tf.T5Config(
        vocab_size=V, d_model=D, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)))


def bart():
    return tf.BartForConditionalGeneration(_eager(tf.BartConfig(
        vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=None)))


_BART_LIKE = dict(
    vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
    max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)


def mbart():
    return tf.MBartForConditionalGeneration(_eager(tf.MBartConfig(**_BART_LIKE)))


def pegasus():
    return tf.PegasusForConditionalGeneration(_eager(tf.PegasusConfig(**_BART_LIKE)))


def mixtral():
    return tf.MixtralForCausalLM(_eager(tf.MixtralConfig(
        **_GQA, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        output_router_logits=False, sliding_window=None)))


def qwen2_moe():
    """Qwen2-MoE: routed experts, a shared expert and its sigmoid gate."""
    return tf.Qwen2MoeForCausalLM(_eager(tf.Qwen2MoeConfig(
        **_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True,
        output_router_logits=False, use_sliding_window=False, tie_word_embeddings=False)))


def vit():
    """ViTForImageClassification on 8x8 images; loss the class CE."""
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(_eager(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=D, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)))
    g = torch.Generator().manual_seed(1)
    px = _spread(g, 3, 8, 8)
    y = torch.randint(0, 3, (B,), generator=g)

    def loss(m, b):
        return F.cross_entropy(m(pixel_values=b["pixel_values"]).logits, b["y"], reduction="none")
    return model, {"pixel_values": px, "y": y}, loss


_CLIP_TEXT = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32, dropout=0.0,
                  attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def clip():
    """CLIPModel with a per-sample loss (the batch's contrastive loss mixes
    samples): -logit_scale.exp() * cos(image_i, text_i)."""
    torch.manual_seed(0)
    model = tf.CLIPModel(_eager(tf.CLIPConfig(
        text_config=_CLIP_TEXT,
        vision_config=dict(hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, image_size=8, patch_size=4, num_channels=3,
                           dropout=0.0, attention_dropout=0.0),
        projection_dim=16)))
    x, _ = _tokens(1)
    px = _spread(torch.Generator().manual_seed(2), 3, 8, 8)

    def loss(m, b):
        out = m(input_ids=b["input_ids"], pixel_values=b["pixel_values"])
        return -(m.logit_scale.exp() * (out.image_embeds * out.text_embeds).sum(-1))
    return model, {"input_ids": x, "pixel_values": px}, loss


def clip_frozen_scale():
    """CLIPModel, logit_scale (a bare nn.Parameter) frozen."""
    model, batch, loss = clip()
    model.logit_scale.requires_grad_(False)
    return model, batch, loss


def clip_text():
    """CLIPTextModelWithProjection, CLIPModel's text tower alone: loss the
    squared norm of the projected text embedding."""
    torch.manual_seed(0)
    model = tf.CLIPTextModelWithProjection(_eager(tf.CLIPTextConfig(
        **_CLIP_TEXT, projection_dim=16)))
    x, _ = _tokens(1)

    def loss(m, b):
        return m(input_ids=b["input_ids"]).text_embeds.pow(2).sum(-1)
    return model, {"input_ids": x}, loss


def _whisper_config(**kw):
    return _eager(tf.WhisperConfig(
        vocab_size=V, num_mel_bins=8, encoder_layers=2, encoder_attention_heads=4,
        decoder_layers=2, decoder_attention_heads=4, d_model=D, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_source_positions=8, max_target_positions=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None,
        apply_spec_augment=False, **kw))


def whisper():
    """WhisperForConditionalGeneration on 8 mel bins x 16 frames."""
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(_whisper_config())
    feats = _spread(torch.Generator().manual_seed(1), 8, 16)
    _, y = _tokens(2)

    def loss(m, b):
        out = m(input_features=b["input_features"], labels=b["y"], use_cache=False)
        return seq_ce(out.logits, b["y"])
    return model, {"input_features": feats, "y": y}, loss


def whisper_cls():
    """WhisperForAudioClassification: the audio encoder (two Conv1d, GELU),
    mean-pooled, a classifier; loss the class CE."""
    torch.manual_seed(0)
    model = tf.WhisperForAudioClassification(_whisper_config(classifier_proj_size=16,
                                                             num_labels=3))
    g = torch.Generator().manual_seed(1)
    feats = _spread(g, 8, 16)
    y = torch.randint(0, 3, (B,), generator=g)

    def loss(m, b):
        return F.cross_entropy(m(input_features=b["input_features"]).logits, b["y"],
                               reduction="none")
    return model, {"input_features": feats, "y": y}, loss


class _Contiguous(torch.autograd.Function):
    """Identity forward; backward passes the gradient on made contiguous."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


@contextlib.contextmanager
def gelu_contiguous_grad():
    """Works around a torch 1.13 CPU bug (Debian's 1.13.0a0 build): the
    float32 gelu backward (aten::gelu_backward) returns zeros or garbage when
    the gradient coming into it is not contiguous, as WhisperEncoder's
    gelu(conv2(x)).permute(0, 2, 1) makes it. Plain float32 autograd,
    without dpclip, is wrong the same way; float64 is right. While this is
    active, F.gelu's output hands its gradient on contiguous. Build the model
    inside it too: transformers' GELUActivation binds F.gelu when made."""
    orig = F.gelu

    def gelu(x, *args, **kw):
        return _Contiguous.apply(orig(x, *args, **kw))
    F.gelu = gelu
    try:
        yield
    finally:
        F.gelu = orig


def adapted(make, **lora):
    """make's model with a PEFT adapter (peft.get_peft_model): the base
    frozen, the adapter's parameters trained. lora: LoraConfig's arguments,
    or ia3=... for IA3Config's."""
    def build():
        ia3 = lora.pop("ia3", None)
        # init_lora_weights=False: lora_B random too (PEFT's default zeros
        # it, and lora_A's gradient with it)
        cfg = peft.IA3Config(**ia3) if ia3 is not None else peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, bias="none", init_lora_weights=False, **lora)
        return peft.get_peft_model(make(), cfg)
    return build


# name -> builder. test_zoo.py's EXPECTED says what each must give.
ARCHS = {
    "LlamaForCausalLM (untied)": lm(llama),
    "MistralForCausalLM": lm(mistral),
    "Qwen2ForCausalLM (tied)": lm(qwen2(True)),
    "Qwen2ForCausalLM (untied)": lm(qwen2(False)),
    "GemmaForCausalLM": lm(gemma),
    "Gemma2ForCausalLM": lm(gemma2),
    "PhiForCausalLM": lm(phi),
    "Phi3ForCausalLM": lm(phi3),
    "GPT2LMHeadModel": lm(gpt2),
    "GPTNeoXForCausalLM": lm(gptneox),
    "OPTForCausalLM": lm(opt),
    "FalconForCausalLM": lm(falcon),
    "BloomForCausalLM": lm(bloom),
    "MixtralForCausalLM": lm(mixtral),
    "Qwen2MoeForCausalLM": lm(qwen2_moe),
    "BertForMaskedLM": lm(bert, cache=False),
    "RobertaForMaskedLM": lm(roberta, cache=False),
    "DebertaV2ForMaskedLM": lm(deberta_v2, cache=False),
    "T5ForConditionalGeneration": seq2seq(t5),
    "BartForConditionalGeneration": seq2seq(bart),
    "MBartForConditionalGeneration": seq2seq(mbart),
    "PegasusForConditionalGeneration": seq2seq(pegasus),
    "ViTForImageClassification": vit,
    "CLIPModel": clip,
    "CLIPModel (logit_scale frozen)": clip_frozen_scale,
    "CLIPTextModelWithProjection": clip_text,
    "WhisperForConditionalGeneration": whisper,
    "WhisperForAudioClassification": whisper_cls,
}
if peft is not None:
    ARCHS.update({
        "LlamaForCausalLM + LoRA (peft)": lm(adapted(
            llama, target_modules=["q_proj", "v_proj", "down_proj"])),
        "GPT2LMHeadModel + LoRA (peft)": lm(adapted(
            gpt2, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
        "LlamaForCausalLM + IA3 (peft)": lm(adapted(llama, ia3=dict(
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"]))),
    })


def _per_sample(model, batch, loss, dt):
    """Each sample's gradient of every trainable parameter, by autograd in
    dtype dt on a CPU copy of the model: (per sample, (name, param))."""
    ref = copy.deepcopy(model).to(dt)
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # transformers fills causal masks made with torch.full's default dtype
    # (f32) with finfo(f64).min, which overflows: a double default here
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        per = []
        for b in range(B):
            sb = {k: (v[b:b + 1].to(dt) if v.is_floating_point() else v[b:b + 1])
                  for k, v in batch.items()}
            gs = torch.autograd.grad(loss(ref, sb).sum(), params, allow_unused=True)
            per.append([(torch.zeros_like(p) if g is None else g).double()
                        for g, p in zip(gs, params)])
    finally:
        torch.set_default_dtype(old)
    return per, named


def reference(model, batch, loss, C=None):
    """DP-SGD without noise, explicitly: each sample's gradient of every
    trainable parameter by float64 autograd on a copy of the model, one
    sample at a time, clipped to C (not clipped for None), summed and divided
    by B (a mean loss). (grads by parameter name, per-sample norms [B])."""
    try:
        per, named = _per_sample(model, batch, loss, torch.float64)
    except RuntimeError as e:
        # transformers 5's grouped expert products (torch._grouped_mm) take
        # no float64: float32 there (its rounding is far inside the GPU's
        # tolerances, and the CPU zoo's models all run in float64)
        if "Double" not in str(e):
            raise
        per, named = _per_sample(model, batch, loss, torch.float32)
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) for gs in per],
                         dtype=torch.float64)
    coefs = torch.ones(B, dtype=torch.float64) if C is None else torch.clamp(C / norms, max=1.0)
    want = {n: sum(coefs[b] * per[b][i] for b in range(B)) / B for i, (n, _) in enumerate(named)}
    return want, norms
