"""Gradient accumulation in the PyTorch integration (issue 39): several
backward passes, then one optimizer.step(), are one logical step.

    optimizer.zero_grad()
    for x, y in micro_batches:               # the pieces of one logical batch
        loss = cross_entropy(model(x), y)    # each micro-batch's own mean
        loss.backward()
    optimizer.step()                         # one logical step: noise and charge once

Each forward pass of the model with gradients on is one micro-batch once
its backward has run: what the layers captured for it (activations and
output gradients, tagged with the pass by the root module's forward
pre-hook). Micro-batches go to the daemon as ClipSteps of one logical step
(Step.set_logical: the step's id, the micro-batch's index, commit on the
last; docs/protocol.md, "Logical steps"). A pass is sent when the next
training forward begins, if every earlier pass of the step has been sent:
what it captured is then released (copied into shared memory, or read in
place on the GPU) and the trainer holds one micro-batch's captures at a
time. optimizer.step() sends the rest, the last with commit, which the
daemon noises once, divides by the expected logical batch size (MEAN) and
writes to param.grad, charged once at the logical batch's sample rate. A
step of one micro-batch is a whole step, as it always was.

MEAN: each micro-batch's loss is the mean over its own samples, as the
user writes it (or engine.loss(per_sample)): the daemon rescales each
micro-batch's per-sample gradients by its own size and divides the
committed sum by the expected LOGICAL batch size, so nothing is scaled by
the micro-batch's share. SUM: no scaling anywhere.

One micro-batch per forward pass, each sample in one micro-batch (two
would clip it twice):
  - a backward call that reaches the captures of two forward passes (the
    model run twice before one backward) is refused, as before;
  - a capture for a pass already sent (a second backward through a forward
    after a later forward began) is refused.
Micro-batches are numbered in the order of their forward passes, and sent
in that order: the members of a norm group (pipeline stages run their
forwards in the batch's order under GPipe and 1F1B alike) number each
micro-batch alike, so the daemon sums each one's per-sample norms over the
stages. GPipe's backwards run in reverse: its micro-batches go at step().

Nothing waits for a micro-batch's reply before step(): a member of a norm
group whose micro-batch waits in the daemon for the other stages' would
otherwise block the pipeline (1F1B deadlocks). Host micro-batches hold a
staging arena each until their reply is collected (dpclip._host); GPU ones
of a flat norm group keep their tensors alive until then (dpclip._cuda).
Outside norm groups a CPU micro-batch's reply is awaited at the next one
(two arenas at most), a GPU one's early notice at once; a sharded engine's
micro-batch (its norm pass and sums steps, Accumulator.submitted) at the
next one too, its tensors or staging arena held until then.

Failure: a micro-batch that fails (here or in the daemon) aborts the
logical step: nothing more of it is sent, the daemon drops what it
accumulated (nothing released, nothing charged), and step() raises the
first error, no parameter updated. zero_grad() in the middle of a logical
step drops it likewise, with a warning naming what it dropped (as plain
PyTorch's zero_grad() drops the accumulated .grad); engine.logical_batches
makes zero_grad() wait for the logical batch's end.

Sharded engines (FSDP2, sharded_noise; dpclip._fsdp) accumulate alike: a
micro-batch goes at the next training forward, as its norm pass and every
bucket's sums step (Sharded.micro), which the daemon accumulates, writing
nothing; no collective runs before step(), whose commit is the sharded
step itself (Sharded.step, with sharded_commit() here).
"""
import contextlib
import time
import warnings
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _lib, _planner
from ._transport import Run, Transport

__all__ = ["Accumulator"]


class _InFlight(NamedTuple):
    """A micro-batch sent and not collected: its ticket, logical step id
    and index, its samples, and its transport's Run, which holds until its
    reply is in what the transport gives back then (a host staging arena,
    or the GPU tensors a detached step names and its own `ready` event)."""
    ticket: int
    logical_id: int
    index: int
    B: int
    run: Run
    io: Optional[Transport]   # None: nothing to give back (release())
    device: torch.device
    sums: bool = False        # a sharded micro-batch's sums step: no result of its own


