"""Which modules dpclip trains, and as what.

torch's own layers are recognised by class (with their own forward);
Hugging Face's Conv1D by its structure, so transformers is never imported;
normalization layers of other libraries by registration:

    dpclip.torch.register(MyRMSNorm, kind="rmsnorm", weight="weight", eps="variance_epsilon")

or by class name (the common Hugging Face classes are registered so).

A subclass of a torch layer dpclip trains (Linear, Embedding, LayerNorm,
RMSNorm, Conv1d/2d, GroupNorm, InstanceNorm, BatchNorm) that has a forward
of its own is trained only where its transform is known: registered with
kind="subclass" (by class or name; transformers' scaled word embeddings
and OPT's learned positions are, by name), which says that its forward
reaches the weight through super().forward(...) alone and transforms that
call's inputs and output per sample (Gemma's sqrt(hidden) scale, OPT's
index offset, an added constant). Its own code then runs with the base
forward swapped for dpclip's (_layers._Layer._swap_class). Any other is
refused at make_private, by name: trained as its base class it would be
silently wrong (transformers 5's GemmaTextScaledWordEmbedding was, issue 38).

Every module dpclip trains is then checked on the engine's first step
(dpclip._verify): its forward against the module's own code, and its
per-sample gradients against autograd's through that code."""
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ._layers import (_RMSNorm, UnsupportedModuleError, _EmbeddingLayer, _HFConv1DLayer, _Layer,
                      _label, _NormLayer)

__all__ = ["register", "registered", "supported_layers"]

