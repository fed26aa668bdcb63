"""Flattened tokens: a module that gets its sequence as rows [B*T, d]
instead of [B, T, d] (OPT's decoder reshapes the hidden states before its
final LayerNorm and MLP; many models flatten before a head).

A per-sample rule needs the sample of each row. Rows are sample-major,
sample b's being rows [b T, (b + 1) T), when the tensor is a reshape of a
batch-first tensor [B, ...] (a reshape keeps the elements' logical order),
or is made from such tensors row by row: by elementwise functions (an
activation, dropout's mask, a residual sum, a product of two such, a
broadcast parameter). sample_rows proves it from the autograd graph that
made the tensor, or answers None: a transpose, an index, a gather (a
mixture-of-experts' token routing) or anything it does not know stops the
proof, and the module is then treated as before (its input's leading size
taken for the batch, which the step's batch check refuses by name).

The batch found is the leading size of the tensor that was reshaped. The
planner then checks it against every other module's batch
(_planner.batch_size), as it does for inputs that are batch-first."""
from typing import Dict, Optional

import torch

__all__ = ["sample_rows"]

# reshapes: the source's sizes are saved on the node (torch 1.13 and 2.x)
_VIEWS = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "ViewBackward1"}
# elementwise, row by row, whatever their other operands (constants, or
# parameters broadcast over the rows)
_ELEMENTWISE = {
    "ReluBackward0", "GeluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0",
    "NativeDropoutBackward0", "CloneBackward0", "ToCopyBackward0", "NegBackward0",
    "LeakyReluBackward0", "EluBackward0", "SoftplusBackward0", "HardtanhBackward0",
    "HardswishBackward0", "MishBackward0", "PowBackward0", "ExpBackward0",
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward1",
    "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
}
_MAX_NODES = 64


def sample_rows(x: torch.Tensor) -> Optional[int]:
    """B where x [N, ...] holds B samples' rows, each sample's N / B
    consecutive rows in sample order (proved as the module docstring
    says), else None."""
    if x.dim() < 2:
        return None
    if x.grad_fn is None:  # no graph (data, or no grad): a plain reshape of it
        base = x._base
        if base is not None and base.dim() >= 2 and base.is_contiguous() and \
                x.is_contiguous() and x.data_ptr() == base.data_ptr() and \
                x.numel() == base.numel():
            return _fits(x, base.shape[0])
        return None
    B = _walk(x.grad_fn, x.numel(), {})
    return _fits(x, B) if B else None


def _fits(x: torch.Tensor, B: int) -> Optional[int]:
    N = x.shape[0]
    return B if 0 < B < N and N % B == 0 else None


def _walk(node: object, numel: int, seen: Dict[int, Optional[int]]) -> Optional[int]:
    """The batch of the reshaped batch-first tensor every row-carrying
    branch leads to through elementwise nodes (the same on all), or None.
    seen: what each node visited gave (a node two branches share)."""
    if node is None:
        return None
    if id(node) in seen:
        return seen[id(node)]
    if len(seen) >= _MAX_NODES:
        return None
    seen[id(node)] = None  # (a graph has no cycle; this only bounds the walk)
    seen[id(node)] = found = _visit(node, numel, seen)
    return found


def _visit(node: object, numel: int, seen: Dict[int, Optional[int]]) -> Optional[int]:
    name = node.name()  # type: ignore[attr-defined]
    if name in _VIEWS:
        sizes = tuple(getattr(node, "_saved_self_sym_sizes", None) or
                      getattr(node, "_saved_self_sizes", None) or ())
        n = 1
        for s in sizes:
            n *= int(s)
        return int(sizes[0]) if len(sizes) >= 2 and n == numel else None
    if name not in _ELEMENTWISE:
        return None
    found = None
    for nxt, _ in node.next_functions:  # type: ignore[attr-defined]
        if nxt is None or nxt.name() == "torch::autograd::AccumulateGrad":
            continue  # a constant, or a parameter broadcast over the rows
        B = _walk(nxt, numel, seen)
        if B is None or (found is not None and B != found):
            return None
        found = B
    return found
