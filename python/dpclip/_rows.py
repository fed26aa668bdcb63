"""Flattened tokens: a module that gets its sequence as rows [N, d] instead
of [B, T, d]. OPT's decoder reshapes the hidden states to [B*T, d] before
its final LayerNorm and MLP; a mixture of experts (Mixtral's) gives each
expert the rows of the tokens its router picked, in token order.

A per-sample rule needs the sample of each row. row_samples proves it from
the autograd graph that made the tensor, as a map sid [N] (row r is sample
sid[r]'s), through:
- reshapes that keep the last dimension (they keep the rows' logical
  order); the one whose source is batch-first, [B, ...] with B the pass's
  batch (what its batch-first modules saw), gives each of its rows its
  sample: the anchor;
- indexing the rows with one index tensor (x[idx], x[None, idx],
  index_select): row r of the result is source row idx[r];
- elementwise functions, each operand's rows proved to the same map (an
  activation, dropout's mask, a residual sum, a product of two), or a
  constant or parameter broadcast over them;
- columns of each row, split or sliced along the last dimension (a gated
  MLP's gate and up halves);
- one index taken along a middle dimension of a batch-first tensor (a
  pooled h[:, 0]);
- dpclip's own output on such rows (RowsFn), which carries its map.
A transpose, a sort, a scatter, a matmul with data, or anything else stops
the proof (None), and the module is treated as before: its input's leading
size taken for the batch, which the step's batch check refuses by name.

The wrapper (_layers._Layer.attach) then runs the module on [B, T, d]:
sample-major rows of one length are a reshape; others are placed in a
zero-padded [B, Tmax, d] (a zero row adds nothing to a per-sample gradient,
its output unused) and their outputs gathered back (RowsFn)."""
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["row_samples", "to_batch", "ranks", "RowsFn", "note_batch", "pass_batch", "flat_rows",
           "flat_forward", "is_batch"]

# reshapes: the source's sizes are saved on the node (torch 1.13 and 2.x)
_VIEWS = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "ViewBackward1",
          "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"}
# elementwise, row by row, whatever their other operands (constants, or
# parameters broadcast over the rows)
_ELEMENTWISE = {
    "ReluBackward0", "GeluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0",
    "NativeDropoutBackward0", "CloneBackward0", "ToCopyBackward0", "NegBackward0",
    "LeakyReluBackward0", "EluBackward0", "SoftplusBackward0", "HardtanhBackward0",
    "HardswishBackward0", "MishBackward0", "PowBackward0", "ExpBackward0",
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1",
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
    "MaskedFillBackward0",
}
# a part of each row: columns along the last dimension (_columns)
_LAST_DIM = {"SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"}
_MAX_NODES = 64
Memo = Dict[int, Optional[torch.Tensor]]


def row_samples(x: torch.Tensor, batch: Optional[int]) -> Optional[torch.Tensor]:
    """sid [N]: the sample of each row of x [N, d] (proved as the module
    docstring says; batch: the pass's batch), or None, also where the
    pass's batch is not known yet (no batch-first module ran before)."""
    if x.dim() != 2 or batch is None:
        return None
    if x.grad_fn is None:  # no graph (data, or no grad): a plain reshape of it
        base = x._base
        if base is not None and base.dim() >= 2 and base.is_contiguous() and \
                x.is_contiguous() and x.data_ptr() == base.data_ptr() and \
                x.numel() == base.numel() and base.shape[-1] == x.shape[-1]:
            return _anchor(base.shape[0], x.shape[0], batch)
        return None
    return _rows(x.grad_fn, x.shape[0], x.shape[1], batch, {})