class Accumulator:
    """One engine's logical step under way: its passes, its micro-batches
    sent and in flight, their results, and its first failure."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        # logical step ids: this engine's count of logical steps (each step()
        # ends one, and so does dropping one that held micro-batches), the
        # same on every member of a norm group, which step alike; increasing,
        # as the daemon wants
        self.serial = 1
        self.open = False           # one may be open in the daemon (sent, not committed)
        self.inflight: List[_InFlight] = []   # in submission order, earlier steps' too
        # the most micro-batches held in flight at once (sent, reply not
        # collected: each holds its tensors or a staging arena)
        self.held_peak = 0
        self._window: set = set()   # passes captured by the backward call under way
        self._queued = False
        self.reset()

    def reset(self, ended: bool = False) -> None:
        """A new logical step (ended: after a step(), or one dropped that
        held micro-batches)."""
        self.serial += 1 if ended else 0
        self.id = 0                 # this step's logical id once a micro-batch was sent
        self.sent = 0               # micro-batches sent
        self.floor = self.e._pass   # the last pass before this step (submodules called
        self.last_sent = 0          # without the root's forward capture for it); the last sent
        self.passes: List[int] = []    # training forwards of this step, in order
        self.sent_passes: set = set()
        self.failure: Optional[BaseException] = None
        self.results: List[Tuple[int, _lib.StepResult]] = []  # (B, result) collected

    # -- what the engine's hooks report ----------------------------------------------
    def forward(self, pass_id: int) -> None:
        """The root module's forward pre-hook, pass_id the new pass: a
        training forward sends the passes before it that are complete."""
        e = self.e
        if not (e.active and torch.is_grad_enabled()):
            return
        # no backward is under way: a window whose end never came (its
        # backward raised) is over
        self._window, self._queued = set(), False
        if self.failure is not None:
            self._discard()
        elif any(l.records for l in e._layers):
            try:
                self._poll()
                self._check_late(self._passes())
                for p in self.passes:
                    if p <= self.last_sent:
                        continue
                    if p >= pass_id or not self._has(p):
                        break
                    e._guard.check(e.module, None)  # an autograd gradient: refused early
                    self._send(p, commit=False)
            except Exception as exc:  # pylint: disable=broad-except
                self._fail(exc)  # raised by step()
        self.passes.append(pass_id)

    def captured(self, pass_id: int) -> None:
        """A layer captured something for pass_id (during a backward):
        tracks the passes one backward call reaches (checked at its end)."""
        self._window.add(pass_id)
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._window_end)
            self._queued = True
        except RuntimeError:  # not inside a backward: nothing to check at its end
            self._window.clear()

    def _window_end(self) -> None:
        passes, self._window, self._queued = sorted(self._window), set(), False
        if len(passes) > 1 and self.failure is None:
            self.failure = RuntimeError(
                "one backward call reached the activations of %d forward passes of the model "
                "(passes %s): dpclip takes each forward pass, once its backward has run, as one "
                "micro-batch of the logical step, and a sample in two passes would be clipped "
                "twice; run the samples through one forward (concatenate them), or call "
                "backward once per forward" % (len(passes), ", ".join(map(str, passes))))

    # -- the step ------------------------------------------------------------------------
    def pending(self) -> Tuple[int, int]:
        """(micro-batches, samples) of this logical step so far: sent, and
        captured and not sent."""
        passes = self._passes()
        samples = sum(b for b, _ in self.results) + \
            sum(e.B for e in self.inflight if e.logical_id == self.id and self.id)
        for p in passes:
            samples += next((r[0].shape[0] for l in self.e._layers for r in l.records
                             if r[2] == p and r[0].dim() > 0), 0)
        return self.sent + len(passes), samples

    def commit(self, gated: bool) -> Optional[torch.Tensor]:
        """step()'s part once the guard passed: the whole step where this
        logical step has one micro-batch (as before), else its micro-batches
        not sent yet and the commit. Returns the engine's success flag (data
        parallel); raises the logical step's first error."""
        e = self.e
        # One micro-batch is a whole step, as before; not in a norm group,
        # whose members must all send a logical step or none (a member that
        # dropped a logical step after sending some of it must send one).
        alone = self.sent == 0 and not self.open and e.norm_group is None
        if alone and self.failure is None:
            # a steady step: one pass, staged as the layers captured it (a
            # pass of a logical step nothing of which was sent is never late)
            whole = e._replanner.whole(e._layers)
            if whole is not None:
                return e._step_whole(whole)
        pending = self._to_commit()
        if alone and len(pending) <= 1:
            return e._step_whole()
        for p in pending[:-1]:
            self._send(p, commit=False)
        self._poll()
        if self.failure is not None:
            raise self.failure
        try:
            return self._send(pending[-1] if pending else None, commit=True, gated=gated)
        except Exception as exc:
            # refused: where a micro-batch failed first, that is the cause (the
            # daemon ran them before the commit, so their replies are in)
            self._drain()
            if self.failure is not None and self.failure is not exc:
                raise self.failure from None
            raise

    def sharded_commit(self) -> Optional[Tuple[int, int]]:
        """A sharded engine's step() (dpclip._fsdp): sends this logical
        step's micro-batches but the last, whose captures stay for the
        commit; returns the commit's (logical id, micro-batch), or None
        where the step is one micro-batch: a whole step, as before. Raises
        the logical step's first error."""
        pending = self._to_commit()
        if self.sent == 0 and len(pending) <= 1 and not self.open:
            return None
        for p in pending[:-1]:
            self._send(p, commit=False)
        # the micro-batches sent without waiting: their results are the
        # step's, and their first error the commit's cause (not sent then)
        self._drain()
        if self.failure is not None:
            raise self.failure
        return self._next()

    def abort(self, why: str) -> bool:
        """Drops the logical step under way (zero_grad() in its middle):
        warns where it held micro-batches (and says so); the daemon drops
        those it was sent (nothing released, nothing charged) when the next
        one opens."""
        n, samples = self.pending()
        held = bool(n or self.sent or self.failure is not None)
        if not held:
            return False
        group = ""
        if self.e.norm_group is not None and self.failure is None:
            # The daemon pairs the members' group steps in order: a member
            # that sent fewer of this logical step's micro-batches than
            # another would pair its next step with the other's leftover.
            # Each member sends what it captured (never the commit), so that
            # members dropping at the same point stay paired.
            try:
                for p in self._passes():
                    if p > self.last_sent:
                        self._send(p, commit=False)
            except Exception:  # pylint: disable=broad-except
                pass  # dropped anyway
            group = "; as a member of a norm group it sent the rest of its micro-batches " \
                "first (never the commit), so that the members' group steps stay paired: " \
                "drop a logical step at the same point on every member"
        warnings.warn(
            "dpclip: %s in the middle of a logical step dropped it: %d micro-batch%s "
            "(%d sample%s, %d sent to the daemon, which drops them: nothing released, "
            "nothing charged)%s%s; optimizer.step() takes only what is captured from here "
            "on. Call zero_grad() before a logical step's first micro-batch only, or use "
            "engine.logical_batches(), whose zero_grad() waits for the logical batch's end"
            % (why, n, "es" if n != 1 else "", samples, "s" if samples != 1 else "",
               self.sent, "" if self.failure is None else
               ", and its error, which step() would have raised: %s" % (self.failure,), group),
            UserWarning, stacklevel=4)
        return True

    def close(self) -> None:
        """The engine closes: what is still in flight is dropped with the
        session (a micro-batch of a norm group may wait on a member that
        left)."""
        self.inflight = []

    # -- sending -------------------------------------------------------------------------
    def _to_commit(self) -> List[int]:
        """step()'s start, whole or sharded: the passes not sent yet, once
        the late check passed; raises the logical step's first error."""
        passes = self._passes()
        if self.failure is None:
            try:
                self._check_late(passes)
            except RuntimeError as exc:
                self.failure = exc
        if self.failure is not None:
            raise self.failure
        return passes

    def _passes(self) -> List[int]:
        return sorted({r[2] for l in self.e._layers for r in l.records})

    def _has(self, p: int) -> bool:
        return any(r[2] == p for l in self.e._layers for r in l.records)

    def done(self) -> int:
        """Passes up to this one are done with (before this step, or sent)."""
        return max(self.floor, self.last_sent)

    def _check_late(self, passes: List[int]) -> None:
        late = [p for p in passes if p <= self.last_sent]
        if late:
            names = sorted({l.name for l in self.e._layers for r in l.records if r[2] in late})
            raise RuntimeError(
                "module%s %s captured a backward of forward pass %d after %s: a second "
                "backward through one forward (retain_graph) once a later forward began, or "
                "a pass run backward only after a later pass was complete; dpclip sends each "
                "forward pass as one micro-batch, once and in order: run each forward's "
                "backwards before the next forward's" % (
                    "s" if len(names) > 1 else "", ", ".join(names), late[0],
                    "that pass was sent to the daemon" if late[0] in self.sent_passes else
                    "a later pass was sent to the daemon"))

    def _discard(self) -> None:
        for l in self.e._layers:
            l.records.clear()
        self.e._replanner.unstage()  # pylint: disable=protected-access

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self._discard()

    @contextlib.contextmanager
    def _only(self, p: Optional[int]) -> Iterator[None]:
        """The layers' records of pass p alone (None: none) while planning
        its micro-batch; dropped from the layers after."""
        layers = self.e._layers
        saved = [l.records for l in layers]
        for l in layers:
            l.records = [r for r in l.records if r[2] == p]
        try:
            yield
        finally:
            left = False
            for l, s in zip(layers, saved):
                l.records = [r for r in s if r[2] != p]
                left = left or bool(l.records)
            self.e._replanner.unstage(clean=not left)  # pylint: disable=protected-access

    def _next(self) -> Tuple[int, int]:
        """(logical id, index) of the next micro-batch sent; the first
        opens the logical step."""
        if self.id == 0:
            self.id, self.open = self.serial, True
        self.sent += 1
        return self.id, self.sent - 1

    def _send(self, p: Optional[int], commit: bool, gated: bool = False
              ) -> Optional[torch.Tensor]:
        """Sends pass p (None: no samples, a zero commit) as the next
        micro-batch; the commit's success flag (data parallel)."""
        e = self.e
        with self._only(p):
            B, plan = e._planned()
            if plan is None:
                if B == 0 and e.loss_reduction == "mean" and e.expected_batch_size <= 0:
                    raise ValueError("an empty micro-batch with a mean loss needs "
                                     "expected_batch_size")
                plan = e._plan(B)
            lid, index = self._next()
            if p is not None:
                self.last_sent = max(self.last_sent, p)
                self.sent_passes.add(p)
            # the engine's mode sends it (dpclip._modes: a ClipStep of the
            # engine's Step; sharded, a pass in phases, never the commit)
            return e.mode.send(self, plan, B, lid, index, commit, gated)

    def _send_micro(self, plan: _planner.Plan, B: int, index: int) -> None:
        e, nb = self.e, max(B, 1)
        device = e._device()
        io = e._io(device)
        # a flat norm group's GPU micro-batch has no early notice: sent
        # detached, its tensors held until collected (the host's are all
        # sent without waiting, each holding a staging arena)
        detached = e.norm_group is not None and not e.asynchronous
        run = io.micro(e._step, plan, nb, device, e.algorithm, e.asynchronous, detached)
        if run.res is not None:
            self._result(B, run.res, self.id)
        else:
            self._hold(_InFlight(run.ticket, self.id, index, B, run, io, device))
        if run.arena is not None and e.norm_group is None:
            self._drain(but=1)  # blocking is safe outside a group: two arenas at most
        else:
            self._poll()

    def submitted(self, holder: Any, tickets: List[int], err: Optional[BaseException],
                  logical_id: int, index: int, B: int, device: torch.device) -> None:
        """A sharded micro-batch sent without waiting (dpclip._fsdp.Sharded.
        micro_submit): its norm pass's ticket (its result) and its sums
        steps' (drained), collected in order; holder.release() once the last
        is in. err: a sums step not sent (the logical step fails). At most
        this micro-batch stays in flight: the earlier ones' replies are
        awaited here (their daemon work ran during this one's forward and
        backward)."""
        t = time.perf_counter()
        run = Run(None, 0, None, None, t, t)
        for i, ticket in enumerate(tickets):
            last = i == len(tickets) - 1
            self._hold(_InFlight(ticket, logical_id, index, B if i == 0 else 0,
                                 run, holder if last else None, device, i > 0))
        if err is not None:
            self._fail(err)
        self._drain(but=len(tickets))
        self._poll()

    def _send_commit(self, plan: _planner.Plan, B: int, gated: bool) -> torch.Tensor:
        e, nb = self.e, max(B, 1)
        device = e._device()
        t0 = time.perf_counter()
        if device.type == "cuda":
            run = e._cuda.run(e._step, plan, nb, device, e.algorithm, gated, e.asynchronous,
                              accumulated=True)
            self.open = False
            # the micro-batches ran before the commit (a session's steps run in
            # order): their replies are in, and their tensors may go
            self._drain()
            if self.failure is not None:
                raise self.failure
            earlier, self.results = self.results, []
            if run.res is None:  # collected at the next step() or synchronize()
                e._inflight = (run.ticket, B, run.info.step_index, earlier)
                e.last_epsilon, e.last_delta = run.info.epsilon, run.info.delta
            else:
                e._finish(run.res, B, earlier)
            e._timing(t0, run.t1, run.t2, run.res is not None)
            return run.ok
        # the host's commit goes as its micro-batches do, queued behind them
        run = e._host.micro(e._step, plan, nb, device, e.algorithm)
        self._hold(_InFlight(run.ticket, self.id, self.sent - 1, B, run, e._host, device))
        t1 = time.perf_counter()
        self._drain()
        t2 = time.perf_counter()
        self.open = False  # committed, or dropped by the daemon on its failure
        if self.failure is not None:
            raise self.failure
        *earlier, (_, res) = self.results  # the commit's is the last
        self.results = []
        e._host.write_grads(plan)
        e._host.trim()
        e._finish(res, B, earlier)
        e._timing(t0, t1, t2, True)
        return torch.ones(1)

    # -- collecting ----------------------------------------------------------------------
    def _hold(self, f: _InFlight) -> None:
        self.inflight.append(f)
        if not f.sums:  # a sharded micro-batch's sums steps are part of it
            self.held_peak = max(self.held_peak, sum(not g.sums for g in self.inflight))

    def _poll(self) -> None:
        """Collects the micro-batches whose replies are in, without waiting."""
        while self.inflight and self._collect(self.inflight[0], 0):
            pass

    def _drain(self, but: int = 0) -> None:
        """Collects every micro-batch in flight but the last `but`, waiting."""
        while len(self.inflight) > but:
            self._collect(self.inflight[0], -1)

    def _collect(self, f: _InFlight, timeout_ms: int) -> bool:
        e = self.e
        try:
            res = e.client.poll(f.ticket, timeout_ms)
        except _lib.DpclipError as err:
            self._release(f)
            if f.logical_id == self.id and self.failure is None:
                self.failure = _lib.DpclipError(
                    err.code, err.field, "micro-batch %d of logical step %d (%d samples) "
                    "failed, so the logical step was dropped: nothing released, nothing "
                    "charged: %s" % (f.index, f.logical_id, f.B, err.message))
                self._discard()
            return True
        if res is None:
            return False
        self._release(f)
        if not f.sums:
            self._result(f.B, res, f.logical_id)
        return True

    def _release(self, f: _InFlight) -> None:
        self.inflight.pop(0)
        if f.io is not None:
            f.io.release(f.run, f.device)

    def _result(self, B: int, res: _lib.StepResult, logical_id: int) -> None:
        if logical_id != self.id or not self.id:
            return  # a step dropped earlier: its reply only drained
        if res.logical_id != logical_id:
            exc = _lib.DpclipError(
                _lib.EUNIMPL, "clip_step.logical",
                "dpclipd at %s answered micro-batch %d of logical step %d as a whole step: it "
                "predates logical steps (gradient accumulation), so it released and charged "
                "that micro-batch alone; upgrade dpclipd, or call optimizer.step() after "
                "each backward" % (self.e.client.socket_path, len(self.results), logical_id))
            if self.failure is None:
                self.failure = exc
            self._discard()
            return
        self.results.append((B, res))


def merged(res: _lib.StepResult, B: int, earlier: Sequence[Tuple[int, _lib.StepResult]]
           ) -> Tuple[_lib.StepResult, int]:
    """A logical step's result as one: every micro-batch's norms and
    coefficients in order (an empty micro-batch's one sample of zeros left
    out), the compute times summed, the commit's index and ledger."""
    if not earlier:
        return res, B
    norms: List[float] = []
    coefs: List[float] = []
    compute = wait = 0
    for b, r in list(earlier) + [(B, res)]:
        if b > 0:
            norms.extend(r.norms[:b])
            coefs.extend(r.coefs[:b])
        compute += r.compute_ns
        wait += r.input_wait_ns
    return res._replace(norms=norms, coefs=coefs, compute_ns=compute,
                        input_wait_ns=wait), len(norms)
