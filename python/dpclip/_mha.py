"""A drop-in for nn.MultiheadAttention built from parts the daemon clips.

nn.MultiheadAttention holds its input projection as a raw parameter
(in_proj_weight [3E, E], or q/k/v_proj_weight) used inside one functional
call, so no Linear is there to capture. DPMultiheadAttention computes the
same function with the same parameters under the same names (its state_dict
is nn.MultiheadAttention's): the q, k and v projections as three Linear
parts writing row blocks of in_proj_weight's gradient, out_proj the
nn.Linear it was, bias_k / bias_v (add_bias_kv) as per-sample gradients,
then scaled dot-product attention with the masks and dropout torch applies.
replace_mha(model) swaps it in for every nn.MultiheadAttention in place,
keeping the parameter objects (an optimizer made before still holds them);
make_private(..., replace_mha=True) does so first."""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._layers import Part, _Layer, _LinearFn, _part, _persample_part

__all__ = ["DPMultiheadAttention", "replace_mha"]


class _Slots(list):
    """The engine's layers of a DPMultiheadAttention (q, k, v projections;
    bias_k, bias_v), the nn.MultiheadAttention it replaced (from_module)
    and the engine's check of it against that module (dpclip._verify): a
    copy or pickle of the model gets empty ones, never the engine."""

    def __init__(self) -> None:
        super().__init__([None] * 7)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Slots":
        return _Slots()

    def __reduce__(self) -> Tuple[type, Tuple[()]]:
        return (_Slots, ())


class DPMultiheadAttention(nn.Module):
    """nn.MultiheadAttention's function and parameters, from Linear parts.
    Build one from an existing module with from_module (sharing its
    parameters), or like nn.MultiheadAttention."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        ref = nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
                                    add_zero_attn, kdim, vdim, batch_first, device=device,
                                    dtype=dtype)
        self._take(ref)

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention) -> "DPMultiheadAttention":
        """A DPMultiheadAttention holding mha's parameter and submodule
        objects (not copies), in mha's training mode."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._take(mha)
        return new

    def _take(self, m: nn.MultiheadAttention) -> None:
        for a in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout",
                  "batch_first", "head_dim", "add_zero_attn"):
            setattr(self, a, getattr(m, a))
        for a in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "in_proj_bias", "bias_k", "bias_v"):
            p = getattr(m, a, None)
            if p is None or isinstance(p, nn.Parameter):
                self.register_parameter(a, p)
            else:
                raise ValueError("%s is not a parameter" % a)
        self.out_proj = m.out_proj
        self.train(m.training)
        self._dp = _Slots()
        self._dp[5] = m  # what it replaced, for the first-step check

    def _wb(self, i: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Projection i's weight and bias (views of in_proj_*)."""
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight[i * E:(i + 1) * E]
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[i]
        b = self.in_proj_bias[i * E:(i + 1) * E] if self.in_proj_bias is not None else None
        return w, b

    def _proj(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, b = self._wb(i)
        l = self._dp[i]
        if l is not None and l.active():
            y = _LinearFn.apply(x, w, b, l)
            if l.verify is not None:  # the first-step check (dpclip._verify)
                y = l.verify(l, (x,), {}, y)
            return y
        return F.linear(x, w, b)

    def _bias_kv(self, i: int, B: int) -> torch.Tensor:
        p = self.bias_k if i == 0 else self.bias_v
        l = self._dp[3 + i]
        if l is not None and l.active():
            y = _BiasKVFn.apply(p, B, l)
            if l.verify is not None:
                y = l.verify(l, (B,), {}, y)
            return y
        return p.reshape(1, 1, -1).expand(B, 1, p.shape[-1])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        kw = dict(key_padding_mask=key_padding_mask, need_weights=need_weights,
                  attn_mask=attn_mask, average_attn_weights=average_attn_weights)
        if is_causal:  # (torch 1.13's nn.MultiheadAttention has no is_causal)
            kw["is_causal"] = True
        out = self._attend(query, key, value, **kw)
        check = self._dp[6]
        if check is not None:  # the first-step check against the module it replaced
            check(self, (query, key, value), kw, out)
        return out

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        batched = query.dim() == 3
        if not batched:  # (L, E): one sample
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, L, E = query.shape
        H, hd = self.num_heads, self.head_dim
        q, k, v = self._proj(0, query), self._proj(1, key), self._proj(2, value)
        mask = _float_mask(attn_mask, key_padding_mask, B, H, L, key.shape[1], q.dtype,
                           is_causal, q.device)
        extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self._bias_kv(0, B).to(k.dtype)], 1)
            v = torch.cat([v, self._bias_kv(1, B).to(v.dtype)], 1)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, E)], 1)
            v = torch.cat([v, v.new_zeros(B, 1, E)], 1)
            extra += 1
        if mask is not None and extra:
            mask = F.pad(mask, (0, extra))
        S = k.shape[1]
        q = q.reshape(B, L, H, hd).transpose(1, 2)
        k = k.reshape(B, S, H, hd).transpose(1, 2)
        v = v.reshape(B, S, H, hd).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        if mask is not None:
            scores = scores + mask
        attn = torch.softmax(scores, -1)
        if self.dropout > 0.0 and self.training:
            attn = F.dropout(attn, self.dropout)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(B, L, E)
        out = self.out_proj(out)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        w = attn.mean(1) if average_attn_weights else attn
        return out, (w.squeeze(0) if not batched else w)


