"""Fail closed: every gradient the optimizer applies came from the daemon.

The engine writes param.grad for the parameters its layers train (the
daemon's clipped, noised sum). Anything else holding a gradient at step()
would be applied as it is, unclipped and unnoised: a parameter make_private
did not see as trainable (frozen then, unfrozen since), one added to a
module or to the optimizer afterwards, or one outside the module. And a
parameter the engine trains must get no gradient from autograd: its layers'
backwards give it none, so one means a use outside them (F.linear(h,
emb.weight), a regularization term), whose gradient the daemon's output
would silently replace. Opacus refuses both; so does dpclip, at step(),
before the daemon is asked for anything: UnclippedGradientError naming the
parameter, no parameter updated.

The second is seen as it happens: a hook on each trained parameter marks it
when autograd computes a gradient for it (book-keeping computes none)."""
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["UnclippedGradientError", "Guard"]


class UnclippedGradientError(RuntimeError):
    """A gradient the daemon did not compute would reach the optimizer (or
    one autograd computed for a parameter the daemon trains would be lost):
    step() refuses, naming the parameter; nothing is updated."""


def param_names(module: Optional[nn.Module]) -> Dict[int, str]:
    """id(parameter) -> its qualified name in module (a shared one: its
    first name)."""
    names: Dict[int, str] = {}
    if module is None:
        return names
    for mn, m in module.named_modules():
        for pn, p in m._parameters.items():  # pylint: disable=protected-access
            if p is not None and id(p) not in names:
                names[id(p)] = mn + "." + pn if mn else pn
    return names


class Guard:
    """The engine's check of the gradients at step(): the trained
    parameters (each once), hooks marking autograd gradients into them, and
    the marks since the last step."""

    def __init__(self, trained: Sequence[torch.Tensor], hooks: bool = True) -> None:
        self.trained = list(trained)
        self._ids = {id(p) for p in self.trained}
        self.stray: Dict[int, torch.Tensor] = {}
        self._handles: List[Any] = []
        if hooks:
            for p in self.trained:
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._marker(p)))

    def _marker(self, p: torch.Tensor) -> Any:
        stray = self.stray

        def mark(grad: Optional[torch.Tensor]) -> None:
            # newer torches call a leaf's hooks with None where a backward
            # gave it no gradient (book-keeping's layers give none): no use
            if grad is not None:
                stray[id(p)] = p
        return mark

    def clear(self) -> None:
        self.stray.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stray.clear()

    def check(self, module: Optional[nn.Module],
              params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Raises UnclippedGradientError where a trained parameter received
        a gradient from autograd since the last step, or one of params (the
        optimizer's) that the engine does not train holds a gradient."""
        stray = list(self.stray.values())
        ids = self._ids
        # (one pass over the optimizer's parameters, each step: no list of them)
        foreign = [(i, p) for i, p in enumerate(params if params is not None else ())
                   if id(p) not in ids and getattr(p, "grad", None) is not None]
        if not stray and not foreign:
            return
        names = param_names(module)

        def name(p: torch.Tensor) -> str:
            n = names.get(id(p))
            return n if n is not None else "a parameter of shape %s that is not in the module" \
                % (tuple(p.shape),)

        if stray:
            raise UnclippedGradientError(
                "parameter%s %s, which dpclip trains through %s module, also received a "
                "gradient from autograd: %s used outside the module dpclip trains (as in "
                "F.linear(h, emb.weight), or a regularization term on it), and that use's "
                "gradient would be lost, not clipped. Use the weight through its module only "
                "(a shared output embedding as an nn.Linear whose weight is the embedding's; "
                "weight decay through the optimizer); no parameter was updated"
                % ("s" if len(stray) > 1 else "", ", ".join(name(p) for p in stray),
                   "their" if len(stray) > 1 else "its", "they are" if len(stray) > 1 else
                   "it is"))
        raise UnclippedGradientError(
            "parameter%s %s of the optimizer hold%s a gradient that dpclip did not compute: "
            "the optimizer would apply it unclipped and unnoised. dpclip trains the "
            "parameters make_private found trainable in modules it supports; this one was "
            "frozen then and unfrozen since, added to a module or to the optimizer after "
            "make_private, or is not in the module. Freeze it (requires_grad_(False)) and set "
            "its .grad to None, or call make_private with it trainable; no parameter was "
            "updated" % ("s" if len(foreign) > 1 else "",
                         ", ".join(name(p) for _, p in foreign),
                         "" if len(foreign) > 1 else "s"))
