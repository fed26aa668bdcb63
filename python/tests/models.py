"""Small models with every supported layer kind, and the naive reference:
explicit per-sample gradients, one sample at a time through autograd, in
double precision. The model-parallel ones: SeqModel cut into two pipeline
stages, and a LayerNorm + Linear split by the Linear's output features
over a tensor-parallel group (the LayerNorm held whole by every rank).
Hugging Face's structures, reproduced without transformers: Conv1D,
LlamaRMSNorm, and GPT-2-, Llama- and BERT-like models with tied embeddings,
trained on the prose in examples/data; Gemma's (transformers 5: an
nn.Embedding subclass that scales its lookup, tied, with padding_idx;
GemmaRMSNorm's (1 + w)) and OPT's learned positions (an nn.Embedding
subclass that offsets its indices). And the tests' shared comparisons:
a clipping threshold between the middle norms (between), the relative
error against the reference (max_rel), ranks in spawned processes (spawn)."""
import copy
import math
import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HAS_RMSNORM = hasattr(nn, "RMSNorm")


# The devices a test of a model runs its private step on: the CPU (host
# memory), and the GPU where there is one (CUDA IPC); the reference stays
# float64 on the CPU. TOL: what a gradient may differ by relative to its
# largest entry (the GPU runs f32 in TF32, and its coefficients carry the
# certified bound on that rounding, step.h dc_clip_e: about 5e-3).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
TOL = {"cpu": 2e-4, "cuda": 1e-2}


def on(device, model, *tensors):
    """model and tensors moved to device (the model in place)."""
    return (model.to(device),) + tuple(t.to(device) for t in tensors)


def private(daemon, model, C, B, reduction="mean", **kw):
    """(engine, model, optimizer): make_private with no noise, flat clipping
    at C, a loss reduced by `reduction` over an expected batch B, SGD at
    learning rate 0 (kw: make_private's other arguments)."""
    from dpclip.torch import PrivacyEngine  # noqa: E402 (the package after conftest's path)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0, max_grad_norm=C, loss_reduction=reduction,
        expected_batch_size=B, **kw)
    return engine, model, opt


def exact_step(daemon, model, kind, inputs, y, device, reduction="mean", expected=None, **kw):
    """One private step of the model on device (inputs, y: its batch; kind:
    per_sample_losses'), at C between the middle per-sample norms of the
    float64 reference (so that some samples clip and some do not), the loss
    reduced by `reduction` over `expected` samples (None: the batch's);
    no parameter given a gradient by autograd, every parameter's .grad and
    the per-sample norms asserted against the reference and every layer
    checked on the first step; kw goes to make_private. Returns (engine,
    model), the engine open."""
    from dpclip.torch import reduce_loss  # noqa: E402 (the package after conftest's path)
    expected = y.shape[0] if expected is None else expected
    _, norms0, _ = reference(model, kind, inputs, y, 1e9, "sum", 1)
    C = between(norms0)
    want, ref_norms, coefs = reference(model, kind, inputs, y, C, reduction, expected)
    assert (coefs < 1).any() and (coefs == 1).any()
    model, *moved = on(device, model, *inputs, y)
    inputs, y = tuple(moved[:-1]), moved[-1]
    engine, model, opt = private(daemon, model, C, expected, reduction, **kw)
    reduce_loss(per_sample_losses(kind, model(*inputs), y), reduction).backward()
    assert all(p.grad is None for p in model.parameters()), "autograd made a weight grad"
    opt.step()
    for n, p in model.named_parameters():
        assert p.grad is not None and max_rel(p.grad.cpu(), want[n]) < TOL[device], n
    assert max_rel(engine.last_norms.cpu(), ref_norms) < TOL[device] / 2
    assert all(l.verify is None for l in engine._layers), "a layer left unchecked"
    return engine, model


def between(norms):
    """A clipping threshold strictly between the middle per-sample norms, so
    that about half the samples are clipped and none sits on the edge."""
    s = sorted(float(n) for n in norms)
    k = len(s) // 2
    return 0.5 * (s[k - 1] + s[k])


def max_rel(got, want, floor=1e-30):
    """The largest error of got relative to want's largest value (or to
    floor: a gradient that is 0 in exact arithmetic, as a key bias's under
    softmax, is compared at the scale of the others), in double precision."""
    want = want.double()
    return float((got.double() - want).abs().max()) / max(float(want.abs().max()), floor)


