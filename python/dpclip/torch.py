"""PyTorch integration: DP-SGD through dpclipd with one backward pass.

    engine = PrivacyEngine(socket_path)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="mean")
    for x, y in loader:
        optimizer.zero_grad()
        loss = engine.loss(per_sample_losses(model(x), y))   # or a plain mean/sum loss
        loss.backward()          # input gradients only; activations/output grads captured
        optimizer.step()         # one ClipStep to the daemon fills param.grad, then the update

Book-keeping: the forward of every supported module (nn.Linear,
nn.Embedding, nn.LayerNorm, nn.RMSNorm where torch has it) is replaced by a
custom autograd.Function whose backward computes the input gradient only:
autograd never runs the weight-gradient GEMMs. Instead each module's input
(activation) and output gradient are kept, and at optimizer.step() the engine
sends the daemon one ClipStep naming all of them; the daemon computes the
per-sample norms, clips, sums, adds N(0, (sigma*C)^2) and writes the private
gradient, which lands in param.grad (divided by the expected batch size with
a mean loss).

The engine is this module; dpclip._planner lays out each step, and the
transports move the tensors: dpclip._host (CPU tensors, through one
shared-memory arena) and dpclip._cuda (GPU tensors in place, CUDA IPC and
interprocess events). dpclip._layers holds the per-module autograd
Functions, dpclip._parallel the data-parallel gate, dpclip._optimizer the
optimizer wrapper.

Ledger account: a PrivacyEngine without job_id gets a fresh job id (printed
once at make_private), so runs do not share one account by accident; pass
job_id= to continue or share one. Data-parallel ranks all use rank 0's.

Conventions the caller must follow: batch-first inputs (dimension 0 is the
sample); one forward/backward per optimizer step (no gradient accumulation
across backward calls); no weight tying between modules; no module that mixes
samples (batch statistics: refused at make_private and at each forward); do
not wrap the model in DistributedDataParallel (the engine all-reduces the
clipped sums, and applies them only where every rank's step succeeded: rank
0's carries the noise).

Empty batches (Poisson sampling makes them): the step still happens, as in
Opacus: param.grad receives the daemon's noise alone (a zero clipped sum plus
N(0, (sigma*C)^2), divided by the expected batch size for a mean loss), sent
as a one-sample step of zeros. Skipping it would change the privacy analysis,
which counts every step.
"""
import math
import secrets
import sys
import time
from typing import Any, List, Optional, Tuple

from . import _needs_torch  # noqa: F401  (says which python3 has torch when it is missing)

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from . import _lib, _parallel, _planner
from ._cuda import CudaIPC
from ._host import HostArena
from ._lib import DpclipError
from ._optimizer import DPOptimizer
from .data import DPDataLoader
from ._layers import (  # noqa: F401  (UnsupportedModuleError is public API)
    UnsupportedModuleError, _Layer, _collect_layers, _mixing, _mixing_error)
from .losses import (  # noqa: F401  (public API)
    cross_entropy, per_sample_cross_entropy, reduce_loss, sequence_cross_entropy)

__all__ = ["PrivacyEngine", "make_private", "DPOptimizer", "UnsupportedModuleError",
           "cross_entropy", "per_sample_cross_entropy", "sequence_cross_entropy", "reduce_loss",
           "DpclipError", "fresh_job_id"]


def fresh_job_id() -> str:
    """A new ledger job id: the time and 32 random bits, readable in
    /status and unique in practice."""
    return "%s-%s" % (time.strftime("%Y%m%d-%H%M%S"), secrets.token_hex(4))


# --- the engine ---------------------------------------------------------------------

