"""One object per way an engine trains (issue 42): make_private chooses it
(choose()), and the engine delegates to it what differs, so that no step
asks again which it is.

  Local         one process (or one rank of one): each step() one ClipStep
                (or a logical step's micro-batches and commit), applied as
                the daemon wrote it;
  DataParallel  ranks of torch.distributed, each a replica: rank 0 adds the
                noise, the clipped sums are all-reduced and applied only
                where every rank's step succeeded (dpclip._gate);
  Sharded       FSDP2 or sharded_noise: each step in phases, the sums
                reduce-scattered and each rank's rows noised by its own
                daemon (dpclip._fsdp.Sharded, which this wraps);
  Grouped       a member of a norm group (model parallelism, dpclip._group),
                around the Local or DataParallel mode of its replicas.

Every mode moves its tensors through the engine's transports
(dpclip._transport), chosen by the layers' device alone.

The interface: open() once the engine's session and Step are final;
step(params), optimizer.step()'s body; collect(), the last step's result
(a data-parallel rank's failure included), before each step and at close;
send(), one micro-batch of a logical step (dpclip._accumulate); close();
check_logical_batches(); and gated (each step's sums gated over ranks) and
guard_hooks (the fail-closed guard watches autograd's gradients)."""
from typing import Any, Iterable, Optional, Union

import torch

from . import _fsdp, _group, _lib, _planner
from ._gate import Gate
from ._group import NormGroup

__all__ = ["Local", "DataParallel", "Sharded", "Grouped", "choose"]


class Local:
    """One process: each step is applied as the daemon wrote it."""

    gated = False
    guard_hooks = True

    def __init__(self, engine: Any) -> None:
        self.e = engine

    def open(self, target_delta: float, target_epsilon: float, device: torch.device) -> None:
        """After the engine's Step is made (nothing to open here)."""

    def step(self, params: Optional[Iterable[torch.Tensor]]) -> None:
        """The last step collected, the guard passed, then the logical step
        committed (dpclip._accumulate); raises its error, no parameter
        updated. Counted once it succeeded."""
        e = self.e
        try:
            self.collect()
            e._guard.check(e.module, params)  # pylint: disable=protected-access
            e._acc.commit(False)  # pylint: disable=protected-access
        finally:
            e._drop()  # pylint: disable=protected-access
        e.steps += 1

    def collect(self) -> None:
        """The last asynchronous step's result (raising its error)."""
        self.e.synchronize()

    def send(self, acc: Any, plan: _planner.Plan, B: int, logical_id: int, index: int,
             commit: bool, gated: bool) -> Optional[torch.Tensor]:
        """Micro-batch `index` of logical step `logical_id` as a ClipStep
        of the engine's Step (the commit where commit: its success flag)."""
        e = self.e
        e._step.set_logical(logical_id, index, commit)  # pylint: disable=protected-access
        try:
            if commit:
                return acc._send_commit(plan, B, gated)  # pylint: disable=protected-access
            acc._send_micro(plan, B, index)  # pylint: disable=protected-access
            return None
        finally:
            e._step.set_logical(0)  # pylint: disable=protected-access

    def close(self) -> None:
        """The engine closes (after the last collection and detach)."""

    def check_logical_batches(self) -> None:
        """Refuses engine.logical_batches where the mode cannot take it."""


class DataParallel(Local):
    """Data-parallel ranks (group: the replicas' process group, None: all):
    every rank joins the all-reduce even when its own step failed (with
    zero gradients and a failure flag), so the ranks stay in step, and the
    summed gradients are zeroed on every rank unless every rank's step
    succeeded: rank 0 alone adds the noise, so a sum without its result
    would be a noiseless update."""

    gated = True

    def __init__(self, engine: Any, world_size: int, group: Any = None) -> None:
        super().__init__(engine)
        self.gate = Gate(world_size, group)

    def step(self, params: Optional[Iterable[torch.Tensor]]) -> None:
        e = self.e
        ok = failed = None
        try:
            self.collect()
            try:
                e._guard.check(e.module, params)  # pylint: disable=protected-access
                ok = e._acc.commit(True)  # pylint: disable=protected-access
            except Exception as exc:  # pylint: disable=broad-except
                failed = exc
        finally:
            e._drop()  # pylint: disable=protected-access
        # counted on every rank alike: each joins the step's collectives
        e.steps += 1
        # a tied weight once
        every = _planner.params(e._layers)  # pylint: disable=protected-access
        self.gate.reduce(every, ok, failed, e.steps,
                         e.asynchronous and every[0].device.type == "cuda")

    def collect(self) -> None:
        """The last step's error, or any rank's failure of it: raised by
        every rank at the same call, before the next step's collectives (a
        rank that read last_norms may have met its own error earlier: the
        gate's flag is what every rank checks here)."""
        try:
            self.e.synchronize()
        except _lib.DpclipError:
            self.gate.drop()  # its flag is 0: every rank raises here
            raise
        self.gate.check()


