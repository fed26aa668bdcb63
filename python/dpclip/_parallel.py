"""Data parallel (torch.distributed) halves of the PyTorch integration: the
checks of a DPDataLoader against the engine's ranks, and the gate that keeps
a step failing on any rank from being applied as the others' noiseless sum.

Only rank 0 adds noise (the others send sigma 0), so the all-reduced sum is
private only with rank 0's result in it. With asynchronous GPU steps a
rank's failure shows on the device alone (the daemon writes zeros after its
early notice), after optimizer.step() has queued the update on every rank;
so the gate works on the device: each rank's success flag is all-reduced
(MIN) with the clipped sums (SUM), and the sums are zeroed unless every flag
is 1, with no host synchronisation."""
import hashlib

import torch

from . import _lib
from .data import DPDataLoader


def check_loader(engine, loader, device, secure_mode):
    """Refuses a DPDataLoader made for another world size or rank than the
    engine's, and (data parallel) ranks whose generators are in one state.
    Every rank calls it (an all-gather)."""
    if not isinstance(loader, DPDataLoader):
        return
    if secure_mode and not loader.secure_mode:
        raise ValueError("secure_mode=True, but the DPDataLoader given draws its masks from a "
                         "torch generator: make it with secure_mode=True")
    if (loader.world_size, loader.rank) != (engine.world_size, engine.rank):
        raise ValueError(
            "the DPDataLoader samples for world size %d (as rank %d), but the engine trains %s: "
            "each rank would sample %s while the privacy ledger accounts the sample rate once; "
            "make the DPDataLoader after torch.distributed.init_process_group, with "
            "distributed=None or True (the engine's distributed=%s)" % (
                loader.world_size, loader.rank,
                "data parallel over %d ranks (this is rank %d)" % (engine.world_size, engine.rank)
                if engine.world_size > 1 else "in one process",
                "the whole dataset" if loader.world_size == 1 else "a shard",
                engine.distributed))
    if engine.world_size == 1:
        return
    # Ranks whose generators are in one state draw the same masks over their
    # shards: compare a digest of each rank's state (0: secure mode, none).
    gen = loader.batch_sampler.generator
    digest = 0 if gen is None else int.from_bytes(hashlib.blake2b(
        bytes(gen.get_state().tolist()), digest_size=8).digest(), "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(engine.world_size)]
    torch.distributed.all_gather(every, mine)
    every = [int(t) for t in every]
    for r, d in enumerate(every):
        if d and every.index(d) != r:
            raise ValueError(
                "the DPDataLoaders of ranks %d and %d have generators in the same state: they "
                "would draw the same batch masks; pass no generator (each loader then seeds its "
                "own from os.urandom) or seed each rank's differently" % (every.index(d), r))


class Gate:
    """One engine's gate: after each step, reduce() sums the ranks' clipped
    sums and zeroes them unless every rank succeeded. A step applied on no
    rank is raised on every rank: at once where steps block, else by
    check() at the next collection, where every rank's step() raises before
    its next collectives, so the ranks stay in step."""

    def __init__(self, world_size):
        self.world_size = world_size
        self._host = self._event = None  # the flag's pinned copy and its event
        self._pending = None             # the optimizer step it belongs to

    def reduce(self, params, ok, failed, step, deferred):
        """ok: this rank's flag ([1] f32 on the gradients' device: 1 where
        its result is in param.grad), or failed: its exception. deferred:
        asynchronous GPU steps (the flag is read at check())."""
        dist = torch.distributed
        if failed is not None:
            ok = torch.zeros(1, device=params[0].device)
            for p in params:
                if p.grad is None or p.grad.shape != p.shape:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        bad = ok[0] == 0
        for p in params:
            p.grad.masked_fill_(bad, 0)  # masked, not multiplied: a stale grad may be NaN
        if deferred:
            if self._host is None:
                self._host = torch.zeros(1, pin_memory=True)
                self._event = torch.cuda.Event()
            with torch.cuda.device(params[0].device):
                self._host.copy_(ok, non_blocking=True)
                self._event.record()
            self._pending = step
        elif failed is None and not bool(ok[0]):
            raise self._not_applied(step)
        if failed is not None:
            raise failed

    def check(self):
        """Raises if the last deferred step was applied on no rank."""
        step, self._pending = self._pending, None
        if step is None:
            return
        self._event.synchronize()  # the flag's copy, queued after the all-reduce
        if not bool(self._host[0]):
            raise self._not_applied(step)

    def drop(self):
        """Forgets the deferred flag (its step raised its own error)."""
        self._pending = None

    def _not_applied(self, step):
        return _lib.DpclipError(
            _lib.EUNAVAIL, "", "optimizer step %d was applied on no rank: it failed on at least "
            "one of the %d ranks (that rank raises its error), and without every rank's result "
            "the update could lack rank 0's noise; the gradients were zeroed" % (
                step, self.world_size))


def broadcast_job_id(job_id: str) -> str:
    """Rank 0's ledger job id, on every rank (every rank calls it)."""
    box = [job_id]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
