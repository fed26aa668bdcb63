"""engine.logical_batches(): Opacus's BatchMemoryManager for dpclip.

    with engine.logical_batches(loader, max_physical_batch_size=16) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

The loader (a DPDataLoader: each sample joins each logical batch with
probability q) draws the logical batches as before; each is split, in the
order drawn, into ceil(B / N) micro-batches of at most N samples, as equal
as they come (B = 50, N = 16: 16, 16, 16, 2); an empty logical batch is one
empty micro-batch, which still steps (the daemon's noise alone). The split
is of the sampler's indices, so only a micro-batch is ever collated.

While the loop runs, the optimizer's step() is a no-op except after each
logical batch's last micro-batch, where it commits the logical step
(dpclip._accumulate), and zero_grad() is a no-op after a skipped step (the
logical batch is still accumulating), as Opacus's are. The privacy terms
stay the logical batch's: the sample rate q, the expected batch size q N
(the divisor of a mean loss) and one charge per logical batch. Leaving the
block in the middle of a logical batch drops it (nothing released or
charged), with a warning.

Under data parallelism each rank splits its own shard's batch: ranks may
take different numbers of micro-batches, and each commits (and joins the
all-reduce) once per logical batch."""
import collections
import math
from typing import Any, Deque, Iterator, List, Optional

from torch.utils.data import DataLoader

__all__ = ["LogicalBatches", "State", "split"]


def split(indices: List[int], n: int) -> List[List[int]]:
    """indices (one logical batch) in ceil(B / n) consecutive pieces of at
    most n; [] gives one empty piece."""
    if not indices:
        return [[]]
    return [indices[i:i + n] for i in range(0, len(indices), n)]


class State:
    """Where the loop is: `last`, whether the micro-batch handed out last
    ends its logical batch; `skipped`, whether the last optimizer.step()
    was a no-op (the logical batch goes on)."""

    def __init__(self) -> None:
        self.last = True
        self.skipped = False
        self.flags: Deque[bool] = collections.deque()  # sampled, not yet handed out


class _SplitSampler:
    """The loader's batch sampler with each batch split; records, in order,
    whether each piece ends its logical batch (the loop takes them in the
    same order, however far workers prefetch)."""

    def __init__(self, inner: Any, n: int, state: State) -> None:
        self.inner, self.n, self.state = inner, n, state

    def __iter__(self) -> Iterator[List[int]]:
        for batch in self.inner:
            pieces = split(list(batch), self.n)
            for k, piece in enumerate(pieces):
                self.state.flags.append(k == len(pieces) - 1)
                yield piece

    def __len__(self) -> int:
        """The expected number of micro-batches (the logical batches' sizes
        are random): logical batches times ceil(expected size / n)."""
        rate = getattr(self.inner, "sample_rate", None)
        pieces = 1
        if rate is not None and hasattr(self.inner, "indices"):
            pieces = max(1, math.ceil(rate * len(self.inner.indices) / self.n))
        return len(self.inner) * pieces


class LogicalBatches:
    """The context manager engine.logical_batches() returns; entering it
    gives the iterable of micro-batches."""

    def __init__(self, engine: Any, data_loader: DataLoader, max_physical_batch_size: int
                 ) -> None:
        if not isinstance(max_physical_batch_size, int) or max_physical_batch_size < 1:
            raise ValueError("max_physical_batch_size must be a positive int, got %r"
                             % (max_physical_batch_size,))
        sampler = getattr(data_loader, "batch_sampler", None)
        if not isinstance(data_loader, DataLoader) or sampler is None or \
                getattr(data_loader, "_dataset_kind", 0) != 0:
            raise ValueError(
                "logical_batches: data_loader must be a DataLoader over a map-style dataset "
                "with a batch sampler (the DPDataLoader make_private returns), got %s"
                % type(data_loader).__name__)
        if engine.norm_group is not None:
            raise ValueError(
                "logical_batches: the engine is a member of a norm group, whose members must "
                "take the same micro-batches: split the batches on the member that loads "
                "them and send each micro-batch on (examples/train_pipeline.py)")
        self.engine = engine
        self.loader = data_loader
        self.n = max_physical_batch_size
        self.state = State()

    def __enter__(self) -> "_Split":
        if self.engine._batches is not None:  # pylint: disable=protected-access
            raise RuntimeError("logical_batches: this engine is already inside one")
        self.engine._batches = self.state  # pylint: disable=protected-access
        return _Split(self)

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        e = self.engine
        e._batches = None  # pylint: disable=protected-access
        if self.state.skipped and kind is None:
            # left in the middle of a logical batch: its micro-batches are dropped
            e.clear()  # warns, naming what it dropped
        self.state.skipped = False


class _Split:
    """The micro-batches of the loader's logical batches (iterable once per
    epoch, as the loader); len() is their expected number."""

    def __init__(self, owner: LogicalBatches) -> None:
        self.owner = owner
        loader = owner.loader
        self.sampler = _SplitSampler(loader.batch_sampler, owner.n, owner.state)
        kw = {"num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
              "pin_memory": loader.pin_memory, "timeout": loader.timeout,
              "worker_init_fn": loader.worker_init_fn,
              "multiprocessing_context": loader.multiprocessing_context,
              "generator": loader.generator}
        if loader.num_workers > 0:
            kw["prefetch_factor"] = loader.prefetch_factor
            kw["persistent_workers"] = loader.persistent_workers
        self.loader = DataLoader(loader.dataset, batch_sampler=self.sampler, **kw)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        state = self.owner.state
        state.flags.clear()
        for batch in self.loader:
            state.last = state.flags.popleft()
            yield batch
        state.last = True


def skip_step(state: Optional[State]) -> bool:
    """DPOptimizer.step(): a no-op (True) where the micro-batch handed out
    last does not end its logical batch."""
    if state is None:
        return False
    state.skipped = not state.last
    return state.skipped


def skip_zero_grad(state: Optional[State]) -> bool:
    """DPOptimizer.zero_grad(): a no-op (True) after a skipped step."""
    return state is not None and state.skipped
