"""The daemon's outputs in the trainer's device memory (the CUDA transport,
dpclip._cuda): each trainable parameter's buffer a slice of a zeroed arena
per dtype, registered once, and param.grad set to a view of it where the
parameter's dtype and layout allow (an alias), so that a step's result
needs no copy."""
import ctypes
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._layers import _ESIZE, Out

__all__ = ["_alias", "_out_buffers", "arena_bytes", "step_buffers", "release_step_buffers"]


def _alias(outs: Sequence[Out], aliased: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]
           ) -> None:
    """Each output's param.grad set to its alias (where it has one), what
    it was kept in `aliased`, to be put back if the step is refused."""
    for o in outs:
        if o.alias is not None:
            aliased.append((o.param, o.param.grad))
            o.param.grad = o.alias


# Where the outputs' buffers start within their arena: a multiple of this
# many elements (16 bytes of f32), so that the daemon's stores stay vectors
_OUT_ALIGN = 4
# An arena's bytes at most (a larger output alone): one allocation of a
# whole large model's gradients may find no room in a device's fragmented
# memory where pieces would; the bucket across two arenas is gathered
_ARENA_BYTES = 1 << 30


def _out_buffers(client: Any, outs: Sequence[Out], device: torch.device,
                 arenas: Optional[List[torch.Tensor]] = None) -> bool:
    """Gives each output without a buffer on `device` one: a slice of a new
    zeroed arena per dtype (_ARENA_BYTES at most), in the outputs' order,
    registered once (True: some were made). The engine holds the outputs
    for its lifetime, so their allocations cannot be freed and reused: the
    references stay valid (activations and output grads are new tensors
    every step and go through libdpclip's check). Zeros, not the
    allocator's leftovers, so that no gradient is ever memory this process
    used for its data (a step that fails is zeroed: by the daemon, or by
    release_flags where the daemon could not). One
    arena rather than a tensor each: the param.grad views of consecutive
    parameters are then consecutive in memory, so the data-parallel
    all-reduce sums a bucket in place (dpclip._gate) instead of gathering
    it into a copy and scattering it back. Each new arena is appended to
    arenas (the transport's: release_flags zeroes them)."""
    todo = [o for o in outs if o.buf is None or o.buf.device != device]
    if not todo:
        return False
    by_dtype: Dict[torch.dtype, List[Out]] = {}
    for o in todo:
        by_dtype.setdefault(o.dtype, []).append(o)
    for dtype, group in by_dtype.items():
        cap = max(_ARENA_BYTES // _ESIZE[dtype], 1)
        first, n = 0, 0
        offs = []
        for i, o in enumerate(group):
            width = -(-o.numel // _OUT_ALIGN) * _OUT_ALIGN
            if n and n + width > cap:  # this arena is full: the outputs so far get it
                _arena(client, group[first:i], offs, n, device, arenas)
                first, n, offs = i, 0, []
            offs.append(n)
            n += width
        _arena(client, group[first:], offs, n, device, arenas)
    return True


def step_buffers(client: Any, outs: Sequence[Out], device: torch.device) -> bool:
    """Per-step gradient buffers (DPCLIP_GRAD_BUFFERS=step, the default
    outside data parallelism): each output a tensor of its own from the
    caching allocator, made at the step (after the backward, from the
    blocks its activations freed), resolved into (buffer id, offset) in one
    call into libdpclip, param.grad's alias a view of it. The transport
    lets go of them once the trainer's stream waits for the daemon
    (release_step_buffers), so that they live only as long as param.grad:
    zero_grad(set_to_none=True) frees them before the next forward, as
    plain training frees its gradients, where the engine's arenas
    (_out_buffers) hold a parameter-sized copy through it. Returns whether
    any output's reference moved (the step's layers must then be pointed at
    them). Zeroed, in one multi-tensor launch on the current stream, before
    the step is sent, as the arenas are when made: a step whose daemon can
    neither write nor zero them (a broken CUDA context) still lets the
    stream apply them, which must then not hold the allocator's leftovers
    (this process's data)."""
    bufs = [torch.empty(o.numel, dtype=o.dtype, device=device) for o in outs]
    if bufs:
        torch._foreach_zero_(bufs)
    n = len(bufs)
    ptrs = (ctypes.c_uint64 * max(n, 1))(*[b.data_ptr() for b in bufs])
    refs = (ctypes.c_uint64 * max(2 * n, 1))()
    rc = client.refs_cuda_at(n, ctypes.addressof(ptrs), ctypes.addressof(refs))
    if rc:
        client.check(rc)
    moved = False
    for i, (o, b) in enumerate(zip(outs, bufs)):
        ref = (int(refs[2 * i]), int(refs[2 * i + 1]))
        moved |= ref != o.ref
        o.buf, o.ref = b, ref
        view = o.grad(b)
        o.alias = view if view.dtype == o.param.dtype and view.is_contiguous() else None
    return moved


def held_weakly(outs: Sequence[Out]) -> List["weakref.ref[torch.Tensor]"]:
    """Weak references to the outputs' buffers: what the transport zeroes
    of them if the daemon goes mid-step (CudaIPC.release_flags), taken
    before the step is sent, without keeping them alive after it."""
    return [weakref.ref(o.buf) for o in outs if o.buf is not None]


def release_step_buffers(outs: Sequence[Out]) -> None:
    """The transport's hold on per-step buffers that param.grad aliases let
    go (their references kept, to see whether the next step's moved). One
    that param.grad copies (another dtype or layout) stays until the next
    step: the copy waits behind the daemon's done, and should the daemon
    go first, the buffer must still be there for release_flags to zero."""
    for o in outs:
        if o.alias is not None:
            o.buf = o.alias = None


def arena_bytes(arenas: Sequence[torch.Tensor]) -> int:
    """Device bytes the arenas hold: the gradient buffers the engine keeps
    for its lifetime, through the forward and backward too (where plain
    training with zero_grad(set_to_none=True) holds no gradients)."""
    return sum(a.numel() * a.element_size() for a in arenas if a.device.type == "cuda")


def _arena(client: Any, outs: Sequence[Out], offs: Sequence[int], n: int,
           device: torch.device, arenas: Optional[List[torch.Tensor]]) -> None:
    """One zeroed arena of n elements on `device`, output i's buffer at offs[i]."""
    arena = torch.zeros(n, dtype=outs[0].dtype, device=device)
    if arenas is not None:
        arenas.append(arena)
    for o, off in zip(outs, offs):
        o.buf = arena[off:off + o.numel]
        o.ref = client.register_cuda(o.buf.data_ptr())
        view = o.grad(o.buf)
        o.alias = view if view.dtype == o.param.dtype and view.is_contiguous() else None
