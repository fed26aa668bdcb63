"""The transports: how a step names the daemon its tensors and outputs. One
interface, two implementations, each serving every mode (dpclip._modes):
dpclip._host.HostArena (CPU tensors, through shared memory the daemon maps)
and dpclip._cuda.CudaIPC (GPU tensors named in place, CUDA IPC and
interprocess events). The engine holds one of each per session and takes
the one of its layers' device (PrivacyEngine._io).

What a transport does:
  - run(): a whole step, or the commit of a logical step on the GPU: sent,
    answered (or, asynchronous, noticed), param.grad written;
  - micro(): one micro-batch of a logical step that does not commit
    (dpclip._accumulate): sent without waiting where the transport allows,
    what it holds until its reply is collected returned in the Run, and
    given back by release();
  - phases(): a sharded step in phases (dpclip._fsdp): its norm pass and its
    buckets' sums steps (Phases)."""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import _lib
from ._planner import Plan

__all__ = ["Run", "Transport", "Phases"]


class Run(NamedTuple):
    """What a transport's run() or micro() did: res, the step's result
    (None when it was submitted without waiting: collect `ticket` later;
    `info` is an asynchronous step's early notice); ok, a [1] f32 flag on
    the gradients' device (1 where the daemon committed the step; data
    parallel, on the GPU); t1/t2 when it was sent and answered. What a step
    sent without waiting holds until its reply is collected (release()):
    keep, the GPU tensors the daemon reads, and ready, a detached step's own
    `ready` event (dpclip._cuda); arena, a host staging arena
    (dpclip._host)."""
    res: Optional[_lib.StepResult]
    ticket: int
    info: Optional[_lib.Enqueued]
    ok: Optional[torch.Tensor]
    t1: float
    t2: float
    keep: Optional[list] = None
    ready: Optional[Tuple[Any, int]] = None
    arena: Optional[Tuple[int, int, torch.Tensor]] = None


class Phases:
    """One sharded step's norm pass and sums (dpclip._fsdp.Sharded), in a
    transport's buffers: norms() runs the pass; sums(k, which, base, n) runs
    bucket k's sums step of the parts `which` and returns the bucket's n
    summed elements (from element base of the layout); copied(k): bucket
    k's were copied out (its slot may be written again); close() ends the
    step in phases."""

    # the daemon's own time for this step's pass and sums steps, where the
    # transport reads it (ms: "pass", "pass_input_wait", "sums"), for
    # bench_fsdp
    daemon_ms: Dict[str, float] = {}

    def norms(self) -> _lib.StepResult:
        raise NotImplementedError

    def norms_submit(self) -> Any:
        """norms(), sent where the transport can without waiting for its
        reply (the sums steps then queued behind it): what norms_wait()
        takes. Here, nothing is sent: norms_wait() runs the pass."""
        return None

    def norms_wait(self, sent: Any) -> _lib.StepResult:
        """The norm pass's result, once norms_submit()'s is answered;
        raises its error."""
        return self.norms()

    def sums(self, k: int, which: List[int], base: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def sums_submit(self, k: int, which: List[int], base: int, n: int) -> Any:
        """sums(), sent where the transport can without waiting for its
        reply (the next bucket's step queued in the daemon while this one's
        is copied out and reduce-scattered): what sums_wait() takes. Here,
        nothing is sent: sums_wait() runs the step (one slot)."""
        return which, base, n

    def sums_wait(self, k: int, sent: Any) -> torch.Tensor:
        """Bucket k's sums, valid on the current stream, once sums_submit()'s
        step is answered (or, where the transport can, queued: sums_done()
        then takes its reply); raises its error."""
        return self.sums(k, *sent)

    def sums_done(self) -> None:
        """The replies of the sums steps sums_wait() returned before their
        end; raises the first error. Here, none: sums_wait() ran them."""

    def submit(self, buckets: List[Tuple[List[int], int]]
               ) -> Tuple[List[int], Optional[BaseException]]:
        """A micro-batch that does not commit (phases(scratch=True)), sent
        without waiting: its norm pass and each bucket's sums step ((which,
        base) each; the daemon writes nothing). Their tickets, the pass's
        first, and the first error of a sums step not sent; what they name
        is held until release()."""
        raise NotImplementedError

    def release(self, run: Any, device: torch.device) -> None:
        """Every reply of submit()'s steps is in (dpclip._accumulate calls
        this as it calls a Transport's)."""
        raise NotImplementedError

    def copied(self, k: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Transport:
    """The interface of dpclip._host.HostArena and dpclip._cuda.CudaIPC
    (see the module's docstring)."""

    def __init__(self, client: _lib.Client) -> None:
        self.client = client

    def run(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
            algorithm: int, gated: bool, asynchronous: bool) -> Run:
        """Sends the planned step of nb samples; param.grad holds (or, on
        the GPU, aliases) the private gradient once it is answered. gated:
        data parallel, ok is the daemon's success flag. asynchronous: where
        the transport can, returns at the early notice (res None)."""
        raise NotImplementedError

    def micro(self, step: _lib.Step, plan: Plan, nb: int, device: torch.device,
              algorithm: int, asynchronous: bool, detached: bool) -> Run:
        """Sends one micro-batch of a logical step that does not commit
        (param.grad is left alone). detached: sent without waiting for
        anything (a norm group's micro-batch, which waits in the daemon for
        the other members')."""
        raise NotImplementedError

    def release(self, run: Run, device: torch.device) -> None:
        """What a micro-batch sent without waiting held, once its reply is
        collected."""
        raise NotImplementedError

    def phases(self, sh: Any, plan: Plan, nb: int, device: torch.device,
               scratch: bool = False) -> Phases:
        """The norm pass and sums of sharded step sh's plan (scratch: a
        micro-batch that does not commit: the daemon writes nothing)."""
        raise NotImplementedError
