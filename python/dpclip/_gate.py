"""The data-parallel success gate, and the buckets its collectives (and the
sharded steps' reduce-scatters) run over.

Only rank 0 adds noise (data parallel), or each rank noises only the rows it
owns (sharded): a sum without every rank's result could lack noise. So each
rank's success flag is all-reduced (MIN) beside its sums, and the sums are
applied only where every flag is 1; otherwise every rank writes zeros and
raises, the failing rank its own error, the others DPCLIP_EUNAVAIL. With
asynchronous GPU steps a rank's failure shows on the device alone (the
daemon writes zeros after its early notice), after optimizer.step() has
queued the update on every rank; so the data-parallel gate works on the
device, with no host synchronisation, and raises at the next collection
(check()). The sharded steps block and read the flag at once (agree())."""
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import _lib

__all__ = ["Gate", "buckets", "span", "BUCKET_ELEMS"]

# Gradient elements per data-parallel all-reduce: one collective per
# parameter costs a launch and a latency-bound exchange each (~150 for
# GPT-2), one for everything a copy of the whole model; a bucket of this
# size (32 MiB of f32) takes NCCL near its bandwidth. (The sharded steps'
# reduce-scatters use their own, larger size per rank: dpclip._shards.bucket_size().)
BUCKET_ELEMS = 1 << 23


def buckets(widths: Sequence[int], limit: int, joined: Callable[[int], bool] = lambda i: False,
            apart: Callable[[int], bool] = lambda i: False) -> List[Tuple[int, int]]:
    """[first, last) ranges of consecutive items whose widths sum to at most
    limit (a larger item alone): one collective each. Items i - 1 and i are
    never cut apart by size where joined(i) (a layer's weight and bias,
    summed in one sums step), and always where apart(i) (another dtype or
    device: one flat tensor per collective). Both users take this one rule,
    each with its own limit: the all-reduce's (BUCKET_ELEMS) and the
    sharded reduce-scatter's (dpclip._shards.bucket_size()), whose staging is per
    rank."""
    out: List[Tuple[int, int]] = []
    first, width = 0, 0
    for i, w in enumerate(widths):
        if i > first and (apart(i) or (width + w > limit and not joined(i))):
            out.append((first, i))
            first, width = i, 0
        width += w
    if first < len(widths):
        out.append((first, len(widths)))
    return out


def grad_buckets(params: Sequence[torch.Tensor], limit: Optional[int] = None
                 ) -> List[List[torch.Tensor]]:
    """params' consecutive runs of one gradient dtype and device, each at most
    `limit` (BUCKET_ELEMS) elements, a larger parameter alone: the
    all-reduces."""
    limit = BUCKET_ELEMS if limit is None else limit
    grads = [p.grad for p in params]

    def apart(i: int) -> bool:
        return grads[i].dtype != grads[i - 1].dtype or grads[i].device != grads[i - 1].device

    # (a run's dtype and device are its first's: apart compares neighbours,
    # which within a run are all alike)
    runs = buckets([g.numel() for g in grads], limit, apart=apart)
    return [list(params[a:b]) for a, b in runs]


def span(grads: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat view of grads where they lie end to end in one storage, in
    their order, each contiguous (the CUDA transport's outputs: an arena,
    dpclip._outputs._out_buffers), so that a collective runs on them in place;
    None otherwise. Exactly end to end: a gap could be another tensor's
    memory, which the collective would overwrite."""
    g0 = grads[0]
    base = _storage_ptr(g0)
    at = g0.storage_offset()
    for g in grads:
        if not g.is_contiguous() or _storage_ptr(g) != base or g.storage_offset() != at:
            return None
        at += g.numel()
    return torch.as_strided(g0, (at - g0.storage_offset(),), (1,), g0.storage_offset())


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of t's storage (torch < 2: storage())."""
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


class Gate:
    """One engine's gate over its data-parallel ranks (group: None, all).
    lacks: what a sum without every rank's result could lack, for the error
    (the data-parallel sum rank 0's noise; a sharded step a shard's
    owner's noise or a rank's samples). The data-parallel steps call
    reduce() (sums and flag; a deferred flag is read by check() at the next
    collection, where every rank's step() raises before its next
    collectives, so the ranks stay in step); the sharded steps agree()."""

    def __init__(self, world_size: int, group: object = None,
                 lacks: str = "the update could lack rank 0's noise") -> None:
        self.world_size = world_size
        self.group = group                 # the data-parallel ranks (None: all)
        self.lacks = lacks
        # the flag's pinned copy and its event
        self._host: Optional[torch.Tensor] = None
        self._event: Optional[torch.cuda.Event] = None
        self._pending: Optional[int] = None  # the optimizer step it belongs to

    def agree(self, ok: bool, device: torch.device) -> bool:
        """Whether every rank's step succeeded (ok: this rank's); every rank
        calls it (an all-reduce; CUDA: waits for the work queued before)."""
        dist = torch.distributed
        flag = torch.ones(1, device=device) if ok else torch.zeros(1, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag[0] > 0)

    def reduce(self, params: Sequence[torch.Tensor], ok: Optional[torch.Tensor],
               failed: Optional[Exception], step: int, deferred: bool) -> None:
        """After each data-parallel step: sums the ranks' clipped sums and
        zeroes them unless every rank succeeded. ok: this rank's flag ([1]
        f32 on the gradients' device: 1 where its result is in param.grad),
        or failed: its exception. deferred: asynchronous GPU steps (the
        flag is read at check())."""
        dist = torch.distributed
        if failed is not None:
            ok = torch.zeros(1, device=params[0].device)
            for p in params:
                if p.grad is None or p.grad.shape != p.shape:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        bad = ok[0] == 0
        for bucket in grad_buckets(params):
            grads = [p.grad for p in bucket]
            flat = grads[0] if len(grads) == 1 else span(grads)
            gathered = flat is None
            if gathered:
                flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat.masked_fill_(bad, 0)  # masked, not multiplied: a stale grad may be NaN
            if gathered:
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        if deferred:
            if self._host is None:
                self._host = torch.zeros(1, pin_memory=True)
                self._event = torch.cuda.Event()
            with torch.cuda.device(params[0].device):
                self._host.copy_(ok, non_blocking=True)
                self._event.record()
            self._pending = step
        elif failed is None and not bool(ok[0]):
            raise self.not_applied(step)
        if failed is not None:
            raise failed

    def check(self) -> None:
        """Raises if the last deferred step was applied on no rank."""
        step, self._pending = self._pending, None
        if step is None:
            return
        self._event.synchronize()  # the flag's copy, queued after the all-reduce
        if not bool(self._host[0]):
            raise self.not_applied(step)

    def drop(self) -> None:
        """Forgets the deferred flag (its step raised its own error)."""
        self._pending = None

    def not_applied(self, step: int) -> _lib.DpclipError:
        """The error of optimizer step `step`, failed on some rank and so
        applied on none."""
        return _lib.DpclipError(
            _lib.EUNAVAIL, "", "optimizer step %d was applied on no rank: it failed on at least "
            "one of the %d ranks (that rank raises its error), and without every rank's result "
            "%s; the gradients were zeroed" % (step, self.world_size, self.lacks))
