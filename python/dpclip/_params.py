"""Raw parameters a module uses directly in its forward, broadcast over the
batch: a class token [1, 1, d] expanded to every sample, position
embeddings [1, T, d] added to every sample's tokens (ViT's, DeiT's).

A parameter of leading size 1 that the forward broadcasts over the batch
(or a vector, whose copy is [B, 1, d]: broadcast against [B, T, d] as the
vector is, or expanded to [B, 1, d] as CLIP's class embedding is) enters
each sample's computation alone, so its per-sample gradient is what
autograd gives a per-sample copy of it: for the forward, the module holds,
in the parameter's place, a leaf of B rows equal to the parameter (the
same values, so the same output), and the gradient autograd gives that
leaf is the per-sample gradient, row b sample b's (a broadcast add's
output gradient summed over the broadcast dimensions, an expand's summed
over the expanded ones). The trainer sends it as a per-sample part (a
Linear of one position and one input feature equal to 1,
_layers._persample_part), so the daemon clips and noises it with the
rest.

Whether the module does broadcast the parameter over the batch (rather
than mix the rows, index one, or reshape it) is not assumed: the
first-step check (dpclip._verify) compares the forward with the module's
own and each per-sample gradient with autograd's through the module's own
code for each sample alone, and refuses the module otherwise (a vector
used against [B, d], for one, gives the forward another shape). Parameters
of other shapes (a scalar, [C, 1, 1]) are refused at make_private by name,
as before."""
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn as nn

from ._layers import Part, UnsupportedModuleError, _label, _Layer, _persample_part

__all__ = ["broadcast_layers"]


def _broadcast(p: torch.Tensor) -> bool:
    """A parameter of leading size 1 over at least one more dimension, or a
    vector (CLIP's class embedding [d], expanded to [B, 1, d]; a layer-scale
    [d] multiplying [B, T, d])."""
    return (p.dim() >= 2 and p.shape[0] == 1) or p.dim() == 1


def _rows_shape(p: torch.Tensor, B: int) -> Tuple[int, ...]:
    """The per-sample copy's shape: B rows in the leading 1's place, or a
    vector's [B, 1, d] (broadcast against [B, T, d] as the vector is)."""
    return (B,) + tuple(p.shape[1:]) if p.dim() >= 2 else (B, 1, p.shape[0])


class _BroadcastParamsLayer(_Layer):
    """The raw parameters `pnames` of `module`, each broadcast over the batch
    by its forward (one layer for them all: one wrapper of the forward).
    A record holds every parameter's per-sample gradient side by side,
    [B, their numels' sum], zeros where a record's parameter is another's:
    the records of a pass sum to all of them."""
    rowwise = False
    kind = "linear"

    def __init__(self, engine: Any, name: str, module: nn.Module, pnames: List[str]) -> None:
        self.pnames = pnames
        self.params = [getattr(module, pn) for pn in pnames]
        super().__init__(engine, name, module, weight=self.params[0], bias=False)
        self.what = "raw parameters broadcast over the batch (%s)" % ", ".join(pnames)
        self.hint = ("its forward does not broadcast them over the batch sample by sample: "
                     "freeze them or hold them in a module dpclip trains")

    def _setup(self) -> None:
        self.d, self.p = 1, sum(p.numel() for p in self.params)
        self.cols: List[int] = []
        at = 0
        for p in self.params:
            self.cols.append(at)
            at += p.numel()

    def outputs(self) -> List[Tuple[torch.Tensor, Optional[Callable]]]:
        return [(p, None) for p in self.params]

    def trains(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def _forward(self, mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        x = next((t for t in list(args) + list(kwargs.values())
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if x is None:
            raise UnsupportedModuleError(
                "module %s: its forward got no batch-first tensor, so dpclip cannot give its "
                "parameters (%s) a row per sample; freeze them or hold them in a module dpclip "
                "trains" % (_label(self.name, self.module), ", ".join(self.pnames)))
        slots = mod._parameters  # pylint: disable=protected-access
        pass_id = self.engine._pass  # pylint: disable=protected-access
        for i, (pn, p) in enumerate(zip(self.pnames, self.params)):
            rows = p.detach().expand(_rows_shape(p, x.shape[0])).clone()
            rows.requires_grad_(True)
            rows.register_hook(self._taker(i, pass_id))
            slots[pn] = rows
        try:
            return self._orig_forward(*args, **kwargs)
        finally:
            for pn, p in zip(self.pnames, self.params):
                slots[pn] = p

    def _taker(self, i: int, pass_id: int) -> Callable[[torch.Tensor], None]:
        def take(g: torch.Tensor) -> None:
            v = g.detach().reshape(g.shape[0], -1)
            row = v.new_zeros((v.shape[0], self.p))
            row[:, self.cols[i]:self.cols[i] + v.shape[1]] = v
            self.record(row, row, pass_id)
        return take

    def parts(self, B: int, nb: int) -> List[Part]:
        v = None
        if B:  # (the planner has checked every record's batch)
            for first, _, _ in self.records:
                v = first if v is None else v + first
        out = []
        for i, (p, o) in enumerate(zip(self.params, self.outs)):
            vi = v[:, self.cols[i]:self.cols[i] + p.numel()] if v is not None else None
            out.append(_persample_part(self, "%s.%s" % (self.name, self.pnames[i]), vi,
                                       p.numel(), nb, o))
        return out


def broadcast_layers(engine: Any, name: str, m: nn.Module,
                     own: List[Tuple[str, torch.Tensor]]) -> Optional[List[_Layer]]:
    """A layer for an otherwise unsupported module whose own trainable
    parameters are all broadcast over the batch (leading size 1, or
    vectors), or None. Not for torch's own layers (a ConvTranspose's weight
    is no broadcast) nor for norms (registered, the daemon computes their
    per-sample gradients itself: the refusal says how)."""
    cls = type(m)
    if not own or cls.__module__.startswith("torch.") or cls.__name__.endswith("Norm") or \
            not all(_broadcast(p) for _, p in own):
        return None
    return [_BroadcastParamsLayer(engine, name, m, [pn for pn, _ in own])]
