"""Embeddings whose forward reads rows of the table itself: Whisper's
decoder positions (WhisperPositionalEmbedding: weight[past : past + T], or
weight[position_ids]), by class name.

Their output is often shared by the batch ([T, d], added to every
sample's [B, T, d]), so autograd gives the table only the batch's summed
gradient. dpclip runs the module's own forward with its weight replaced by
a detached copy (the rows it read are on the output's autograd node: a
slice, or an index), and returns, in the output's place, a leaf of B rows
equal to it, [B, T, d] (the same values once broadcast; an output that has
its batch already is kept as it is). The gradient autograd gives that leaf
is each sample's own; the daemon gets it as an embedding over the rows
read (indices [B, T], output grads [B, T, d]).

The caller must broadcast the output over the batch (Whisper adds it to
the token embeddings). The first step checks the per-sample rule against
autograd through the module's own forward in float64 for the first
samples; a module whose output is used otherwise (its batch dimension
unexpected) fails there or in the caller, by name."""
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from . import _rows
from ._layers import UnsupportedModuleError, _EmbeddingLayer, _label
from ._verify import K, check_table_rule

__all__ = ["NAMES", "layers_for"]

NAMES = ("WhisperPositionalEmbedding",)


def _rows_read(out: torch.Tensor) -> Optional[torch.Tensor]:
    """The table rows an output [..., d] holds, as indices out.shape[:-1],
    from its autograd node (a slice of dimension 0, or one index tensor),
    else None."""
    node = out.grad_fn
    if node is None:
        return None
    name = node.name()
    if name == "SliceBackward0" and int(node._saved_dim) == 0:
        start, end, step = int(node._saved_start), int(node._saved_end), int(node._saved_step)
        n = out.shape[0]
        idx = torch.arange(start, start + n * step, step, device=out.device)
        return idx if end >= start + (n - 1) * step else None
    if name == "IndexBackward0":
        idxs = list(node._saved_indices)
        if len(idxs) == 1 and idxs[0] is not None and idxs[0].dtype != torch.bool:
            return idxs[0]
    return None


class _TableRowsLayer(_EmbeddingLayer):
    """The module's table, trained through the rows its forward reads."""
    rowwise = False

    def __init__(self, engine: Any, name: str, module: nn.Module) -> None:
        super().__init__(engine, name, module)
        self.what = "%s (its forward reads rows of its table)" % type(module).__name__
        self.hint = ("its forward does not return rows of its table for the caller to "
                     "broadcast over the batch: freeze it")
        self._probe: Optional[Tuple[tuple, dict, torch.Tensor]] = None

    def _forward(self, mod: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        w = mod._parameters["weight"]  # pylint: disable=protected-access
        leaf = w.detach().requires_grad_(True)
        mod._parameters["weight"] = leaf  # pylint: disable=protected-access
        try:
            out = self._orig_forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            mod._parameters["weight"] = w  # pylint: disable=protected-access
        idx = _rows_read(out) if isinstance(out, torch.Tensor) else None
        B = _rows.pass_batch(self.engine)
        if idx is None or B is None or tuple(idx.shape) != tuple(out.shape[:-1]):
            raise UnsupportedModuleError(
                "module %s: its forward did not return rows of its table (a slice or an "
                "index of its weight) after a batch-first module of the pass: %s"
                % (_label(self.name, self.module), self.hint))
        # shared by the batch: [T, d], or [1, T, d]; else its own batch [B, T, d]
        if out.dim() == 2:
            rows, ii = out.detach().expand((B,) + tuple(out.shape)), idx.expand(B, -1)
        elif out.dim() >= 3 and out.shape[0] in (1, B):
            shape = (B,) + tuple(out.shape[1:])
            rows, ii = out.detach().expand(shape), idx.expand(shape[:-1])
        else:
            raise UnsupportedModuleError(
                "module %s: its forward returned rows %s for a batch of %d: %s"
                % (_label(self.name, self.module), tuple(out.shape), B, self.hint))
        shared = out.dim() == 2 or out.shape[0] == 1
        rows = rows.clone().requires_grad_(True)
        ii = ii.reshape(B, -1)
        pass_id = self.engine._pass
        rows.register_hook(lambda g: self._take(ii, g, pass_id, args, kwargs, shared))
        return rows

    def _take(self, ii: torch.Tensor, g: torch.Tensor, pass_id: int, args: tuple,
              kwargs: dict, shared: bool) -> None:
        gi = g.detach().reshape(g.shape[0], -1, g.shape[-1])
        if self.verify is not None and self._probe is None:
            self._probe = (args, kwargs, g.detach()[:K].double(), shared)  # type: ignore
        self.capture(ii, gi, pass_id)

    def self_check(self, tol: float) -> None:
        """The first step's check (dpclip._verify.check_step): the rule (the
        rows' scatter of each sample's output gradient) against autograd's
        through the module's own forward, for the first samples."""
        if self._probe is None:
            return
        args, kwargs, gs, shared = self._probe  # type: ignore[misc]
        self._probe = None

        def per_sample(b: int, out: torch.Tensor
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            idx = _rows_read(out)
            if shared:  # [T, d] or [1, T, d]: sample b's gradient of it
                return gs[b].reshape(out.shape), idx.reshape(-1), gs[b]  # type: ignore
            cot = torch.zeros_like(out)
            cot[b] = gs[b]
            return cot, idx[b].reshape(-1), gs[b]  # type: ignore
        check_table_rule(self, self.module, self._orig_forward, args, kwargs,  # type: ignore
                         gs.shape[0], per_sample, "its own forward", tol)


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_EmbeddingLayer]]:
    """The layer of an embedding that reads its table's rows itself (by
    class name; empty: frozen), or None for other modules."""
    if type(m).__name__ not in NAMES or not isinstance(m, nn.Embedding):
        return None
    return [_TableRowsLayer(engine, name, m)] if m.weight.requires_grad else []
