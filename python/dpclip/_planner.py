"""The step planner: what one optimizer step sends the daemon. From the
(input, output grad) pairs the layers captured in one forward/backward pass
it finds the batch size, lays each layer's tensors out in the shapes and
dtypes the daemon reads (a LayerPlan per layer), adds the layers to a
dpclip Step given each tensor's reference in a transport (_host, _cuda), and
writes the daemon's outputs into param.grad. It holds no state: the engine
(dpclip.torch) owns the layers and the Step."""
import collections
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _lib
from ._layers import _FLOAT_WIRE, _Layer, _wire_dtype

# refs(i) -> (input ref, output grad ref, weight out ref, bias out ref) of
# the plan's layer i, in the transport's buffers.
Refs = Callable[[int], Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]]


class LayerPlan(NamedTuple):
    """One layer of a step: its captured input and output gradient (None
    where it has none this step: the transport sends zeros), and the shapes
    and dtypes they travel in (inputs [B, T, d] or indices [B, T], output
    grads [B, T, p or d])."""
    layer: _Layer
    inp: Optional[torch.Tensor]
    grad: Optional[torch.Tensor]
    in_shape: Tuple[int, ...]
    in_dtype: torch.dtype
    grad_shape: Tuple[int, ...]
    grad_dtype: torch.dtype


def batch_size(layers: Sequence[_Layer]) -> int:
    """The batch size of what the layers captured (0: nothing captured);
    ValueError naming a module that saw another."""
    counts: collections.Counter = collections.Counter()
    for l in layers:
        for inp, _, _ in l.records:
            counts[inp.shape[0] if inp.dim() > 0 else -1] += 1
    if not counts:
        return 0
    B = counts.most_common(1)[0][0]
    for l in layers:
        for inp, g, _ in l.records:
            if inp.dim() == 0 or inp.shape[0] != B or g.shape[0] != B:
                raise ValueError(
                    "module %s saw a batch of %s samples where the other modules saw %d: "
                    "inputs must be batch-first, with the sample in dimension 0 (e.g. "
                    "positional indices expanded to [B, T])"
                    % (l.name, tuple(inp.shape[:1]) or "a scalar", B))
    return B


def plan(layers: Sequence[_Layer], B: int) -> List[LayerPlan]:
    """A LayerPlan per layer. Layers not used in this pass (and every layer
    of an empty batch) get zeros of one position: norm 0, so the daemon adds
    noise alone to their params."""
    nb = max(B, 1)
    out = []
    for l in layers:
        if B > 0 and l.records:
            ins, gs = l.flat_parts(B)
            inp = ins[0] if len(ins) == 1 else torch.cat(ins, 1)
            g = gs[0] if len(gs) == 1 else torch.cat(gs, 1)
            T = inp.shape[1]
        else:
            inp = g = None
            T = 1
        gw = l.p if l.kind == "linear" else l.d
        if l.kind == "embedding":
            in_shape, in_dt = (nb, T), (_wire_dtype(inp) if inp is not None else torch.int64)
        else:
            in_shape = (nb, T, l.d)
            in_dt = _wire_dtype(inp) if inp is not None else torch.float32
        g_dt = _wire_dtype(g) if g is not None else torch.float32
        out.append(LayerPlan(l, inp, g, in_shape, in_dt, (nb, T, gw), g_dt))
    return out


def add_layers(step: _lib.Step, plan: Sequence[LayerPlan], algorithm: int, refs: Refs) -> None:
    """Adds every planned layer to the step, its tensors named by refs."""
    for i, lp in enumerate(plan):
        l = lp.layer
        a_ref, g_ref, w_ref, b_ref = refs(i)
        name = l.name.encode()
        if l.kind == "linear":
            step.add_linear(_lib.Linear(name, a_ref, g_ref, int(l.bias is not None),
                                        algorithm, w_ref, b_ref, 0.0))
        elif l.kind == "embedding":
            pad = l.padding_idx
            step.add_embedding(_lib.Embedding(name, a_ref, g_ref, l.vocab, int(pad is not None),
                                              pad if pad is not None else 0, w_ref, 0.0))
        else:
            eps = l.eps_used if l.eps_used is not None else \
                l.eps_for(torch.empty(0, dtype=torch.float32))
            nl = _lib.NormLayer(name, a_ref, g_ref, eps, int(l.bias is not None), w_ref,
                                b_ref, 0.0)
            if l.kind == "layernorm":
                step.add_layernorm(nl)
            else:
                step.add_rmsnorm(nl)
        if l.replicated:
            step.set_replicated(i)


def out_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the daemon writes a parameter's gradient in: its own where
    the daemon writes it, else f32."""
    return weight.dtype if weight.dtype in _FLOAT_WIRE else torch.float32


def set_grad(p: torch.Tensor, src: torch.Tensor) -> None:
    """param.grad = a copy of src in the parameter's dtype (a copy: the
    transport's buffer is reused, and may be replaced, by the next step)."""
    if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype:
        p.grad = src.to(p.dtype, copy=True)
    else:
        p.grad.copy_(src)
