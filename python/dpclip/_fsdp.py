"""Sharded data parallelism in the PyTorch integration: models under FSDP2
(torch.distributed.fsdp.fully_shard), and plain models with
make_private(sharded_noise=True), which run the same steps.

Each optimizer step, on every rank:
  1. the norm pass: one ClipStep of the engine's session in phase
     STEP_NORMS names every layer (flat clipping needs each sample's whole
     norm), at the engine's sigma; the daemon keeps the per-sample norms for
     the sums. It is this rank's member of the job's logical step
     (data_parallel: world W, this rank, the job's sigma), so the ledger
     charges the logical step once, whichever rank's pass comes first, and
     covers the others;
  2. the sums and the reduce-scatter, bucket by bucket (about 256M
     elements per rank, fewer past 2 ranks: _shards.bucket_size; each a run
     of whole layers): a STEP_SUMS step names
     the layers writing the bucket's parameters and gets their clipped sum
     of this rank's samples, in the reduce dtype, each parameter in a padded
     region of world * chunk rows (chunk = ceil(rows / world): fully_shard's
     dim-0 chunks). The daemon adds the noise to the rows this rank owns in
     that same step, before it writes them: each output names its rows
     (Step.set_noise_range: rows [rank * chunk, rank * chunk + mine) of the
     parameter, or the columns of the daemon's [out, in] output for a weight
     kept [in, out]), which get N(0, (sigma C)^2) / E, drawn as a whole step
     draws them; the other rows get none. The trainer's process group (the
     FSDP mesh's) reduce-scatters the bucket, staged rank-major, so that
     each rank holds the sum over every rank's samples of the rows it owns,
     noised once, by its owner's daemon, at the full sigma C, and no more;
  3. the gate: a flag (1: this rank's norm pass and sums steps all
     succeeded) is all-reduced (MIN). Unless every rank's is 1, every rank
     writes zero gradients and raises: a shard missing its owner's noise,
     or a sum missing a rank's samples, is never applied;
  4. param.grad, the shards as they came: under FSDP2 the sharded DTensor
     fully_shard expects (this rank's rows, in the parameter's dtype); with
     sharded_noise the shards are all-gathered, so that every rank holds the
     whole gradient. Python adds no noise: everything it applies the daemon
     wrote clipped and noised, and charged (docs/design.md, "Guarantees").

Accounting: each rank's norm pass carries sigma and declares itself rank r
of W in the job's logical step; the ledger (ledger_dp.c) charges it once,
at (q, sigma), and covers the other ranks' passes. The sums steps belong to
their pass and are not accounted again; each adds its pass's sigma, which
the daemon checks. With one rank the pass is a logical step of its own, and
its sums noise their whole outputs.

Gradient accumulation (several backwards, one optimizer.step(); issue 39):
each micro-batch but the last goes when the next training forward begins
(dpclip._accumulate; one micro-batch's captures held) as a norm pass and
every bucket's sums step, carrying its ClipStep.logical (Sharded.micro):
the daemon adds the sums into its accumulators (unsharded f32) and writes
nothing; no collective runs. step() sends the last as the commit, the steps
above with logical.commit: its sums write the accumulated and its own sums
plus the owner's noise, so the collectives, the gate, the noise and the
charge (the commit's pass; every pass carries the same terms) are once per
logical step. A failed micro-batch aborts the logical step in the daemon,
and step() raises on every rank. A pass's sums are all sent even after one
failed (then refused): the daemon takes no other step of the session while
a micro-batch's pass has layers to sum.

Who reduce-scatters: the trainer's process group (FSDP's own, NCCL on GPUs),
once the daemon wrote the local sum: it exists wherever fully_shard runs and
needs no second communicator (the daemon has none for data parallelism).
Backends without reduce-scatter (gloo in older torches) all-reduce the sums
and keep their rows: the same result.

Memory: as FSDP holds one layer group's unsharded gradient at a time, the
clipped sums exist a few buckets at a time: on the GPU three slots, each
the size of the widest bucket it takes (bucket k + 1's sums step is queued
in the daemon, which fills its slot while the trainer's stream copies
bucket k out of another and bucket k - 1's waits to be reused), and a
bucket's staging. Past the norm pass (which waits for the backward's end)
the daemon waits for nothing of the trainer's: a sums step's early notice
comes once its writes are queued, the trainer's stream waits on its
slot's event, and the host reuses a slot only after the stream copied it
out, so no daemon work ever waits behind a collective. A micro-batch that does not commit goes
without waiting (micro_submit; make_private's asynchronous): its norm
pass and sums steps are queued in the daemon while the trainer runs the
next micro-batch, and the accumulator collects their replies (at most
one micro-batch in flight: its tensors or staging arena held until
then)."""
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _gate, _lib, _planner
from ._layers import _ESIZE, Part, Slice, UnsupportedModuleError, _Layer
from ._shards import _EALIGN, _al, _relaid, _transposed, bucket_size, buckets, layout