def _float_mask(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                B: int, H: int, L: int, S: int, dtype: torch.dtype, is_causal: bool,
                device: torch.device) -> Optional[torch.Tensor]:
    """The masks as one additive float mask [B or 1, H or 1, L, S] (bool
    True and -inf: not attended), or None."""
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=device).triu(1)
    mask = None
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        else:
            m = m.to(dtype)
        mask = m.reshape(B, H, L, S) if m.dim() == 3 else m.reshape(1, 1, L, S)
    if key_padding_mask is not None:
        k = key_padding_mask
        if k.dtype == torch.bool:
            k = torch.zeros(k.shape, dtype=dtype, device=k.device).masked_fill(k, float("-inf"))
        else:
            k = k.to(dtype)
        k = k.reshape(B, 1, 1, S)
        mask = k if mask is None else mask + k
    return mask


class _BiasKVFn(torch.autograd.Function):
    """bias_k / bias_v [1, 1, E] as each sample's extra key/value row: its
    per-sample gradient is that row's output gradient."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, B: int, layer: "_BiasKVLayer") -> torch.Tensor:
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        return p.detach().reshape(1, 1, -1).expand(B, 1, p.shape[-1]).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, None, None]:
        g = g.detach().reshape(g.shape[0], -1)
        ctx.layer.record(g, g, ctx.pass_id)
        return None, None, None


class _ProjLayer(_Layer):
    """Projection i (q, k, v) of a DPMultiheadAttention: a Linear writing
    rows [i E, (i + 1) E) of in_proj_weight's gradient (or all of
    q/k/v_proj_weight's) and the same block of in_proj_bias's."""
    rowwise = False

    def __init__(self, engine: Any, name: str, module: nn.Module, i: int) -> None:
        self.i = i
        same = module._qkv_same_embed_dim
        w = module.in_proj_weight if same else \
            (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)[i]
        b = module.in_proj_bias
        super().__init__(engine, "%s.%s_proj" % (name, "qkv"[i]), module, weight=w,
                         bias=b if b is not None else False)

    def _setup(self) -> None:
        m = self.module
        self.p = m.embed_dim
        self.d = (m.embed_dim, m.kdim, m.vdim)[self.i] if not m._qkv_same_embed_dim else \
            m.embed_dim
        self.w_off = self.i * self.p * self.d if self.module._qkv_same_embed_dim else 0

    def attach(self) -> None:
        self.module._dp[self.i] = self

    def detach(self) -> None:
        self.module._dp[self.i] = None

    def reference(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *mod._wb(self.i))

    def parts(self, B: int, nb: int) -> List[Part]:
        inp, g, T = self.captured(B)
        b = (self.b_out, self.i * self.p, (self.p,)) if self.bias is not None else None
        return [_part(self, "linear", self.name, inp, g, (nb, T, self.d), (nb, T, self.p),
                      (self.w_out, self.w_off, (self.p, self.d)), b, self.bias is not None)]


class _BiasKVLayer(_Layer):
    """bias_k (i = 0) or bias_v (1): per-sample gradients [B, E]."""
    rowwise = False

    def __init__(self, engine: Any, name: str, module: nn.Module, i: int) -> None:
        self.i = i
        super().__init__(engine, "%s.%s" % (name, ("bias_k", "bias_v")[i]), module,
                         weight=module.bias_k if i == 0 else module.bias_v, bias=False)

    def _setup(self) -> None:
        self.d, self.p = self.weight.numel(), 0

    def attach(self) -> None:
        self.module._dp[3 + self.i] = self

    def detach(self) -> None:
        self.module._dp[3 + self.i] = None

    def reference(self, mod: nn.Module, B: int) -> torch.Tensor:
        return mod._bias_kv(self.i, B)  # no layer active: the plain expand

    def parts(self, B: int, nb: int) -> List[Part]:
        v = None
        if B:
            for g, _, _ in self.records:
                v = g if v is None else v + g
        return [_persample_part(self, self.name, v, self.d, nb, self.w_out)]


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_Layer]]:
    """A DPMultiheadAttention's parts (its out_proj is a Linear of its own),
    or None for any other module (nn.MultiheadAttention itself is refused,
    with the hint to swap it)."""
    if type(m) is not DPMultiheadAttention:
        return None
    out: List[_Layer] = []
    ws = [m.in_proj_weight] * 3 if m._qkv_same_embed_dim else \
        [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
    b = m.in_proj_bias
    for i, w in enumerate(ws):
        if w.requires_grad:
            out.append(_ProjLayer(engine, name, m, i))
        elif b is not None and b.requires_grad:
            from ._layers import UnsupportedModuleError, _label
            raise UnsupportedModuleError(
                "module %s: a trainable in_proj_bias with a frozen projection weight is not "
                "supported; freeze both or neither" % _label(name, m))
    for i, p in enumerate((m.bias_k, m.bias_v)):
        if p is not None and p.requires_grad:
            out.append(_BiasKVLayer(engine, name, m, i))
    return out


def replace_mha(model: nn.Module) -> int:
    """Swaps every nn.MultiheadAttention inside model (not model itself) for
    a DPMultiheadAttention over the same parameters, in place; the number
    swapped."""
    n = 0
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(parent, cname, DPMultiheadAttention.from_module(child))
                n += 1
    return n