def _rank_then_exit(rank, fn, *args):
    """A spawned rank: fn, then an exit that skips the interpreter's
    shutdown. Under torch 2.15 a gloo worker thread could still drop a
    finished send's tensor then, taking the GIL during finalization, and
    std::terminate aborted the rank (SIGABRT) after a clean run (about two
    runs in fifteen of test_fsdp_accumulate.py; bench_parallel's ranks do
    the same). Output is flushed first; an exception still fails the rank."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args, nprocs=2, timeout=900):
    """nprocs processes running fn(rank, *args) (spawned), waited for; a
    failing one raises here, and so do ranks still running after `timeout`
    seconds (killed first: a deadlocked pipeline fails its test instead of
    hanging the suite)."""
    ctx = mp.start_processes(_rank_then_exit, nprocs=nprocs, join=False, start_method="spawn",
                             args=(fn,) + tuple(args))
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=min(10.0, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [p for p in ctx.processes if p.is_alive()]
            for p in alive:
                p.kill()
            raise TimeoutError("%s: %d rank(s) still running after %d s (killed)"
                               % (fn.__name__, len(alive), timeout))


def _norm(d):
    return nn.RMSNorm(d, eps=1e-5) if HAS_RMSNORM else nn.LayerNorm(d)


class SeqModel(nn.Module):
    """Tokens [B, T] -> logits [B, T, V]: token and position embeddings
    (padding_idx, repeated tokens), LayerNorm, an MLP, RMSNorm where torch
    has it, a Linear applied twice (captured twice per pass) and a head."""

    def __init__(self, V=11, T=6, d=16, h=24):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.norm2 = _norm(d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        h = h + self.fc2(torch.tanh(self.fc1(self.ln(h))))
        h = self.norm2(h)
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h)


class SteadyModel(nn.Module):
    """Tokens [B, T] -> logits [B, T, V], every module used once per pass
    (a plan template's case: dpclip._planner.Replanner), and one (`extra`)
    used only when use_extra is set (use_extra = 2: twice, its captures
    concatenated)."""

    def __init__(self, V=11, d=8, h=12):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, h)
        self.extra = nn.Linear(h, h)
        self.head = nn.Linear(h, V)
        self.use_extra = False

    def forward(self, x):
        h = torch.tanh(self.fc(self.ln(self.tok(x))))
        for _ in range(int(self.use_extra)):
            h = self.extra(h)
        return self.head(h)


class FlatModel(nn.Module):
    """Features [B, F] and a category [B] -> logits [B, C]: every layer sees
    2D input. One frozen Linear (no gradient, not sent)."""

    def __init__(self, F_=10, cats=5, e=6, d=12, classes=4):
        super().__init__()
        self.cat = nn.Embedding(cats, e)
        self.frozen = nn.Linear(F_, F_)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(F_ + e, d)
        self.ln = nn.LayerNorm(d)
        self.norm2 = _norm(d)
        self.out = nn.Linear(d, classes)

    def forward(self, x, c):
        h = torch.cat([torch.tanh(self.frozen(x)), self.cat(c)], 1)
        h = torch.tanh(self.ln(self.fc1(h)))
        return self.out(self.norm2(h))


class Stage0(nn.Module):
    """SeqModel's first pipeline stage: tokens [B, T] -> hidden [B, T, d]."""

    def __init__(self, V=11, T=6, d=16, h=24):
        super().__init__()
        self.tok = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        return h + self.fc2(torch.tanh(self.fc1(self.ln(h))))


class Stage1(nn.Module):
    """SeqModel's second stage: hidden [B, T, d] -> logits [B, T, V]."""

    def __init__(self, V=11, d=16):
        super().__init__()
        self.norm2 = _norm(d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, h):
        h = self.norm2(h)
        return self.head(self.shared(torch.tanh(self.shared(h))))


class Stage1Once(nn.Module):
    """Stage1 with each layer used once (a steady step's template takes
    one capture a layer: dpclip._planner.Replanner)."""

    def __init__(self, V=11, d=16):
        super().__init__()
        self.norm2 = _norm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, h):
        return self.head(torch.tanh(self.fc(self.norm2(h))))


