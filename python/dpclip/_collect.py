"""make_private's walk of the module tree: which module each trainable
parameter is trained through (a _Layer of dpclip._layers, or of the layer
kinds the registry knows: dpclip._registry, _linfn, _params), shared
weights tied or merged, and everything else refused by name. It builds on
every layer kind; none of them imports it."""
from typing import Any, List, Tuple

import torch.nn as nn

from . import _linfn, _params, _registry
from ._layers import (_NORMS, UnsupportedModuleError, _EmbeddingLayer, _Layer, _label, _mixing,
                      _mixing_error, bind_outputs)

__all__ = ["collect_layers"]


def _tie(a: "_Layer", b: "_Layer") -> None:
    """Marks b's weight as a's (a met first): an Embedding and a Linear (a
    language model's input embedding and output projection), or b merged
    into a where both are embeddings (_merge). Anything else that shares a
    parameter is refused."""
    if type(a) is _Layer and isinstance(a.tied_by, _EmbeddingLayer):
        a = a.tied_by  # a Linear tied to an embedding met first: merge into that one
    if type(a) is _EmbeddingLayer and type(b) is _EmbeddingLayer and a.weight is b.weight and \
            a.padding_idx == b.padding_idx and a.merged_into is None:
        _merge(a, b)
        return
    kinds = {type(a), type(b)}
    if kinds != {_Layer, _EmbeddingLayer} or a.weight.shape != b.weight.shape or \
            a.tie is not None or a.tied_by is not None:
        raise UnsupportedModuleError(
            "modules %s and %s share a parameter: dpclip trains a weight shared by one "
            "nn.Embedding and one nn.Linear of the same shape (tied input and output "
            "embeddings); untie the others" % (_label(a.name, a.module), _label(b.name, b.module)))
    b.tie, a.tied_by = a, b


def _merge(a: "_Layer", b: "_Layer") -> None:
    """b, an embedding of a's weight in another module (BART's encoder and
    decoder token embeddings and its `shared`), merged into a: b's lookups
    are a's, each sample's concatenated along its positions, which is
    exact (a table's per-sample gradient is the scatter of every lookup of
    it, whichever module made it), so that the per-sample norm covers
    every use, cross terms included, and a Linear tied to the weight ties
    to a. The first-step check checks a's rule against all their uses."""
    b.merged_into = a
    a.merged.append(b)


def collect_layers(engine: Any, module: nn.Module
                   ) -> Tuple[List[_Layer], List[Tuple[str, nn.Module]]]:
    """make_private's walk of the module tree: the _Layers of the supported
    modules with a trainable weight, and the normalizations whose mode is
    checked at each forward. UnsupportedModuleError names any module it
    cannot train. A parameter owned by an unsupported module is fine where
    a supported one uses it too (BERT's prediction head holds the bias its
    decoder Linear uses)."""
    layers, norms, pending = [], [], []
    owner = {}  # id(param) -> the _Layer that trains it
    claimed = set()  # modules a layer of another module trains (T5's relative bias)
    for name, m in module.named_modules():
        why = _mixing(m)
        if why is not None:
            raise _mixing_error(name, m, why)
        if isinstance(m, _NORMS):
            norms.append((name, m))
        own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
        made = [] if id(m) in claimed else _registry.layers_for(engine, name, m)
        if own:  # each trained by some layer, checked once every layer is known
            pending.append((name, m, own, made is not None))
        if made is None:
            continue
        for l in made:
            claimed.update(id(c) for c in getattr(l, "claims", ()))
            more = [q for q, _ in l.outputs() if q is not l.weight and q is not l.bias]
            for p in [l.weight, l.bias] + more:
                if p is None:
                    continue
                other = owner.get(id(p))
                if other is None:
                    owner[id(p)] = l
                elif other.module is not l.module:
                    if p is not l.weight or p is not other.weight:
                        raise UnsupportedModuleError(
                            "modules %s and %s share a parameter (%s): dpclip trains a shared "
                            "weight of an nn.Embedding and an nn.Linear only"
                            % (_label(other.name, other.module), _label(name, m),
                               "bias" if p is l.bias else "weight"))
                    _tie(other, l)
            layers.append(l)
    # raw parameters broadcast over the batch (ViT's tokens) or passed to
    # F.linear (a router's, experts'), of modules no layer trains, once
    # every other layer owns what it trains (BERT's head holds the bias its
    # decoder Linear trains)
    for i, (name, m, own, supported) in enumerate(pending):
        left = [(pn, p) for pn, p in own if id(p) not in owner]
        made = None if supported else (_params.broadcast_layers(engine, name, m, left) or
                                       _linfn.layers_for(engine, name, m, left))
        for l in made or ():
            for p, _ in l.outputs():
                owner[id(p)] = l
            layers.append(l)
        if made:
            pending[i] = (name, m, own, True)
    for name, m, own, supported in pending:
        left = [pn for pn, p in own if id(p) not in owner]
        if left and not supported:
            raise _registry.unsupported(name, m, left)
        if left:
            # an extra parameter on a module dpclip trains (used by its
            # parent or a hook): its gradient would be autograd's, unclipped
            kept = [pn for pn, p in own if id(p) in owner]
            raise UnsupportedModuleError(
                "module %s has trainable parameters dpclip does not train (%s): it trains "
                "%s, what the module computes as dpclip knows it; a parameter added to it is "
                "used elsewhere (by its parent, by a hook), where no per-sample gradient is "
                "formed. Freeze it, or hold it in a module dpclip trains"
                % (_label(name, m), ", ".join(left), ", ".join(kept) or "none of them"))
    if not layers:
        raise UnsupportedModuleError("the module has no trainable parameters to train privately")
    bind_outputs(layers)
    return layers, norms