class PrivacyEngine:
    """A session with dpclipd and the book-keeping for one model.

    socket_path: the daemon's socket (default $DPCLIP_SOCKET, else
    /run/dpclip/dpclipd.sock). The connection is made here, so a daemon that
    is not running is reported at once (DpclipError, code DPCLIP_EIO).
    job_id: the daemon's privacy-ledger account the steps are charged to
    (with the user's uid). None: a fresh one (fresh_job_id()), printed once
    at make_private, so two runs never share an account unless told to;
    pass one to continue a run's account or share it (at most 63 bytes).
    Data parallel: every rank uses rank 0's (make_private broadcasts it; a
    rank given another is refused), since the daemon counts the sigma-0
    steps of the other ranks as shares of rank 0's job."""

    def __init__(self, socket_path: Optional[str] = None, *, client_name: str = "dpclip-torch",
                 job_id: Optional[str] = None) -> None:
        self._socket_path = socket_path
        self._client_name = client_name
        self._job_given = job_id is not None
        self.job_id: str = job_id if job_id is not None else fresh_job_id()
        self._connect()
        self.active = False
        self._layers: List[_Layer] = []
        self._pass = 0
        self._step: Optional[_lib.Step] = None
        self._hook = None
        self._norm_hooks: list = []  # normalizations' checks against mixing samples
        self.module: Optional[nn.Module] = None
        self.steps = 0
        self._last_norms: Optional[torch.Tensor] = None
        self._last_coefs: Optional[torch.Tensor] = None
        self._last_compute_ns = 0
        self._last_step_index = 0
        self.compute_ns_total = 0   # the daemon's compute time of every collected step
        self.last_epsilon = self.last_delta = 0.0   # the daemon's ledger, after the last step
        # GPU steps run asynchronously (see make_private): (ticket, B, step
        # index) of the step whose result has not been collected yet.
        self.asynchronous = True
        self._inflight = None
        self._gate = None           # data parallel: see _parallel.Gate
        # Wall time of the last step's phases in the trainer (ms): building
        # the request (copies, registrations), the daemon round trip, and
        # writing param.grad. For diagnosing overheads; costs two clock reads.
        self.last_timing = {}

    def _connect(self) -> None:
        """(Re)connects under self.job_id; the transports start empty."""
        self.client = _lib.Client(self._socket_path, client_name=self._client_name,
                                  job_id=self.job_id)
        self._host = HostArena(self.client)     # CPU tensors: a shared-memory arena
        self._cuda = CudaIPC(self.client)       # GPU tensors: CUDA IPC and events

    def _agree_job_id(self) -> None:
        """Data parallel (every rank calls it): take rank 0's job id,
        reconnecting under it where this rank's was generated (nothing is
        registered yet); refuse one given that differs."""
        rank0 = _parallel.broadcast_job_id(self.job_id)
        if rank0 == self.job_id:
            return
        if self._job_given:
            raise ValueError(
                "job_id: rank %d's %r differs from rank 0's %r; data-parallel ranks must share "
                "rank 0's job id (the daemon counts their noiseless steps as shares of its "
                "account): pass the same job_id on every rank, or none" % (
                    self.rank, self.job_id, rank0))
        self.client.close()
        self.job_id = rank0
        self._connect()

    # -- setup ------------------------------------------------------------------
    def make_private(self, *, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                     data_loader: Optional[DataLoader] = None, noise_multiplier: float,
                     max_grad_norm: float, loss_reduction: str = "mean",
                     poisson_sampling: bool = True, expected_batch_size: Optional[int] = None,
                     distributed: Optional[bool] = None, algorithm: str = "auto",
                     sample_rate: Optional[float] = None, target_delta: float = 0.0,
                     target_epsilon: float = 0.0, asynchronous: bool = True,
                     secure_mode: bool = False
                     ) -> Tuple[nn.Module, Optional[torch.optim.Optimizer], Optional[DataLoader]]:
        """Attach to `module`; returns (module, optimizer, data_loader), the
        optimizer wrapped so that step() first fills param.grad with the
        private gradient, the loader replaced by a Poisson-sampled one
        (poisson_sampling=True).

        expected_batch_size: the divisor of the noised sum with a mean loss;
        default sample_rate * len(dataset) of the (Poisson) loader, else the
        loader's batch size times the world size, else the actual batch size
        of each step (not private under Poisson sampling: give it).
        distributed: None = use torch.distributed when initialized. Then
        every rank has its own session, only rank 0 adds noise, and the
        clipped sums are all-reduced (SUM) after each step, gated on every
        rank's success: a step that fails on any rank (even on the device,
        after the update was queued) leaves zero gradients on every rank, and
        raises on every rank (DpclipError DPCLIP_EUNAVAIL on the others), at
        once or, with asynchronous GPU steps, at the next collection.
        A DPDataLoader must have been made for the engine's world size and
        rank (after init_process_group), else every rank would sample the
        whole dataset while the ledger accounts q once; and no two ranks'
        generators may be in the same state (their masks would be alike).
        secure_mode: the loader made here draws its masks from os.urandom
        (see dpclip.data); a DPDataLoader given must then be in secure mode.
        sample_rate: the Poisson rate q the daemon's privacy ledger accounts
        each step at (default: the DPDataLoader's; else 0, which the ledger
        counts as q = 1). target_delta / target_epsilon: the delta epsilon is
        reported at (engine.last_epsilon, last_delta) and the job's budget,
        past which the daemon refuses steps (0 = the daemon's defaults).
        asynchronous (GPU models): optimizer.step() returns as soon as the
        daemon has queued the step's GPU work; the trainer's stream waits for
        it on the device, so the trainer can queue its next work meanwhile.
        The step's result (norms, coefficients, and any error found on the
        device, such as a non-finite gradient) is collected at the next
        step(), by synchronize(), or when last_norms / last_coefs is read. A
        step that fails on the device leaves zero gradients (the daemon
        writes zeros; it refunds the spend unless the failure depended on
        the noise, e.g. an f16 output overflowing once noised) and raises DpclipError
        at that collection. False: every step blocks until its result."""
        if self.module is not None:
            raise RuntimeError("this PrivacyEngine is already attached to a module")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError("loss_reduction must be 'mean' or 'sum', got %r" % (loss_reduction,))
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError("max_grad_norm must be a positive number")
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError("noise_multiplier must be >= 0")
        algo = {"auto": _lib.ALGO_AUTO, "direct": _lib.ALGO_DIRECT,
                "ghost": _lib.ALGO_GHOST}[algorithm]

        layers, norms = _collect_layers(self, module)

        if distributed is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.distributed = bool(distributed)
        self.rank, self.world_size = 0, 1
        if self.distributed:
            self.rank = torch.distributed.get_rank()
            self.world_size = torch.distributed.get_world_size()
        _parallel.check_loader(self, data_loader, layers[0].weight.device, secure_mode)
        self._gate = _parallel.Gate(self.world_size)
        if self.distributed:
            # Same starting point on every rank (what DDP would do).
            for p in module.parameters():
                torch.distributed.broadcast(p.data, 0)
            # Ranks other than 0 send sigma 0 (noise once per logical step)
            # under rank 0's job id: the daemon counts a sigma-0 step of a
            # job with several sessions as a data-parallel share, charged
            # through rank 0's step, so a budget does not refuse them. A
            # node without rank 0's session charges them as sigma 0.
            self._agree_job_id()
        if not self._job_given and self.rank == 0:
            print("dpclip: job id %s (pass job_id= to share an account)" % self.job_id,
                  file=sys.stderr, flush=True)

        if data_loader is not None and poisson_sampling and not isinstance(data_loader,
                                                                          DPDataLoader):
            data_loader = DPDataLoader.from_data_loader(data_loader, distributed=self.distributed,
                                                        secure_mode=secure_mode)
        if expected_batch_size is None:
            if isinstance(data_loader, DPDataLoader):
                expected_batch_size = data_loader.expected_batch_size
            elif data_loader is not None and data_loader.batch_size:
                expected_batch_size = data_loader.batch_size * self.world_size
            else:
                expected_batch_size = 0
        self.expected_batch_size = int(expected_batch_size)
        if sample_rate is None:
            sample_rate = data_loader.sample_rate if isinstance(data_loader, DPDataLoader) else 0.0
        if loss_reduction == "mean" and self.expected_batch_size <= 0 and \
                0.0 < float(sample_rate) < 1.0:
            # Dividing by the drawn batch size would release it without noise.
            raise ValueError(
                "a mean loss under Poisson sampling (sample_rate %g) needs expected_batch_size "
                "(the daemon divides the noised sum by it, not by the drawn batch size)"
                % float(sample_rate))
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.loss_reduction = loss_reduction
        self.algorithm = algo
        self.asynchronous = bool(asynchronous)
        # Noise once per logical step: rank 0 adds it, the others send sigma 0.
        sigma = self.noise_multiplier if self.rank == 0 else 0.0
        self.sample_rate = float(sample_rate)
        self._step = _lib.Step(1, self.max_grad_norm,
                               _lib.MEAN if loss_reduction == "mean" else _lib.SUM,
                               self.expected_batch_size, sigma, sample_rate=self.sample_rate,
                               target_delta=target_delta, target_epsilon=target_epsilon)

        self._layers = layers
        for l in layers:
            l.attach()
        # A plain function, not a bound method: copy.deepcopy of the model
        # then leaves the engine (and its ctypes handles) alone.
        engine = self

        def on_forward(mod, inputs):
            engine._pass += 1

        self._hook = module.register_forward_pre_hook(on_forward)

        def mixing_hook(name):
            def check(mod, inputs):
                why = _mixing(mod) if engine.active else None
                if why is not None:
                    raise _mixing_error(name, mod, why)
            return check

        self._norm_hooks = [m.register_forward_pre_hook(mixing_hook(n)) for n, m in norms]
        self.module = module
        self.active = True
        if optimizer is not None:
            optimizer = DPOptimizer(optimizer, self)
        return module, optimizer, data_loader

    def detach(self) -> None:
        """Restore the modules' own forwards; the engine is unusable after."""
        for l in self._layers:
            l.detach()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for h in self._norm_hooks:
            h.remove()
        self._norm_hooks = []
        self.active = False
        self.module = None

    def close(self) -> None:
        """Collects the last asynchronous step (raising its error, if any),
        detaches and disconnects."""
        try:
            self._collect()
        finally:
            self.detach()
            if self._step is not None:
                self._step.close()
                self._step = None
            self.client.close()

    def synchronize(self) -> None:
        """Collects the result of an asynchronous step still in flight:
        blocks until the daemon finished it; raises DpclipError if it failed
        (its gradients were zeros). Data parallel: a step that failed on any
        rank (and so was applied on none) raises at the next step() or
        close(), on every rank."""
        if self._inflight is None:
            return
        ticket, B, index = self._inflight
        self._inflight = None
        try:
            res = self.client.wait(ticket)
        except _lib.DpclipError as e:
            raise _lib.DpclipError(
                e.code, e.field, "step %d failed on the device after it was queued, so its "
                "gradients were zeros (the optimizer step that used them moved the parameters "
                "only through momentum or weight decay): %s" % (index, e.message)) from None
        self._finish(res, B)

    def _collect(self) -> None:
        """step()'s and close()'s collection of the last step: its error, or
        (data parallel) any rank's failure of it. Raised by every rank at
        the same call, before the next step's collectives (a rank that read
        last_norms may have met its own error earlier: the gate's flag is
        what every rank checks here)."""
        try:
            self.synchronize()
        except _lib.DpclipError:
            if self._gate is not None:
                self._gate.drop()  # its flag is 0: every rank raises here
            raise
        if self._gate is not None:
            self._gate.check()

    # Results of the last step; reading them collects an asynchronous one.
    @property
    def last_norms(self) -> Optional[torch.Tensor]:
        self.synchronize()
        return self._last_norms

    @property
    def last_coefs(self) -> Optional[torch.Tensor]:
        self.synchronize()
        return self._last_coefs

    @property
    def last_compute_ns(self) -> int:
        self.synchronize()
        return self._last_compute_ns

    @property
    def last_step_index(self) -> int:
        self.synchronize()
        return self._last_step_index

    # -- losses -------------------------------------------------------------------
    def loss(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Reduce a [B] tensor of per-sample losses the way the daemon was
        told (mean or sum over samples)."""
        return reduce_loss(per_sample, self.loss_reduction)

    def clear(self) -> None:
        """Forget what was captured since the last step."""
        for l in self._layers:
            l.records.clear()

    # -- the step -------------------------------------------------------------------
    def step(self) -> None:
        """Send the captured activations and output gradients as one
        ClipStep and write the private gradient into each parameter's .grad
        (replacing what was there). Called by DPOptimizer.step().

        Data parallel: every rank joins the all-reduce even when its own
        step failed (with zero gradients and a failure flag), so the ranks
        stay in step, and the summed gradients are zeroed on every rank
        unless every rank's step succeeded: rank 0 alone adds the noise, so
        a sum without its result would be a noiseless update (_parallel)."""
        if not self.active:
            raise RuntimeError("the PrivacyEngine is not attached to a module")
        gated = self.distributed and self.world_size > 1
        ok = failed = None
        try:
            self._collect()
            try:
                ok = self._step_local()
            except Exception as e:  # pylint: disable=broad-except
                if not gated:
                    raise
                failed = e
        finally:
            self.clear()
        if gated:
            # counted on every rank alike: each joins the step's collectives
            self.steps += 1
            params = [p for l in self._layers for p in (l.weight, l.bias) if p is not None]
            self._gate.reduce(params, ok, failed, self.steps,
                              self.asynchronous and params[0].device.type == "cuda")
        else:
            self.steps += 1

    def _step_local(self) -> Optional[torch.Tensor]:
        """This process's step; returns (data parallel) a [1] f32 tensor on
        the gradients' device: 1 where the step's result is in param.grad,
        0 where it is not."""
        passes = {pid for l in self._layers for _, _, pid in l.records}
        if len(passes) > 1:
            raise RuntimeError(
                "activations from %d forward/backward passes were captured for one "
                "optimizer step; dpclip takes one pass per step (no gradient "
                "accumulation): call optimizer.step() after each backward" % len(passes))
        B = _planner.batch_size(self._layers)
        if B == 0:
            if self.loss_reduction == "mean" and self.expected_batch_size <= 0:
                raise ValueError("an empty batch with a mean loss needs expected_batch_size")
            self.clear()
        device = self._device()
        t0 = time.perf_counter()
        plan = _planner.plan(self._layers, B)
        nb = max(B, 1)
        if device.type == "cuda":
            run = self._cuda.run(self._step, plan, nb, device, self.algorithm,
                                 self.distributed and self.world_size > 1, self.asynchronous)
            if run.res is None:
                self._inflight = (run.ticket, B, run.info.step_index)
                self.last_epsilon, self.last_delta = run.info.epsilon, run.info.delta
            else:
                self._finish(run.res, B)
            self._timing(t0, run.t1, run.t2)
            return run.ok
        res, t1, t2 = self._host.run(self._step, plan, nb, self.algorithm)
        self._finish(res, B)
        self._timing(t0, t1, t2)
        return torch.ones(1)

    def _device(self) -> torch.device:
        devs = {l.weight.device for l in self._layers}
        if len(devs) != 1:
            raise ValueError("the private parameters span several devices (%s); one engine "
                             "serves one device" % ", ".join(str(d) for d in devs))
        return devs.pop()

    def _finish(self, res: _lib.StepResult, B: int) -> None:
        # An empty batch was sent as one sample of zeros: no real norms.
        self._last_norms = torch.tensor(res.norms if B > 0 else [], dtype=torch.float32)
        self._last_coefs = torch.tensor(res.coefs if B > 0 else [], dtype=torch.float32)
        self._last_step_index = res.step_index
        self._last_compute_ns = res.compute_ns
        self.compute_ns_total += res.compute_ns
        self.last_epsilon = res.epsilon
        self.last_delta = res.delta

    def _timing(self, t0: float, t1: float, t2: float) -> None:
        t3 = time.perf_counter()
        self.last_timing = {"prepare_ms": (t1 - t0) * 1e3, "run_ms": (t2 - t1) * 1e3,
                            "finish_ms": (t3 - t2) * 1e3}

def make_private(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 data_loader: Optional[DataLoader] = None, *, noise_multiplier: float,
                 max_grad_norm: float, loss_reduction: str = "mean",
                 socket_path: Optional[str] = None, job_id: Optional[str] = None, **kwargs: Any
                 ) -> Tuple[nn.Module, Optional[torch.optim.Optimizer], Optional[DataLoader]]:
    """Opacus-shaped shorthand: a PrivacyEngine on socket_path (job_id: its
    ledger account, as PrivacyEngine's) attached to model; returns (model,
    optimizer, data_loader). The engine is optimizer.engine."""
    engine = PrivacyEngine(socket_path, job_id=job_id)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=data_loader,
                               noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                               loss_reduction=loss_reduction, **kwargs)
