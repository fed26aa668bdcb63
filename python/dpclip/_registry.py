"""Which modules dpclip trains, and as what.

torch's own layers are recognised by class (with their own forward, not a
subclass's); Hugging Face's Conv1D by its structure, so transformers is
never imported; normalization layers of other libraries by registration:

    dpclip.torch.register(MyRMSNorm, kind="rmsnorm", weight="weight", eps="variance_epsilon")

or by class name (the common Hugging Face classes are registered so). A
registered module, and a Conv1D, is checked on its first training forward:
its own forward runs beside the replacement, and an output that differs
(the module does not compute what it was registered as) is refused there,
naming the module, before any step uses it."""
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from ._layers import (_RMSNorm, UnsupportedModuleError, _EmbeddingLayer, _HFConv1DLayer, _Layer,
                      _label, _NormLayer)

__all__ = ["register", "registered"]

KINDS = ("rmsnorm", "layernorm")


class _Reg(dict):
    pass


# class object or class name -> the registration (kind, weight, bias, eps, offset)
_by_class: Dict[type, _Reg] = {}
_by_name: Dict[str, _Reg] = {}


def register(cls: Union[type, str], kind: str, weight: str = "weight",
             bias: Optional[str] = None, eps: Union[str, float] = "eps",
             weight_offset: float = 0.0) -> None:
    """Train modules of class `cls` (the class, or its name: "LlamaRMSNorm"
    matches that class from any module without importing it) as a
    normalization over the last dimension of `kind`:

      "rmsnorm":   y = x / sqrt(mean(x^2) + eps) * (weight_offset + w)
      "layernorm": y = (x - mean(x)) / sqrt(var(x) + eps) * w + b

    weight, bias: the names of the affine parameters (bias: layernorm only;
    None: no bias); eps: the name of the attribute holding epsilon, or its
    value. weight_offset: 1.0 for norms that scale by (1 + w), as Gemma's.
    The module's own forward replaced by the formula, and checked against it
    on the first training forward: a module that computes something else is
    refused there (UnsupportedModuleError). Registering a class again
    replaces its registration."""
    if kind not in KINDS:
        raise ValueError("register: kind must be one of %s, got %r" % (", ".join(KINDS), kind))
    if bias is not None and kind != "layernorm":
        raise ValueError("register: a bias is a layernorm's only (kind %r)" % kind)
    if not isinstance(weight, str) or not weight:
        raise ValueError("register: weight must name the weight parameter")
    if not isinstance(eps, (str, float, int)) or isinstance(eps, bool):
        raise ValueError("register: eps must name an attribute or be a number")
    reg = _Reg(kind=kind, weight=weight, bias=bias, eps=eps, offset=float(weight_offset))
    if isinstance(cls, str):
        _by_name[cls] = reg
    elif isinstance(cls, type) and issubclass(cls, nn.Module):
        _by_class[cls] = reg
    else:
        raise ValueError("register: cls must be an nn.Module class or a class name, got %r"
                         % (cls,))


def registered(cls: type) -> Optional[Dict[str, Any]]:
    """The registration that applies to modules of class cls, or None."""
    reg = _by_class.get(cls)
    if reg is None:
        reg = _by_name.get(cls.__name__)
    return dict(reg) if reg is not None else None


# Hugging Face's RMSNorms: y = w * normalize(x in f32).to(x.dtype), eps in
# variance_epsilon; Gemma's scale by (1 + w) and keep eps in eps.
for _n in ("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm",
           "Qwen2MoeRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm",
           "Olmo2RMSNorm", "GraniteRMSNorm", "DeepseekV3RMSNorm", "Starcoder2RMSNorm",
           "T5LayerNorm", "MT5LayerNorm", "LongT5LayerNorm", "UMT5LayerNorm"):
    register(_n, "rmsnorm", eps="variance_epsilon")
for _n in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"):
    register(_n, "rmsnorm", eps="eps", weight_offset=1.0)


# --- the first-step check -----------------------------------------------------------

def _tolerance(dtype):
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _verify(what):
    """A check for _Layer.verify: the module's own forward on the same
    input, once, against the replacement's output y."""

    def check(layer, args, kwargs, y):
        layer.verify = None
        with torch.no_grad():
            want = layer._orig_forward(*args, **kwargs)
        if not isinstance(want, torch.Tensor) or want.shape != y.shape:
            raise UnsupportedModuleError(
                "module %s is trained as %s, but its own forward returns %s where %s gives "
                "shape %s: register it as what it computes, or not at all"
                % (_label(layer.name, layer.module), what,
                   "shape %s" % (tuple(want.shape),) if isinstance(want, torch.Tensor)
                   else type(want).__name__, what, tuple(y.shape)))
        own_dtype = want.dtype
        got, want = y.detach().double(), want.double()
        scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-12)
        err = float((got - want).abs().max()) / scale if want.numel() else 0.0
        # the loosest precision in play: under autocast a norm runs in f32 here
        # while the module's own forward may keep the input's bf16
        dts = [y.dtype, own_dtype] + [a.dtype for a in args if isinstance(a, torch.Tensor)]
        if not err <= max(_tolerance(dt) for dt in dts):
            raise UnsupportedModuleError(
                "module %s is trained as %s, but its own forward computes something else (the "
                "outputs differ by %.3g of their largest magnitude on its first forward): "
                "register it with the kind, weight and eps it computes (dpclip.torch.register), "
                "or not at all" % (_label(layer.name, layer.module), what, err))
    return check