KINDS = ("rmsnorm", "layernorm", "subclass", "same")


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
    refused there (UnsupportedModuleError).

    kind="subclass": cls subclasses a torch layer dpclip trains (nn.Linear,
    nn.Embedding, ...) with a forward of its own that uses the weight only
    through super().forward(...), transforming that call's inputs and its
    output per sample (a scale, an offset, shifted indices), as
    transformers' GemmaTextScaledWordEmbedding (output times sqrt(hidden))
    and OPTLearnedPositionalEmbedding (indices plus 2) do; it is trained
    through those calls (the other arguments are not used). The first
    step checks the claim against autograd.

    kind="same": cls subclasses a torch layer dpclip trains with a forward
    of its own that computes exactly the base's function (transformers'
    FalconLinear: x @ W.T + b); it is trained as the base, its forward
    replaced by dpclip's, and its own checked against that on its first
    training forward (UnsupportedModuleError where they differ).

    Registering a class again replaces its registration."""
    if kind not in KINDS:
        raise ValueError("register: kind must be one of %s, got %r" % (", ".join(KINDS), kind))
    if kind in ("subclass", "same"):
        if isinstance(cls, type) and supported_base(cls) is None:
            raise ValueError("register: kind=%r needs a subclass of a torch layer "
                             "dpclip trains (%s), got %s"
                             % (kind, ", ".join(b.__name__ for b in _bases()), cls.__name__))
        reg = _Reg(kind=kind)
        if isinstance(cls, str):
            _by_name[cls] = reg
        elif isinstance(cls, type):
            _by_class[cls] = reg
        else:
            raise ValueError("register: cls must be an nn.Module class or a class name, got %r"
                             % (cls,))
        return
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
# transformers' nn.Embedding subclasses whose forward is
# super().forward(input_ids) * embed_scale, or super().forward(positions +
# offset) (OPT's, BART's and mBART's learned positions)
for _n in ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding",
           "Gemma3TextScaledWordEmbedding",
           "Gemma3nTextScaledWordEmbedding", "BartScaledWordEmbedding", "MBartScaledWordEmbedding",
           "M2M100ScaledWordEmbedding", "NllbMoeScaledWordEmbedding",
           "OPTLearnedPositionalEmbedding", "BartLearnedPositionalEmbedding",
           "MBartLearnedPositionalEmbedding"):
    register(_n, "subclass")
# transformers' layers that compute their base's function in code of their own
register("FalconLinear", "same")


# --- classification ---------------------------------------------------------------

def _bases() -> List[type]:
    """The torch classes whose forward a layer of dpclip replaces, the most
    derived first where one subclasses another (none do today)."""
    from . import _conv  # noqa: E402 (it imports this module's imports)
    out = [nn.Linear, nn.Embedding, nn.LayerNorm] + ([_RMSNorm] if _RMSNorm else [])
    return out + list(_conv.BASES)


# What each torch layer dpclip trains takes: the one source of the lists the
# READMEs, the docstrings and the refusals give (supported_layers()).
_TERMS = {"Linear": "any input rank, with or without bias",
          "Embedding": "padding_idx honoured; max_norm, scale_grad_by_freq and sparse refused",
          "LayerNorm": "over the last dimension",
          "RMSNorm": "over the last dimension (torch >= 2.4)",
          "Conv1d": "any stride, padding, padding mode, dilation, groups",
          "Conv2d": "any stride, padding, padding mode, dilation, groups",
          "GroupNorm": "affine",
          "_InstanceNorm": "InstanceNorm1d/2d/3d, affine",
          "_BatchNorm": "BatchNorm1d/2d/3d, affine, in eval mode (training mode mixes samples)"}


def supported_layers() -> List[Tuple[str, str]]:
    """(what, on which terms) for every kind of module dpclip trains, from
    the classes it recognises and the registrations in force: torch's
    layers, transformers' Conv1D, DPMultiheadAttention, registered norms and
    registered subclasses (by class or by name)."""
    names = [b.__name__ for b in _bases()]
    if "RMSNorm" not in names:  # listed whatever this torch is: the docs are one text
        names.insert(names.index("LayerNorm") + 1, "RMSNorm")
    out = [("nn." + n.lstrip("_"), _TERMS.get(n, "")) for n in names]
    out.append(("transformers' Conv1D", "a Linear with its weight [in, out], by structure"))
    out.append(("dpclip.torch.DPMultiheadAttention",
                "make_private(replace_mha=True) swaps it in for nn.MultiheadAttention"))
    out.append(("the relative position bias of %s" % " and ".join(_relbias_names()),
                "by class name, through its compute_bias; checked on the first step"))
    out.append(("embeddings that read rows of their table themselves: %s"
                % ", ".join(_tablerows_names()), "by class name; checked on the first step"))
    out.append(("raw nn.Parameters of leading size 1, or vectors, that a module's forward "
                "broadcasts over the batch", "class tokens, position embeddings (ViT's, CLIP's), "
                "layer-scales; checked on the first step"))
    out.append(("raw 2-D or 3-D weights a module passes to F.linear or to a grouped product "
                "itself", "a mixture of experts' router weight and experts [E, out, in] "
                "(transformers 5's Mixtral, Qwen2-MoE: eager or grouped_mm), without a bias; "
                "any other use refused; checked on the first step"))
    for kind in KINDS:
        names = sorted([c.__name__ for c, r in _by_class.items() if r["kind"] == kind] +
                       [n for n, r in _by_name.items() if r["kind"] == kind])
        if names:
            what = ("subclasses with a forward of their own, registered kind='subclass'"
                    if kind == "subclass" else
                    "subclasses computing their base's function, registered kind='same'"
                    if kind == "same" else "norms registered kind=%r" % kind)
            out.append((what, ", ".join(names)))
    return out


def _relbias_names() -> Tuple[str, ...]:
    from ._relbias import NAMES  # noqa: E402 (it imports _layers)
    return NAMES


def _tablerows_names() -> Tuple[str, ...]:
    from ._tablerows import NAMES  # noqa: E402 (it imports _layers)
    return NAMES


def supported_markdown() -> str:
    """supported_layers() as the Markdown list the READMEs carry between
    their `<!-- supported-layers -->` markers (scripts/layers_doc.py)."""
    return "".join("- %s%s\n" % (what, ": " + terms if terms else "")
                   for what, terms in supported_layers())


def supported_base(cls: type) -> Optional[type]:
    """The torch layer dpclip trains that cls is or subclasses, or None."""
    for b in _bases():
        if issubclass(cls, b):
            return b
    return None


def _own_forward(m: nn.Module, base: type) -> bool:
    return isinstance(m, base) and type(m).forward is base.forward


def _is_hf_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D, by structure: named Conv1D, an int nf, weight
    [nx, nf], bias [nf] or none."""
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    nf = getattr(m, "nf", None)
    return (type(m).__name__ == "Conv1D" and isinstance(nf, int) and
            isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == nf and
            (b is None or (isinstance(b, torch.Tensor) and tuple(b.shape) == (nf,))))


def _frozen(name: str, m: nn.Module, w: Optional[torch.Tensor], b: Any) -> bool:
    """True when the module trains nothing; a trainable bias beside a frozen
    weight is refused."""
    if w is None or not w.requires_grad:
        if isinstance(b, torch.Tensor) and b.requires_grad:
            raise UnsupportedModuleError(
                "module %s: a trainable bias with a frozen weight is not supported; "
                "freeze both or neither" % _label(name, m))
        return True
    return False


