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

Book-keeping: the forward of every supported module (supported_layers()
lists them) is replaced by a custom autograd.Function whose backward
computes the input gradient only: autograd never runs the weight-gradient
GEMMs. Instead each module's input (activation) and output gradient are
kept, and at optimizer.step() the engine sends the daemon one ClipStep
naming all of them; the daemon computes the per-sample norms, clips, sums,
adds N(0, (sigma*C)^2) and writes the private gradient, which lands in
param.grad (divided by the expected batch size with a mean loss). A subclass
of one of these with a forward of its own is trained only where registered
as kind="subclass" (dpclip._registry), and every module dpclip trains is
checked against autograd through its own code on the first step
(dpclip._verify). Fail closed: step() refuses a gradient the daemon did not
compute (dpclip._guard).

The engine is this module; dpclip._planner lays out each step, and the
transports (one interface, dpclip._transport) move the tensors:
dpclip._host (CPU tensors, through one shared-memory arena) and
dpclip._cuda (GPU tensors in place, CUDA IPC and interprocess events).
dpclip._layers holds the per-module autograd Functions, dpclip._gate the
data-parallel gate, dpclip._optimizer the optimizer wrapper.

Ledger account: a PrivacyEngine without job_id gets a fresh job id (printed
once at make_private), so runs do not share one account by accident; pass
job_id= to continue or share one. Data-parallel ranks all use rank 0's.

Gradient accumulation (dpclip._accumulate): several forward/backward
passes before one optimizer.step() are one logical step, each pass a
micro-batch whose loss is the mean over its own samples (MEAN: the daemon
divides the committed sum by the expected LOGICAL batch size), noised and
charged once; engine.logical_batches() splits a loader's logical batches
(dpclip._batches). zero_grad() in the middle of one drops it, warning.

