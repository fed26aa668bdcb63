"""Sharded data parallelism in the PyTorch integration: models under FSDP2
(torch.distributed.fsdp.fully_shard), and plain models with
make_private(sharded_noise=True), which run the same steps.

Each optimizer step, on every rank:
  1. the clipping step: one ClipStep of the engine's session names every
     layer (flat clipping needs each sample's whole norm), sigma 0; the
     daemon writes the clipped sum of this rank's samples into one buffer
     in the reduce dtype, each parameter in a padded region of world *
     chunk rows (chunk = ceil(rows / world): fully_shard's dim-0 chunks);
  2. the noise step: a second session of the engine (same job) draws
     N(0, (sigma*C)^2) (divided by the expected batch size for a mean loss)
     for exactly the rows this rank owns: a one-sample step of zeros whose
     output is as long as this rank's shards. Each coordinate is noised
     once, by its owner, at the full sigma*C; no rank is special. It comes
     before the collectives, which it does not need: on a GPU the daemon's
     work must never wait for a collective that waits for another rank's
     daemon work queued behind it;
  3. the reduce-scatter: the trainer's process group (the FSDP mesh's)
     reduce-scatters the parameters' regions, in buckets of about 16M
     elements per rank (each staged rank-major, one collective each), so
     that each rank holds the sum over every rank's samples of the rows it
     owns, and no more;
  4. the gate: a flag (1: this rank's clipping and noise steps both
     succeeded) is all-reduced (MIN). Unless every rank's is 1, every rank
     writes zero gradients and raises: a shard missing its owner's noise,
     or a sum missing a rank's samples, is never applied;
  5. param.grad, the shards plus their noise: under FSDP2 the sharded
     DTensor fully_shard expects (this rank's rows, in the parameter's
     dtype); with sharded_noise the noised shards are all-gathered, so that
     every rank holds the whole gradient.

Accounting: the ranks' noise sessions form a GROUP_WISE dpclip norm group,
whose rank 0 the ledger charges once per group step (its members' steps are
the same logical step; they clip zeros, so the group's C / sqrt(size) never
matters and the noise stays sigma*C). The clipping steps carry sigma 0 in
the same job: data-parallel shares, charged nothing.

Who reduce-scatters: the trainer's process group, after the daemon wrote the
local sum. It is the group FSDP itself reduce-scatters over (NCCL on GPUs,
with its topology, streams and timeouts), it exists wherever fully_shard
runs, and it needs no second communicator: the daemons' NCCL (ClipStep
writing straight into each rank's shard) would need one per data-parallel
job, bootstrapped through the trainers anyway, and the daemon has none for
data parallelism yet. Backends without reduce-scatter (gloo in older
torches) all-reduce the sums and keep their rows: the same result.

Memory: the local clipped sum of every parameter exists at once, for the
step: one ClipStep writes every layer, as the ledger takes one sigma-0
share per rank and logical step (more would be charged as steps without
noise). FSDP itself holds one layer group's at a time; splitting the step
by layer group needs the daemon to write a step's outputs group by group
under one norm pass and one charge."""
import math
import secrets
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import _lib, _planner
from ._cuda import CudaIPC
from ._host import HostArena
from ._layers import _ESIZE, Out, Part, Slice, UnsupportedModuleError, _align, _Layer, _tref

__all__ = ["Sharded", "refuse_fsdp1", "is_fsdp2", "check_unwrapped"]

_EALIGN = 32  # element alignment of each region (64 bytes and more)
# elements per rank in one reduce-scatter bucket (64 MiB of bf16 staging on
# each of 2 ranks): few collectives, bounded extra memory
_BUCKET = 1 << 24
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
        for mp in [getattr(g, "mp_policy", None) for g in groups] or \
                [getattr(state, "_mp_policy", None)]:
            dtypes.add(getattr(mp, "reduce_dtype", None) or getattr(mp, "param_dtype", None))
        offload |= any(type(getattr(g, "offload_policy", None)).__name__ == "CPUOffloadPolicy"
                       for g in groups)
    return (dtypes.pop() if len(dtypes) == 1 else None), offload