def _as_base(engine: Any, name: str, m: nn.Module, base: type) -> List[_Layer]:
    """The layers of m as an instance of the torch class base (empty:
    frozen); raises for a configuration dpclip cannot train."""
    from . import _conv  # noqa: E402

    w = getattr(m, "weight", None)
    if base is nn.Linear:
        return [] if _frozen(name, m, w, m.bias) else [_Layer(engine, name, m)]
    if base is nn.Embedding:
        if _frozen(name, m, w, None):
            return []
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            raise UnsupportedModuleError(
                "module %s: Embedding with max_norm, scale_grad_by_freq or sparse=True is not "
                "supported" % _label(name, m))
        return [_EmbeddingLayer(engine, name, m)]
    if base in (nn.LayerNorm, _RMSNorm):
        if _frozen(name, m, w, getattr(m, "bias", None)):
            return []
        if len(m.normalized_shape) != 1:
            raise UnsupportedModuleError(
                "module %s: only normalization over the last dimension is supported "
                "(normalized_shape %s)" % (_label(name, m), tuple(m.normalized_shape)))
        return [_NormLayer(engine, name, m, "layernorm" if base is nn.LayerNorm else "rmsnorm")]
    return _conv.build(engine, name, m) or []


def _subclass(engine: Any, name: str, m: nn.Module, base: type) -> List[_Layer]:
    """A subclass of base with a forward of its own: trained through its
    calls of base's forward where registered as kind="subclass", else
    refused (unless it trains nothing)."""
    made = _as_base(engine, name, m, base)
    if not made:
        return made
    reg = registered(type(m))
    if reg is not None and reg["kind"] == "same":
        for l in made:
            l.what = "an nn.%s (registered kind='same')" % base.__name__
            l.hint = ("its forward computes something else than nn.%s's: register it as what "
                      "it computes, or not at all" % base.__name__)
        return made
    if reg is None or reg["kind"] != "subclass":
        raise UnsupportedModuleError(
            "module %s subclasses nn.%s with a forward of its own, which dpclip does not "
            "know: trained as an nn.%s it could be silently wrong (a scaled output would be "
            "clipped unscaled). If its forward uses the weight only through "
            "super().forward(...), transforming that call's inputs and output per sample (a "
            "scale, an offset, shifted indices), register it: dpclip.torch.register(%s, "
            "kind='subclass') (checked against autograd on the first step); else freeze it "
            "or replace it with a module dpclip trains"
            % (_label(name, m), base.__name__, base.__name__, type(m).__name__))
    for l in made:
        l.via_super = base
        l.what = "a subclass of nn.%s, through its super().forward" % base.__name__
        l.hint = ("its forward does not reach the weight through super().forward(...) "
                  "alone, or mixes samples: unregister it, freeze it or replace it")
    return made


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_Layer]]:
    """The _Layers for module m (empty when it trains nothing), or None when
    dpclip does not support it. Raises for a supported module configured
    in a way dpclip cannot train, and for a subclass of one with a forward
    of its own that is not registered as kind="subclass"."""
    from . import _mha, _relbias, _tablerows  # noqa: E402 (they import this module's imports)

    base = supported_base(type(m))
    if base is not None and type(m).forward is base.forward:
        return _as_base(engine, name, m, base)
    made = _mha.layers_for(engine, name, m)
    if made is not None:
        return made
    made = _relbias.layers_for(engine, name, m)
    if made is not None:
        return made
    made = _tablerows.layers_for(engine, name, m)
    if made is not None:
        return made
    reg = registered(type(m))
    if reg is not None and reg["kind"] not in ("subclass", "same"):
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
                "last dimension has a 1-D weight"
                % (_label(name, m), reg["kind"], reg["weight"], tuple(w.shape)))
        if isinstance(reg["eps"], str) and not isinstance(getattr(m, reg["eps"], None),
                                                          (float, int)):
            raise UnsupportedModuleError(
                "module %s is registered with eps=%r, but has no such number"
                % (_label(name, m), reg["eps"]))
        l = _NormLayer(engine, name, m, reg["kind"], weight=w,
                       bias=b if b is not None else False, eps=reg["eps"],
                       offset=reg["offset"], hf_style=True)
        l.what = "a registered %s" % reg["kind"]
        l.hint = ("register it with the kind, weight and eps it computes "
                  "(dpclip.torch.register), or not at all")
        return [l]
    if base is not None:
        return _subclass(engine, name, m, base)
    if _is_hf_conv1d(m):
        if _frozen(name, m, getattr(m, "weight", None), m.bias):
            return []
        l = _HFConv1DLayer(engine, name, m)
        l.what = "a Conv1D (a Linear with its weight [in, out])"
        l.hint = "register it as what it computes, or not at all"
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
    kinds = ", ".join(what for what, _ in supported_layers()
                      if not what.startswith(("norms registered", "subclasses")))
    return UnsupportedModuleError(
        "module %s has trainable parameters (%s) but is not supported by dpclip (supported: "
        "%s, and registered norms and subclasses: dpclip.torch.supported_layers()); %s"
        % (_label(name, m), ", ".join(params), kinds, hint))
