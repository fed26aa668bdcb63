"""The host transport: CPU tensors travel through one shared-memory arena
per engine. The daemon maps the arena once; each step lays it out afresh
(activations, output gradients and the outputs it writes, each aligned),
copies the captured tensors in, and copies the outputs into param.grad. The
arena grows (doubling, at least 1 MiB) when a step needs more.

Logical steps (gradient accumulation, dpclip._accumulate) send their
micro-batches without waiting (a pipeline stage must not block on a
micro-batch that the other stages have not sent yet), so each micro-batch
in flight holds a staging arena of its own, taken from a pool and given
back once its reply is collected; and every micro-batch must name the same
outputs, so they live in a buffer of their own that no staging growth
moves.

A sharded step (dpclip._fsdp) lays out the arena once for its norm pass
and sums (HostPhases)."""
import ctypes
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _lib, _planner
from ._layers import _ESIZE, Part, Slice, _align, _tref
from ._planner import Plan, add_layers, set_grad
from ._transport import Phases, Run, Transport


class HostArena(Transport):
    """The arena of one engine's session: (buffer id, size, uint8 view) once
    a step has needed it."""

    def __init__(self, client: _lib.Client) -> None:
        super().__init__(client)
        self._arena: Optional[Tuple[int, int, torch.Tensor]] = None
        # logical steps: the outputs' buffer (id, size, bytes) and each
        # output's byte offset in it; staging arenas not in use
        self._outs: Optional[Tuple[int, int, torch.Tensor]] = None
        self._out_off: Dict[int, int] = {}
        self._free: List[Tuple[int, int, torch.Tensor]] = []

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

    def stage(self, parts: Sequence[Part], off: int
              ) -> Tuple[int, torch.Tensor, List[Tuple[int, int]]]:
        """Copies each part's input and output gradient into the arena from
        byte off on (zeros for a part not used this pass): (the arena's
        buffer id, its bytes, each part's (input, grad) byte offsets)."""
        slots, end = _layout(parts, off)
        bid, _, mem = self.view(end)
        _fill(mem, parts, slots)
        return bid, mem, slots

    def run(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
            algorithm: int, gated: bool = False, asynchronous: bool = False) -> Run:
        """Sends the planned step of nb samples and waits for it (host steps
        block: asynchronous is the GPU's); param.grad holds the private
        gradient after, and ok is 1 (gated or not: the reply says it)."""
        off = 0

        def take(nbytes: int) -> int:
            nonlocal off
            o = _align(off)
            off = o + nbytes
            return o

        out_off = {id(o): take(o.numel * _ESIZE[o.dtype]) for o in plan.outs}
        bid, mem, slots = self.stage(plan.parts, off)

        def out_ref(sl: Optional[Slice]) -> _lib.Tensor:
            if sl is None:
                return _lib.Tensor()
            o, elem, shape = sl
            return _tref(bid, out_off[id(o)] + elem * _ESIZE[o.dtype], o.dtype, shape)

        def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
            pt = plan.parts[i]
            a_off, g_off = slots[i]
            return (_tref(bid, a_off, pt.in_dtype, pt.in_shape),
                    _tref(bid, g_off, pt.grad_dtype, pt.grad_shape), out_ref(pt.w),
                    out_ref(pt.b))

        step.reset(nb)
        add_layers(step, plan.parts, algorithm, refs)
        t1 = time.perf_counter()
        res = step.run(self.client)
        t2 = time.perf_counter()
        for o in plan.outs:
            at = out_off[id(o)]
            set_grad(o.param, o.grad(mem[at:at + o.numel * _ESIZE[o.dtype]].view(o.dtype)))
        return Run(res, 0, None, torch.ones(1), t1, t2)

    # -- logical steps (dpclip._accumulate) ------------------------------------------
    def micro(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
              algorithm: int, asynchronous: bool = False, detached: bool = True) -> Run:
        """One micro-batch of a logical step, or its commit (which names
        the same outputs: write_grads() copies them out), sent without
        waiting (submit()): the Run's arena is held until release()."""
        t1 = time.perf_counter()
        ticket, arena = self.submit(step, plan, nb, algorithm)
        return Run(None, ticket, None, None, t1, time.perf_counter(), arena=arena)

    def release(self, run: Run, device: torch.device) -> None:
        if run.arena is not None:
            self.give(run.arena)

    def submit(self, step: _lib.Step, plan: Plan, nb: int, algorithm: int
               ) -> Tuple[int, Tuple[int, int, torch.Tensor]]:
        """Sends one micro-batch of a logical step (nb samples) without
        waiting: (its ticket, the staging arena it holds until its reply is
        collected: give() it back then). Its outputs name the outputs'
        buffer, the same for every micro-batch."""
        outs = self._outputs(plan)
        arena, slots = self.take_staged(plan.parts, 0)
        bid = arena[0]
        step.reset(nb)
        add_layers(step, plan.parts, algorithm, self._refs(plan, bid, slots, outs))
        try:
            return step.submit(self.client), arena
        except BaseException:
            self.give(arena)
            raise

    def take_staged(self, parts: Sequence[Part], off: int
                    ) -> Tuple[Tuple[int, int, torch.Tensor], List[Tuple[int, int]]]:
        """A staging arena from the pool (give() it back) with each part's
        input and output gradient copied in from byte off on: (the arena,
        each part's (input, grad) byte offsets)."""
        slots, end = _layout(parts, off)
        arena = self._take(end)
        _fill(arena[2], parts, slots)
        return arena, slots

    def give(self, arena: Tuple[int, int, torch.Tensor]) -> None:
        """A staging arena back to the pool (its micro-batch's reply is in)."""
        self._free.append(arena)

    def write_grads(self, plan: Plan) -> None:
        """param.grad = each output as the commit wrote it."""
        _, _, mem = self._outs
        for o in plan.outs:
            at = self._out_off[id(o)]
            set_grad(o.param, o.grad(mem[at:at + o.numel * _ESIZE[o.dtype]].view(o.dtype)))

    def trim(self, keep: int = 2) -> None:
        """Releases staging arenas past `keep` (called with nothing in flight:
        a release waits for the session's earlier requests)."""
        self._free.sort(key=lambda a: -a[1])
        while len(self._free) > keep:
            self.client.buffer_release(self._free.pop()[0])

    def _outputs(self, plan: Plan) -> Tuple[int, int, torch.Tensor]:
        """The outputs' buffer, laid out once for the engine's outputs."""
        if self._outs is None:
            off, where = 0, {}
            for o in plan.outs:
                where[id(o)] = _align(off)
                off = where[id(o)] + o.numel * _ESIZE[o.dtype]
            size = (max(off, 1) + 4095) // 4096 * 4096
            bid, addr = self.client.buffer_alloc(size)
            raw = (ctypes.c_uint8 * size).from_address(addr)
            self._outs = (bid, size, torch.frombuffer(raw, dtype=torch.uint8))
            self._out_off = where
        return self._outs

    def _take(self, need: int) -> Tuple[int, int, torch.Tensor]:
        """A staging arena of at least `need` bytes: the smallest free one
        that fits, else a new one (doubling from the largest, at least 1 MiB)."""
        fits = [a for a in self._free if a[1] >= need]
        if fits:
            best = min(fits, key=lambda a: a[1])
            self._free.remove(best)
            return best
        size = max(need, 1 << 20)
        size = (size + 4095) // 4096 * 4096
        bid, addr = self.client.buffer_alloc(size)
        raw = (ctypes.c_uint8 * size).from_address(addr)
        return bid, size, torch.frombuffer(raw, dtype=torch.uint8)

    def _refs(self, plan: Plan, bid: int, slots: List[Tuple[int, int]],
              outs: Tuple[int, int, torch.Tensor]
              ) -> Callable[[int], Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]]:
        out_bid = outs[0]

        def out_ref(sl: Optional[Slice]) -> _lib.Tensor:
            if sl is None:
                return _lib.Tensor()
            o, elem, shape = sl
            return _tref(out_bid, self._out_off[id(o)] + elem * _ESIZE[o.dtype], o.dtype, shape)

        def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
            pt = plan.parts[i]
            a_off, g_off = slots[i]
            return (_tref(bid, a_off, pt.in_dtype, pt.in_shape),
                    _tref(bid, g_off, pt.grad_dtype, pt.grad_shape), out_ref(pt.w),
                    out_ref(pt.b))
        return refs

    def phases(self, sh: Any, plan: Plan, nb: int, device: torch.device,
               scratch: bool = False) -> "HostPhases":
        return HostPhases(self, sh, plan, nb, device, scratch)


