"""Data parallel (torch.distributed) halves of the PyTorch integration: the
checks of a DPDataLoader against the engine's ranks, the ledger membership
of each rank's step, and the replicas of norm groups. The gate that keeps a
step failing on any rank from being applied as the others' noiseless sum is
dpclip._gate's.

Only rank 0 adds noise (the others send sigma 0), so the all-reduced sum is
private only with rank 0's result in it. Each rank's step declares itself
its member of the job's logical step (declare_member): the daemon charges
each logical step once, at the engine's sigma, to whichever rank comes
first, and takes the others' noiseless steps as shares of it, at most one
per rank and logical step; a sigma-0 step that declares nothing is charged
as no privacy.

With norm groups (model parallelism, dpclip._group) the data-parallel
ranks are the replicas: the members holding the same part of the model in
each replica form a data-parallel group of their own (replicas()), over
which the parameters are broadcast, the loaders checked and the gradients
gated; the engine's rank and world size are then the replica's index and
the number of replicas."""
import hashlib
from typing import Any, Iterable, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from . import _lib
from .data import DPDataLoader


def generator_digest(loader: DPDataLoader) -> int:
    """A digest of a DPDataLoader's generator state (0: secure mode, none)."""
    gen = loader.batch_sampler.generator
    return 0 if gen is None else int.from_bytes(hashlib.blake2b(
        bytes(gen.get_state().tolist()), digest_size=8).digest(), "little", signed=True)


def check_loader(engine: Any, loader: Optional[DataLoader], device: torch.device,
                 secure_mode: bool) -> None:
    """Refuses a DPDataLoader made for another world size or rank than the
    engine's, and (data parallel) ranks whose generators are in one state.
    Every rank calls it (an all-gather)."""
    if not isinstance(loader, DPDataLoader):
        return
    fault = loader_fault(engine, loader, secure_mode)
    if fault is not None:
        raise fault
    if engine.world_size == 1:
        return
    # Ranks whose generators are in one state draw the same masks over their
    # shards: compare a digest of each rank's state (0: secure mode, none).
    mine = torch.tensor([generator_digest(loader)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(engine.world_size)]
    torch.distributed.all_gather(every, mine)
    fault = same_generators(list(enumerate(int(t) for t in every)))
    if fault is not None:
        raise fault


def same_generators(digests: Iterable[Tuple[int, Optional[int]]]) -> Optional[ValueError]:
    """The fault of (rank, generator digest) pairs of the data-parallel
    ranks where two are in one state (they would draw the same masks over
    their shards), or None; a digest of 0 or None (secure mode, no loader)
    is passed over."""
    seen = {}
    for r, d in digests:
        if d and d in seen:
            return ValueError(
                "the DPDataLoaders of ranks %d and %d have generators in the same state: they "
                "would draw the same batch masks; pass no generator (each loader then seeds its "
                "own from os.urandom) or seed each rank's differently" % (seen[d], r))
        seen.setdefault(d, r)
    return None


def loader_fault(engine: Any, loader: Optional[DataLoader], secure_mode: bool
                 ) -> Optional[ValueError]:
    """What is wrong with a DPDataLoader for this engine (made for another
    world size or rank, or not in the secure mode asked for), or None."""
    if not isinstance(loader, DPDataLoader):
        return None
    if secure_mode and not loader.secure_mode:
        return ValueError("secure_mode=True, but the DPDataLoader given draws its masks from a "
                          "torch generator: make it with secure_mode=True")
    if (loader.world_size, loader.rank) != (engine.world_size, engine.rank) and \
            engine.norm_group is not None:
        return ValueError(
            "the DPDataLoader samples for world size %d (as rank %d), but with its norm group "
            "the engine trains %d data-parallel replica%s (this is replica %d): make it with "
            "rank=%d and world_size=%d (the replica's index and count), or distributed=False "
            "where one replica trains" % (loader.world_size, loader.rank, engine.world_size,
                                          "s" if engine.world_size > 1 else "", engine.rank,
                                          engine.rank, engine.world_size))
    if (loader.world_size, loader.rank) != (engine.world_size, engine.rank):
        return ValueError(
            "the DPDataLoader samples for world size %d (as rank %d), but the engine trains %s: "
            "each rank would sample %s while the privacy ledger accounts the sample rate once; "
            "make the DPDataLoader after torch.distributed.init_process_group, with "
            "distributed=None or True (the engine's distributed=%s)" % (
                loader.world_size, loader.rank,
                "data parallel over %d ranks (this is rank %d)" % (engine.world_size, engine.rank)
                if engine.world_size > 1 else "in one process",
                "the whole dataset" if loader.world_size == 1 else "a shard",
                engine.distributed))
    return None


def declare_member(engine: Any, step: _lib.Step) -> None:
    """Data parallel: makes `step`, the engine's, this rank's member of each
    logical step of its job (_lib.Step.set_data_parallel), with the engine's
    noise multiplier as the job's sigma. Over norm groups every member of
    every replica is one: member replica * size + rank of replicas * size
    (replica 0's members add the noise, the others' are shares). Nothing to
    declare with one replica, or without noise (every step is then charged
    as what it is: no privacy)."""
    if not (engine.distributed and engine.world_size > 1 and engine.noise_multiplier > 0):
        return
    rank, world = engine.rank, engine.world_size
    group = engine.norm_group
    if group is not None:
        rank, world = rank * group.size + group.rank, world * group.size
    step.set_data_parallel(world, rank, engine.noise_multiplier)


def broadcast_job_id(job_id: str, group: Any = None, src: int = 0) -> str:
    """The ledger job id of global rank src, on every rank of group (None:
    all; every one calls it)."""
    box = [job_id]
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]


def replica_groups(parts: Sequence[Tuple[int, ...]], mine: Sequence[int], rank: int
                   ) -> Tuple[Any, int, int, int]:
    """Data parallelism over norm groups (every rank calls it alike):
    `parts` are the norm groups' global ranks (each in rank order, sorted,
    the same list on every rank), `mine` this rank's and `rank` its rank in
    it. Makes the data-parallel groups, one per part of the model (the
    members holding it in every replica; new_group is a collective of all
    ranks, in one order) and returns (this rank's, None where there is one
    replica; this replica's index; the number of replicas; the global rank
    of this part's member in replica 0, which adds the noise)."""
    dp = None
    if len(parts) > 1:
        for j in range(len(mine)):
            g = torch.distributed.new_group([part[j] for part in parts])
            if j == rank:
                dp = g
    return dp, parts.index(tuple(mine)), len(parts), parts[0][rank]