# --- the layout ---------------------------------------------------------------------

class Piece(NamedTuple):
    """One parameter in the sharded layout: its whole shape, the elements
    of one dim-0 row, the rows of each rank's padded shard (chunk), the
    rows this rank owns (mine: chunk or fewer, maybe 0), and the element
    offsets of its padded [world * chunk, ...] region in the sums and of
    its [chunk, ...] shard in this rank's shards."""
    param: torch.Tensor
    out: Out
    shape: Tuple[int, ...]
    inner: int
    chunk: int
    mine: int
    full_off: int
    shard_off: int


def _al(n: int) -> int:
    return (n + _EALIGN - 1) // _EALIGN * _EALIGN


def layout(layers: Sequence[_Layer], world: int, rank: int
           ) -> Tuple[List[Piece], int, int]:
    """The pieces of the layers' outputs (one per trainable parameter, a
    tied weight once, in the layers' order), the sums' length and this
    rank's shards' length, in elements. Rank r owns rows [r * chunk,
    (r + 1) * chunk) of each parameter (those that exist): torch.chunk's
    split, which fully_shard uses."""
    pieces, full, shard = [], 0, 0
    for o in _planner.outputs(layers):
        p = o.param
        shape = tuple(p.shape)
        rows = shape[0]
        inner = math.prod(shape[1:])
        chunk = -(-rows // world)
        mine = max(0, min(chunk, rows - rank * chunk))
        pieces.append(Piece(p, o, shape, inner, chunk, mine, full, shard))
        full += _al(world * chunk * inner)
        shard += _al(chunk * inner)
    return pieces, full, shard


def buckets(pieces: Sequence[Piece], per_rank: int) -> List[Tuple[int, int]]:
    """[first, last) ranges of consecutive pieces whose shards span about
    per_rank elements (a larger piece alone): one collective each."""
    out, first, width = [], 0, 0
    for i, pc in enumerate(pieces):
        w = _al(pc.chunk * pc.inner)
        if i > first and width + w > per_rank:
            out.append((first, i))
            first, width = i, 0
        width += w
    if first < len(pieces):
        out.append((first, len(pieces)))
    return out


def _noise_shape(n: int) -> Tuple[int, int]:
    """(p, d) of the Linear whose [p, d] weight gradient holds n noise
    values: near square, so its zero inputs are small."""
    d = max(1, math.isqrt(max(n - 1, 0)) + 1)
    return -(-n // d), d


# --- the engine's sharded steps ---------------------------------------------------------

class Sharded:
    """One engine's sharded data parallelism: the layout, the noise session
    and its norm group, the two steps, the collectives and the gate."""

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
        get = getattr(dist, "get_global_rank", None) or \
            dist.distributed_c10d._get_global_rank  # pylint: disable=protected-access
        self._global = [k if self.group is None else int(get(self.group, k))
                        for k in range(self.world)]
        self.pieces, self.full_n, self.shard_n = layout(self.layers, self.world, self.rank)
        self._buckets = buckets(self.pieces, _BUCKET)
        if fsdp:
            self._check_rows()
        self.client: Optional[_lib.Client] = None  # the noise session
        self._host: Optional[HostArena] = None
        self._cuda: Optional[CudaIPC] = None
        self._clip: Optional[_lib.Step] = None
        self._noise: Optional[_lib.Step] = None
        self._rs_native = True  # reduce_scatter_tensor works on this backend (probed at open)
        self._events: Optional[Tuple[Any, Any]] = None  # CUDA: the reduce-scatter's start/end
        self.timing: Dict[str, float] = {}

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
        """The noise session under job_id (every rank's, already agreed), its
        norm group (named by rank 0), the steps (cfg: the engine's; every
        rank's noise step has the full sigma), and the backend's
        reduce-scatter (probed: every rank sees the same answer)."""
        dist = torch.distributed
        if cfg.reduction == _lib.MEAN and cfg.expected_batch_size <= 0:
            raise ValueError("sharded data parallelism with a mean loss needs "
                             "expected_batch_size: each rank's noise step divides its shard's "
                             "noise by it")
        box = ["dpclip-noise-" + secrets.token_hex(8)]
        dist.broadcast_object_list(box, src=self._global[0], group=self.group)
        self.client = _lib.Client(socket_path, client_name=client_name + "-noise", job_id=job_id)
        self.client.join_group(box[0], self.rank, self.world, 0, group_wise=True)
        self._host, self._cuda = HostArena(self.client), CudaIPC(self.client)
        terms = dict(sample_rate=cfg.sample_rate, target_delta=target_delta,
                     target_epsilon=target_epsilon)
        self._clip = _lib.Step(1, cfg.max_grad_norm, cfg.reduction, cfg.expected_batch_size,
                               0.0, **terms)
        self._noise = _lib.Step(1, cfg.max_grad_norm, cfg.reduction, cfg.expected_batch_size,
                                self.engine.noise_multiplier, **terms)
        probe = torch.zeros(self.world, dtype=self.dtype, device=device)
        try:
            dist.reduce_scatter_tensor(torch.zeros_like(probe[:1]), probe, group=self.group)
        except (RuntimeError, AttributeError, ValueError):
            self._rs_native = False  # raised before any traffic, alike on every rank

    def close(self) -> None:
        for s in (self._clip, self._noise):
            if s is not None:
                s.close()
        self._clip = self._noise = None
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- the step -------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step (see the module's docstring); raises on every
        rank where any rank's step failed, after zeroing the gradients."""
        e = self.engine
        dist = torch.distributed
        device = self.layers[0].weight.device
        cuda = device.type == "cuda"
        failed: Optional[BaseException] = None
        res, B, ok = None, 0, None
        t0 = time.perf_counter()
        try:
            passes = {pid for l in self.layers for _, _, pid in l.records}
            if len(passes) > 1:
                raise RuntimeError(
                    "activations from %d forward/backward passes were captured for one "
                    "optimizer step; dpclip takes one pass per step (no gradient "
                    "accumulation): call optimizer.step() after each backward" % len(passes))
            B = _planner.batch_size(self.layers)
            plan = _planner.plan(self.layers, B)
            run = self._clip_cuda if cuda else self._clip_host
            full, res, ok = run(plan, max(B, 1), device)
            self._to_param_layout(full)
        except Exception as exc:  # pylint: disable=broad-except
            failed = exc  # this rank still joins every collective, with zeros
            full = torch.zeros(self.full_n, dtype=self.dtype, device=device)
        t1 = time.perf_counter()
        # the noise before the collectives (see the module's docstring);
        # rank 0's first: the daemon charges the noise group's step to rank
        # 0's and covers the others' only once that one is charged (a rank
        # ahead of it would be charged again), so the others wait for it.
        # The wait is the host's: an NCCL all_reduce returns at once, and
        # a rank's noise step sent ahead of rank 0's would queue in the
        # daemon in front of it, waiting on this rank's stream, which waits
        # in the all_reduce for rank 0's stream, which waits for the daemon
        # (a deadlock on a GPU; the first version had it)
        noise = nres = None
        for turn in (0, 1):
            if turn == 1:
                after_rank0 = torch.zeros(1, device=device)
                dist.all_reduce(after_rank0, group=self.group)
                float(after_rank0)  # the host waits for rank 0's noise step to be sent
            if failed is None and (self.rank == 0) == (turn == 0):
                try:
                    noise, nres, ok_noise = (self._noise_cuda if cuda else self._noise_host)(
                        device)
                    ok = ok * ok_noise
                except Exception as exc:  # pylint: disable=broad-except
                    failed = exc
        if failed is not None:
            ok = torch.zeros(1, device=device)
        t2 = time.perf_counter()
        shards = self._reduce_scatter(full, cuda)
        del full
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        applied = bool(ok[0] > 0)  # CUDA: waits for the steps and the collectives
        t3 = time.perf_counter()
        self._write(shards, noise if applied else None)
        self.timing = {"clip_ms": (t1 - t0) * 1e3, "noise_ms": (t2 - t1) * 1e3,
                       "reduce_scatter_ms": (t3 - t2) * 1e3,
                       "write_ms": (time.perf_counter() - t3) * 1e3}
        if failed is not None:
            raise failed
        if not applied:
            raise _lib.DpclipError(
                _lib.EUNAVAIL, "", "optimizer step %d was applied on no rank: it failed on at "
                "least one of the %d ranks (that rank raises its error), and without every "
                "rank's result a shard could lack its owner's noise or a rank's samples; the "
                "gradients were zeroed" % (e.steps + 1, self.world))
        e._finish(res, B)  # pylint: disable=protected-access
        # the job's spend with this step: the noise step's (rank 0's is charged)
        e.last_epsilon, e.last_delta = nres.epsilon, nres.delta

    def reduce_scatter_ms(self) -> float:
        """The last step's reduce-scatter on the device (CUDA; synchronizes),
        else its wall time."""
        if self._events is None:
            return self.timing.get("reduce_scatter_ms", 0.0)
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1])

    # -- the clipping step ------------------------------------------------------------------
    def _out_refs(self, ref: Any) -> Any:
        """outs(part) -> (weight out ref, bias out ref) of a part, where
        ref(element offset, shape) names a place in the sums: each slice at
        its offset in its parameter's region."""
        by_out = {id(pc.out): pc for pc in self.pieces}

        def one(sl: Optional[Slice]) -> _lib.Tensor:
            if sl is None:
                return _lib.Tensor()
            o, off, shape = sl
            return ref(by_out[id(o)].full_off + off, shape)

        def outs(pt: Part) -> Tuple[_lib.Tensor, _lib.Tensor]:
            return one(pt.w), one(pt.b)
        return outs

    def _to_param_layout(self, full: torch.Tensor) -> None:
        """Rewrites, in place, each region the daemon wrote in another
        layout than its parameter's (a weight kept as [in, out], such as
        transformers' Conv1D, is written [out, in]) in the parameter's, so
        that its dim-0 rows are the ones fully_shard shards."""
        for pc in self.pieces:
            n = math.prod(pc.shape)
            flat = full[pc.full_off:pc.full_off + n]
            g = pc.out.grad(flat)
            if g.data_ptr() != flat.data_ptr() or not g.is_contiguous():
                flat.copy_(g.contiguous().reshape(-1))

    def _clip_host(self, plan: _planner.Plan, nb: int, device: torch.device
                   ) -> Tuple[torch.Tensor, _lib.StepResult, torch.Tensor]:
        """The clipping step through the engine's arena: the sums at its
        start (the reduce-scatter reads them there), then each layer's
        activations and output gradients."""
        e = self.engine
        esz = _ESIZE[self.dtype]
        off = self.full_n * esz
        parts = plan.parts
        slots = []
        for lp in parts:
            a_off = _align(off)
            g_off = _align(a_off + math.prod(lp.in_shape) * _ESIZE[lp.in_dtype])
            off = g_off + math.prod(lp.grad_shape) * _ESIZE[lp.grad_dtype]
            slots.append((a_off, g_off))
        bid, _, mem = e._host.view(off)  # pylint: disable=protected-access

        def view(o: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
            return mem[o:o + math.prod(shape) * _ESIZE[dtype]].view(dtype).view(shape)

        for lp, (a_off, g_off) in zip(parts, slots):
            av, gv = view(a_off, lp.in_dtype, lp.in_shape), view(g_off, lp.grad_dtype,
                                                               lp.grad_shape)
            if lp.inp is None:
                av.zero_()
                gv.zero_()
            else:
                av.copy_(lp.inp)
                gv.copy_(lp.grad)
        outs = self._out_refs(lambda o, shape: _tref(bid, o * esz, self.dtype, shape))

        def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
            lp, (a_off, g_off) = parts[i], slots[i]
            return (_tref(bid, a_off, lp.in_dtype, lp.in_shape),
                    _tref(bid, g_off, lp.grad_dtype, lp.grad_shape)) + outs(lp)

        self._clip.reset(nb)
        _planner.add_layers(self._clip, plan.parts, e.algorithm, refs)
        res = self._clip.run(e.client)
        return mem[:self.full_n * esz].view(self.dtype), res, torch.ones(1)

    def _clip_cuda(self, plan: _planner.Plan, nb: int, device: torch.device
                   ) -> Tuple[torch.Tensor, _lib.StepResult, torch.Tensor]:
        """The clipping step on the GPU: tensors named in place, the sums a
        fresh buffer (freed after the reduce-scatter), ordered by the
        engine's events; its flag is its coefficients' (each > 0 once the
        daemon committed the step, zeros otherwise)."""
        e = self.engine
        io = e._cuda  # pylint: disable=protected-access
        full = torch.empty(self.full_n, dtype=self.dtype, device=device)
        esz = _ESIZE[self.dtype]
        keep = []
        for lp in plan.parts:
            if lp.inp is None:
                inp = torch.zeros(lp.in_shape, dtype=lp.in_dtype, device=device)
                g = torch.zeros(lp.grad_shape, dtype=lp.grad_dtype, device=device)
            else:
                inp = lp.inp.to(lp.in_dtype).contiguous()
                g = lp.grad.to(lp.grad_dtype).contiguous()
            keep.append((inp, g))
        ready, done, rid, did = io.events(device)
        with torch.cuda.device(device):
            fbid, foff = e.client.register_cuda(full.data_ptr())
            outs = self._out_refs(lambda o, shape: _tref(fbid, foff + o * esz, self.dtype, shape))

            def refs(i: int) -> Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]:
                lp = plan.parts[i]
                inp, g = keep[i]
                return (io.ref(inp, lp.in_shape), io.ref(g, lp.grad_shape)) + outs(lp)

            self._clip.reset(nb)
            _planner.add_layers(self._clip, plan.parts, e.algorithm, refs)
            coefs = io.coefs_out(nb, device)
            coefs.zero_()  # stays zero unless the daemon commits the step
            self._clip.set_outputs(coefs_out=io.ref(coefs, (nb,)))
            stream = torch.cuda.current_stream(device)
            ready.record(stream)
            self._clip.set_events(rid, did)
            self._clip.notify_enqueued(False)
            res = self._clip.run(e.client)
            stream.wait_event(done)  # after the daemon's reads of `keep` and writes of `full`
            ok = (coefs > 0).all().to(torch.float32).reshape(1)
        keep.clear()
        return full, res, ok

    # -- the reduce-scatter -------------------------------------------------------------------
    def _reduce_scatter(self, full: torch.Tensor, cuda: bool) -> torch.Tensor:
        """This rank's shards of the sums over every rank: [shard_n], each
        piece's padded [chunk, ...] at its shard offset. In buckets of
        consecutive pieces (about _BUCKET elements per rank): each bucket's
        regions copied rank-major into a staging buffer, then one collective
        per bucket, as FSDP itself does (one reduce-scatter per parameter
        cost a collective's latency each: 150 of them on GPT-2 small).
        Backends without reduce-scatter all-reduce the bucket and keep this
        rank's row: the same result."""
        dist = torch.distributed
        shards = torch.empty(self.shard_n, dtype=self.dtype, device=full.device)
        if cuda:
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        for first, last in self._buckets:
            s0 = self.pieces[first].shard_off
            s1 = self.pieces[last - 1].shard_off + _al(self.pieces[last - 1].chunk *
                                                        self.pieces[last - 1].inner)
            stage = torch.empty((self.world, s1 - s0), dtype=self.dtype, device=full.device)
            for pc in self.pieces[first:last]:
                n = pc.chunk * pc.inner
                o = pc.shard_off - s0
                stage[:, o:o + n].copy_(full[pc.full_off:pc.full_off + self.world * n]
                                        .view(self.world, n))
            if self._rs_native:
                dist.reduce_scatter_tensor(shards[s0:s1], stage.view(-1), group=self.group)
            else:
                dist.all_reduce(stage, group=self.group)
                shards[s0:s1].copy_(stage[self.rank])
            del stage
        if cuda:
            self._events[1].record()
        return shards

    # -- the noise step -------------------------------------------------------------------------
    def _noise_host(self, device: torch.device
                    ) -> Tuple[torch.Tensor, _lib.StepResult, torch.Tensor]:
        """The noise of this rank's shards, [shard_n] f32, from the noise
        session's arena (one Linear of zeros whose [p, d] output holds it),
        the step's result and its flag."""
        p, d = _noise_shape(self.shard_n)
        a_off = _align(p * d * 4)
        g_off = _align(a_off + d * 4)
        bid, _, mem = self._host.view(g_off + p * 4)
        mem[a_off:g_off + p * 4].zero_()
        self._noise.reset(1)
        self._noise.add_linear(_lib.Linear(
            b"noise of rank %d's shards" % self.rank, _tref(bid, a_off, torch.float32, (1, 1, d)),
            _tref(bid, g_off, torch.float32, (1, 1, p)), 0, _lib.ALGO_AUTO,
            _tref(bid, 0, torch.float32, (p, d)), _lib.Tensor(), 0.0))
        res = self._noise.run(self.client)
        return mem[:self.shard_n * 4].view(torch.float32), res, torch.ones(1)

    def _noise_cuda(self, device: torch.device
                    ) -> Tuple[torch.Tensor, _lib.StepResult, torch.Tensor]:
        p, d = _noise_shape(self.shard_n)
        io = self._cuda
        out = torch.empty(p * d, dtype=torch.float32, device=device)
        a = torch.zeros(1, 1, d, dtype=torch.float32, device=device)
        g = torch.zeros(1, 1, p, dtype=torch.float32, device=device)
        ready, done, rid, did = io.events(device)
        with torch.cuda.device(device):
            self._noise.reset(1)
            self._noise.add_linear(_lib.Linear(
                b"noise of rank %d's shards" % self.rank, io.ref(a, (1, 1, d)),
                io.ref(g, (1, 1, p)), 0, _lib.ALGO_AUTO, io.ref(out, (p, d)), _lib.Tensor(), 0.0))
            coefs = io.coefs_out(1, device)
            coefs.zero_()
            self._noise.set_outputs(coefs_out=io.ref(coefs, (1,)))
            stream = torch.cuda.current_stream(device)
            ready.record(stream)
            self._noise.set_events(rid, did)
            self._noise.notify_enqueued(False)
            res = self._noise.run(self.client)
            stream.wait_event(done)
            ok = (coefs > 0).all().to(torch.float32).reshape(1)
        return out[:self.shard_n], res, ok

    # -- param.grad -------------------------------------------------------------------------------
    def _write(self, shards: torch.Tensor, noise: Optional[torch.Tensor]) -> None:
        """param.grad from the noised shards, or zeros where noise is None
        (the step was applied on no rank)."""
        dist = torch.distributed
        if noise is not None:
            noised = shards.to(torch.float32) + noise
        else:
            noised = torch.zeros(self.shard_n, dtype=torch.float32, device=shards.device)
        if self.fsdp:
            dtensor = _classes()[0]
            for pc in self.pieces:
                p = pc.param
                local = noised[pc.shard_off:pc.shard_off + pc.mine * pc.inner]
                local = local.view((pc.mine,) + pc.shape[1:]).to(p.dtype)
                p.grad = dtensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            return
        every = [torch.empty_like(noised) for _ in range(self.world)]
        dist.all_gather(every, noised, group=self.group)
        for pc in self.pieces:
            n = pc.chunk * pc.inner
            whole = torch.cat([t[pc.shard_off:pc.shard_off + n] for t in every])
            _planner.set_grad(pc.param, whole[:math.prod(pc.shape)].view(pc.shape))
