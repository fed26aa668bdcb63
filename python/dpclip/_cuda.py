"""The CUDA transport: GPU tensors are named in place through CUDA IPC (one
registration per caching-allocator block, cached by libdpclip), outputs go
into one flat CUDA tensor per parameter (slices end to end of arenas per
dtype, 1 GiB at most each) that the engine keeps and param.grad aliases (a
view; a copy where the layout or dtype differs), and ordering uses two
interprocess events per device: the trainer records
`ready` on its stream before the step, the daemon waits on it and records
`done`, the trainer's stream waits on `done`. No host synchronisation beyond
the step's reply (or, asynchronous, its early notice).

A sharded step (dpclip._fsdp) names its tensors in place too, its sums in
three slots, bucket k in slot k % 3, each of its buckets' widest (CudaPhases)."""
import ctypes
import os
import select
import threading
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import _lib, _planner
from ._flags import _FLAG_BYTES, _UNKNOWN_PEER_S, _Flag, _gone, _peer
from ._layers import _ESIZE, Part, Slice, _tref
from ._outputs import _alias, _out_buffers, held_weakly, release_step_buffers, step_buffers
from ._planner import Plan, add_layers, set_grad
from ._transport import Phases, Run, Transport


def mps_advice(daemon_mps: bool, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why a trainer on CUDA runs slower than it could for want of CUDA MPS
    (None: it shares the daemon's MPS). Without MPS each hand-off between
    the trainer's process and the daemon's is a GPU context switch and their
    kernels take turns on the GPU; the daemon reports whether it found an
    MPS control pipe (HelloReply.mps_active), and this process looks for
    its own where CUDA will: $CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if not daemon_mps:
        return ("dpclipd reports that CUDA MPS is not active: each step's hand-off between this "
                "process and the daemon is a GPU context switch, and their kernels take turns "
                "on the GPU (pipelined and sharded steps measured 1.08-1.14x the plain step "
                "under MPS against 1.20-1.34x without, and a 1F1B pipeline, whose stages hold "
                "each micro-batch until the daemon's reply, 1.58x the memory against 2.03x). "
                "Start the MPS control daemon for both "
                "(dpclip-mps.service, or nvidia-cuda-mps-control -d with the same "
                "CUDA_MPS_PIPE_DIRECTORY; docs/gpu.md, \"MPS\")")
    if not os.path.exists(os.path.join(pipe, "control")):
        return ("dpclipd runs under CUDA MPS, but this process finds no MPS control pipe in "
                "%s, so it runs outside MPS and takes turns with the daemon on the GPU: set "
                "CUDA_MPS_PIPE_DIRECTORY to the daemon's (/run/nvidia-mps under the shipped "
                "systemd units) before CUDA starts in this process" % pipe)
    return None


def warn_without_mps(client: _lib.Client) -> None:
    """A PerformanceWarning where mps_advice has one (make_private on CUDA)."""
    why = mps_advice(bool(client.info.mps_active))
    if why is not None:
        warnings.warn("dpclip: " + why, _lib.PerformanceWarning, stacklevel=3)


def _wire(pt: Part, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A part's input and output grad as the daemon reads them: in their
    wire dtypes, contiguous (zeros of the planned shapes where the module
    was not used this step)."""
    inp, g = pt.inp, pt.grad
    if inp is None:
        return (torch.zeros(pt.in_shape, dtype=pt.in_dtype, device=device),
                torch.zeros(pt.grad_shape, dtype=pt.grad_dtype, device=device))
    # (guarded: each call costs host time even when it is a no-op)
    if inp.dtype != pt.in_dtype:
        inp = inp.to(pt.in_dtype)
    if not inp.is_contiguous():
        inp = inp.contiguous()
    if g.dtype != pt.grad_dtype:
        g = g.to(pt.grad_dtype)
    if not g.is_contiguous():
        g = g.contiguous()
    return inp, g


def _signature(plan: Plan) -> List[Tuple[Any, ...]]:
    """What a step's layers in libdpclip are built from: its parts but for
    their tensors."""
    return [(pt[0], pt[1], pt[2]) + pt[5:] for pt in plan.parts]


def _slice_at(sl: Slice) -> Tuple[int, int]:
    """The (buffer id, byte offset) where an output slice starts."""
    o, elem, _ = sl
    return o.ref[0], o.ref[1] + elem * o.buf.element_size()


def _out_refs(plan: Plan) -> Any:
    """The (buffer id, offset) of each part's weight and bias output, 4 a
    part, buffer 0 where it has none (Step.rebind_outputs)."""
    refs = (ctypes.c_uint64 * (4 * max(len(plan.parts), 1)))()
    for i, pt in enumerate(plan.parts):
        for k, sl in enumerate((pt.w, pt.b)):
            if sl is not None:
                refs[4 * i + 2 * k], refs[4 * i + 2 * k + 1] = _slice_at(sl)
    return refs


def grad_buffers() -> str:
    """DPCLIP_GRAD_BUFFERS: "step" (unset: the default) or "engine"."""
    mode = os.environ.get("DPCLIP_GRAD_BUFFERS", "") or "step"
    if mode not in ("step", "engine"):
        raise ValueError("DPCLIP_GRAD_BUFFERS=%r: expected \"step\" (each step's gradients "
                         "in buffers of their own, the default) or \"engine\" (arenas the "
                         "engine holds)" % mode)
    return mode


def _index(device: torch.device) -> int:
    """The device's ordinal ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


# A sharded step's sums slots (CudaPhases): bucket k's in slot k % _SLOTS,
# so that bucket k + 1's step can be queued in the daemon while the
# trainer's stream copies bucket k out and bucket k - 1's waits to be reused
_SLOTS = 3

# The current stream's handle on a device (torch's CUDA builds)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_STREAMS_KEPT = 64

# What CudaIPC.run did (dpclip._transport.Run; kept under its old name)
CudaRun = Run


class CudaIPC(Transport):
    """One engine's CUDA plumbing: its interprocess events per device and
    (data parallel) the coefficients output the daemon writes."""

    def __init__(self, client: _lib.Client) -> None:
        super().__init__(client)
        # cuda device index -> (ready, done, ready_id, done_id)
        self._events: Dict[int, Tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = {}
        # Detached steps' `ready` events, free ones per device (see readied()).
        self._ready_free: Dict[int, List[Tuple[torch.cuda.Event, int]]] = {}
        # (device, slot) -> a sharded step's sums slot's `done` (slot_done())
        self._slot_done: Dict[Tuple[int, int], Tuple[torch.cuda.Event, int]] = {}
        # Data parallel: the [B] coefficients output the daemon writes
        # (zeroed before each step: zero after it unless it succeeded).
        self._coefs: Optional[torch.Tensor] = None
        self._coefs_ref: Optional[Tuple[int, int]] = None
        # The step whose layers run() last built, with what they were built
        # from (its layout count, batch, algorithm, the parts' signature and
        # the plan's template serial): the next step of the same layout
        # rebinds its inputs (_layers()).
        self._bound: Optional[Tuple[Any, ...]] = None
        # Done flags (done_flag()) per device index; on unless
        # DPCLIP_DONE_FLAG=0 (the events instead, to compare), off where the
        # driver cannot map them.
        self._flags: Dict[int, _Flag] = {}
        self._zero_streams: Dict[int, torch.cuda.Stream] = {}  # release_flags', a flag's device
        self._flag_on = os.environ.get("DPCLIP_DONE_FLAG", "1") != "0"
        self._watcher: Optional[Tuple[threading.Thread, int]] = None  # (thread, wake fd)
        self._peer: Optional[Tuple[int, str]] = None  # the daemon's process (_peer)
        self._release_mu = threading.Lock()
        # every output arena made (_out_buffers): what release_flags zeroes
        self._arenas: List[torch.Tensor] = []
        self._streams: Dict[Tuple[int, int], torch.cuda.Stream] = {}  # (_current_stream)
        # (plan serial, device) whose outputs all have buffers there: the
        # steady steps of one template skip _out_buffers' look at each
        self._outs_on: Optional[Tuple[int, torch.device]] = None
        # Each step's gradients in buffers of its own (DPCLIP_GRAD_BUFFERS
        # "step", the default: dpclip._outputs.step_buffers), or in arenas
        # the engine holds ("engine"); a data-parallel (gated) step keeps
        # the arenas, whose consecutive gradients the all-reduce sums in
        # place. The last such step's buffers, weakly: what release_flags
        # zeroes of them.
        self.step_grads = grad_buffers() == "step"
        self._step_bufs: List[Any] = []

    def _current_stream(self, device: torch.device) -> torch.cuda.Stream:
        """torch.cuda.current_stream(device), its Stream object made once per
        stream (a step's host time: the handle is read, not wrapped anew)."""
        idx = _index(device)
        raw = _RAW_STREAM(idx) if _RAW_STREAM is not None else None
        s = self._streams.get((idx, raw)) if raw is not None else None
        if s is None:
            s = torch.cuda.current_stream(device)
            if raw is not None and s.cuda_stream == raw:
                if len(self._streams) >= _STREAMS_KEPT:  # (a stream made per step: bounded)
                    self._streams.clear()
                self._streams[(idx, raw)] = s
        return s

    def _ipc_event(self, idx: int) -> Tuple[torch.cuda.Event, int]:
        """A new interprocess event on device idx, registered with the
        daemon: (the event, its id there)."""
        with torch.cuda.device(idx):
            ev = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
            return ev, self.client.register_event(ev.ipc_handle(), idx)

    def events(self, device: torch.device) -> Tuple[torch.cuda.Event, torch.cuda.Event, int, int]:
        idx = _index(device)
        ev = self._events.get(idx)
        if ev is None:
            (ready, rid), (done, did) = self._ipc_event(idx), self._ipc_event(idx)
            ev = self._events[idx] = (ready, done, rid, did)
        return ev

    def readied(self, device: torch.device) -> Tuple[torch.cuda.Event, int]:
        """An interprocess event of the device's for one detached step's
        `ready` alone, until settle() gives it back. The daemon's stream
        waits on the record an event has when it queues the step's GPU
        work, and a norm group's micro-batch is queued only once every
        member's is in: with one shared `ready`, re-recorded by this
        trainer's later micro-batches meanwhile, it would wait for a later
        point of this stream, which under 1F1B waits (NCCL receive) for
        the other stage, whose own host may wait on this session's replies:
        a deadlock."""
        idx = _index(device)
        free = self._ready_free.setdefault(idx, [])
        if free:
            return free.pop()
        return self._ipc_event(idx)

    def slot_done(self, device: torch.device, slot: int) -> Tuple[torch.cuda.Event, int]:
        """The interprocess event a sums step writing `slot` signals
        (CudaPhases), one per slot and device, made once: the trainer's
        stream waits on the record its own step made. With the device's one
        `done`, re-recorded by the next bucket's step before the trainer
        took the notice, bucket k's copy would wait for bucket k + 1's
        sums."""
        key = (_index(device), slot)
        ev = self._slot_done.get(key)
        if ev is None:
            ev = self._slot_done[key] = self._ipc_event(key[0])
        return ev

    def done_flag(self, device: torch.device) -> Optional[_Flag]:
        """The device's done flag (made once): a word of shared memory the
        daemon stores each asynchronous step's done value into once its
        work is done, mapped into the device, on which the stream waits
        instead of on `done`. The host then need not wait for the daemon
        to queue the step's work before the optimizer's is queued (1.2 ms
        of a GPT-2 step bound by the host). The wait is released by the
        daemon's host, never by other GPU work, so no hardware queue the
        trainer's streams share can hold up what releases it. None: events
        instead."""
        if not self._flag_on:
            return None
        idx = _index(device)
        f = self._flags.get(idx)
        if f is None:
            bid = 0
            try:
                bid, addr = self.client.buffer_alloc(_FLAG_BYTES)
                ctypes.memset(addr, 0, _FLAG_BYTES)
                with torch.cuda.device(idx):
                    dev = _lib.cuda_host_map(addr, _FLAG_BYTES)
            except _lib.DpclipError as e:
                if bid:
                    self.client.buffer_release(bid)
                self._flag_on = False
                warnings.warn(
                    "dpclip: no done flag on cuda:%d (%s): each step outside data parallelism "
                    "waits for its reply instead, so the next forward no longer overlaps the "
                    "daemon's work "
                    "(docs/protocol.md, \"Done flag\")" % (idx, e.message),
                    _lib.PerformanceWarning, stacklevel=2)
                return None
            f = self._flags[idx] = _Flag(bid, addr, dev)
            # release_flags' stream on this device, made here: made on the
            # watcher's thread, while the trainer's is blocked in a device
            # synchronisation behind the flag, it waits for that (H200)
            with torch.cuda.device(idx):
                self._zero_streams[idx] = torch.cuda.Stream()
            if self._watcher is None:
                self._watch()
        return f

    def events_only(self) -> None:
        """No done flags: a norm group member's steps complete through
        their replies (the daemon refuses a flag there)."""
        self._flag_on = False

    def _watch(self) -> None:
        """A thread that releases the flags (release_flags) if the daemon's
        socket hangs up: this process's host may then be blocked on its
        device (a synchronisation: loss.item()) behind a flag, where no
        collection would ever notice the daemon went. It polls for the hang
        up alone (replies are the caller's to read) and a pipe that close()
        writes."""
        fd = self.client.fileno()
        self._peer = _peer(fd)  # (while it is connected)
        r, w = os.pipe()
        gone = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL

        def run() -> None:
            p = select.poll()
            p.register(fd, select.POLLRDHUP)
            p.register(r, select.POLLIN)
            try:
                while True:
                    for got, ev in p.poll():
                        if got == r:
                            return
                        if ev & gone:
                            self.release_flags()
                            return
            finally:
                os.close(r)

        t = threading.Thread(target=run, name="dpclip-done-flags", daemon=True)
        t.start()
        self._watcher = (t, w)

    def release_flags(self) -> None:
        """The daemon's socket hung up: each flag the daemon did not store
        set to the last value a notice gave, from this host, so that no
        stream waits for good. Not before the daemon can no longer write
        the outputs (its process gone, or its abandon word saying it gave
        them up: docs/protocol.md, "Done flag"), and not before they are
        zeroed: a daemon killed between a step's clipped sums and its noise
        leaves sums without noise there, which the optimizer queued behind
        the flag would apply. A daemon alive stores its flags itself once
        its work ends (the wait polls for it); one whose pid is hidden is
        taken for gone after _UNKNOWN_PEER_S."""
        with self._release_mu:
            t0 = time.monotonic()
            said = False
            while True:
                todo = [f for f in self._flags.values() if not f.stored()]
                if not todo:
                    return
                waited = time.monotonic() - t0
                if any(f.abandoned() for f in todo) or (
                        _gone(self._peer) if self._peer is not None else waited > _UNKNOWN_PEER_S):
                    break
                if waited > _UNKNOWN_PEER_S and not said:
                    said = True
                    warnings.warn(
                        "dpclip: the daemon's connection closed with a step in flight; its "
                        "process (pid %d) lives, so this trainer's stream waits for it to "
                        "finish or zero that step's outputs before it goes on"
                        % self._peer[0], RuntimeWarning, stacklevel=2)
                time.sleep(0.001)
            try:
                self._zero_outputs()
            except Exception as e:  # pylint: disable=broad-except
                # fail closed: outputs that may hold un-noised sums are
                # never let through; the stream waits on, and says so
                warnings.warn(
                    "dpclip: the daemon went with a step in flight and its outputs could not "
                    "be zeroed (%s); the flags stay unreleased, so this trainer's stream waits "
                    "for good rather than apply them" % e, RuntimeWarning, stacklevel=2)
                return
            for f in todo:
                ctypes.c_uint32.from_address(f.addr).value = f.last & 0xFFFFFFFF

    def _zero_outputs(self) -> None:
        """Every output the daemon writes zeroed before this returns, on the
        device's own zeroing stream (the trainer's waits on the flag) after
        its last `ready`: what the trainer queued before the step, the last
        optimizer step's reads included, goes first. The trainer's thread
        may be blocked in a device synchronisation behind the flag, so this
        makes no stream (done_flag made them), launches no kernel and
        allocates nothing: a driver memset on a stream made beforehand."""
        outs = list(self._arenas) + ([self._coefs] if self._coefs is not None else [])
        outs += [t for t in (w() for w in self._step_bufs) if t is not None]
        used: Dict[int, torch.cuda.Stream] = {}
        for t in outs:
            if t.device.type != "cuda":
                t.zero_()
                continue
            idx = _index(t.device)
            with torch.cuda.device(idx):
                s = used.get(idx)
                if s is None:
                    s = self._zero_streams.get(idx)
                    if s is None:  # (no flag on this device: nothing waits behind one)
                        s = torch.cuda.Stream()
                    used[idx] = s
                    ev = self._events.get(idx)
                    if ev is not None:
                        s.wait_event(ev[0])
                if t.is_contiguous():
                    _lib.cuda_zero_async(s.cuda_stream, t.data_ptr(),
                                         t.numel() * t.element_size())
                else:
                    with torch.cuda.stream(s):
                        t.zero_()
        for s in used.values():
            s.synchronize()

    def close(self) -> None:
        """The flags unmapped from their devices and released (before the
        client goes, which unmaps their memory)."""
        if self._watcher is not None:  # stopped before the pages go
            t, w = self._watcher
            self._watcher = None
            try:
                os.write(w, b"x")
            except BrokenPipeError:
                pass  # it saw the daemon go and ended
            t.join()
            os.close(w)
        flags, self._flags = self._flags, {}
        for f in flags.values():
            try:
                _lib.cuda_host_unmap(f.addr)
                self.client.buffer_release(f.buffer)
            except _lib.DpclipError:
                pass

    def ref(self, t: torch.Tensor, shape: Tuple[int, ...]) -> _lib.Tensor:
        bid, off = self.client.register_cuda(t.data_ptr())
        return _tref(bid, off, t.dtype, shape)

    def coefs_out(self, nb: int, device: torch.device) -> torch.Tensor:
        """The first nb elements of the coefficients output on `device`
        (grown when a step needs more; registered once per buffer: the
        engine holds it, so its reference stays valid)."""
        if self._coefs is None or self._coefs.numel() < nb or self._coefs.device != device:
            n = max(nb, 2 * self._coefs.numel() if self._coefs is not None else 0, 64)
            self._coefs = torch.zeros(n, dtype=torch.float32, device=device)
            self._coefs_ref = self.client.register_cuda(self._coefs.data_ptr())
        return self._coefs[:nb]

    def run(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
            algorithm: int, gated: bool, asynchronous: bool, detached: bool = False,
            write: bool = True, accumulated: bool = False) -> Run:
        """Sends the planned step of nb samples on `device`; param.grad
        aliases (or, in another dtype or layout, holds) the daemon's outputs,
        valid on the current stream. gated: data parallel, have the daemon
        write the coefficients and return the success flag.

        Micro-batches of a logical step (dpclip._accumulate) write no
        outputs (write=False: param.grad is left alone); its commit
        (accumulated) writes into the arenas they named. detached: sent
        without waiting for anything (a norm group's micro-batch waits in
        the daemon for the other members' and has no early notice): the
        tensors it names are returned in `keep`, to be held until its reply
        is collected and settle() has ordered this stream after the daemon."""
        keep: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        if plan.ptrs is not None and not detached:
            ptrs = plan.ptrs  # staged as the layers captured (the plan holds the tensors)
        else:
            # (a wired plan's part of a module not used this pass has no
            # tensors: its zeros are made here)
            keep = [(pt.inp, pt.grad) if plan.wired and pt.inp is not None else _wire(pt, device)
                    for pt in plan.parts]
            ptrs = [t.data_ptr() for pair in keep for t in pair]
        # (a logical step's micro-batches name the engine's arenas, and its
        # commit must name the same outputs)
        per_step = self.step_grads and write and not gated and not accumulated
        moved = False
        if per_step:
            # the step's layers name their outputs: re-pointed where one moved
            moved = step_buffers(self.client, plan.outs, device)
            self._step_bufs = held_weakly(plan.outs)
            fresh = False
            self._outs_on = None
        elif plan.serial and self._outs_on == (plan.serial, device):
            fresh = False  # (a template's outputs, checked for this device at its first step)
        else:
            fresh = _out_buffers(self.client, plan.outs, device, self._arenas)
            self._outs_on = (plan.serial, device)

        def out_ref(sl: Optional[Slice]) -> _lib.Tensor:
            if sl is None:
                return _lib.Tensor()
            bid, off = _slice_at(sl)
            return _tref(bid, off, sl[0].dtype, sl[2])

        def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
            pt = plan.parts[i]
            inp, g = keep[i] if keep is not None else (pt.inp, pt.grad)
            return (self.ref(inp, pt.in_shape), self.ref(g, pt.grad_shape), out_ref(pt.w),
                    out_ref(pt.b))

        ready, done, rid, did = self.events(device)
        own = self.readied(device) if detached else None
        flag = self.done_flag(device) if asynchronous and not detached else None
        if flag is None and asynchronous and not detached and not gated:
            # No done flag (DPCLIP_DONE_FLAG=0, or a driver that cannot map
            # host memory): the step waits for its reply. Behind an early
            # notice the stream would wait on `done`, and what a record of
            # an event by a daemon that died before it ran does to a waiting
            # stream is not specified by CUDA: were it let go, the optimizer
            # would apply outputs the daemon may have left without their
            # noise. A gated (data-parallel) step stays asynchronous: its
            # coefficients, zeroed before it and written after its noised
            # sums, fail the gate unless the whole step was written.
            asynchronous = False
        if own is not None:
            ready, rid = own

        ticket, info, res = 0, None, None
        with torch.cuda.device(device):
            rebound = self._layers(step, plan, nb, algorithm, refs, ptrs, fresh)
            if rebound and moved:  # (a step built again named them as they are)
                step.rebind_outputs(_out_refs(plan))
            stream = self._current_stream(device)
            if gated:
                coefs = self.coefs_out(nb, device)
                coefs.zero_()  # stays zero unless the daemon's step succeeds
                step.set_outputs(coefs_out=_tref(self._coefs_ref[0], self._coefs_ref[1],
                                                 torch.float32, (nb,)))
            elif rebound:
                step.set_outputs()  # (a rebound step keeps a commit's coefficients output)
            ready.record(stream)
            step.set_events(rid, did)
            step.notify_enqueued(asynchronous and not detached)
            step.set_done_flag(flag.ref if flag is not None else None)
            t1 = time.perf_counter()
            if detached:
                ticket = step.submit(self.client)
                return Run(None, ticket, None, None, t1, time.perf_counter(), keep, own)
            # param.grad aliases the outputs (a view of each, made once),
            # after an asynchronous step is sent and before its notice is
            # read: the daemon validates and charges it meanwhile, so the
            # host's wait for the notice is not idle time. Put back where
            # the step is refused. (A copy waits for the step, below.)
            aliased: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
            try:
                if asynchronous:
                    ticket = step.submit(self.client)
                    _alias(plan.outs if write else (), aliased)
                    info = self.client.wait_enqueued(ticket)  # raises an early error
                else:
                    _alias(plan.outs if write else (), aliased)
                    res = step.run(self.client)
            except BaseException:
                for p, was in aliased:
                    p.grad = was
                raise
            t2 = time.perf_counter()
            # The daemon recorded `done` before replying: from here on the
            # trainer's stream is ordered after the daemon's writes (and after
            # its reads of `keep`, whose blocks the allocator may now reuse).
            if flag is not None:
                flag.last = info.done_value
                _lib.cuda_wait_value(stream.cuda_stream, flag.dev, info.done_value)
            else:
                stream.wait_event(done)
            # Data parallel: this step's success flag, on the device. Each
            # coefficient (min(1, C / norm), > 0 for any finite norm) is
            # written after the (noised) gradients once the daemon commits
            # them; zero where it failed after its notice (it writes zeros),
            # wrote nothing, or died first.
            ok = (coefs > 0).all().to(torch.float32).reshape(1) if gated else None
        if keep is not None:
            keep.clear()
        for o in plan.outs if write else ():
            if o.alias is None:
                set_grad(o.param, o.grad(o.buf))
        if per_step:
            # the stream waits for the daemon's writes: param.grad alone holds them now
            release_step_buffers(plan.outs)
        return Run(res, ticket, info, ok, t1, t2)

    def _layers(self, step: _lib.Step, plan: Plan, nb: int, algorithm: int,
                refs: Any, ptrs: List[int], fresh: bool) -> bool:
        """The plan's layers in the step: where the step holds the layers
        this transport last built in it, the same parts (names, kinds,
        shapes, dtypes, outputs) for the same batch, only their inputs are
        pointed at this step's tensors (one call into libdpclip, which
        finds each tensor's registration: True); else the step is built
        again (False)."""
        b = self._bound
        if b is not None and not fresh and b[0] is step and b[1] == step.layout and b[2] == nb \
                and b[3] == algorithm:
            # a plan made again from the template of the one bound has its parts
            if plan.serial and plan.serial == b[5]:
                self._rebind(step, plan, ptrs)
                return True
            sig = _signature(plan)
            if b[4] == sig:
                self._rebind(step, plan, ptrs)
                self._bound = b[:5] + (plan.serial,)
                return True
        else:
            sig = _signature(plan)
        self._bound = None
        step.reset(nb)
        add_layers(step, plan.parts, algorithm, refs)
        self._bound = (step, step.layout, nb, algorithm, sig, plan.serial)
        return False

    def _rebind(self, step: _lib.Step, plan: Plan, ptrs: Any) -> None:
        """The step's inputs pointed at the plan's tensors: by the refs
        resolved at the backward's end (plan.refs: a sealed staged plan),
        or from their pointers now."""
        if plan.refs is not None:
            step.rebind(plan.refs)
        else:
            step.rebind_cuda(self.client, ptrs)

    def micro(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
              algorithm: int, asynchronous: bool, detached: bool) -> Run:
        """One micro-batch that does not commit: run() writing no outputs,
        not gated; asynchronous unless detached."""
        return self.run(step, plan, nb, device, algorithm, False, asynchronous and not detached,
                        detached=detached, write=False)

    def release(self, run: Run, device: torch.device) -> None:
        if run.keep is not None:
            self.settle(device, run.ready)
            run.keep.clear()

    def phases(self, sh: Any, plan: Plan, nb: int, device: torch.device,
               scratch: bool = False) -> "CudaPhases":
        return CudaPhases(self, sh, plan, nb, device, scratch)

    def settle(self, device: torch.device,
               ready: Optional[Tuple[torch.cuda.Event, int]] = None) -> None:
        """After the reply of a detached micro-batch (or a later step of the
        session) is in: the daemon has recorded `done` after its reads, so
        ordering the current stream after `done` lets the allocator reuse
        the tensors it named once they are dropped. (A later record of
        `done` is a later point of the daemon's work, which waited only on
        this stream's earlier `ready` records: no cycle.)"""
        _, done, _, _ = self.events(device)
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).wait_event(done)
        if ready is not None:  # its step was queued long since: its record may change
            idx = _index(device)
            self._ready_free.setdefault(idx, []).append(ready)


class CudaPhases(Phases):
    """A sharded step's norm pass and sums on the GPU: the parts' tensors named in
    place (kept until the sums are done); _SLOTS slots, each the size of
    the widest bucket it takes (Sharded.slot_sizes), written in turn
    (sums_submit() queues bucket k + 1's step while bucket k is copied
    out). The daemon's steps wait on no event of ours but
    the norm pass's (its input: the backward's end): a sums step's early
    notice comes once its writes are queued, the trainer's stream waits on
    its slot's `done` (slot_done()), and the host reuses a slot only once
    the trainer's stream has copied it out. So the daemon never waits for
    work queued behind a collective, which waits for another rank's daemon
    work (a deadlock on a GPU).

    The slots are taken together at the first sums step, then the
    trainer's stream is drained: the daemon's writes are in no order with
    it, and memory the allocator hands out may still be read by work queued
    there (a slot taken at bucket 1 once got bucket 0's staging, still read
    by its queued reduce-scatter, and the daemon wrote over it)."""

    def __init__(self, io: CudaIPC, sh: Any, plan: _planner.Plan, nb: int,
                 device: torch.device, scratch: bool = False) -> None:
        self.io = io
        self.sh, self.plan, self.nb, self.device = sh, plan, nb, device
        self.scratch = scratch  # a micro-batch that does not commit: nothing is written
        self.keep = [_wire(lp, device) for lp in plan.parts]
        self.widest = sh.widest
        self.slots: List[Optional[torch.Tensor]] = [None] * _SLOTS
        self.copied_ev: List[Optional[Any]] = [None] * _SLOTS
        self.own: Optional[Tuple[torch.cuda.Event, int]] = None  # submit()'s `ready`
        self.open: List[int] = []  # sums steps past their notice, replies not collected

    def _ins(self, i: int) -> Tuple[_lib.Tensor, _lib.Tensor]:
        io = self.io
        lp, (inp, g) = self.plan.parts[i], self.keep[i]
        return io.ref(inp, lp.in_shape), io.ref(g, lp.grad_shape)

    def norms(self) -> _lib.StepResult:
        return self._norms(False)

    def norms_submit(self) -> Any:
        return self._norms(True)

    def norms_wait(self, sent: Any) -> _lib.StepResult:
        res = self.io.client.wait(sent)
        self.daemon_ms = {"pass": res.compute_ns / 1e6,
                          "pass_input_wait": res.input_wait_ns / 1e6, "sums": 0.0}
        return res

    def _norms(self, submit: bool, own: Optional[Tuple[Any, int]] = None) -> Any:
        """The norm pass, waiting on `ready` (the device's shared one, or
        own's; recorded here, on the current stream: the backward's end):
        its result, or (submit) its ticket."""
        if own is not None:
            ready, rid = own
        else:
            ready, _, rid, _ = self.io.events(self.device)
        e = self.sh.engine
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
                return st.submit(self.io.client) if submit else st.run(self.io.client)
            finally:
                st.set_events(0, 0)

    def submit(self, buckets: List[Tuple[List[int], int]]
               ) -> Tuple[List[int], Optional[BaseException]]:
        """A micro-batch that does not commit (scratch), sent without
        waiting for anything: its norm pass, on a `ready` event of its own
        (CudaIPC.readied: the trainer records the shared one again at its
        next micro-batch), and each bucket's sums step ((which, base) each;
        the daemon writes nothing). Their tickets, in order: the pass's
        first; and the first error of a sums step not sent. This object
        holds the tensors they name until release(), once every reply is
        collected (dpclip._accumulate)."""
        assert self.scratch
        self.own = self.io.readied(self.device)
        tickets = [self._norms(True, self.own)]
        err: Optional[BaseException] = None
        for k, (which, base) in enumerate(buckets):
            try:
                tickets.append(self._sums(k, which, base, True))
            except Exception as exc:  # pylint: disable=broad-except
                err = err or exc  # the rest still sent (dpclip._fsdp's docstring)
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access
        return tickets, err

    def release(self, run: Any, device: torch.device) -> None:
        """Every reply of submit()'s steps is in: the tensors they named may
        go (the trainer's stream ordered after the daemon's reads), and so
        may the pass's own `ready` event (dpclip._transport.Transport's
        release(), which dpclip._accumulate calls)."""
        if self.own is not None:
            self.io.settle(device, self.own)
            self.own = None
        self.keep.clear()
        self.slots = [None] * _SLOTS

    def sums(self, k: int, which: List[int], base: int, n: int) -> torch.Tensor:
        self._sums(k, which, base, False)
        return self.slots[self._slot(k)][:n]

    def sums_submit(self, k: int, which: List[int], base: int, n: int) -> Any:
        return self._sums(k, which, base, True), n

    def sums_wait(self, k: int, sent: Any) -> torch.Tensor:
        """Bucket k's slot, valid on the current stream: after the step's
        early notice, the stream ordered after its slot's `done` (the host
        does not wait for the daemon's GPU work, so the copy-out and the
        collective are queued before the sums are done; sums_done() takes
        the final replies)."""
        ticket, n = sent
        self.io.client.wait_enqueued(ticket)  # raises an early error
        ev, _ = self.io.slot_done(self.device, self._slot(k))
        torch.cuda.current_stream(self.device).wait_event(ev)
        self.open.append(ticket)
        return self.slots[self._slot(k)][:n]

    def sums_done(self) -> None:
        """Every sums step's final reply since the last call (those
        sums_wait() left at their notice); raises the first error, after
        collecting all. A step that failed after its notice wrote zeros."""
        err: Optional[BaseException] = None
        while self.open:
            try:
                res = self.io.client.wait(self.open.pop(0))
            except Exception as exc:  # pylint: disable=broad-except
                err = err or exc
                continue
            if self.daemon_ms:
                self.daemon_ms["sums"] += res.compute_ns / 1e6
        if err is not None:
            raise err

    def _slot(self, k: int) -> int:
        return 0 if self.scratch else k % _SLOTS

    def _sums(self, k: int, which: List[int], base: int, submit: bool) -> int:
        """Bucket k's sums step into its slot: run (0) or (submit) its ticket."""
        sh, e = self.sh, self.sh.engine
        slot = self._slot(k)
        if self.scratch and self.slots[0] is None:  # nothing written: one slot, every bucket
            self.slots[0] = torch.empty(self.widest, dtype=sh.dtype, device=self.device)
        elif not self.scratch and self.copied_ev[slot] is not None:
            self.copied_ev[slot].synchronize()  # the host: bucket k - _SLOTS is out of it
        if self.slots[slot] is None:
            # every slot now, none later (see the class's docstring), then
            # the stream drained: nearly free, the daemon's norm pass waited
            # for the backward it holds
            for i, n in enumerate(sh.slot_sizes(_SLOTS)):
                if self.slots[i] is None and n:
                    self.slots[i] = torch.empty(n, dtype=sh.dtype, device=self.device)
            torch.cuda.current_stream(self.device).synchronize()
        buf = self.slots[slot]
        esz = _ESIZE[sh.dtype]
        st = sh._clip  # pylint: disable=protected-access
        with torch.cuda.device(self.device):
            fbid, foff = self.io.client.register_cuda(buf.data_ptr())
            outs = sh._out_refs(lambda o, shape: _tref(fbid, foff + o * esz, sh.dtype, shape),
                                base)
            st.reset(self.nb)
            st.set_phase(_lib.STEP_SUMS)
            _planner.add_layers(st, self.plan.parts, e.algorithm,
                                lambda i: self._ins(i) + outs(self.plan.parts[i]), which)
            sh._set_ranges(st, self.plan, which)  # pylint: disable=protected-access
            if not submit:
                st.run(self.io.client)  # replies once the daemon's writes are done
                return 0
            if self.scratch:
                return st.submit(self.io.client)
            # the daemon waits on no event of ours (the class's docstring);
            # the trainer's stream waits on the slot's
            st.set_events(0, self.io.slot_done(self.device, slot)[1])
            st.notify_enqueued(True)
            try:
                return st.submit(self.io.client)
            finally:
                st.notify_enqueued(False)
                st.set_events(0, 0)

    def copied(self, k: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.copied_ev[self._slot(k)] = ev

    def close(self) -> None:
        self.sh._clip.set_phase(_lib.STEP_WHOLE)  # pylint: disable=protected-access
        self.keep.clear()
