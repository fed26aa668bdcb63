"""The host transport: CPU tensors travel through one shared-memory arena
per engine. The daemon maps the arena once; each step lays it out afresh
(activations, output gradients and the outputs it writes, each aligned),
copies the captured tensors in, and copies the outputs into param.grad. The
arena grows (doubling, at least 1 MiB) when a step needs more."""
import ctypes
import math
import time
from typing import List, Optional, Sequence, Tuple

import torch

from . import _lib
from ._layers import _ESIZE, _align, _tref
from ._planner import LayerPlan, add_layers, out_dtype, set_grad


class HostArena:
    """The arena of one engine's session: (buffer id, size, uint8 view) once
    a step has needed it."""

    def __init__(self, client: _lib.Client) -> None:
        self.client = client
        self._arena: Optional[Tuple[int, int, torch.Tensor]] = None

    def view(self, need: int) -> Tuple[int, int, torch.Tensor]:
        """(buffer id, size, uint8 view) of an arena of at least `need`
        bytes; a smaller one is released first."""
        if self._arena is None or self._arena[1] < need:
            old = self._arena
            size = max(need, 2 * old[1] if old else 0, 1 << 20)
            size = (size + 4095) // 4096 * 4096
            if old is not None:
                self._arena = None
                self.client.buffer_release(old[0])
            bid, addr = self.client.buffer_alloc(size)
            raw = (ctypes.c_uint8 * size).from_address(addr)
            self._arena = (bid, size, torch.frombuffer(raw, dtype=torch.uint8))
        return self._arena

    def run(self, step: _lib.Step, plan: Sequence[LayerPlan], nb: int,
            algorithm: int) -> Tuple[_lib.StepResult, float, float]:
        """Sends the planned step of nb samples and waits for it; param.grad
        holds the private gradient after. (result, time sent, time answered)."""
        off = 0
        slots: List[Tuple[torch.dtype, int, Optional[int], int, int]] = []

        def take(nbytes: int) -> int:
            nonlocal off
            o = _align(off)
            off = o + nbytes
            return o

        for l, _, _, in_shape, in_dt, g_shape, g_dt in plan:
            w_dt = out_dtype(l.weight)
            w_off = take(l.weight.numel() * _ESIZE[w_dt])
            b_off = take(l.bias.numel() * _ESIZE[w_dt]) if l.bias is not None else None
            a_off = take(math.prod(in_shape) * _ESIZE[in_dt])
            g_off = take(math.prod(g_shape) * _ESIZE[g_dt])
            slots.append((w_dt, w_off, b_off, a_off, g_off))
        bid, _, mem = self.view(off)

        def view(o: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
            n = math.prod(shape) * _ESIZE[dtype]
            return mem[o:o + n].view(dtype).view(shape)

        for (l, inp, g, in_shape, in_dt, g_shape, g_dt), (_, _, _, a_off, g_off) in zip(plan, slots):
            av, gv = view(a_off, in_dt, in_shape), view(g_off, g_dt, g_shape)
            if inp is None:
                av.zero_()
                gv.zero_()
            else:
                av.copy_(inp)
                gv.copy_(g)

        def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
            l, _, _, in_shape, in_dt, g_shape, g_dt = plan[i]
            w_dt, w_off, b_off, a_off, g_off = slots[i]
            b_ref = _tref(bid, b_off, w_dt, tuple(l.bias.shape)) if b_off is not None \
                else _lib.Tensor()
            return (_tref(bid, a_off, in_dt, in_shape), _tref(bid, g_off, g_dt, g_shape),
                    _tref(bid, w_off, w_dt, tuple(l.weight.shape)), b_ref)

        step.reset(nb)
        add_layers(step, plan, algorithm, refs)
        t1 = time.perf_counter()
        res = step.run(self.client)
        t2 = time.perf_counter()
        for (l, *_), (w_dt, w_off, b_off, _, _) in zip(plan, slots):
            set_grad(l.weight, view(w_off, w_dt, tuple(l.weight.shape)))
            if b_off is not None:
                set_grad(l.bias, view(b_off, w_dt, tuple(l.bias.shape)))
        return res, t1, t2