__all__ = ["Sharded", "refuse_fsdp1", "is_fsdp2", "check_unwrapped"]

_CLASSES: Optional[Tuple[Any, Any, Any]] = None


def _classes() -> Tuple[Any, Any, Any]:
    """(DTensor, Shard, FSDPModule) of this torch, None for what it lacks:
    fully_shard came with torch 2.4 (torch.distributed._composable.fsdp,
    public from 2.6), and Debian's torch 1.13 cannot even import
    torch.distributed.fsdp under Python 3.11, hence the broad excepts."""
    global _CLASSES
    if _CLASSES is None:
        dtensor = shard = fsdp = None
        for mod in ("torch.distributed.tensor", "torch.distributed._tensor"):
            try:
                m = __import__(mod, fromlist=["DTensor", "Shard"])
                dtensor, shard = m.DTensor, m.Shard
                break
            except Exception:  # pylint: disable=broad-except
                continue
        for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
            try:
                fsdp = getattr(__import__(mod, fromlist=["FSDPModule"]), "FSDPModule")
                break
            except Exception:  # pylint: disable=broad-except
                continue
        _CLASSES = (dtensor, shard, fsdp)
    return _CLASSES


# --- what make_private is given -------------------------------------------------------

def refuse_fsdp1(module: nn.Module) -> None:
    """UnsupportedModuleError for a model under FSDP1
    (FullyShardedDataParallel): its flat parameters cannot be split back
    into layers. Checked by class name: importing FSDP1 fails on some
    torches."""
    for name, m in module.named_modules():
        fsdp1 = any(c.__name__ == "FullyShardedDataParallel" and
                    c.__module__.startswith("torch.distributed.fsdp") for c in type(m).__mro__)
        flat = [pn for pn, p in m.named_parameters(recurse=False)
                if type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False)]
        if not (fsdp1 or flat):
            continue
        orig = getattr(m, "_use_orig_params", None)
        why = ("with use_orig_params=True each parameter is a flattened slice of a flat "
               "parameter, not the layer's tensor" if orig else
               "its flat parameters (use_orig_params=False) hold the weights of many modules "
               "in one flattened tensor, so no layer's gradient can be written alone")
        raise UnsupportedModuleError(
            "module %s (%s) is under FSDP1 (FullyShardedDataParallel): %s; shard the model "
            "with FSDP2 instead: torch.distributed.fsdp.fully_shard (torch >= 2.4), on each "
            "block and then on the root, before make_private"
            % (name or "<root>", type(m).__name__, why))


def is_fsdp2(module: nn.Module) -> bool:
    """Whether fully_shard was applied to the module or one of its
    submodules."""
    fsdp = _classes()[2]
    return fsdp is not None and any(isinstance(m, fsdp) for m in module.modules())


def check_unwrapped(layers: Sequence[_Layer]) -> None:
    """At the first step: a module whose weight is no longer the parameter
    make_private saw was wrapped afterwards (fully_shard replaces each
    parameter by its sharded DTensor), so param.grad would go to a
    parameter the optimizer does not hold."""
    for l in layers:
        if not any(p is l.weight for p in l.module.parameters(recurse=False)):
            raise RuntimeError(
                "module %s: its weight is no longer the parameter make_private was given "
                "(fully_shard, or another wrapper, replaced it afterwards): apply fully_shard "
                "first (each block, then the root), then build the optimizer over "
                "model.parameters(), then call make_private" % l.name)


def _policies(module: nn.Module) -> Tuple[Optional[torch.dtype], bool]:
    """(the reduce dtype of fully_shard's MixedPrecisionPolicy, None where no
    unit sets one or the units differ; whether a unit offloads to the CPU).
    Read from FSDP2's state (private attributes, since torch 2.4)."""
    fsdp = _classes()[2]
    dtypes, offload = set(), False
    for m in module.modules():
        if not isinstance(m, fsdp):
            continue
        try:
            state = m._get_fsdp_state()  # pylint: disable=protected-access
        except Exception:  # pylint: disable=broad-except
            continue
        # one parameter group per state (_fsdp_param_group) or several (later torches)
        groups = [g for g in (getattr(state, "_fsdp_param_groups", None) or
                              [getattr(state, "_fsdp_param_group", None)]) if g is not None]
        # the groups' policies, or (torch 2.15: the groups hold none) the state's
        for mp in [p for p in (getattr(g, "mp_policy", None) for g in groups) if p is not None] \
                or [getattr(state, "_mp_policy", None)]:
            dtypes.add(getattr(mp, "reduce_dtype", None) or getattr(mp, "param_dtype", None))
        offload |= any(type(getattr(g, "offload_policy", None)).__name__ == "CPUOffloadPolicy"
                       for g in groups)
    return (dtypes.pop() if len(dtypes) == 1 else None), offload