def pipeline_model(once=False):
    """The whole model; its [k] is pipeline stage k (once: Stage1Once)."""
    return nn.Sequential(Stage0(), Stage1Once() if once else Stage1())


class TPModel(nn.Module):
    """Features [B, T, d] -> logits [B, T, p]: a LayerNorm, then a Linear
    that TPShard splits by output features."""

    def __init__(self, d=8, p=10):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, p)

    def forward(self, x):
        return self.fc(self.ln(x))


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group
    (each rank's Linear slice gives part of its input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g, None


class _GatherFromGroup(torch.autograd.Function):
    """Concatenates the ranks' output features; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.rank = torch.distributed.get_rank(group)
        ctx.size = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(y) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, y.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.size, -1)[ctx.rank].contiguous(), None


class TPShard(nn.Module):
    """This rank's part of a TPModel over `group`: the whole LayerNorm (a
    copy on every rank) and rows [k * p / size, (k + 1) * p / size) of the
    Linear, as a plain nn.Linear."""

    def __init__(self, whole, group):
        super().__init__()
        k, n = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        self.group = group
        self.ln = copy.deepcopy(whole.ln)
        p = whole.fc.out_features // n
        self.fc = nn.Linear(whole.fc.in_features, p)
        with torch.no_grad():
            self.fc.weight.copy_(whole.fc.weight[k * p:(k + 1) * p])
            self.fc.bias.copy_(whole.fc.bias[k * p:(k + 1) * p])

    def forward(self, x):
        h = _CopyToGroup.apply(self.ln(x), self.group)
        return _GatherFromGroup.apply(self.fc(h), self.group)


def tp_data(B, T=3, d=8, p=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, d, generator=g) * torch.linspace(0.3, 3.0, B).view(B, 1, 1) + 0.5
    y = torch.randint(0, p, (B, T), generator=g)
    return (x,), y


def seq_data(B, T=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    x[0, :2] = 0  # some padding
    x[1, :] = 3   # a sample of one repeated token
    y = torch.randint(0, V, (B, T), generator=g)
    return (x,), y


def flat_data(B, F_=10, cats=5, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, F_, generator=g) * torch.linspace(0.2, 3.0, B).unsqueeze(1)
    c = torch.randint(0, cats, (B,), generator=g)
    y = torch.randint(0, classes, (B,), generator=g)
    return (x, c), y


def per_sample_losses(kind, out, y):
    if kind == "seq":
        tok = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                              reduction="none").view(y.shape)
        return tok.mean(1)
    return F.cross_entropy(out, y, reduction="none")


# A step in phases (sharded models: a norm pass, then the sums layer group by
# layer group) clips by norms raised by the daemon's re-measurement margin on
# squared norms (daemon/protocol/step_pass.h, DC_PHASE_RECHECK_TOL).
PHASED_MARGIN = 1.0 + 1.0 / 1024.0


def reference(model, kind, inputs, y, C, reduction, expected, only=None, margin=1.0):
    """(grads by parameter name, norms [B], coefs [B]) of DP-SGD without
    noise: each sample's full gradient (all trainable parameters, or those
    named in `only`) built explicitly in double precision, clipped to C
    (its squared norm times `margin`: PHASED_MARGIN for steps in phases),
    summed, divided by `expected` for a mean loss."""
    ref = copy.deepcopy(model).double()
    named = [(n, p) for n, p in ref.named_parameters()
             if p.requires_grad and (only is None or n in only)]
    names = [n for n, _ in named]
    params = [p for _, p in named]
    B = y.shape[0]
    per = []
    for b in range(B):
        xb = tuple(t[b:b + 1].double() if t.is_floating_point() else t[b:b + 1] for t in inputs)
        loss = per_sample_losses(kind, ref(*xb), y[b:b + 1]).sum()
        per.append(torch.autograd.grad(loss, params, allow_unused=True))
    per = [[g if g is not None else torch.zeros_like(p) for g, p in zip(gs, params)]
           for gs in per]
    norms = torch.tensor([math.sqrt(sum(float(g.pow(2).sum()) for g in gs)) for gs in per],
                         dtype=torch.float64)
    coefs = torch.clamp(C / (norms * math.sqrt(margin) + 1e-6), max=1.0)
    out = {}
    for i, n in enumerate(names):
        s = sum(coefs[b] * per[b][i] for b in range(B))
        out[n] = s / expected if reduction == "mean" else s
    return out, norms, coefs


# --- Hugging Face structures, reproduced (the suite has no transformers) ----------

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "examples", "data")


def prose(B, T, seed=0):
    """A small real sequence task: B windows of T + 1 characters of the prose
    in examples/data, as (inputs [B, T], next characters [B, T]) over a
    vocabulary of the corpus's characters (index 0 unused, for padding)."""
    text = "".join(open(os.path.join(DATA, f), encoding="utf-8").read()
                   for f in sorted(os.listdir(DATA)))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) + 1 for c in text], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, len(ids) - T - 1, (B,), generator=g)
    w = torch.stack([ids[s:s + T + 1] for s in start.tolist()])
    return (w[:, :-1],), w[:, 1:], len(chars) + 1


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a Linear whose weight is [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (registered by name in dpclip)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _causal(q, k, v, heads):
    B, T, d = q.shape
    q, k, v = (t.reshape(B, T, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1),
                      float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, d)


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = Conv1D(2 * d, d)
        self.c_proj2 = Conv1D(d, 2 * d)

    def forward(self, h):
        q, k, v = self.c_attn(self.ln_1(h)).split(h.shape[-1], dim=2)
        h = h + self.c_proj(_causal(q, k, v, self.heads))
        return h + self.c_proj2(F.gelu(self.c_fc(self.ln_2(h))))


class GPT2Like(nn.Module):
    """GPT2LMHeadModel's structure: wte and wpe (positions [1, T], broadcast
    over the batch as GPT-2 does), Conv1D projections, LayerNorms, and an
    lm_head tied to wte."""

    def __init__(self, V, T=16, d=16, heads=2, layers=2):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.wpe = nn.Embedding(T, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = self.wte(x) + self.wpe(position_ids)
        for blk in self.h:
            h = blk(h)
        return self.lm_head(self.ln_f(h))


class LlamaLike(nn.Module):
    """LlamaForCausalLM's structure: embed_tokens, LlamaRMSNorms, bias-free
    q/k/v/o and gated MLP Linears, an lm_head tied to embed_tokens or not."""

    def __init__(self, V, d=16, heads=2, tied=True):
        super().__init__()
        self.heads = heads
        self.embed_tokens = nn.Embedding(V, d)
        self.input_layernorm = LlamaRMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = \
            (nn.Linear(d, d, bias=False) for _ in range(4))
        self.post_attention_layernorm = LlamaRMSNorm(d)
        self.gate_proj, self.up_proj = nn.Linear(d, 24, bias=False), nn.Linear(d, 24, bias=False)
        self.down_proj = nn.Linear(24, d, bias=False)
        self.norm = LlamaRMSNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x):
        h = self.embed_tokens(x)
        a = self.input_layernorm(h)
        h = h + self.o_proj(_causal(self.q_proj(a), self.k_proj(a), self.v_proj(a), self.heads))
        a = self.post_attention_layernorm(h)
        h = h + self.down_proj(F.silu(self.gate_proj(a)) * self.up_proj(a))
        return self.lm_head(self.norm(h))


class BertLMPredictionHead(nn.Module):
    """Owns the decoder's bias as its own parameter, as BERT's does."""

    def __init__(self, d, V):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.decoder = nn.Linear(d, V, bias=False)
        self.bias = nn.Parameter(torch.randn(V) * 0.1)
        self.decoder.bias = self.bias

    def forward(self, h):
        return self.decoder(self.LayerNorm(F.gelu(self.dense(h))))


class BertLike(nn.Module):
    """BertForMaskedLM's structure: word (padding_idx 0), position (a [1, T]
    buffer) and token-type embeddings (a buffer of zeros expanded to the
    batch), LayerNorm, a self-attention layer, and the prediction head whose
    decoder is tied to the word embeddings."""

    def __init__(self, V, T=16, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.word_embeddings = nn.Embedding(V, d, padding_idx=0)
        self.position_embeddings = nn.Embedding(T, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.LayerNorm = nn.LayerNorm(d, eps=1e-12)
        self.register_buffer("position_ids", torch.arange(T).unsqueeze(0), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, T, dtype=torch.long),
                             persistent=False)
        self.query, self.key, self.value = (nn.Linear(d, d) for _ in range(3))
        self.attn_out = nn.Linear(d, d)
        self.attn_ln = nn.LayerNorm(d, eps=1e-12)
        self.cls = BertLMPredictionHead(d, V)
        self.cls.decoder.weight = self.word_embeddings.weight

    def forward(self, x):
        B, T = x.shape
        h = self.word_embeddings(x) + \
            self.token_type_embeddings(self.token_type_ids[:, :T].expand(B, T))
        h = self.LayerNorm(h + self.position_embeddings(self.position_ids[:, :T]))
        q, k, v = self.query(h), self.key(h), self.value(h)
        s = (q.reshape(B, T, self.heads, -1).transpose(1, 2) @
             k.reshape(B, T, self.heads, -1).transpose(1, 2).transpose(-1, -2))
        a = (torch.softmax(s / math.sqrt(q.shape[-1] // self.heads), -1) @
             v.reshape(B, T, self.heads, -1).transpose(1, 2)).transpose(1, 2).reshape(B, T, -1)
        h = self.attn_ln(h + self.attn_out(a))
        return self.cls(h)


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


def lorafy(model, names, **kw):
    """Freezes model and wraps the named Linear/Conv1D modules in LoraLinear."""
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, LoraLinear(getattr(holder, child), **kw))
    return model


# --- Gemma's structures (transformers 5), reproduced from plain modules ------------

class GemmaTextScaledWordEmbedding(nn.Embedding):
    """transformers 5's: an nn.Embedding subclass whose forward scales the
    lookup by embed_scale (sqrt(hidden)), a non-persistent buffer; dpclip
    knows it by name."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx, embed_scale=1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = embed_scale
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: in f32, scaled by (1 + weight), weight
    starting near 0 (registered by name in dpclip)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class OffsetLinear(nn.Linear):
    """A Linear subclass whose forward adds a constant (a buffer) to the
    base forward's output: exact once registered as kind="subclass"."""

    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out)
        self.register_buffer("offset", 0.1 * torch.randn(d_out))

    def forward(self, x):
        return super().forward(x) + self.offset


class GemmaLike(nn.Module):
    """GemmaForCausalLM's structure (transformers 5): the scaled token
    embedding with padding_idx 0, tied to lm_head; GemmaRMSNorms (1 + w);
    one attention block with a single key/value head and a gated GELU
    MLP whose down projection is an OffsetLinear."""

    def __init__(self, V, d=16, heads=2, ffn=24):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.embed_tokens = GemmaTextScaledWordEmbedding(V, d, 0, embed_scale=d ** 0.5)
        self.input_layernorm = GemmaRMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, self.hd, bias=False)  # one key/value head
        self.v_proj = nn.Linear(d, self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = GemmaRMSNorm(d)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = OffsetLinear(ffn, d)
        self.norm = GemmaRMSNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x):
        B, T = x.shape
        h = self.embed_tokens(x)
        a = self.input_layernorm(h)
        q = self.q_proj(a).reshape(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(a).reshape(B, T, 1, self.hd).transpose(1, 2)
        v = self.v_proj(a).reshape(B, T, 1, self.hd).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1),
                          float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, -1)
        h = h + self.o_proj(o)
        a = self.post_attention_layernorm(h)
        h = h + self.down_proj(F.gelu(self.gate_proj(a), approximate="tanh") * self.up_proj(a))
        return self.lm_head(self.norm(h))


class OPTLearnedPositionalEmbedding(nn.Embedding):
    """transformers' OPT positions: indices from the attention mask, plus 2
    (dpclip knows it by name)."""

    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, attention_mask, past_key_values_length=0):
        attention_mask = attention_mask.long()
        positions = (torch.cumsum(attention_mask, dim=1).type_as(attention_mask) *
                     attention_mask).long() - 1
        positions = positions[:, past_key_values_length:]
        return super().forward(positions + self.offset)


class OPTLike(nn.Module):
    """Token embedding plus OPT's learned positions (from a mask with left
    padding), a LayerNorm and a head."""

    def __init__(self, V, T, d=16):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, d, padding_idx=0)
        self.embed_positions = OPTLearnedPositionalEmbedding(T, d)
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, V)

    def forward(self, x):
        mask = (x != 0).long()
        h = self.embed_tokens(x) + self.embed_positions(mask)
        return self.head(torch.tanh(self.fc(self.ln(h))))