class Sharded(Local):
    """Sharded data parallelism (dpclip._fsdp): each step (and each
    micro-batch of a logical step) in phases, through `shards`. Steps
    block; FSDP2's sharded parameters get their gradients through its own
    hooks, so the guard checks only the optimizer's parameters there."""

    def __init__(self, engine: Any, shards: _fsdp.Sharded) -> None:
        super().__init__(engine)
        self.shards = shards
        self.guard_hooks = not shards.fsdp
        # make_private's asynchronous, which a sharded step cannot be: its
        # micro-batches that do not commit go without waiting
        self.micro_async = True

    def open(self, target_delta: float, target_epsilon: float, device: torch.device) -> None:
        e = self.e
        self.shards.open(e._socket_path, e._client_name,  # pylint: disable=protected-access
                         e.job_id, e._step.cfg, target_delta,  # pylint: disable=W0212
                         target_epsilon, device)
        self.micro_async, e.asynchronous = e.asynchronous, False

    def step(self, params: Optional[Iterable[torch.Tensor]]) -> None:
        e = self.e
        e._guard.check(e.module, params)  # pylint: disable=protected-access
        try:
            # the commit of the logical step
            self.shards.step(e._acc)  # pylint: disable=protected-access
        finally:
            e._drop()  # pylint: disable=protected-access
            e.steps += 1

    def send(self, acc: Any, plan: _planner.Plan, B: int, logical_id: int, index: int,
             commit: bool, gated: bool) -> Optional[torch.Tensor]:
        # never the commit: that is step()'s. Sent without waiting unless
        # asynchronous=False: the trainer's next micro-batch runs while the
        # daemon works on this one
        if self.micro_async:
            acc.submitted(*self.shards.micro_submit(plan, B, logical_id, index),
                          logical_id, index, B, self.shards.layers[0].weight.device)
        else:
            acc._result(B, self.shards.micro(plan, B, logical_id, index),  # pylint: disable=W0212
                        logical_id)
        return None

    def close(self) -> None:
        self.shards.close()

    def check_logical_batches(self) -> None:
        self.shards.refuse_logical_batches()


class Grouped:
    """A member of a norm group (dpclip._group): its replicas' mode
    (`inner`, Local or DataParallel) steps, and at close the members wait
    for each other (a barrier over the group): a member that leaves
    dissolves the group in the daemon, which would fail another's last
    step still under way (group-wise steps do not wait for each other)."""

    guard_hooks = True

    def __init__(self, inner: Local, group: NormGroup) -> None:
        self.inner = inner
        self.group = group
        self.gated = inner.gated

    def open(self, target_delta: float, target_epsilon: float, device: torch.device) -> None:
        _group.join(self.group, self.inner.e.client)
        self.inner.e._cuda.events_only()  # pylint: disable=protected-access

    def step(self, params: Optional[Iterable[torch.Tensor]]) -> None:
        self.inner.step(params)

    def collect(self) -> None:
        self.inner.collect()

    def send(self, acc: Any, plan: _planner.Plan, B: int, logical_id: int, index: int,
             commit: bool, gated: bool) -> Optional[torch.Tensor]:
        return self.inner.send(acc, plan, B, logical_id, index, commit, gated)

    def close(self) -> None:
        if self.group.id and torch.distributed.is_initialized():
            torch.distributed.barrier(group=self.group.pg)

    def check_logical_batches(self) -> None:
        """(A member's refusal is dpclip._batches', after its arguments' checks.)"""


Mode = Union[Local, Grouped]  # (DataParallel and Sharded are Locals)


def choose(engine: Any, shards: Optional[_fsdp.Sharded], group: Optional[NormGroup],
           dp_group: Any) -> Mode:
    """make_private's mode, once the engine's rank and world size (of its
    data-parallel replicas) are known: sharded (FSDP2, sharded_noise), else
    data parallel with more than one replica, else local; a norm group's
    member wraps the latter two."""
    if shards is not None:
        return Sharded(engine, shards)
    inner = DataParallel(engine, engine.world_size, dp_group) \
        if engine.distributed and engine.world_size > 1 else Local(engine)
    return inner if group is None else Grouped(inner, group)