def trace_mark(trace: List[Tuple[str, float, Any]], what: str, cuda: bool) -> None:
    """Appends to trace where a step is: (what, the host's time, on the GPU
    an event recorded on the current stream, else None); bench_fsdp's
    --trace reads them."""
    ev = None
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
    trace.append((what, time.perf_counter(), ev))


def trace_add(trace: Dict[str, List[float]], marks: List[Tuple[str, float, Any]]) -> None:
    """Adds one step's marks (trace_mark's; its stream synchronised) into
    trace: label -> [host ms, GPU ms] from the first mark, summed."""
    _, h0, e0 = marks[0]
    for what, h, ev in marks:
        got = trace.setdefault(what, [0.0, 0.0])
        got[0] += (h - h0) * 1e3
        got[1] += e0.elapsed_time(ev) if ev is not None else 0.0


# --- the engine's sharded steps ---------------------------------------------------------

class Sharded:
    """One engine's sharded data parallelism: the layout, the norm pass and
    its sums (each noising the rows this rank owns), the collectives and
    the gate."""

    def __init__(self, engine: Any, layers: Sequence[_Layer], module: nn.Module, fsdp: bool,
                 distributed: bool, norm_group: Any) -> None:
        dist = torch.distributed
        what = "an FSDP2 (fully_shard) model" if fsdp else "sharded_noise=True"
        if not (distributed and dist.is_available() and dist.is_initialized()):
            raise ValueError("%s needs torch.distributed: call init_process_group first, and "
                             "leave make_private's distributed at None or True" % what)
        if norm_group is not None:
            raise NotImplementedError(
                "norm_group with %s: norm groups do not compose with sharded data parallelism "
                "yet; shard the model with fully_shard alone, or split it with norm groups "
                "over plain data parallelism" % what)
        self.engine = engine
        self.layers = list(layers)
        self.fsdp = fsdp
        self.group: Any = None
        self.dtype = layers[0].weight.dtype
        if fsdp:
            self.group = self._check_dtensors(module)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if fsdp and self.world != dist.get_world_size():
            raise NotImplementedError(
                "fully_shard over %d of the %d ranks (HSDP, or FSDP beside tensor "
                "parallelism): dpclip shards over every rank only, for now"
                % (self.world, dist.get_world_size()))
        self.pieces, self.full_n, self.shard_n = layout(self.layers, self.world, self.rank)
        self._by_out = {id(pc.out): pc for pc in self.pieces}
        self._piece_at = {id(pc.out): i for i, pc in enumerate(self.pieces)}
        # outputs the daemon writes transposed ([out, in] of a weight kept
        # [in, out]): this rank's rows of the parameter are columns there
        self._cols: set = set()
        self._buckets = buckets(self.pieces, bucket_size(self.world), self._spans())
        # each bucket's sums, in elements, and the largest: what one slot holds
        self.widths = [end - base for base, end, _, _ in
                       (self._span(f, l) for f, l in self._buckets)]
        self.widest = max(self.widths, default=0)
        self.sums_steps = 0  # the last step's sums steps run (one per bucket)
        if fsdp:
            self._check_rows()
        self._clip: Optional[_lib.Step] = None  # the norm pass, then each bucket's sums
        self._rs_native = True  # reduce_scatter_tensor works on this backend (probed at open)
        self.gate = _gate.Gate(self.world, self.group,
                               lacks="a shard could lack its owner's noise or a rank's samples")
        self._events: List[Tuple[Any, Any]] = []  # CUDA: each reduce-scatter's start/end
        self.timing: Dict[str, float] = {}
        self.trace: Optional[List[Tuple[str, float, Any]]] = None  # _mark's
        # pieces the daemon writes in another layout than their parameter's
        self._relaid = [i for i, pc in enumerate(self.pieces) if _relaid(pc)]
        self._zeros: Optional[torch.Tensor] = None  # _gap's
        # (device, {dtype: [shard_n] buffer}, each piece's DTensor gradient): _hold's
        self._held: Optional[Tuple[torch.device, Dict[torch.dtype, torch.Tensor], List[Any]]] = None

    def _check_dtensors(self, module: nn.Module) -> Any:
        """FSDP2: every private parameter a DTensor sharded on dim 0 over one
        1-D mesh; the reduce dtype; no CPU offload. Returns the mesh's
        process group."""
        dtensor, shard, _ = _classes()
        reduce_dtype, offload = _policies(module)
        if offload:
            raise NotImplementedError(
                "fully_shard with offload_policy=CPUOffloadPolicy(): dpclip writes the sharded "
                "gradients on the device the layers compute on; leave the parameters there")
        mesh = None
        for l in self.layers:
            for p in (l.weight, l.bias):
                if p is None:
                    continue
                if not isinstance(p, dtensor):
                    raise ValueError(
                        "module %s: its parameters are not sharded by fully_shard, while other "
                        "modules' are: apply fully_shard to the root module too (after the "
                        "blocks), so that every parameter is sharded" % l.name)
                m = p.device_mesh
                if m.ndim != 1 or tuple(p.placements) != (shard(0),):
                    raise NotImplementedError(
                        "module %s: a parameter placed %s over a %d-dimensional mesh; dpclip "
                        "takes fully_shard's default placement only (Shard(0) over a 1-D "
                        "mesh: no HSDP, no shard_placement_fn)"
                        % (l.name, tuple(p.placements), m.ndim))
                if mesh is None:
                    mesh = m
                elif m != mesh:
                    raise NotImplementedError(
                        "module %s: its parameters are sharded over another mesh than the "
                        "others'; dpclip takes one mesh per model" % l.name)
        # Low-precision reduction as FSDP's (bf16 sums, cast up per shard);
        # parameters of another dtype than f32 reduce in their own.
        self.dtype = reduce_dtype if reduce_dtype in _ESIZE else self.layers[0].weight.dtype
        return mesh.get_group()

    def _check_rows(self) -> None:
        for pc in self.pieces:
            local = pc.param.to_local()
            if tuple(local.shape) != (pc.mine,) + pc.shape[1:]:
                raise NotImplementedError(
                    "a parameter of shape %s holds local shape %s on rank %d; dpclip expects "
                    "fully_shard's dim-0 chunks (%d rows here)"
                    % (pc.shape, tuple(local.shape), self.rank, pc.mine))

    # -- setup --------------------------------------------------------------------------
    def open(self, socket_path: Optional[str], client_name: str, job_id: str, cfg: Any,
             target_delta: float, target_epsilon: float, device: torch.device) -> None:
        """The step of the engine's session that runs each norm pass and
        its sums (cfg: the engine's terms, at its sigma; with more than one
        rank, this rank's member of the job's logical steps), each output's
        layout for its noise ranges, and the backend's reduce-scatter
        (probed: every rank sees the same answer). socket_path, client_name
        and job_id: the engine's session has them."""
        dist = torch.distributed
        sigma = self.engine.noise_multiplier
        if cfg.reduction == _lib.MEAN and cfg.expected_batch_size <= 0:
            raise ValueError("sharded data parallelism with a mean loss needs "
                             "expected_batch_size: each rank's sums divide the noise of the "
                             "rows it owns by it")
        if sigma > 0:
            self._cols = {id(pc.out) for pc in self.pieces if _transposed(pc)}
        self._clip = _lib.Step(1, cfg.max_grad_norm, cfg.reduction, cfg.expected_batch_size,
                               sigma, sample_rate=cfg.sample_rate, target_delta=target_delta,
                               target_epsilon=target_epsilon)
        if sigma > 0 and self.world > 1:
            # one logical step of W members, one per rank's norm pass,
            # charged once; each pass's sums noise its rows
            self._clip.set_data_parallel(self.world, self.rank, sigma)
        probe = torch.zeros(self.world, dtype=self.dtype, device=device)
        try:
            dist.reduce_scatter_tensor(torch.zeros_like(probe[:1]), probe, group=self.group)
        except (RuntimeError, AttributeError, ValueError):
            self._rs_native = False  # raised before any traffic, alike on every rank

    def close(self) -> None:
        if self._clip is not None:
            self._clip.close()
        self._clip = None

    def _spans(self) -> List[Tuple[int, int]]:
        """[lo, hi] piece ranges each layer writes (its weight and bias,
        and a tied weight's other use): what a bucket must not cut."""
        at = {id(pc.out): i for i, pc in enumerate(self.pieces)}
        spans = []
        for l in self.layers:
            idx = [at[id(o)] for o in l.outs if id(o) in at]
            if len(idx) > 1:
                spans.append((min(idx), max(idx)))
        return spans

    def refuse_logical_batches(self) -> None:
        """engine.logical_batches under fully_shard: each rank splits its
        own Poisson batch, so the ranks' counts of forwards may differ,
        which fully_shard's all-gathers cannot pair (a hang)."""
        if self.fsdp:
            raise NotImplementedError(
                "engine.logical_batches with fully_shard: each rank splits its own Poisson "
                "batch by its size, so ranks could run different numbers of forward passes, "
                "which fully_shard's all-gathers pair; split each rank's logical batch into "
                "the same number of micro-batches on every rank (any sizes), backward on each, "
                "then optimizer.step() once")

    # -- the step -------------------------------------------------------------------------
    def micro(self, plan: _planner.Plan, B: int, logical_id: int, index: int
              ) -> _lib.StepResult:
        """Micro-batch `index` of logical step `logical_id`, not its commit:
        its norm pass and every bucket's sums step, accumulated by the
        daemon, nothing written, no collective. Raises its error (the daemon
        aborted the logical step: nothing released, nothing charged)."""
        device = self.layers[0].weight.device
        io = self.engine._io(device).phases(  # pylint: disable=W0212
            self, plan, max(B, 1), device, True)
        self._clip.set_logical(logical_id, index, False)
        err: Optional[BaseException] = None
        try:
            res = io.norms()
            for k in range(len(self._buckets)):
                try:
                    io.sums(k, *self._bucket_step(plan, k))
                except Exception as exc:  # pylint: disable=broad-except
                    err = err or exc  # the rest still sent (the module's docstring)
            if err is not None:
                raise err
            return res
        except _lib.DpclipError as x:
            raise _lib.DpclipError(x.code, x.field, "micro-batch %d of logical step %d (%d "
                                   "samples) failed, so the logical step was dropped: nothing "
                                   "released, nothing charged: %s" % (index, logical_id, B,
                                                                      x.message)) from None
        finally:
            self._clip.set_logical(0)
            io.close()

    def micro_submit(self, plan: _planner.Plan, B: int, logical_id: int, index: int
                     ) -> Tuple[Any, List[int], Optional[BaseException]]:
        """micro() sent without waiting: (what holds what its steps name
        until release(): the GPU's tensors, the host's staging arena; their
        tickets, the pass's first; the first error of a sums step not
        sent). The trainer goes on to the next micro-batch while the daemon
        works (dpclip._accumulate collects the replies)."""
        device = self.layers[0].weight.device
        io = self.engine._io(device).phases(  # pylint: disable=W0212
            self, plan, max(B, 1), device, True)
        buckets = [self._bucket_step(plan, k)[:2] for k in range(len(self._buckets))]
        self._clip.set_logical(logical_id, index, False)
        try:
            tickets, err = io.submit(buckets)
        except BaseException:
            io.release(None, device)  # nothing in flight: its `ready` back
            io.close()
            raise
        finally:
            self._clip.set_logical(0)
        return io, tickets, err

    def slot_sizes(self, n: int) -> List[int]:
        """Elements of each of n slots taking bucket k in slot k % n: the
        widest of its buckets (with no more buckets than slots, each its
        own: together the whole local sum, not n of the widest)."""
        return [max(self.widths[i::n], default=0) for i in range(n)]

    def _span(self, first: int, last: int) -> Tuple[int, int, int, int]:
        """(base, end) of pieces [first, last) in the sums, and (s0, s1) in
        this rank's shards, in elements."""
        lp = self.pieces[last - 1]
        return (self.pieces[first].full_off, lp.full_off + _al(self.world * lp.chunk * lp.inner),
                self.pieces[first].shard_off, lp.shard_off + _al(lp.chunk * lp.inner))

    def step(self, acc: Any) -> None:
        """One optimizer step (see the module's docstring): the commit of
        acc's logical step (dpclip._accumulate.Accumulator) after its other
        micro-batches; raises on every rank where any rank's step failed,
        after zeroing the gradients."""
        e = self.engine
        device = self.layers[0].weight.device
        cuda = device.type == "cuda"
        failed: Optional[BaseException] = None
        res, B, plan, io, commit, pending = None, 0, None, None, None, None
        t0 = time.perf_counter()
        try:
            # the logical step's micro-batches not sent yet but the last,
            # accumulated in the daemon; the last is the commit (None: a
            # step of one micro-batch, a whole step)
            commit = acc.sharded_commit()
            B, plan = e._planned()  # pylint: disable=protected-access
            if plan is None:
                plan = e._plan(B)  # pylint: disable=protected-access
            io = e._io(device).phases(self, plan, max(B, 1), device)  # pylint: disable=W0212
            if commit is not None:
                self._clip.set_logical(*commit, True)
            pending = io.norms_submit()
        except Exception as exc:  # pylint: disable=broad-except
            failed = exc  # this rank still joins every collective, with zeros
        self._mark("pass sent")
        try:
            shards, failed, res, t1 = self._sums_and_scatter(
                plan, io if failed is None else None, device, cuda, failed, commit is not None,
                pending)
        finally:
            self._clip.set_logical(0)
            if io is not None:
                io.close()
        got = self._grads_from(shards)  # queued before the gate's wait
        self._mark("sums scattered")
        applied = self.gate.agree(failed is None, device)  # CUDA: waits for the collectives
        t3 = time.perf_counter()
        self._mark("gate")
        self._write(got, applied, device)
        self._mark("written")
        # noise_ms: none apart (the sums steps add it); kept for the bench
        self.timing = {"clip_ms": (t1 - t0) * 1e3, "noise_ms": 0.0,
                       "sums_and_reduce_scatter_ms": (t3 - t1) * 1e3,
                       "reduce_scatter_ms": (t3 - t1) * 1e3,
                       "write_ms": (time.perf_counter() - t3) * 1e3}
        if io is not None:
            self.timing.update({"daemon_%s_ms" % k: v for k, v in io.daemon_ms.items()})
        if failed is not None:
            raise failed
        acc.open = False  # committed (else it may be open: the next step opens another)
        if not applied:
            raise self.gate.not_applied(e.steps + 1)
        # the job's spend with this step: the norm pass's (charged or covered),
        # with the logical step's other micro-batches' norms
        e._finish(res, B, acc.results)  # pylint: disable=protected-access

    def reduce_scatter_ms(self) -> float:
        """The last step's reduce-scatters on the device (CUDA; synchronizes),
        else the wall time of its sums and reduce-scatters."""
        if not self._events:
            return self.timing.get("reduce_scatter_ms", 0.0)
        self._events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._events)

    def _sums_and_scatter(self, plan: Optional[_planner.Plan], io: Any, device: torch.device,
                          cuda: bool, failed: Optional[BaseException], logical: bool,
                          pending: Any) -> Tuple[torch.Tensor, Optional[BaseException], Any,
                                                 float]:
        """This rank's shards of the sums over every rank: [shard_n], each
        piece's padded [chunk, ...] at its shard offset. Bucket by bucket
        (a layer group of about bucket_size() elements per rank): the daemon's
        sums step of the parts writing the bucket's pieces, into a slot of
        the bucket's size; its regions copied rank-major into a staging
        buffer; one collective. So no more than two buckets' full sums
        exist at once, as FSDP holds one layer group's gradient. Without io
        (this rank failed) and after a failure, zeros: every rank runs every
        collective. Backends without reduce-scatter all-reduce the bucket
        and keep this rank's row: the same result. The commit of a logical
        step (logical) sends every sums step after a failure too (its pass
        summed whole: see the module's docstring), staging zeros.

        pending: the norm pass, sent (Phases.norms_submit); its reply is
        awaited once bucket 0's sums step is sent too, so that the daemon
        goes from the norms to the sums without a round trip to the
        trainer. Returns (shards, the first failure, the pass's result,
        when its reply came)."""
        dist = torch.distributed
        shards = self._shards_out(device)
        self._events = []
        self.sums_steps = 0
        sent: Dict[int, Any] = {}  # bucket -> its sums step, sent and not answered

        def send(k: int, failed: Optional[BaseException]) -> Optional[BaseException]:
            """Bucket k's sums step, sent without waiting where io can (the
            daemon works on it while the trainer copies out and
            reduce-scatters bucket k - 1); the first failure."""
            if io is None or k >= len(self._buckets) or not (failed is None or logical):
                return failed
            try:
                sent[k] = io.sums_submit(k, *self._bucket_step(plan, k))
            except Exception as exc:  # pylint: disable=broad-except
                failed = failed or exc
            return failed

        failed = send(0, failed)
        res = None
        if io is not None:
            try:
                res = io.norms_wait(pending)
            except Exception as exc:  # pylint: disable=broad-except
                failed = failed or exc
        t1 = time.perf_counter()
        self._mark("pass answered")
        for k, (first, last) in enumerate(self._buckets):
            base, end, s0, s1 = self._span(first, last)
            full = None
            failed = send(k + 1, failed)
            if k in sent:
                try:
                    got = io.sums_wait(k, sent.pop(k))
                    self.sums_steps += 1
                    if failed is None:  # else sent for the pass alone; zeros staged
                        self._to_param_layout(got, first, last, base)
                        full = got
                except Exception as exc:  # pylint: disable=broad-except
                    failed = failed or exc
            stage = torch.empty((self.world, s1 - s0), dtype=self.dtype, device=device)
            if full is None:
                stage.zero_()
            else:
                self._stage(full, stage, first, last, base, s0)
            if io is not None:
                io.copied(k)  # the slot may be written again
            del full
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            if self._rs_native:
                dist.reduce_scatter_tensor(shards[s0:s1], stage.view(-1), group=self.group)
            else:
                dist.all_reduce(stage, group=self.group)
                shards[s0:s1].copy_(stage[self.rank])
            if cuda:
                ev[1].record()
                self._events.append(ev)
            del stage
        if io is not None:
            try:
                io.sums_done()  # the replies the loop left at their notices
            except Exception as exc:  # pylint: disable=broad-except
                failed = failed or exc
        return shards, failed, res, t1

    def _stage(self, full: torch.Tensor, stage: torch.Tensor, first: int, last: int, base: int,
               s0: int) -> None:
        """Bucket [first, last)'s sums (full, from element base of the
        layout: each piece's [world, chunk * inner] region) rank-major into
        stage ([world, its shards' span], s0 the first): each rank's chunks
        side by side, in one concatenation (a few kernels, not a copy per
        piece: the host launching 150 of them left the GPU idle), the
        alignment gaps zeros."""
        parts, at = [], s0
        for pc in self.pieces[first:last]:
            if pc.shard_off > at:
                parts.append(self._gap(pc.shard_off - at, full))
            n = pc.chunk * pc.inner
            f = pc.full_off - base
            parts.append(full[f:f + self.world * n].view(self.world, n))
            at = pc.shard_off + n
        end = s0 + stage.shape[1]
        if end > at:
            parts.append(self._gap(end - at, full))
        torch.cat(parts, dim=1, out=stage)

    def _gap(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """[world, n] zeros (n below the alignment), for _stage."""
        z = self._zeros
        if z is None or z.device != like.device or z.dtype != like.dtype:
            z = self._zeros = torch.zeros((self.world, _EALIGN), dtype=like.dtype,
                                          device=like.device)
        return z[:, :n]

    def _mark(self, what: str) -> None:
        """Where the step is, for bench_fsdp's --trace (self.trace a list,
        else None): trace_mark's."""
        if self.trace is not None:
            trace_mark(self.trace, what, self.layers[0].weight.device.type == "cuda")

    def _bucket_step(self, plan: _planner.Plan, k: int) -> Tuple[List[int], int, int]:
        """Bucket k's sums step: (the parts it names, its first element in
        the layout, its elements)."""
        first, last = self._buckets[k]
        base, end = self._span(first, last)[:2]
        return self._bucket_parts(plan, self._piece_at, first, last), base, end - base

    @staticmethod
    def _bucket_parts(plan: _planner.Plan, by_out: Dict[int, int], first: int,
                      last: int) -> List[int]:
        """The parts a bucket's sums step names, in the plan's order: those
        writing its pieces [first, last), and the other use of a tied weight
        among them (its later use writes nothing itself: the owner's output
        holds both)."""
        which = {i for i, pt in enumerate(plan.parts)
                 if any(sl is not None and first <= by_out[id(sl[0])] < last
                        for sl in (pt.w, pt.b))}
        for i, pt in enumerate(plan.parts):
            if pt.tied_to and (i in which or pt.tied_to - 1 in which):
                which |= {i, pt.tied_to - 1}
        return sorted(which)

    def _set_ranges(self, st: _lib.Step, plan: _planner.Plan, which: Sequence[int]) -> None:
        """With noise, each output of a sums step (of the parts `which`,
        added in that order) names the part of it this rank owns: the
        daemon noises that part alone, once, at the pass's sigma."""
        if self.engine.noise_multiplier <= 0:
            return
        for k, i in enumerate(which):
            pt = plan.parts[i]
            for o, sl in ((0, pt.w), (1, pt.b)):
                if sl is not None:
                    st.set_noise_range(k, o, *self._noise_range(sl))

    def _noise_range(self, sl: Slice) -> Tuple[int, int, int]:
        """(dim, begin, end) of the daemon's output for slice sl that
        holds this rank's rows [rank * chunk, rank * chunk + mine) of its
        parameter: where the parameter's layout is the output's, the rows
        of the slice that lie in them (a slice is a run of whole rows: an
        attention's q, k or v part, a per-sample part's [n, 1]); for a
        weight kept [in, out] and written [out, in], those columns."""
        o, off, shape = sl
        pc = self._by_out[id(o)]
        r0 = min(self.rank * pc.chunk, pc.shape[0])
        r1 = r0 + pc.mine
        if id(o) in self._cols:
            return 1, r0, r1
        n, inner = math.prod(shape), math.prod(shape[1:])
        lo = min(max(r0 * pc.inner - off, 0), n)
        hi = min(max(r1 * pc.inner - off, 0), n)
        if hi <= lo:
            return 0, 0, 0
        if lo % inner or hi % inner:
            raise NotImplementedError(
                "a parameter of shape %s is written in parts of shape %s at element %d, which "
                "do not split along its rows: the daemon cannot noise only this rank's rows "
                "[%d, %d)" % (pc.shape, shape, off, r0, r1))
        return 0, lo // inner, hi // inner

    def _out_refs(self, ref: Any, base: int) -> Any:
        """outs(part) -> (weight out ref, bias out ref) of a part, where
        ref(element offset, shape) names a place in a bucket's sums starting
        at element base of the layout: each slice at its offset in its
        parameter's region."""
        def one(sl: Optional[Slice]) -> _lib.Tensor:
            if sl is None:
                return _lib.Tensor()
            o, off, shape = sl
            return ref(self._by_out[id(o)].full_off - base + off, shape)

        def outs(pt: Part) -> Tuple[_lib.Tensor, _lib.Tensor]:
            return one(pt.w), one(pt.b)
        return outs

    def _to_param_layout(self, full: torch.Tensor, first: int, last: int, base: int) -> None:
        """Rewrites, in place, each region of pieces [first, last) the daemon
        wrote in another layout than its parameter's (a weight kept as
        [in, out], such as transformers' Conv1D, is written [out, in]) in
        the parameter's, so that its dim-0 rows are the ones fully_shard
        shards. full: the bucket's sums, from element base."""
        for i in self._relaid:
            if not first <= i < last:
                continue
            pc = self.pieces[i]
            n = math.prod(pc.shape)
            flat = full[pc.full_off - base:pc.full_off - base + n]
            flat.copy_(pc.out.grad(flat).contiguous().reshape(-1))

    # -- param.grad -------------------------------------------------------------------------------
    def _shards_out(self, device: torch.device) -> torch.Tensor:
        """Where the reduce-scatters write this rank's shards: under FSDP2,
        where every parameter has the sums' dtype, the gradients' buffer
        itself (_hold; written before the gate as the copy into it was: a
        step not applied zeroes it), sparing a copy of the shards; else a
        new tensor."""
        if self.fsdp:
            bufs = self._hold(device)
            if list(bufs) == [self.dtype]:
                return bufs[self.dtype]
        return torch.empty(self.shard_n, dtype=self.dtype, device=device)

    def _grads_from(self, shards: torch.Tensor) -> Any:
        """Under FSDP2, the shards copied into the gradients' buffers (one
        per parameter dtype, kept from step to step: _hold; none where the
        reduce-scatters wrote the buffer: _shards_out), queued before the
        gate so that its wait covers them; else the shards in f32."""
        if not self.fsdp:
            return shards.to(torch.float32)
        bufs = self._hold(shards.device)
        for b in bufs.values():
            if b.data_ptr() != shards.data_ptr():
                b.copy_(shards)
        return bufs

    def _hold(self, device: torch.device) -> Dict[torch.dtype, torch.Tensor]:
        """The gradients' buffers ([shard_n] per parameter dtype) on
        `device`, with each parameter's sharded DTensor gradient over its
        rows of them, built once per device: DTensor.from_local per
        parameter and step cost the host ~60 us each (9 ms for a 1B model's
        150), with the GPU idle behind the gate's wait."""
        if self._held is not None and self._held[0] == device:
            return self._held[1]
        dtensor = _classes()[0]
        bufs: Dict[torch.dtype, torch.Tensor] = {}
        grads = []
        for pc in self.pieces:
            p = pc.param
            if p.dtype not in bufs:
                bufs[p.dtype] = torch.empty(self.shard_n, dtype=p.dtype, device=device)
            local = bufs[p.dtype][pc.shard_off:pc.shard_off + pc.mine * pc.inner]
            local = local.view((pc.mine,) + pc.shape[1:])
            grads.append(dtensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride()))
        self._held = (device, bufs, grads)
        return bufs

    def _write(self, got: Any, applied: bool, device: torch.device) -> None:
        """param.grad from this rank's shards of the noised sums, as the
        daemon wrote them and the reduce-scatter summed them (nothing is
        added here; got: _grads_from's), or zeros where not applied (on no
        rank). Under FSDP2 each parameter's gradient is the same DTensor
        every step, over its rows of the buffers (as DDP's gradients are
        views of its buckets): each step writes it again."""
        dist = torch.distributed
        if self.fsdp:
            if not applied:
                for b in got.values():
                    b.zero_()
            for pc, g in zip(self.pieces, self._held[2]):
                pc.param.grad = g
            return
        if not applied:
            got = torch.zeros(self.shard_n, dtype=torch.float32, device=device)
        every = [torch.empty_like(got) for _ in range(self.world)]
        dist.all_gather(every, got, group=self.group)
        for pc in self.pieces:
            n = pc.chunk * pc.inner
            whole = torch.cat([t[pc.shard_off:pc.shard_off + n] for t in every])
            _planner.set_grad(pc.param, whole[:math.prod(pc.shape)].view(pc.shape))