def _anchor(lead: int, n: int, batch: Optional[int]) -> Optional[torch.Tensor]:
    """The map of n rows reshaped from a tensor of leading size lead, if that
    is the batch."""
    if lead != batch or n % lead:
        return None
    return torch.arange(lead).repeat_interleave(n // lead)


def _rows(node: Any, n: int, d: int, batch: Optional[int], memo: Memo) -> Optional[torch.Tensor]:
    """The map of the n rows (of width d) of the tensor node made, or None."""
    if node is None:
        return None
    key = (id(node), n)
    if key in memo:
        return memo[key]  # type: ignore[index]
    if len(memo) >= _MAX_NODES:
        return None
    memo[key] = None  # type: ignore[index]
    memo[key] = found = _visit(node, n, d, batch, memo)  # type: ignore[index]
    return found


def _sizes(node: Any, *names: str) -> Tuple[int, ...]:
    for name in names:
        v = getattr(node, name, None)
        if v is not None:
            return tuple(int(s) for s in v)
    return ()


def _visit(node: Any, n: int, d: int, batch: Optional[int], memo: Memo) -> Optional[torch.Tensor]:
    sid = getattr(node, "dpclip_sid", None)  # dpclip's own output (RowsFn)
    if isinstance(sid, torch.Tensor):
        return sid if sid.numel() == n else None
    name = node.name()
    nexts = [f for f, _ in node.next_functions]
    if name in _VIEWS:
        src = _sizes(node, "_saved_self_sym_sizes", "_saved_self_sizes")
        if name.startswith(("Unsqueeze", "Squeeze")):
            # a unit dimension added or removed ahead of the last: same rows
            return _rows(nexts[0], n, d, batch, memo)
        if len(src) < 2 or src[-1] != d:
            return None
        found = _anchor(src[0], n, batch)
        return found if found is not None else _rows(nexts[0], n, d, batch, memo)
    if name in ("IndexBackward0", "IndexSelectBackward0"):
        return _indexed(node, name, nexts[0], n, d, batch, memo)
    if name in _LAST_DIM:
        return _columns(node, nexts[0], n, batch, memo)
    if name == "SelectBackward0":
        return _selected(node, n, batch)
    if name not in _ELEMENTWISE:
        return None
    found = None
    for nxt in nexts:
        if nxt is None or nxt.name() == "torch::autograd::AccumulateGrad":
            continue  # a constant, or a parameter broadcast over the rows
        sid = _rows(nxt, n, d, batch, memo)
        if sid is None or (found is not None and not torch.equal(sid, found)):
            return None
        found = sid
    return found


def _dim(node: Any) -> int:
    """A node's saved dimension, signed (some are saved unsigned: -1 reads
    2^64 - 1)."""
    dim = int(node._saved_dim)
    return dim - 2**64 if dim >= 2**63 else dim


def _columns(node: Any, nxt: Any, n: int, batch: Optional[int], memo: Memo
             ) -> Optional[torch.Tensor]:
    """Columns of rows taken along the last dimension (a gated MLP's chunk
    into gate and up): the same rows as the source's."""
    src = _sizes(node, "_saved_self_sym_sizes", "_saved_self_sizes")
    dim = _dim(node)
    if len(src) != 2:
        return None
    if dim % 2 == 0:  # along the rows: only the whole of them (x[:, a:b] slices both)
        whole = node.name() == "SliceBackward0" and int(node._saved_start) == 0 and \
            int(node._saved_step) == 1 and int(node._saved_end) >= src[0]
        return _rows(nxt, n, src[-1], batch, memo) if whole else None
    return _rows(nxt, n, src[-1], batch, memo)


def _selected(node: Any, n: int, batch: Optional[int]) -> Optional[torch.Tensor]:
    """One index taken along a dimension between the first and the last
    of a batch-first tensor (a pooled [B, d] = h[:, 0]): each row is still
    its sample's."""
    src = _sizes(node, "_saved_self_sym_sizes", "_saved_self_sizes")
    dim = _dim(node)
    if len(src) < 3 or not 0 < dim % len(src) < len(src) - 1:
        return None
    return _anchor(src[0], n, batch)


def _indexed(node: Any, name: str, nxt: Any, n: int, d: int, batch: Optional[int],
             memo: Memo) -> Optional[torch.Tensor]:
    """Rows picked by one index tensor along one dimension ahead of the last."""
    src = _sizes(node, "_saved_self_sizes", "_saved_self_sym_sizes")
    if len(src) < 2 or src[-1] != d:
        return None
    if name == "IndexSelectBackward0":
        dim, idx = int(node._saved_dim), node._saved_index
    else:
        idxs = list(node._saved_indices)
        at = [i for i, t in enumerate(idxs) if t is not None]
        if len(at) != 1:
            return None
        dim, idx = at[0], idxs[at[0]]
    if idx is None or idx.dim() != 1 or idx.dtype == torch.bool or dim >= len(src) - 1:
        return None
    rows_src = 1
    for s in src[:-1]:
        rows_src *= s
    grid = torch.arange(rows_src).view(src[:-1])
    picked = grid.index_select(dim, idx.detach().cpu().long() % src[dim]).reshape(-1)
    if picked.numel() != n:
        return None
    sid = _rows(nxt, rows_src, d, batch, memo)
    return None if sid is None else sid[picked]


class RowsFn(torch.autograd.Function):
    """Rows [N, p] gathered from [B, Tmax, p] at (sid, pos), marked with
    their map for the modules that read them (row_samples)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, sid: torch.Tensor, pos: torch.Tensor
                ) -> torch.Tensor:
        ctx.shape = y.shape
        ctx.save_for_backward(sid, pos)
        ctx.dpclip_sid = sid.cpu()
        return y[sid, pos]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        sid, pos = ctx.saved_tensors
        out = g.new_zeros(ctx.shape)
        out[sid, pos] = g
        return out, None, None


def ranks(key: torch.Tensor, bins: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows per bin [bins], each row's rank among its bin's rows, in row
    order) for the bin of each row, key [N] (on the host): where a row goes
    in a zero-padded [bins, most] layout."""
    counts = torch.bincount(key, minlength=bins)
    order = torch.sort(key, stable=True)[1]
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(key)
    pos[order] = torch.arange(key.numel()) - starts[key[order]]
    return counts, pos


def to_batch(x: torch.Tensor, sid: torch.Tensor, B: int
             ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """x [N, d] as [B, T, d]: a reshape where sid is sample-major with T rows
    each (at None), else zero-padded to the most rows a sample has, with
    the (sid, pos) its rows went to (on x's device)."""
    N = x.shape[0]
    if N and N % B == 0 and torch.equal(sid, torch.arange(B).repeat_interleave(N // B)):
        return x.reshape(B, N // B, x.shape[1]), None
    counts, pos = ranks(sid, B)
    sid_d, pos_d = sid.to(x.device), pos.to(x.device)
    most = int(counts.max()) if N else 1  # (no rows: one zero row a sample)
    xb = x.new_zeros((B, most, x.shape[1])).index_put((sid_d, pos_d), x)
    return xb, (sid_d, pos_d)


# --- the layers' side (_layers._Layer.attach) ---------------------------------------

def note_batch(engine: Any, n: int) -> None:
    """The pass's batch, as its first batch-first module saw it (a token
    embedding's [B, T], a Linear's [B, T, d]): what flattened tokens must be
    a reshape of (dpclip._rows), and what positions [1, T] expand to."""
    hint = getattr(engine, "_batch_hint", None)
    if n > 1 and (hint is None or hint[0] != engine._pass):
        engine._batch_hint = (engine._pass, n)


def pass_batch(engine: Any) -> Optional[int]:
    hint = getattr(engine, "_batch_hint", None)
    return hint[1] if hint is not None and hint[0] == engine._pass else None


def flat_rows(layer: Any, x: torch.Tensor) -> bool:
    """Whether x [N, d] holds flattened tokens whose samples are proved
    (dpclip._rows); sets layer.sid. Rows that are the pass's batch already
    are not (a classifier's [B, d])."""
    B = pass_batch(layer.engine)
    if B is not None and x.shape[0] == 0:  # an expert no token was routed to
        layer.sid = torch.zeros(0, dtype=torch.long)
        return True
    sid = row_samples(x, B)
    if sid is None or sid.numel() == 0 or is_batch(sid, B):
        # (unproved rows are taken as batch-first, and B of them as the
        # batch: the step's batch check refuses any other count)
        return False
    layer.sid = sid
    return True


def is_batch(sid: torch.Tensor, B: Optional[int]) -> bool:
    """Whether a proved map is row b = sample b, all B of them (a
    classifier's [B, d]): batch-first as it is. Only the map says so: B
    rows an index picked (an expert's) may all be one sample's."""
    return B is not None and sid.numel() == B and bool(torch.equal(sid, torch.arange(B)))


def flat_forward(layer: Any, mod: Any, x: torch.Tensor) -> torch.Tensor:
    """The layer on flattened tokens x [N, d]: run on [B, T, d] (rows
    reshaped, or placed zero-padded), its output given back as x's rows."""
    sid, B = layer.sid, pass_batch(layer.engine)
    xb, at = to_batch(x, sid, B)
    yb = layer._forward(mod, xb)
    if at is None:
        return yb.reshape(x.shape[0], yb.shape[-1])
    return RowsFn.apply(yb, *at)