# --- classification ---------------------------------------------------------------

def _own_forward(m, base):
    return isinstance(m, base) and type(m).forward is base.forward


def _is_hf_conv1d(m):
    """transformers' Conv1D, by structure: named Conv1D, an int nf, weight
    [nx, nf], bias [nf] or none."""
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    nf = getattr(m, "nf", None)
    return (type(m).__name__ == "Conv1D" and isinstance(nf, int) and
            isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == nf and
            (b is None or (isinstance(b, torch.Tensor) and tuple(b.shape) == (nf,))))


def _frozen(name, m, w, b):
    """True when the module trains nothing; a trainable bias beside a frozen
    weight is refused."""
    if w is None or not w.requires_grad:
        if isinstance(b, torch.Tensor) and b.requires_grad:
            raise UnsupportedModuleError(
                "module %s: a trainable bias with a frozen weight is not supported; "
                "freeze both or neither" % _label(name, m))
        return True
    return False


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_Layer]]:
    """The _Layers for module m (empty when it trains nothing), or None when
    dpclip does not support it. Raises for a supported module configured
    in a way dpclip cannot train."""
    from . import _conv, _mha  # noqa: E402 (they import this module's imports)

    w = getattr(m, "weight", None)
    if _own_forward(m, nn.Linear):
        return [] if _frozen(name, m, w, m.bias) else [_Layer(engine, name, m)]
    if _own_forward(m, nn.Embedding):
        if _frozen(name, m, w, None):
            return []
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            raise UnsupportedModuleError(
                "module %s: Embedding with max_norm, scale_grad_by_freq or sparse=True is not "
                "supported" % _label(name, m))
        return [_EmbeddingLayer(engine, name, m)]
    for base, kind in ((nn.LayerNorm, "layernorm"), (_RMSNorm, "rmsnorm")):
        if base is not None and _own_forward(m, base):
            if _frozen(name, m, w, getattr(m, "bias", None)):
                return []
            if len(m.normalized_shape) != 1:
                raise UnsupportedModuleError(
                    "module %s: only normalization over the last dimension is supported "
                    "(normalized_shape %s)" % (_label(name, m), tuple(m.normalized_shape)))
            return [_NormLayer(engine, name, m, kind)]
    made = _conv.layers_for(engine, name, m)
    if made is not None:
        return made
    made = _mha.layers_for(engine, name, m)
    if made is not None:
        return made
    reg = registered(type(m))
    if reg is not None:
        w = getattr(m, reg["weight"], None)
        b = getattr(m, reg["bias"], None) if reg["bias"] else None
        if not isinstance(w, torch.Tensor):
            raise UnsupportedModuleError(
                "module %s is registered with weight=%r, but has no such tensor"
                % (_label(name, m), reg["weight"]))
        if _frozen(name, m, w, b):
            return []
        if w.dim() != 1:
            raise UnsupportedModuleError(
                "module %s is registered as a %s with weight=%r of shape %s: a norm over the "
                "last dimension has a 1-D weight" % (_label(name, m), reg["kind"], reg["weight"],
                                                    tuple(w.shape)))
        if isinstance(reg["eps"], str) and not isinstance(getattr(m, reg["eps"], None),
                                                          (float, int)):
            raise UnsupportedModuleError(
                "module %s is registered with eps=%r, but has no such number"
                % (_label(name, m), reg["eps"]))
        l = _NormLayer(engine, name, m, reg["kind"], weight=w,
                       bias=b if b is not None else False, eps=reg["eps"],
                       offset=reg["offset"], hf_style=True)
        l.verify = _verify("a registered %s" % reg["kind"])
        return [l]
    if _is_hf_conv1d(m):
        if _frozen(name, m, w, m.bias):
            return []
        l = _HFConv1DLayer(engine, name, m)
        l.verify = _verify("a Conv1D (a Linear with its weight [in, out])")
        return [l]
    return None


def unsupported(name: str, m: nn.Module, params: List[str]) -> UnsupportedModuleError:
    """The error for a module with trainable parameters dpclip cannot train."""
    hint = "freeze them or replace the module"
    if isinstance(m, nn.MultiheadAttention):
        hint = ("pass replace_mha=True to make_private, which swaps in "
                "dpclip.torch.DPMultiheadAttention (the same function from parts dpclip trains; "
                "the parameters keep their names), or freeze them")
    elif type(m).__name__.endswith(("RMSNorm", "LayerNorm")):
        hint = ("if it is a norm over the last dimension, register it: dpclip.torch.register(%s, "
                "kind='rmsnorm' or 'layernorm', weight=..., eps=...); else freeze them"
                % type(m).__name__)
    return UnsupportedModuleError(
        "module %s has trainable parameters (%s) but is not supported by dpclip (supported: "
        "Linear, Embedding, LayerNorm%s, Conv1d, Conv2d, GroupNorm, transformers' Conv1D, "
        "registered norms); %s" % (_label(name, m), ", ".join(params),
                                   ", RMSNorm" if _RMSNorm else "", hint))
