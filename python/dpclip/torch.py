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

Data planes: CPU tensors are copied into one shared-memory arena per engine
(the daemon maps it once; it is laid out per step and grown when a step needs
more), outputs come back through it and are copied into param.grad. CUDA
tensors are named in place through CUDA IPC (one registration per caching-
allocator block, cached by libdpclip), outputs go into param-shaped CUDA
tensors the engine owns and param.grad aliases, and ordering uses two
interprocess events: the trainer records `ready` on its stream before the
step, the daemon waits on it and records `done`, the trainer's stream waits on
`done`. No host synchronisation beyond the step's reply.

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
import collections
import ctypes
import math
import time

import torch
import torch.nn as nn

from . import _lib, _parallel
from ._lib import DpclipError
from .data import DPDataLoader
from ._layers import (  # noqa: F401  (UnsupportedModuleError is public API)
    UnsupportedModuleError, _Layer, _classify, _check_module, _align, _wire_dtype, _tref,
    _RMSNorm, _FLOAT_WIRE, _ESIZE, _NORMS, _mixing, _mixing_error)
from .losses import per_sample_cross_entropy, reduce_loss, sequence_cross_entropy  # noqa: F401


# --- the engine ---------------------------------------------------------------------

class PrivacyEngine:
    """A session with dpclipd and the book-keeping for one model.

    socket_path: the daemon's socket (default $DPCLIP_SOCKET, else
    /run/dpclip/dpclipd.sock). The connection is made here, so a daemon that
    is not running is reported at once (DpclipError, code DPCLIP_EIO)."""

    def __init__(self, socket_path=None, *, client_name="dpclip-torch", job_id=None):
        self.client = _lib.Client(socket_path, client_name=client_name, job_id=job_id)
        self.active = False
        self._layers = []
        self._pass = 0
        self._step = None
        self._arena = None          # (buffer_id, size, uint8 tensor view)
        self._events = {}           # cuda device index -> (ready, done, ready_id, done_id)
        self._hook = None
        self._norm_hooks = []       # normalizations' checks against mixing samples
        self.module = None
        self.steps = 0
        self._last_norms = None
        self._last_coefs = None
        self._last_compute_ns = 0
        self._last_step_index = 0
        self.compute_ns_total = 0   # the daemon's compute time of every collected step
        self.last_epsilon = self.last_delta = 0.0   # the daemon's ledger, after the last step
        # GPU steps run asynchronously (see make_private): (ticket, B, step
        # index) of the step whose result has not been collected yet.
        self.asynchronous = True
        self._inflight = None
        self._job_id = job_id
        self._gate = None           # data parallel: see _parallel.Gate
        # Data parallel GPU steps: the [B] coefficients output the daemon
        # writes (zeroed before each step: zero after it unless it succeeded).
        self._coefs = None
        self._coefs_ref = None
        # Wall time of the last step's phases in the trainer (ms): building
        # the request (copies, registrations), the daemon round trip, and
        # writing param.grad. For diagnosing overheads; costs two clock reads.
        self.last_timing = {}

    # -- setup ------------------------------------------------------------------
    def make_private(self, *, module, optimizer=None, data_loader=None, noise_multiplier,
                     max_grad_norm, loss_reduction="mean", poisson_sampling=True,
                     expected_batch_size=None, distributed=None, algorithm="auto",
                     sample_rate=None, target_delta=0.0, target_epsilon=0.0,
                     asynchronous=True, secure_mode=False):
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

        layers, seen, norms = [], {}, []
        for name, m in module.named_modules():
            why = _mixing(m)
            if why is not None:
                raise _mixing_error(name, m, why)
            if isinstance(m, _NORMS):
                norms.append((name, m))
            own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
            kind = _classify(m)
            if kind is None:
                if own:
                    raise UnsupportedModuleError(
                        "module %s (%s) has trainable parameters (%s) but is not supported by "
                        "dpclip (supported: Linear, Embedding, LayerNorm%s); freeze them or "
                        "replace the module" % (name or "<root>", type(m).__name__,
                                                 ", ".join(pn for pn, _ in own),
                                                 ", RMSNorm" if _RMSNorm else ""))
                continue
            if not _check_module(name, m, kind):
                continue
            for _, p in own:
                if id(p) in seen:
                    raise UnsupportedModuleError(
                        "modules %s and %s share a parameter (tied weights are not supported)"
                        % (seen[id(p)], name))
                seen[id(p)] = name
            layers.append(_Layer(self, name, m, kind))
        if not layers:
            raise UnsupportedModuleError("the module has no trainable parameters to train privately")

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

    def detach(self):
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

    def close(self):
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

    def synchronize(self):
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

    def _collect(self):
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
    def last_norms(self):
        self.synchronize()
        return self._last_norms

    @property
    def last_coefs(self):
        self.synchronize()
        return self._last_coefs

    @property
    def last_compute_ns(self):
        self.synchronize()
        return self._last_compute_ns

    @property
    def last_step_index(self):
        self.synchronize()
        return self._last_step_index

    # -- losses -------------------------------------------------------------------
    def loss(self, per_sample):
        """Reduce a [B] tensor of per-sample losses the way the daemon was
        told (mean or sum over samples)."""
        return reduce_loss(per_sample, self.loss_reduction)

    def clear(self):
        """Forget what was captured since the last step."""
        for l in self._layers:
            l.records.clear()

    # -- the step -------------------------------------------------------------------
    def _batch_size(self):
        counts = collections.Counter()
        for l in self._layers:
            for inp, _, _ in l.records:
                counts[inp.shape[0] if inp.dim() > 0 else -1] += 1
        if not counts:
            return 0
        B = counts.most_common(1)[0][0]
        for l in self._layers:
            for inp, g, _ in l.records:
                if inp.dim() == 0 or inp.shape[0] != B or g.shape[0] != B:
                    raise ValueError(
                        "module %s saw a batch of %s samples where the other modules saw %d: "
                        "inputs must be batch-first, with the sample in dimension 0 (e.g. "
                        "positional indices expanded to [B, T])"
                        % (l.name, tuple(inp.shape[:1]) or "a scalar", B))
        return B

    def step(self):
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

    def _step_local(self):
        """This process's step; returns (data parallel) a [1] f32 tensor on
        the gradients' device: 1 where the step's result is in param.grad,
        0 where it is not."""
        passes = {pid for l in self._layers for _, _, pid in l.records}
        if len(passes) > 1:
            raise RuntimeError(
                "activations from %d forward/backward passes were captured for one "
                "optimizer step; dpclip takes one pass per step (no gradient "
                "accumulation): call optimizer.step() after each backward" % len(passes))
        B = self._batch_size()
        if B == 0:
            if self.loss_reduction == "mean" and self.expected_batch_size <= 0:
                raise ValueError("an empty batch with a mean loss needs expected_batch_size")
            self.clear()
        device = self._device()
        if device.type == "cuda":
            return self._run_cuda(B, device)
        self._run_host(B)
        return torch.ones(1)

    def _device(self):
        devs = {l.weight.device for l in self._layers}
        if len(devs) != 1:
            raise ValueError("the private parameters span several devices (%s); one engine "
                             "serves one device" % ", ".join(str(d) for d in devs))
        return devs.pop()

    def _plan(self, B, device):
        """Per layer: (layer, input tensor or None, grad tensor or None,
        input shape, input dtype, grad shape, grad dtype). Layers not used
        in this pass (and every layer of an empty batch) get zeros of one
        position: norm 0, so the daemon adds noise alone to their params."""
        nb = max(B, 1)
        plan = []
        for l in self._layers:
            if B > 0 and l.records:
                ins, gs = l.flat_parts(B)
                inp = ins[0] if len(ins) == 1 else torch.cat(ins, 1)
                g = gs[0] if len(gs) == 1 else torch.cat(gs, 1)
                T = inp.shape[1]
            else:
                inp = g = None
                T = 1
            gw = l.p if l.kind == "linear" else l.d
            if l.kind == "embedding":
                in_shape, in_dt = (nb, T), (_wire_dtype(inp) if inp is not None else torch.int64)
            else:
                in_shape = (nb, T, l.d)
                in_dt = _wire_dtype(inp) if inp is not None else torch.float32
            g_dt = _wire_dtype(g) if g is not None else torch.float32
            plan.append((l, inp, g, in_shape, in_dt, (nb, T, gw), g_dt))
        return plan

    def _add_layers(self, step, plan, refs):
        """refs(i) -> (input ref, grad ref, weight out ref, bias out ref)."""
        for i, (l, _, _, _, _, _, _) in enumerate(plan):
            a_ref, g_ref, w_ref, b_ref = refs(i)
            name = l.name.encode()
            if l.kind == "linear":
                step.add_linear(_lib.Linear(name, a_ref, g_ref, int(l.bias is not None),
                                            self.algorithm, w_ref, b_ref, 0.0))
            elif l.kind == "embedding":
                pad = l.padding_idx
                step.add_embedding(_lib.Embedding(name, a_ref, g_ref, l.vocab, int(pad is not None),
                                                  pad if pad is not None else 0, w_ref, 0.0))
            else:
                eps = l.eps_used if l.eps_used is not None else \
                    l.eps_for(torch.empty(0, dtype=torch.float32))
                nl = _lib.NormLayer(name, a_ref, g_ref, eps, int(l.bias is not None), w_ref,
                                    b_ref, 0.0)
                if l.kind == "layernorm":
                    step.add_layernorm(nl)
                else:
                    step.add_rmsnorm(nl)

    def _finish(self, res, B):
        # An empty batch was sent as one sample of zeros: no real norms.
        self._last_norms = torch.tensor(res.norms if B > 0 else [], dtype=torch.float32)
        self._last_coefs = torch.tensor(res.coefs if B > 0 else [], dtype=torch.float32)
        self._last_step_index = res.step_index
        self._last_compute_ns = res.compute_ns
        self.compute_ns_total += res.compute_ns
        self.last_epsilon = res.epsilon
        self.last_delta = res.delta

    def _timing(self, t0, t1, t2):
        t3 = time.perf_counter()
        self.last_timing = {"prepare_ms": (t1 - t0) * 1e3, "run_ms": (t2 - t1) * 1e3,
                            "finish_ms": (t3 - t2) * 1e3}

    # -- host memory: one shared-memory arena ---------------------------------------
    def _arena_view(self, need):
        if self._arena is None or self._arena[1] < need:
            old = self._arena
            size = max(need, 2 * old[1] if old else 0, 1 << 20)
            size = (size + 4095) // 4096 * 4096
            if old is not None:
                self._arena = None
                self.client.buffer_release(old[0])
            bid, addr = self.client.buffer_alloc(size)
            raw = (ctypes.c_uint8 * size).from_address(addr)
            self._arena = (bid, size, torch.frombuffer(raw, dtype=torch.uint8))
        return self._arena

    def _run_host(self, B):
        t0 = time.perf_counter()
        plan = self._plan(B, torch.device("cpu"))
        nb = max(B, 1)
        off = 0
        slots = []

        def take(nbytes):
            nonlocal off
            o = _align(off)
            off = o + nbytes
            return o

        for l, _, _, in_shape, in_dt, g_shape, g_dt in plan:
            w_dt = l.weight.dtype if l.weight.dtype in _FLOAT_WIRE else torch.float32
            w_off = take(l.weight.numel() * _ESIZE[w_dt])
            b_off = take(l.bias.numel() * _ESIZE[w_dt]) if l.bias is not None else None
            a_off = take(math.prod(in_shape) * _ESIZE[in_dt])
            g_off = take(math.prod(g_shape) * _ESIZE[g_dt])
            slots.append((w_dt, w_off, b_off, a_off, g_off))
        bid, _, mem = self._arena_view(off)

        def view(o, dtype, shape):
            n = math.prod(shape) * _ESIZE[dtype]
            return mem[o:o + n].view(dtype).view(shape)

        for (l, inp, g, in_shape, in_dt, g_shape, g_dt), (_, _, _, a_off, g_off) in zip(plan, slots):
            av, gv = view(a_off, in_dt, in_shape), view(g_off, g_dt, g_shape)
            if inp is None:
                av.zero_()
                gv.zero_()
            else:
                av.copy_(inp)
                gv.copy_(g)

        def refs(i):
            l, _, _, in_shape, in_dt, g_shape, g_dt = plan[i]
            w_dt, w_off, b_off, a_off, g_off = slots[i]
            b_ref = _tref(bid, b_off, w_dt, tuple(l.bias.shape)) if b_off is not None \
                else _lib.Tensor()
            return (_tref(bid, a_off, in_dt, in_shape), _tref(bid, g_off, g_dt, g_shape),
                    _tref(bid, w_off, w_dt, tuple(l.weight.shape)), b_ref)

        step = self._step
        step.reset(nb)
        self._add_layers(step, plan, refs)
        t1 = time.perf_counter()
        res = step.run(self.client)
        t2 = time.perf_counter()
        for (l, *_), (w_dt, w_off, b_off, _, _) in zip(plan, slots):
            self._set_grad(l.weight, view(w_off, w_dt, tuple(l.weight.shape)))
            if b_off is not None:
                self._set_grad(l.bias, view(b_off, w_dt, tuple(l.bias.shape)))
        self._finish(res, B)
        self._timing(t0, t1, t2)

    @staticmethod
    def _set_grad(p, src):
        # A copy: the arena is reused (and may be replaced) by the next step.
        if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype:
            p.grad = src.to(p.dtype, copy=True)
        else:
            p.grad.copy_(src)

    # -- CUDA: tensors in place over CUDA IPC, ordered by interprocess events -------
    def _cuda_events(self, device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        ev = self._events.get(idx)
        if ev is None:
            with torch.cuda.device(idx):
                ready = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                done = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                rid = self.client.register_event(ready.ipc_handle(), idx)
                did = self.client.register_event(done.ipc_handle(), idx)
            ev = self._events[idx] = (ready, done, rid, did)
        return ev

    def _cuda_ref(self, t, shape):
        bid, off = self.client.register_cuda(t.data_ptr())
        return _tref(bid, off, t.dtype, shape)

    def _run_cuda(self, B, device):
        t0 = time.perf_counter()
        plan = self._plan(B, device)
        nb = max(B, 1)
        keep = []
        tensors = []
        for l, inp, g, in_shape, in_dt, g_shape, g_dt in plan:
            if inp is None:
                inp = torch.zeros(in_shape, dtype=in_dt, device=device)
                g = torch.zeros(g_shape, dtype=g_dt, device=device)
            else:
                # (guarded: each call costs host time even when it is a no-op)
                if inp.dtype != in_dt:
                    inp = inp.to(in_dt)
                if not inp.is_contiguous():
                    inp = inp.contiguous()
                if g.dtype != g_dt:
                    g = g.to(g_dt)
                if not g.is_contiguous():
                    g = g.contiguous()
            if l.out_w is None:
                w_dt = l.weight.dtype if l.weight.dtype in _FLOAT_WIRE else torch.float32
                l.out_w = torch.empty(l.weight.shape, dtype=w_dt, device=device)
                if l.bias is not None:
                    l.out_b = torch.empty(l.bias.shape, dtype=w_dt, device=device)
            keep.append((inp, g))
            tensors.append((inp, g))
        ready, done, rid, did = self._cuda_events(device)

        def refs(i):
            l, _, _, in_shape, _, g_shape, _ = plan[i]
            inp, g = tensors[i]
            if l.out_refs is None:
                # The engine holds the output tensors for its lifetime, so
                # their allocation cannot be freed and reused: the references
                # stay valid and are made once (activations and output grads
                # are new tensors every step and go through libdpclip's check).
                l.out_refs = (self._cuda_ref(l.out_w, tuple(l.out_w.shape)),
                              self._cuda_ref(l.out_b, tuple(l.out_b.shape))
                              if l.out_b is not None else _lib.Tensor())
            return (self._cuda_ref(inp, in_shape), self._cuda_ref(g, g_shape)) + l.out_refs

        step = self._step
        step.reset(nb)
        gated = self.distributed and self.world_size > 1
        with torch.cuda.device(device):
            self._add_layers(step, plan, refs)
            stream = torch.cuda.current_stream(device)
            if gated:
                coefs = self._coefs_out(nb, device)
                coefs.zero_()  # stays zero unless the daemon's step succeeds
                step.set_outputs(coefs_out=_tref(self._coefs_ref[0], self._coefs_ref[1],
                                                 torch.float32, (nb,)))
            ready.record(stream)
            step.set_events(rid, did)
            step.notify_enqueued(self.asynchronous)
            t1 = time.perf_counter()
            if self.asynchronous:
                ticket = step.submit(self.client)
                info = self.client.wait_enqueued(ticket)  # raises an early error
                res = None
            else:
                res = step.run(self.client)
            t2 = time.perf_counter()
            # The daemon recorded `done` before replying: from here on the
            # trainer's stream is ordered after the daemon's writes (and after
            # its reads of `keep`, whose blocks the allocator may now reuse).
            stream.wait_event(done)
            # Data parallel: this step's success flag, on the device. Each
            # coefficient (min(1, C / norm), > 0 for any finite norm) is
            # written after the (noised) gradients once the daemon commits
            # them; zero where it failed after its notice (it writes zeros),
            # wrote nothing, or died first.
            ok = (coefs > 0).all().to(torch.float32).reshape(1) if gated else None
        keep.clear()
        for l, *_ in plan:
            for p, out in ((l.weight, l.out_w), (l.bias, l.out_b)):
                if p is None:
                    continue
                if out.dtype == p.dtype:
                    p.grad = out  # aliases the output buffer: no copy
                else:
                    self._set_grad(p, out)
        if res is None:
            self._inflight = (ticket, B, info.step_index)
            self.last_epsilon, self.last_delta = info.epsilon, info.delta
        else:
            self._finish(res, B)
        self._timing(t0, t1, t2)
        return ok

    def _coefs_out(self, nb, device):
        """The first nb elements of the engine's coefficients output on
        `device` (grown when a step needs more; registered once per
        buffer: the engine holds it, so its reference stays valid)."""
        if self._coefs is None or self._coefs.numel() < nb or self._coefs.device != device:
            n = max(nb, 2 * self._coefs.numel() if self._coefs is not None else 0, 64)
            self._coefs = torch.zeros(n, dtype=torch.float32, device=device)
            self._coefs_ref = self.client.register_cuda(self._coefs.data_ptr())
        return self._coefs[:nb]


# --- the optimizer wrapper -------------------------------------------------------------

class DPOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: step() first has the engine fill param.grad with
    the private gradient, then runs the wrapped optimizer's step. State,
    param_groups and defaults are the wrapped optimizer's (LR schedulers
    work on either)."""

    def __init__(self, optimizer, engine):  # pylint: disable=super-init-not-called
        # Optimizer.__init__ would rebuild param_groups; share the wrapped ones.
        self.original_optimizer = optimizer
        self.engine = engine
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, v):
        self.original_optimizer.param_groups = v

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, v):
        self.original_optimizer.state = v

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, v):
        self.original_optimizer.defaults = v

    def zero_grad(self, set_to_none=True):
        self.engine.clear()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.engine.step()
        return self.original_optimizer.step()

    def add_param_group(self, param_group):
        self.original_optimizer.add_param_group(param_group)

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.original_optimizer.load_state_dict(state_dict)

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self):
        return "DPOptimizer(%r)" % (self.original_optimizer,)


def make_private(model, optimizer, data_loader=None, *, noise_multiplier, max_grad_norm,
                 loss_reduction="mean", socket_path=None, **kwargs):
    """Opacus-shaped shorthand: a PrivacyEngine on socket_path attached to
    model; returns (model, optimizer, data_loader). The engine is
    optimizer.engine."""
    engine = PrivacyEngine(socket_path)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=data_loader,
                               noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                               loss_reduction=loss_reduction, **kwargs)
