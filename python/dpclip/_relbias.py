"""Relative position biases shared by the batch: T5's (T5Attention,
MT5Attention: an nn.Embedding from position buckets to one bias a head).

The attention computes the bias once, from [q, k] bucket indices, as
[1, heads, q, k], and adds it to every sample's scores (with the mask, and
again in every later layer of the stack). So the embedding's output is
shared by the batch, and autograd gives the table only the batch's summed
gradient. dpclip wraps the attention's compute_bias: the module's own code
runs with the embedding's lookup recorded (the bucket indices) and its
weight detached, and the bias it returns is replaced by a leaf of B rows
equal to it (the same values, so the same scores). The gradient autograd
gives that leaf, [B, heads, q, k], is each sample's own; the daemon gets it
as an embedding over the buckets (indices [B, q k], output grads
[B, q k, heads]), which clips and sums it with the rest.

That the module's code maps lookup [q, k, heads] to bias [1, heads, q, k]
by that permutation is checked on the first step, against autograd through
the module's own compute_bias in float64 for the first samples, as the
other layers are (dpclip._verify); a module that computes its bias
otherwise is refused by name."""
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _rows
from ._layers import UnsupportedModuleError, _EmbeddingLayer, _label
from ._verify import K, check_table_rule

__all__ = ["NAMES", "layers_for"]

# the attention classes whose relative bias is trained so (by class name)
NAMES = ("T5Attention", "MT5Attention")


class _RelBiasLayer(_EmbeddingLayer):
    """The relative_attention_bias embedding of `attn`, trained through
    attn.compute_bias (see the module docstring). claims: the embedding
    module, which no other layer trains."""
    rowwise = False

    def __init__(self, engine: Any, name: str, attn: nn.Module) -> None:
        self.attn = attn
        emb = attn.relative_attention_bias
        super().__init__(engine, (name + "." if name else "") + "relative_attention_bias", emb)
        self.claims = [emb]
        self.what = "%s's relative position bias, shared by the batch" % type(attn).__name__
        self.hint = ("its compute_bias does not return the lookup permuted to [1, heads, q, k]: "
                     "freeze relative_attention_bias")
        self._orig_bias: Optional[Callable[..., Any]] = None
        # the first step's check: (compute_bias's arguments, the buckets, the
        # first samples' bias gradients in f64) of the first call captured
        self._probe: Optional[Tuple[tuple, dict, torch.Tensor, torch.Tensor]] = None

    def attach(self) -> None:
        layer, orig = self, self.attn.compute_bias

        def compute_bias(*args: Any, **kwargs: Any) -> Any:
            if not layer.active():
                return orig(*args, **kwargs)
            return layer._bias(orig, args, kwargs)

        self._orig_bias = orig
        self.attn.compute_bias = compute_bias

    def detach(self) -> None:
        if self._orig_bias is not None:
            try:
                del self.attn.compute_bias  # the instance attribute; the method shows again
            except AttributeError:
                pass
            self._orig_bias = None

    def _bias(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> torch.Tensor:
        emb, seen = self.module, {}

        def lookup(idx: torch.Tensor) -> torch.Tensor:
            seen["idx"] = idx
            return F.embedding(idx, emb.weight.detach())

        emb.forward = lookup
        try:
            values = orig(*args, **kwargs)
        finally:
            del emb.forward
        idx = seen.get("idx")
        B = _rows.pass_batch(self.engine)
        if idx is None or not isinstance(values, torch.Tensor) or values.dim() != 4 or \
                values.shape[0] != 1 or tuple(values.shape[2:]) != tuple(idx.shape) or B is None:
            raise UnsupportedModuleError(
                "module %s: its compute_bias did not look up [q, k] buckets and return a bias "
                "[1, heads, q, k] after a batch-first module of the pass (seen: %s): %s"
                % (_label(self.name, self.attn), None if idx is None else tuple(idx.shape),
                   self.hint))
        rows = values.detach().expand((B,) + tuple(values.shape[1:])).clone()
        rows.requires_grad_(True)
        pass_id = self.engine._pass
        rows.register_hook(lambda g: self._take(idx, g, pass_id, args, kwargs))
        return rows

    def _take(self, idx: torch.Tensor, g: torch.Tensor, pass_id: int, args: tuple,
              kwargs: dict) -> None:
        B, h = g.shape[0], g.shape[1]
        gi = g.detach().permute(0, 2, 3, 1).reshape(B, -1, h)
        ii = idx.reshape(1, -1).expand(B, -1)
        if self.verify is not None and self._probe is None:
            self._probe = (args, kwargs, idx, g.detach()[:K].double())
        self.capture(ii, gi, pass_id)

    def self_check(self, tol: float) -> None:
        """The first step's check (dpclip._verify.check_step calls it): the
        per-sample table gradients by the rule (the buckets' scatter of the
        bias gradient) against autograd's through the module's own
        compute_bias, for the first samples."""
        if self._probe is None:
            return
        args, kwargs, idx, gs = self._probe
        self._probe = None

        def per_sample(b: int, values: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # the bias [1, h, q, k] is the lookup [q, k, h] permuted
            return gs[b:b + 1], idx.reshape(-1), gs[b].permute(1, 2, 0)
        check_table_rule(self, self.attn, self._orig_bias, args, kwargs,  # type: ignore
                         gs.shape[0], per_sample, "the module's own compute_bias", tol)


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_EmbeddingLayer]]:
    """The relative-bias layer of a T5-style attention (empty: it has none,
    or it is frozen), or None for other modules."""
    if type(m).__name__ not in NAMES:
        return None
    emb = getattr(m, "relative_attention_bias", None)
    if not getattr(m, "has_relative_attention_bias", False) or not isinstance(emb, nn.Embedding):
        return []
    if not emb.weight.requires_grad:
        return []
    return [_RelBiasLayer(engine, name, m)]
