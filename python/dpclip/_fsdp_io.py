"""The transports of a sharded step in phases (dpclip._fsdp.Sharded): how its
norm pass and sums steps name the daemon their tensors and outputs, through
the engine's host arena (_HostIO) or in place on the GPU (_CudaIO)."""

from typing import Any, List, Optional, Tuple

import torch

from . import _lib, _planner
from ._layers import _ESIZE, _align, _tref


class _HostIO:
    """A step's norm pass and sums through the engine's arena: one slot of
    the largest bucket's size at its start (the sums steps are synchronous:
    the slot is copied out before the next), then each part's activations
    and output gradients, which the norm pass and the sums name alike."""

    def __init__(self, sh: Any, plan: _planner.Plan, nb: int, device: torch.device,
                 scratch: bool = False) -> None:
        e = sh.engine
        self.sh, self.plan, self.nb, self.scratch = sh, plan, nb, scratch  # one slot either way
        esz = _ESIZE[sh.dtype]
        # the slot first, then the parts' tensors
        self.bid, self.mem, self.slots = e._host.stage(  # pylint: disable=protected-access
            plan.parts, _align(sh.widest * esz))

    def _ins(self, i: int) -> Tuple[_lib.Tensor, _lib.Tensor]:
        lp, (a_off, g_off) = self.plan.parts[i], self.slots[i]
        return (_tref(self.bid, a_off, lp.in_dtype, lp.in_shape),
                _tref(self.bid, g_off, lp.grad_dtype, lp.grad_shape))

    def norms(self) -> _lib.StepResult:
        st = self.sh._clip  # pylint: disable=protected-access
        st.reset(self.nb)
        st.set_phase(_lib.STEP_NORMS)
        _planner.add_layers(st, self.plan.parts, self.sh.engine.algorithm,
                            lambda i: self._ins(i) + (_lib.Tensor(), _lib.Tensor()))
        return st.run(self.sh.engine.client)

    def sums(self, k: int, which: List[int], base: int, n: int) -> torch.Tensor:
        sh = self.sh
        esz = _ESIZE[sh.dtype]
        outs = sh._out_refs(lambda o, shape: _tref(self.bid, o * esz, sh.dtype, shape), base)
        st = sh._clip  # pylint: disable=protected-access
        st.reset(self.nb)
        st.set_phase(_lib.STEP_SUMS)
        _planner.add_layers(st, self.plan.parts, sh.engine.algorithm,
                            lambda i: self._ins(i) + outs(self.plan.parts[i]), which)
        sh._set_ranges(st, self.plan, which)  # pylint: disable=protected-access
        st.run(sh.engine.client)
        return self.mem[:n * esz].view(sh.dtype)

    def copied(self, k: int) -> None:
        pass  # synchronous: the slot was copied out already

    def close(self) -> None:
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access


class _CudaIO:
    """A step's norm pass and sums on the GPU: the parts' tensors named in
    place (kept until the sums are done); two slots of the largest bucket's
    size, written in turn. The daemon's steps wait on no event of ours but
    the norm pass's (its input: the backward's end): a sums step replies
    once its writes are done, and the host reuses a slot only once the
    trainer's stream has copied it out. So the daemon never waits for work
    queued behind a collective, which waits for another rank's daemon
    work (a deadlock on a GPU).

    The slots are taken together at the first sums step, then the
    trainer's stream is drained: the daemon's writes are in no order with
    it, and memory the allocator hands out may still be read by work queued
    there (a slot taken at bucket 1 once got bucket 0's staging, still read
    by its queued reduce-scatter, and the daemon wrote over it)."""

    def __init__(self, sh: Any, plan: _planner.Plan, nb: int, device: torch.device,
                 scratch: bool = False) -> None:
        self.sh, self.plan, self.nb, self.device = sh, plan, nb, device
        self.scratch = scratch  # a micro-batch that does not commit: nothing is written
        self.keep = []
        for lp in plan.parts:
            if lp.inp is None:
                inp = torch.zeros(lp.in_shape, dtype=lp.in_dtype, device=device)
                g = torch.zeros(lp.grad_shape, dtype=lp.grad_dtype, device=device)
            else:
                inp = lp.inp.to(lp.in_dtype).contiguous()
                g = lp.grad.to(lp.grad_dtype).contiguous()
            self.keep.append((inp, g))
        self.widest = sh.widest
        self.slots: List[Optional[torch.Tensor]] = [None, None]
        self.copied_ev: List[Optional[Any]] = [None, None]

    def _ins(self, i: int) -> Tuple[_lib.Tensor, _lib.Tensor]:
        io = self.sh.engine._cuda  # pylint: disable=protected-access
        lp, (inp, g) = self.plan.parts[i], self.keep[i]
        return io.ref(inp, lp.in_shape), io.ref(g, lp.grad_shape)

    def norms(self) -> _lib.StepResult:
        e = self.sh.engine
        io = e._cuda  # pylint: disable=protected-access
        ready, _, rid, _ = io.events(self.device)
        st = self.sh._clip  # pylint: disable=protected-access
        with torch.cuda.device(self.device):
            st.reset(self.nb)
            st.set_phase(_lib.STEP_NORMS)
            _planner.add_layers(st, self.plan.parts, e.algorithm,
                                lambda i: self._ins(i) + (_lib.Tensor(), _lib.Tensor()))
            ready.record(torch.cuda.current_stream(self.device))
            st.set_events(rid, 0)
            st.notify_enqueued(False)
            try:
                return st.run(e.client)
            finally:
                st.set_events(0, 0)

    def sums(self, k: int, which: List[int], base: int, n: int) -> torch.Tensor:
        sh, e = self.sh, self.sh.engine
        slot = 0 if self.scratch else k % 2
        if self.scratch and self.slots[0] is None:  # nothing written: one slot, every bucket
            self.slots[0] = torch.empty(self.widest, dtype=sh.dtype, device=self.device)
        elif not self.scratch and self.copied_ev[slot] is not None:
            self.copied_ev[slot].synchronize()  # the host: bucket k - 2 is out of it
        if self.slots[slot] is None:
            # both slots now, none later (see the class's docstring), then
            # the stream drained: nearly free, the daemon's norm pass waited
            # for the backward it holds
            for i in range(min(2, len(sh._buckets))):  # pylint: disable=protected-access
                if self.slots[i] is None:
                    self.slots[i] = torch.empty(self.widest, dtype=sh.dtype, device=self.device)
            torch.cuda.current_stream(self.device).synchronize()
        buf = self.slots[slot]
        esz = _ESIZE[sh.dtype]
        st = sh._clip  # pylint: disable=protected-access
        with torch.cuda.device(self.device):
            fbid, foff = e.client.register_cuda(buf.data_ptr())
            outs = sh._out_refs(lambda o, shape: _tref(fbid, foff + o * esz, sh.dtype, shape),
                                base)
            st.reset(self.nb)
            st.set_phase(_lib.STEP_SUMS)
            _planner.add_layers(st, self.plan.parts, e.algorithm,
                                lambda i: self._ins(i) + outs(self.plan.parts[i]), which)
            sh._set_ranges(st, self.plan, which)  # pylint: disable=protected-access
            st.run(e.client)  # replies once the daemon's writes are done
        return buf[:n]

    def copied(self, k: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.copied_ev[k % 2] = ev

    def close(self) -> None:
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access
        self.keep.clear()
