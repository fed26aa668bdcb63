"""Poisson-sampled data loading for DP-SGD.

The privacy analysis of DP-SGD (amplification by subsampling) assumes every
sample joins each batch independently with probability q = sample_rate, so
batch sizes vary and a batch may be empty. A fixed-size shuffled batch gives
a different (weaker) guarantee. The loader here draws such batches; the
expected batch size q * N is what the daemon divides by with a mean loss.

Under torch.distributed each rank samples, with the same q, from its own
shard of the dataset (indices rank, rank + world, ...): the union of the
ranks' batches is then a Poisson sample of the whole dataset with rate q,
whose expected size (q * N, the global one) the engine passes to every rank.
That holds only if the ranks' draws are independent: each sampler has its
own generator, seeded from os.urandom (not the global torch RNG, which
trainers seed alike on every rank), and make_private refuses loaders made
for another world size or rank, and ranks whose generators are in the same
state.

The masks come from torch's CPU generator (a Mersenne Twister, whose seed
is 32 bits): independent across ranks and runs, but not secret from
whoever sees enough batches. secure_mode=True draws them from os.urandom
instead (the kernel's CSPRNG, as Python's `secrets` does): 8 bytes per
sample of the shard per batch, some tens of milliseconds per million
samples, against a few for the generator.
"""
import fractions
import math
import os
from typing import Any, Callable, Iterator, List, Optional, Sequence

from . import _needs_torch  # noqa: F401  (says which python3 has torch when it is missing)

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

__all__ = ["UniformWithReplacementSampler", "DPDataLoader", "poisson_loader"]


def _urandom_generator() -> torch.Generator:
    """A CPU generator of its own, seeded from os.urandom."""
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return g


def _secure_mask(n: int, rate: float) -> torch.Tensor:
    """n independent Bernoulli(rate) draws from os.urandom: 63 random bits
    each against floor(rate * 2^63), computed exactly (off by < 2^-63)."""
    if rate >= 1.0:
        return torch.ones(n, dtype=torch.bool)
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    bits = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    return (bits & ((1 << 63) - 1)) < int(fractions.Fraction(rate) * (1 << 63))


class UniformWithReplacementSampler:
    """A batch sampler: each of `indices` enters each batch independently
    with probability sample_rate; `steps` batches per epoch (default
    round(1 / sample_rate), one expected pass over the data).

    generator: where the draws come from (default: one of its own, seeded
    from os.urandom; give one only for reproducible tests). secure_mode:
    draw from os.urandom instead (no generator)."""

    def __init__(self, indices: Sequence[int], sample_rate: float, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, secure_mode: bool = False) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError("sample_rate must be in (0, 1], got %r" % (sample_rate,))
        if secure_mode and generator is not None:
            raise ValueError("secure_mode draws the masks from os.urandom: do not pass a "
                             "generator")
        self.indices = torch.as_tensor(list(indices), dtype=torch.long)
        self.sample_rate = float(sample_rate)
        self.steps = int(steps) if steps is not None else max(1, int(round(1.0 / sample_rate)))
        self.secure_mode = bool(secure_mode)
        self.generator = None if secure_mode else (generator if generator is not None
                                                   else _urandom_generator())

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        n = len(self.indices)
        for _ in range(self.steps):
            if self.secure_mode:
                mask = _secure_mask(n, self.sample_rate)
            else:
                # f64: uniform on a 2^-53 grid, so a small rate is drawn at its value
                mask = torch.rand(n, generator=self.generator, dtype=torch.float64) < \
                    self.sample_rate
            yield self.indices[mask].tolist()


def _empty_collate(dataset: Any, collate_fn: Callable[[List[Any]], Any]
                   ) -> Callable[[List[Any]], Any]:
    """collate_fn that turns an empty batch into correctly shaped tensors
    with a leading dimension of 0 (default_collate cannot collate nothing),
    so that the training loop runs unchanged on an empty batch."""

    def collate(batch: List[Any]) -> Any:
        if len(batch) > 0:
            return collate_fn(batch)
        proto = collate_fn([dataset[0]])
        return _slice0(proto)

    return collate