class HostPhases(Phases):
    """A sharded step's norm pass and sums through the engine's arena: one slot of
    the largest bucket's size at its start (the sums steps are synchronous:
    the slot is copied out before the next), then each part's activations
    and output gradients, which the norm pass and the sums name alike. A
    micro-batch that does not commit (scratch: the daemon writes nothing)
    stages in a staging arena of its own instead, from the pool that
    logical steps use (HostArena.micro), so that it can be sent without
    waiting (submit()) while the next one stages: given back at release(),
    or at close() where it was run and waited for."""

    def __init__(self, io: HostArena, sh: Any, plan: _planner.Plan, nb: int,
                 device: torch.device, scratch: bool = False) -> None:
        self.io = io
        self.sh, self.plan, self.nb, self.scratch = sh, plan, nb, scratch  # one slot either way
        esz = _ESIZE[sh.dtype]
        # the slot first, then the parts' tensors
        off = _align(sh.widest * esz)
        self.arena: Optional[Tuple[int, int, torch.Tensor]] = None
        if scratch:
            self.arena, self.slots = io.take_staged(plan.parts, off)
            self.bid, _, self.mem = self.arena
        else:
            self.bid, self.mem, self.slots = io.stage(plan.parts, off)
        self.sent = False

    def _ins(self, i: int) -> Tuple[_lib.Tensor, _lib.Tensor]:
        lp, (a_off, g_off) = self.plan.parts[i], self.slots[i]
        return (_tref(self.bid, a_off, lp.in_dtype, lp.in_shape),
                _tref(self.bid, g_off, lp.grad_dtype, lp.grad_shape))

    def norms(self) -> _lib.StepResult:
        return self._norms().run(self.io.client)

    def _norms(self) -> _lib.Step:
        st = self.sh._clip  # pylint: disable=protected-access
        st.reset(self.nb)
        st.set_phase(_lib.STEP_NORMS)
        _planner.add_layers(st, self.plan.parts, self.sh.engine.algorithm,
                            lambda i: self._ins(i) + (_lib.Tensor(), _lib.Tensor()))
        return st

    def sums(self, k: int, which: List[int], base: int, n: int) -> torch.Tensor:
        self._sums(which, base).run(self.io.client)
        return self.mem[:n * _ESIZE[self.sh.dtype]].view(self.sh.dtype)

    def _sums(self, which: List[int], base: int) -> _lib.Step:
        sh = self.sh
        esz = _ESIZE[sh.dtype]
        outs = sh._out_refs(lambda o, shape: _tref(self.bid, o * esz, sh.dtype, shape), base)
        st = sh._clip  # pylint: disable=protected-access
        st.reset(self.nb)
        st.set_phase(_lib.STEP_SUMS)
        _planner.add_layers(st, self.plan.parts, sh.engine.algorithm,
                            lambda i: self._ins(i) + outs(self.plan.parts[i]), which)
        sh._set_ranges(st, self.plan, which)  # pylint: disable=protected-access
        return st

    def submit(self, buckets: List[Tuple[List[int], int]]
               ) -> Tuple[List[int], Optional[BaseException]]:
        """A micro-batch that does not commit, sent without waiting: its
        norm pass and each bucket's sums step ((which, base) each), as
        dpclip._cuda.CudaPhases.submit sends them; the staging arena is held
        until release()."""
        assert self.scratch
        self.sent = True
        tickets = [self._norms().submit(self.io.client)]
        err: Optional[BaseException] = None
        for which, base in buckets:
            try:
                tickets.append(self._sums(which, base).submit(self.io.client))
            except Exception as exc:  # pylint: disable=broad-except
                err = err or exc  # the rest still sent (dpclip._fsdp's docstring)
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access
        return tickets, err

    def release(self, run: Any, device: torch.device) -> None:
        """Every reply of submit()'s steps is in: the staging arena goes
        back to the pool."""
        self._give()

    def _give(self) -> None:
        if self.arena is not None:
            self.io.give(self.arena)
            self.arena = None

    def copied(self, k: int) -> None:
        pass  # synchronous: the slot was copied out already

    def close(self) -> None:
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access
        if not self.sent:  # run and waited for (or nothing sent): nothing reads it now
            self._give()