Conventions the caller must follow: batch-first inputs (dimension 0 is the
sample); each forward pass run backward before the next forward's backward,
and one backward call per forward pass's samples (a backward reaching two
passes is refused); a weight shared between modules only by an
nn.Embedding and an nn.Linear (tied embeddings: exact); no module that mixes
samples (batch statistics: refused at make_private and at each forward); do
not wrap the model in DistributedDataParallel (the engine all-reduces the
clipped sums, and applies them only where every rank's step succeeded: rank
0's carries the noise).

Model parallelism (tensor-parallel shards, pipeline stages): make_private's
norm_group is the process group of the ranks that hold one model replica
together; their engines form a dpclip norm group, whose per-sample norms
the daemon sums before clipping (dpclip._group). With data parallelism
too, each replica is a norm group of its own.

Empty batches (Poisson sampling makes them): the step still happens, as in
Opacus: param.grad receives the daemon's noise alone (a zero clipped sum plus
N(0, (sigma*C)^2), divided by the expected batch size for a mean loss), sent
as a one-sample step of zeros. Skipping it would change the privacy analysis,
which counts every step.
"""
import secrets
import sys
import time
import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from . import _needs_torch  # noqa: F401  (says which python3 has torch when it is missing)

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from . import (_accumulate, _batches, _fsdp, _group, _lib, _modes, _outputs, _parallel,
               _planner, _terms, _verify)
from ._cuda import CudaIPC, grad_buffers, warn_without_mps
from ._host import HostArena
from ._transport import Transport
from ._lib import DpclipError
from ._guard import Guard, UnclippedGradientError
from ._optimizer import DPOptimizer
from .data import DPDataLoader
from ._collect import collect_layers
from ._layers import (  # noqa: F401  (UnsupportedModuleError is public API)
    UnsupportedModuleError, _Layer, _mixing, _mixing_error)
from . import _mha
from ._mha import DPMultiheadAttention, replace_mha  # noqa: F401  (public API)
from ._registry import register, supported_layers  # noqa: F401  (public API)
from .losses import (  # noqa: F401  (public API)
    cross_entropy, per_sample_cross_entropy, reduce_loss, sequence_cross_entropy)

__all__ = ["PrivacyEngine", "make_private", "DPOptimizer", "UnsupportedModuleError",
           "UnclippedGradientError",
           "cross_entropy", "per_sample_cross_entropy", "sequence_cross_entropy", "reduce_loss",
           "DpclipError", "fresh_job_id", "register", "supported_layers",
           "DPMultiheadAttention", "replace_mha"]


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
    steps of the other ranks as shares of rank 0's job.
    allow_insecure_seed: a daemon started with --insecure-fixed-seed (tests
    only: its noise is predictable, so nothing it releases is private,
    whatever epsilon it reports) is refused (DpclipError, code
    DPCLIP_EPERM) unless this is True; then the engine warns once
    (UserWarning) and trains."""

    def __init__(self, socket_path: Optional[str] = None, *, client_name: str = "dpclip-torch",
                 job_id: Optional[str] = None, allow_insecure_seed: bool = False) -> None:
        self._socket_path = socket_path
        self._client_name = client_name
        self._job_given = job_id is not None
        self.job_id: str = job_id if job_id is not None else fresh_job_id()
        self.allow_insecure_seed = bool(allow_insecure_seed)
        self._warned_insecure = False
        grad_buffers()  # a bad DPCLIP_GRAD_BUFFERS refused before connecting
        self._connect()
        self.active = False
        self._layers: List[_Layer] = []
        self._probed = False  # no first-step check left to run (_probing())
        self._record_changes = [0]  # (dpclip._layers.Records; the replanner relies on it)
        self._replanner = _planner.Replanner(self._record_changes)
        self._pass = 0
        # gradient accumulation: the logical step under way (dpclip._accumulate),
        # and engine.logical_batches()'s state while one is in use (dpclip._batches)
        self._acc = _accumulate.Accumulator(self)
        self._batches: Optional[_batches.State] = None
        self._step: Optional[_lib.Step] = None
        self._hook = None
        self._norm_hooks: list = []  # normalizations' checks against mixing samples
        self._guard: Optional[Guard] = None  # fail closed at step(): see dpclip._guard
        self._reference = False  # the first-step check runs modules' own code (_verify)
        self.module: Optional[nn.Module] = None
        self.steps = 0
        self._last_norms: Optional[torch.Tensor] = None
        self._last_coefs: Optional[torch.Tensor] = None
        # the last step's norms and coefficients as the reply gave them
        # (lists), made tensors when first read (_results): not on step()'s path
        self._last_lists: Optional[Tuple[List[float], List[float]]] = None
        self._last_compute_ns = 0
        self._last_step_index = 0
        self.compute_ns_total = 0   # the daemon's compute time of every collected step
        # ... of which its GPU waited for this trainer's own work (the backward
        # the step's gradients come from) before the daemon's could start
        self.input_wait_ns_total = 0
        self.last_epsilon = self.last_delta = 0.0   # the daemon's ledger, after the last step
        # GPU steps run asynchronously (see make_private): (ticket, B, step
        # index) of the step whose result has not been collected yet.
        self.asynchronous = True
        self._inflight = None
        # how the engine trains (one process, data parallel, sharded, a norm
        # group's member): make_private chooses it (dpclip._modes)
        self.mode: _modes.Mode = _modes.Local(self)
        self.norm_group: Optional[_group.NormGroup] = None  # model parallel: see make_private
        # Wall time of the last step's phases in the trainer (ms): building
        # the request (copies, registrations), the daemon round trip, and
        # writing param.grad; after a blocking step also the daemon's own
        # (_lib.Client.last_timing: daemon_ms, compute_ms, and in a norm
        # group group_wait_ms and group_exchange_ms). For diagnosing
        # overheads; costs a few clock reads.
        self.last_timing = {}

    def _connect(self) -> None:
        """(Re)connects under self.job_id; the transports start empty."""
        self.client = _lib.Client(self._socket_path, client_name=self._client_name,
                                  job_id=self.job_id)
        self.check_daemon(self.client)
        self._host = HostArena(self.client)     # CPU tensors: a shared-memory arena
        self._cuda = CudaIPC(self.client)       # GPU tensors: CUDA IPC and events

    def check_daemon(self, client: _lib.Client) -> None:
        """Refuses (closing client) a daemon whose noise is predictable
        (--insecure-fixed-seed) unless allow_insecure_seed; warns once per
        engine where it is allowed."""
        if not client.insecure:
            return
        if not self.allow_insecure_seed:
            path = client.socket_path
            client.close()
            raise DpclipError(
                _lib.EPERM, "", "dpclipd at %s runs with --insecure-fixed-seed: its noise is "
                "predictable, so nothing trained through it is private, whatever epsilon it "
                "reports; restart it without that flag, or pass allow_insecure_seed=True to "
                "PrivacyEngine (tests only)" % path)
        if not self._warned_insecure:
            self._warned_insecure = True
            warnings.warn("dpclip: dpclipd at %s runs with --insecure-fixed-seed: its noise is "
                          "predictable and nothing trained through it is private (allowed by "
                          "allow_insecure_seed=True)" % client.socket_path, UserWarning,
                          stacklevel=4)  # the caller of PrivacyEngine()

    def _agree_job_id(self, group: Any = None, src: int = 0) -> None:
        """Data parallel, or a norm group (every rank of `group` calls it;
        None: all): take global rank src's job id, reconnecting under it
        where this rank's was generated (nothing is registered yet); refuse
        one given that differs."""
        rank0 = _parallel.broadcast_job_id(self.job_id, group, src)
        if rank0 == self.job_id:
            return
        if self._job_given:
            raise ValueError(
                "job_id: rank %d's %r differs from rank %d's %r; data-parallel ranks and the "
                "members of a norm group must share one job id (the daemon charges each "
                "logical step once, to that account): pass the same job_id on every rank, or "
                "none" % (torch.distributed.get_rank(), self.job_id, src, rank0))
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
                     secure_mode: bool = False, norm_group: Any = None,
                     norm_group_clipping: str = "flat",
                     replicated_modules: Iterable[Union[nn.Module, str]] = (),
                     norm_group_timeout_ms: int = 0, sharded_noise: bool = False,
                     replace_mha: bool = False, check_first_step: bool = True
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
        replace_mha: swap every nn.MultiheadAttention in module for a
        DPMultiheadAttention first (the same function and parameters, from
        parts dpclip trains; see dpclip._mha).
        check_first_step (default True): check every module dpclip trains
        once, on the first K = 2 samples of its first training forward and
        step, in float64 against autograd through the module's own code:
        its output, and each trained parameter's per-sample gradient by
        dpclip's rule; UnsupportedModuleError naming the module and the
        parameter on a difference, before anything is sent or updated
        (dpclip._verify). False turns the check off. (FSDP2 models, whose
        parameters are DTensors, are not checked.)
        secure_mode: the loader made here draws its masks from os.urandom
        (see dpclip.data); a DPDataLoader given must then be in secure mode.
        sample_rate: the Poisson rate q the daemon's privacy ledger accounts
        each step at (default: the DPDataLoader's; else 0, which the ledger
        counts as q = 1); one given beside a DPDataLoader (given, or made
        here) that samples at another rate is refused, naming both.
        target_delta / target_epsilon: the delta epsilon is
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
        at that collection. False: every step blocks until its result.

        norm_group (model parallelism): the torch.distributed process group
        of the ranks that hold one model replica together, each with its own
        shard or stage in `module` (tensor-parallel shards as plain
        nn.Linears, pipeline stages); every member calls make_private with
        its part. The members' engines join one dpclip norm group (rank 0 of
        the process group names it; ranks and size are the process group's)
        and share its rank 0's job id; each member's optimizer.step() is its
        part of the group's step and waits in the daemon for the others'
        (norm_group_timeout_ms, 0: the daemon's groups.timeout_ms); the
        ledger charges the group step once. norm_group_clipping: "flat" (the
        default: each sample's norm is summed over every member's layers,
        so the split model is clipped exactly as the whole one) or
        "group_wise" (each member clips its own layers to C / sqrt(size), no
        waiting); both on CPU and CUDA models. replicated_modules:
        the modules (this rank's objects, or their names in `module`) that
        every member holds whole, such as a LayerNorm under tensor
        parallelism: counted once in the norms and noised alike on every
        member. Their output gradient must be the whole model's on every
        member (all-reduced over the group, as a tensor-parallel "copy to
        region" does), and every member must mark the same ones. The members
        must train on the same samples: a member without data_loader or
        expected_batch_size / sample_rate takes them from the one that has
        them. With distributed (data parallelism) as well, the norm groups
        must split the ranks into replicas of one size: each replica is a
        group, replica 0 adds the noise, and rank / world_size are the
        replica's index and count.

        Sharded data parallelism (dpclip._fsdp): a model under FSDP2
        (fully_shard on each block, then on the root, before make_private
        and the optimizer) gets, on each rank, only its shard of the private
        gradient, as the sharded DTensor fully_shard expects: the daemon
        clips this rank's samples, the mesh's process group reduce-scatters
        the sums, and each rank's second session noises the rows it owns
        (sigma * C, once per coordinate; the ledger charges rank 0 once per
        step). Steps block (no asynchronous GPU steps); with asynchronous
        (the default) the micro-batches of a logical step that do not
        commit go without waiting, so the daemon works on one
        while the trainer runs the next (faster; one more micro-batch's
        activations and output gradients held meanwhile), and
        asynchronous=False sends each and waits for it (less memory).
        sharded_noise=True runs the same steps for a plain model and
        all-gathers the noised shards into param.grad on every rank: no
        rank is special."""
        if self.module is not None:
            raise RuntimeError("this PrivacyEngine is already attached to a module")
        algo = _terms.check_terms(loss_reduction, max_grad_norm, noise_multiplier, algorithm)
        _terms.check_module(module)
        _fsdp.refuse_fsdp1(module)
        fsdp = _fsdp.is_fsdp2(module)
        if replace_mha:
            _mha.replace_mha(module)
        layers, norms = collect_layers(self, module)
        if check_first_step and not fsdp:
            _verify.install(self, module, layers)
            self._probed = False
        device = layers[0].weight.device
        if distributed is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.distributed = bool(distributed)
        group, dp_group, dp_src = self._open_parallel(
            module, layers, device, norm_group, norm_group_clipping, norm_group_timeout_ms,
            replicated_modules, {"max_grad_norm": float(max_grad_norm),
                                 "noise_multiplier": float(noise_multiplier),
                                 "loss_reduction": loss_reduction},
            _terms.loader_kind(data_loader, poisson_sampling, secure_mode))
        shards = None
        if fsdp or sharded_noise:
            shards = _fsdp.Sharded(self, layers, module, fsdp, self.distributed, norm_group)
            self.rank, self.world_size = shards.rank, shards.world
        self.norm_group = group
        loader_fault = digest = None
        if group is None:
            _parallel.check_loader(self, data_loader, device, secure_mode)
        elif isinstance(data_loader, DPDataLoader):
            # checked with the second agreement, where every rank raises alike
            loader_fault = _parallel.loader_fault(self, data_loader, secure_mode)
            digest = _parallel.generator_digest(data_loader)
        self.mode = _modes.choose(self, shards, group, dp_group)
        self._agree_account(module, fsdp, group, dp_group, dp_src)
        data_loader = _terms.settle_sampling(self, data_loader, poisson_sampling, secure_mode,
                                             expected_batch_size, sample_rate, loss_reduction,
                                             group, loader_fault, digest)
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.loss_reduction = loss_reduction
        self.algorithm = algo
        # A flat-clipped group step has no early notice (its outputs are
        # queued once every member's norms are in): its GPU steps run synchronously.
        self.asynchronous = bool(asynchronous) and (group is None or group.group_wise)
        # Noise once per logical step: rank 0 adds it, the others send sigma 0.
        sigma = self.noise_multiplier if self.rank == 0 else 0.0
        self._step = _lib.Step(1, self.max_grad_norm,
                               _lib.MEAN if loss_reduction == "mean" else _lib.SUM,
                               self.expected_batch_size, sigma, sample_rate=self.sample_rate,
                               target_delta=target_delta, target_epsilon=target_epsilon)
        _parallel.declare_member(self, self._step)
        if device.type == "cuda" and self.client.info.has_cuda:
            warn_without_mps(self.client)
            if shards is None:  # a steady step's tensors named at the backward's end
                # (a group member never registers there: Replanner._seal)
                self._replanner.resolve = self.client.refs_cuda_cached_at \
                    if group is not None else self.client.refs_cuda_at
        self.mode.open(target_delta, target_epsilon, device)  # (sharded: steps block)
        self._attach(module, layers, norms)
        if optimizer is not None:
            optimizer = DPOptimizer(optimizer, self)
        return module, optimizer, data_loader

    def _open_parallel(self, module: nn.Module, layers: List[_Layer], device: torch.device,
                       norm_group: Any, clipping: str, timeout_ms: int,
                       replicated_modules: Iterable[Union[nn.Module, str]],
                       terms: dict, loader_kind: str) -> Tuple[Any, Any, int]:
        """Sets rank and world size (of the data-parallel replicas); with a
        norm group, opens it and agrees its terms with every member. Returns
        (the norm group or None, the data-parallel process group (None: all
        ranks), the global rank of its rank 0)."""
        self.rank, self.world_size = 0, 1
        if norm_group is None:
            if replicated_modules:
                raise ValueError("replicated_modules needs a norm_group (the process group of "
                                 "the ranks that hold the model together)")
            if self.distributed:
                self.rank = torch.distributed.get_rank()
                self.world_size = torch.distributed.get_world_size()
            return None, None, 0
        group = _group.open_group(norm_group, clipping, timeout_ms)
        failure = None
        try:
            _group.check(group, replicated_modules, module, layers, device)
        except (ValueError, NotImplementedError) as e:
            failure = e  # raised once every member (every rank) knows of it
        mates, parts = _group.agree(group, _group.terms(group, layers, terms, loader_kind),
                                    failure, self.distributed, _group.judge_terms)
        group.name, group.seed = mates[0]["name"], mates[0]["seed"]
        if not self.distributed:
            return group, None, 0
        _group.judge_layout(torch.distributed.get_world_size(), sorted(parts))
        dp_group, self.rank, self.world_size, dp_src = _parallel.replica_groups(
            sorted(parts), group.ranks, group.rank)
        return group, dp_group, dp_src

    def _agree_account(self, module: nn.Module, fsdp: bool, group: Any, dp_group: Any,
                       dp_src: int) -> None:
        """One ledger account for a logical step: every data-parallel rank
        and every member of a norm group takes its rank 0's job id."""
        if self.distributed and self.world_size > 1:
            # Same starting point on every rank (what DDP would do; fully_shard
            # leaves that to the trainer, as FSDP itself does).
            for p in module.parameters() if not fsdp else ():
                torch.distributed.broadcast(p.data, dp_src, group=dp_group)
            # Ranks other than 0 send sigma 0 (noise once per logical step)
            # under rank 0's job id: the daemon counts a sigma-0 step of a
            # job with several sessions as a data-parallel share, charged
            # through rank 0's step, so a budget does not refuse them. A
            # node without rank 0's session charges them as sigma 0.
            self._agree_job_id()
        elif group is not None:
            # the group step is charged to its rank 0's job: one account
            self._agree_job_id(group.pg, group.ranks[0])
        if not self._job_given and self.rank == 0 and (group is None or group.rank == 0):
            print("dpclip: job id %s (pass job_id= to share an account)" % self.job_id,
                  file=sys.stderr, flush=True)

    def _attach(self, module: nn.Module, layers: List[_Layer], norms: list) -> None:
        """Swaps in the layers' forwards and hooks the module: a pass count,
        and each normalization's check against mixing samples."""
        self._layers = layers
        # FSDP2's sharded parameters get their gradients through its own
        # hooks: only the optimizer's parameters are checked there
        self._guard = Guard(_planner.params(layers), hooks=self.mode.guard_hooks)
        for l in layers:
            l.attach()
        # A plain function, not a bound method: copy.deepcopy of the model
        # then leaves the engine (and its ctypes handles) alone.
        engine = self

        def on_forward(mod: nn.Module, inputs: Tuple[Any, ...]) -> None:
            engine._pass += 1
            engine._acc.forward(engine._pass)  # sends the micro-batches complete by now

        self._hook = module.register_forward_pre_hook(on_forward)

        def mixing_hook(name: str) -> Callable[[nn.Module, Tuple[Any, ...]], None]:
            def check(mod: nn.Module, inputs: Tuple[Any, ...]) -> None:
                why = _mixing(mod) if engine.active else None
                if why is not None:
                    raise _mixing_error(name, mod, why)
            return check

        self._norm_hooks = [m.register_forward_pre_hook(mixing_hook(n)) for n, m in norms]
        self.module = module
        self.active = True

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
        if self._guard is not None:
            self._guard.remove()
        self.active = False
        self.module = None

    def close(self) -> None:
        """Collects the last asynchronous step (raising its error, if any),
        detaches and disconnects. A member of a norm group first waits for
        the other members to get there (a barrier over the group): a member
        that leaves dissolves the group in the daemon, which would fail
        another's last step still under way (group-wise steps do not wait
        for each other)."""
        try:
            self._collect()
        finally:
            self._acc.close()
            self.detach()
            if self._step is not None:
                self._step.close()
                self._step = None
            # closed once (a norm group's member: the barrier)
            mode, self.mode, self.norm_group = self.mode, _modes.Local(self), None
            try:
                mode.close()
            finally:
                self._cuda.close()
                self.client.close()

    def synchronize(self) -> None:
        """Collects the result of an asynchronous step still in flight:
        blocks until the daemon finished it; raises DpclipError if it failed
        (its gradients were zeros). Data parallel: a step that failed on any
        rank (and so was applied on none) raises at the next step() or
        close(), on every rank."""
        if self._inflight is None:
            return
        ticket, B, index, earlier = self._inflight
        self._inflight = None
        try:
            res = self.client.wait(ticket)
        except _lib.DpclipError as e:
            if e.code == _lib.EIO:
                self._cuda.release_flags()  # no stream may wait for the daemon that went
            raise _lib.DpclipError(
                e.code, e.field, "step %d failed on the device after it was queued, so its "
                "gradients were zeros (the optimizer step that used them moved the parameters "
                "only through momentum or weight decay): %s" % (index, e.message)) from None
        self._finish(res, B, earlier)

    def _collect(self) -> None:
        """step()'s and close()'s collection of the last step: its error, or
        (data parallel) any rank's failure of it (the mode's collect())."""
        self.mode.collect()

    # Results of the last step; reading them collects an asynchronous one.
    @property
    def last_norms(self) -> Optional[torch.Tensor]:
        self._results()
        return self._last_norms

    @property
    def last_coefs(self) -> Optional[torch.Tensor]:
        self._results()
        return self._last_coefs

    def _results(self) -> None:
        """The last step collected, and its norms and coefficients made
        tensors once."""
        self.synchronize()
        if self._last_lists is not None:
            norms, coefs = self._last_lists
            self._last_lists = None
            self._last_norms = torch.tensor(norms, dtype=torch.float32)
            self._last_coefs = torch.tensor(coefs, dtype=torch.float32)

    @property
    def micro_batches_held_peak(self) -> int:
        """The most micro-batches held at once: sent, their replies not yet
        collected, each keeping its tensors (or a staging arena) alive."""
        return self._acc.held_peak

    @property
    def output_buffer_bytes(self) -> int:
        """GPU bytes of the gradient arenas the engine holds from their
        first step on (data parallelism, accumulated steps, or
        DPCLIP_GRAD_BUFFERS=engine); per-step buffers, which param.grad
        alone holds, are not counted."""
        return _outputs.arena_bytes(self._cuda._arenas)

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
        """Forget what was captured since the last step (zero_grad() calls
        it). In the middle of a logical step (micro-batches captured, or
        sent) it drops the logical step, with a warning saying what it
        dropped; the daemon releases and charges nothing of it."""
        self._drop(ended=self._acc.abort("zero_grad()"))

    def logical_batches(self, data_loader: DataLoader, max_physical_batch_size: int
                        ) -> "_batches.LogicalBatches":
        """Opacus's BatchMemoryManager: `with engine.logical_batches(loader,
        max_physical_batch_size=16) as batches: for x, y in batches: ...`
        splits each logical batch the loader draws into micro-batches of at
        most that many samples, and makes optimizer.step() and zero_grad()
        no-ops except at each logical batch's end: one logical step per
        logical batch, at the loader's sample rate (dpclip._batches)."""
        self.mode.check_logical_batches()
        return _batches.LogicalBatches(self, data_loader, max_physical_batch_size)

    def _drop(self, ended: bool = True) -> None:
        """Forgets captures, guard marks and the logical step (ended: counted as one)."""
        for l in self._layers:
            l.records.clear()
            if l.verify is not None:
                l.verify.uses = []  # the first-step check's record of the same calls
        self._replanner.unstage()
        if self._guard is not None:
            self._guard.clear()
        self._acc.reset(ended)

    # -- the step -------------------------------------------------------------------
    def step(self, params: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Send the captured activations and output gradients as one
        ClipStep and write the private gradient into each parameter's .grad
        (replacing what was there). Called by DPOptimizer.step(), with the
        optimizer's parameters as params. After several backward passes it
        commits their logical step (dpclip._accumulate): the micro-batches
        not sent yet, then the commit; a failure of any micro-batch raises
        here, no parameter updated.

        Fail closed (dpclip._guard): first, where a parameter the engine
        trains received a gradient from autograd since the last step (a use
        outside its module), or one of params that it does not train holds
        a gradient, it raises UnclippedGradientError naming the parameter,
        before anything is sent or updated.

        Data parallel: every rank joins the all-reduce even when its own
        step failed (with zero gradients and a failure flag), so the ranks
        stay in step, and the summed gradients are zeroed on every rank
        unless every rank's step succeeded: rank 0 alone adds the noise, so
        a sum without its result would be a noiseless update
        (dpclip._modes.DataParallel, dpclip._gate)."""
        if not self.active:
            raise RuntimeError("the PrivacyEngine is not attached to a module")
        if self.steps == 0:
            _fsdp.check_unwrapped(self._layers)
        self.mode.step(params)  # dpclip._modes: one process, data parallel, sharded, grouped

    def _step_whole(self, staged: Optional[_planner.Plan] = None) -> Optional[torch.Tensor]:
        """This process's step of one pass, as a whole step (the logical
        step's only micro-batch; staged: its plan, the pass staged whole);
        returns (data parallel) a [1] f32 tensor on the gradients' device:
        1 where the step's result is in param.grad, 0 where it is not."""
        t0 = time.perf_counter()
        B, plan = (self._replanner.B, staged) if staged is not None else self._planned()
        if plan is None:
            if B == 0:
                if self.loss_reduction == "mean" and self.expected_batch_size <= 0:
                    raise ValueError("an empty batch with a mean loss needs expected_batch_size")
                self._drop(ended=False)  # (step() ends the step)
            plan = self._plan(B)
        device = self._device()
        run = self._io(device).run(self._step, plan, max(B, 1), device, self.algorithm,
                                   self.mode.gated, self.asynchronous)
        if run.res is None:  # asynchronous (GPU): collected later
            self._inflight = (run.ticket, B, run.info.step_index, ())
            self.last_epsilon, self.last_delta = run.info.epsilon, run.info.delta
        else:
            self._finish(run.res, B)
        self._timing(t0, run.t1, run.t2, run.res is not None)
        return run.ok

    def _planned(self) -> Tuple[int, Optional[_planner.Plan]]:
        """The batch size of the pass the layers hold and, for a steady
        step, its plan from the last one's template (without counting the
        batch); else (B, None): the caller plans (_plan(B)) once it has
        dealt with an empty batch."""
        if not self._probing():
            hit = self._replanner.steady(self._layers)
            if hit is not None:
                return hit
        return _planner.batch_size(self._layers), None

    def _plan(self, B: int) -> _planner.Plan:
        """The plan of the pass the layers hold (B samples), after the
        first-step check where a layer's is still to run (dpclip._verify):
        every mode's steps and micro-batches are planned here."""
        if self._probing():
            plan = _planner.plan(self._layers, B)
            _verify.check_step(self, plan, B)
            return plan
        return self._replanner.plan(self._layers, B)

    def _probing(self) -> bool:
        """A layer's first-step check is still to run (once none is, none
        ever is again: checks are installed by make_private alone)."""
        if self._probed:
            return False
        self._probed = not any(l.verify is not None for l in self._layers)
        return not self._probed

    @property
    def norm_group_name(self) -> Optional[str]:
        """The dpclip norm group's name (the same on every member), or None."""
        return self.norm_group.name if self.norm_group is not None else None

    def _io(self, device: torch.device) -> Transport:
        """The transport of tensors on `device` (dpclip._transport)."""
        return self._cuda if device.type == "cuda" else self._host

    def _device(self) -> torch.device:
        devs = {l.weight.device for l in self._layers}
        if len(devs) != 1:
            raise ValueError("the private parameters span several devices (%s); one engine "
                             "serves one device" % ", ".join(str(d) for d in devs))
        return devs.pop()

    def _finish(self, res: _lib.StepResult, B: int,
                earlier: Sequence[Tuple[int, _lib.StepResult]] = ()) -> None:
        """Takes a step's result (earlier: a logical step's micro-batches
        before its commit, as (samples, result))."""
        res, B = _accumulate.merged(res, B, earlier)
        # An empty batch was sent as one sample of zeros: no real norms.
        self._last_lists = (res.norms if B > 0 else [], res.coefs if B > 0 else [])
        self._last_step_index = res.step_index
        self._last_compute_ns = res.compute_ns
        self.compute_ns_total += res.compute_ns
        self.input_wait_ns_total += res.input_wait_ns
        self.last_epsilon = res.epsilon
        self.last_delta = res.delta

    def _timing(self, t0: float, t1: float, t2: float, blocked: bool) -> None:
        t3 = time.perf_counter()
        self.last_timing = {"prepare_ms": (t1 - t0) * 1e3, "run_ms": (t2 - t1) * 1e3,
                            "finish_ms": (t3 - t2) * 1e3}
        if blocked:  # the daemon's own times come with a blocking step's reply
            self.last_timing.update(self.client.last_timing() or {})


def make_private(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 data_loader: Optional[DataLoader] = None, *, noise_multiplier: float,
                 max_grad_norm: float, loss_reduction: str = "mean",
                 socket_path: Optional[str] = None, job_id: Optional[str] = None,
                 allow_insecure_seed: bool = False, **kwargs: Any
                 ) -> Tuple[nn.Module, Optional[torch.optim.Optimizer], Optional[DataLoader]]:
    """Opacus-shaped shorthand: a PrivacyEngine on socket_path (job_id,
    allow_insecure_seed: as PrivacyEngine's) attached to model; returns
    (model, optimizer, data_loader). The engine is optimizer.engine."""
    engine = PrivacyEngine(socket_path, job_id=job_id, allow_insecure_seed=allow_insecure_seed)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=data_loader,
                               noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                               loss_reduction=loss_reduction, **kwargs)