def _slice0(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x[:0]
    if isinstance(x, (list, tuple)):
        return type(x)(_slice0(v) for v in x)
    if isinstance(x, dict):
        return {k: _slice0(v) for k, v in x.items()}
    return x


class DPDataLoader(DataLoader):
    """A DataLoader whose batches are Poisson samples of `dataset`.

    sample_rate: each sample's probability of joining a batch. distributed:
    None = use torch.distributed when it is initialized (make the loader
    after init_process_group); then this rank samples from its shard only.
    rank, world_size: the data-parallel rank and world size to sample for,
    where they are not torch.distributed's: with model parallelism (norm
    groups) the replica's index and the number of replicas.
    The expected (global) batch size is `expected_batch_size`. generator:
    default one of this loader's own, seeded from os.urandom (give one only
    for reproducible tests). secure_mode: masks from os.urandom (see the
    module's note on its cost)."""

    def __init__(self, dataset: Dataset, sample_rate: float, *, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, distributed: Optional[bool] = None,
                 collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 secure_mode: bool = False, rank: Optional[int] = None,
                 world_size: Optional[int] = None, **kwargs: Any) -> None:
        for bad in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if bad in kwargs:
                raise ValueError("DPDataLoader draws its own batches; do not pass %s" % bad)
        n = len(dataset)
        if (rank is None) != (world_size is None):
            raise ValueError("DPDataLoader: give rank and world_size together")
        if world_size is not None:
            if not 0 <= rank < world_size:
                raise ValueError("DPDataLoader: rank %r outside [0, world_size=%r)"
                                 % (rank, world_size))
            rank, world = int(rank), int(world_size)
        else:
            rank, world = 0, 1
            if distributed is None:
                distributed = torch.distributed.is_available() and \
                    torch.distributed.is_initialized()
            if distributed:
                rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = max(1, int(round(self.sample_rate * n)))
        self.rank, self.world_size = rank, world
        self.secure_mode = bool(secure_mode)
        sampler = UniformWithReplacementSampler(range(rank, n, world), sample_rate, steps=steps,
                                                generator=generator, secure_mode=secure_mode)
        collate = collate_fn or default_collate
        super().__init__(dataset, batch_sampler=sampler,
                         collate_fn=_empty_collate(dataset, collate), **kwargs)

    @classmethod
    def from_data_loader(cls, loader: DataLoader, *, generator: Optional[torch.Generator] = None,
                         distributed: Optional[bool] = None, secure_mode: bool = False,
                         rank: Optional[int] = None,
                         world_size: Optional[int] = None) -> "DPDataLoader":
        """The Poisson counterpart of a fixed-batch loader: sample rate
        batch_size / N (world size times that under torch.distributed, whose
        usual DistributedSampler gives each rank batch_size samples; or
        world_size, given with rank, as DPDataLoader takes them)."""
        n = len(loader.dataset)
        bs = loader.batch_size
        if bs is None:
            raise ValueError("the data loader has no batch_size to derive a sample rate from")
        world = 1
        if distributed is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            world = torch.distributed.get_world_size()
        if world_size is not None:
            world = int(world_size)
        rate = min(1.0, bs * world / n)
        return cls(loader.dataset, rate, steps=max(1, int(math.ceil(n / (bs * world)))),
                   generator=generator, distributed=distributed, secure_mode=secure_mode,
                   rank=rank, world_size=world_size,
                   collate_fn=loader.collate_fn if loader.collate_fn is not default_collate
                   else None, num_workers=loader.num_workers, pin_memory=loader.pin_memory)


def poisson_loader(dataset: Dataset, sample_rate: float, **kwargs: Any) -> DPDataLoader:
    """Shorthand for DPDataLoader(dataset, sample_rate, **kwargs)."""
    return DPDataLoader(dataset, sample_rate, **kwargs)