def _layout(parts: Sequence[Part], off: int) -> Tuple[List[Tuple[int, int]], int]:
    """Each part's (input, grad) byte offsets from off on, and the end."""
    slots: List[Tuple[int, int]] = []
    for pt in parts:
        a_off = _align(off)
        g_off = _align(a_off + math.prod(pt.in_shape) * _ESIZE[pt.in_dtype])
        off = g_off + math.prod(pt.grad_shape) * _ESIZE[pt.grad_dtype]
        slots.append((a_off, g_off))
    return slots, off


def _fill(mem: torch.Tensor, parts: Sequence[Part], slots: List[Tuple[int, int]]) -> None:
    """Copies each part's input and output gradient to its slots in mem
    (zeros for a part not used this pass)."""
    def view(o: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape) * _ESIZE[dtype]
        return mem[o:o + n].view(dtype).view(shape)

    for pt, (a_off, g_off) in zip(parts, slots):
        av, gv = view(a_off, pt.in_dtype, pt.in_shape), view(g_off, pt.grad_dtype,
                                                             pt.grad_shape)
        if pt.inp is None:
            av.zero_()
            gv.zero_()
        else:
            av.copy_(pt.inp.reshape(pt.in_shape))
            gv.copy_(pt.grad.reshape(pt.grad_shape))
