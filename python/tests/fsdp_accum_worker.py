"""The per-rank halves of the sharded gradient-accumulation tests
(test_fsdp_accumulate.py; spawned processes import this module by name, so
it must not be a test module): make_private(sharded_noise=True) on gloo,
and FSDP2 (fully_shard) models on one GPU or on two (rank r on cuda:r), a
logical step in micro-batches (several backwards, one optimizer.step())."""
import math
import os
import warnings

import torch
import torch.distributed as dist

from dpclip import DpclipError, _host, _shards
from dpclip._layers import _ESIZE
from dpclip.torch import PrivacyEngine, reduce_loss
from fsdp_worker import GPT, _error, _init, _params, _shard, _sharded, fsdp2_api
from models import SeqModel, per_sample_losses

# what make_private's steps could run between ranks (FSDP2's own forward
# all-gathers aside: counted only where named)
_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather",
                "all_gather_into_tensor", "broadcast", "barrier", "send", "recv", "isend",
                "irecv")


def count_collectives(names=_COLLECTIVES):
    """Wraps torch.distributed's collectives (dpclip._fsdp looks them up
    there at each call): a dict of calls by name, and 'n' in all."""
    counts = {"n": 0}
    for name in names:
        f = getattr(dist, name, None)
        if f is None:
            continue

        def wrap(*a, _f=f, _name=name, **k):
            counts["n"] += 1
            counts[_name] = counts.get(_name, 0) + 1
            return _f(*a, **k)

        setattr(dist, name, wrap)
    return counts


def logical_step(model, opt, x, y, mine, sizes, counts=None, loss_scale=None, drop=False,
                 before=None):
    """One logical step over this rank's samples `mine`, in micro-batches
    of `sizes` (in order), each loss its micro-batch's own mean (times
    loss_scale(i) for micro-batch i; before(i) is called before its
    forward); then optimizer.step() (drop: zero_grad() instead, which drops
    it). Returns the collectives run before step() and in all (with
    counts)."""
    assert sum(sizes) == len(mine), (sizes, len(mine))
    opt.zero_grad()
    c0 = counts["n"] if counts else 0
    at = 0
    for i, n in enumerate(sizes):
        idx = mine[at:at + n]
        at += n
        if before is not None:
            before(i)
        loss = reduce_loss(per_sample_losses("seq", model(x[idx]).float(), y[idx]), "mean")
        if loss_scale is not None:
            loss = loss * loss_scale(i)
        loss.backward()
    c1 = counts["n"] if counts else 0
    if drop:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad()
        assert any("dropped it" in str(w.message) for w in caught), caught
    else:
        opt.step()
    return (c1 - c0, (counts["n"] if counts else 0) - c0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def run_accumulate(rank, world, init_file, socket_path, data, C, expected, splits, out_dir):
    """sharded_noise=True at sigma 0 on SeqModel (several reduce-scatter
    buckets), this rank's samples x[rank::world]: (1) one step of them all
    (a whole step, as before); (2) the same as a logical step in
    micro-batches of splits[rank]; (3) again, the micro-batches reversed;
    (4) a logical step dropped by zero_grad() after its micro-batches, then
    (5) the logical step of (2). Saves each step's gradients, its norms
    (the micro-batches', in order) and the collectives run in each."""
    _init("gloo", rank, world, init_file)
    try:
        _shards._BUCKET = 256  # several reduce-scatter buckets
        torch.manual_seed(100 + rank)  # make_private broadcasts rank 0's weights
        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-acc-exact", C, expected)
        x, y = data
        mine = torch.arange(rank, x.shape[0], world)
        counts = count_collectives()
        out = {"grads": [], "norms": [], "before": [], "total": [], "steps": []}
        sizes = splits[rank]
        for run in ([len(mine)], sizes, sizes[::-1], None, sizes):
            drop = run is None
            before, total = logical_step(model, opt, x, y, mine, sizes if drop else run, counts,
                                         drop=drop)
            if drop:
                continue
            out["grads"].append(_grads(model))
            out["norms"].append(engine.last_norms.clone())
            out["before"].append(before)
            out["total"].append(total)
            out["steps"].append(engine.steps)
        out["buckets"] = len(engine.mode.shards._buckets)  # pylint: disable=protected-access
        engine.close()
        torch.save(out, os.path.join(out_dir, "acc%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_accumulate_noise(rank, world, init_file, socket_path, data, C, expected, sigma, q,
                         steps, sizes, out_dir):
    """sharded_noise=True at sigma > 0 on a zero loss: `steps` logical
    steps of micro-batches of `sizes`, so every clipped sum is exactly 0.
    Records the commit's sums outputs (as the daemon wrote them), and how
    many sums steps of the other micro-batches ran (sent without waiting)
    and left their outputs (NaN before) untouched; saves them, this rank's
    pieces, the gradients of each logical step and the epsilon."""
    _init("gloo", rank, world, init_file)
    try:
        _shards._BUCKET = 256
        recorded, scratch = [], [0, 0]  # non-commit sums steps; those that wrote nothing
        sums, submit, release = (_host.HostPhases.sums, _host.HostPhases.submit,
                                 _host.HostPhases.release)

        def slot(io):  # the outputs' slot, at the arena's start
            return io.mem[:io.sh.widest * _ESIZE[io.sh.dtype]].view(io.sh.dtype)

        def record(io, k, which, base, n):
            full = sums(io, k, which, base, n)
            recorded.append((base, full.detach().clone()))
            return full

        def nan_first(io, buckets):
            slot(io).fill_(float("nan"))
            io.n_sums = len(buckets)
            return submit(io, buckets)

        def still_nan(io, run, device):  # every reply in: what the daemon left there
            scratch[0] += io.n_sums
            scratch[1] += io.n_sums * bool(slot(io).isnan().all())
            release(io, run, device)

        _host.HostPhases.sums = record
        _host.HostPhases.submit = nan_first
        _host.HostPhases.release = still_nan
        torch.manual_seed(9)
        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-acc-noise-%d" % world, C,
                                      expected, sigma, sample_rate=q, target_delta=1e-5)
        x, y = data
        mine = torch.arange(rank, x.shape[0], world)
        out = {"grads": [], "recorded": []}
        for _ in range(steps):
            recorded.clear()
            logical_step(model, opt, x, y, mine, sizes, loss_scale=lambda i: 0.0)
            out["grads"].append(_grads(model))
            out["recorded"].append(list(recorded))
        sh = engine.mode.shards
        names = {id(p): n for n, p in model.named_parameters()}
        out["pieces"] = [{"name": names[id(pc.param)], "full_off": pc.full_off,
                          "chunk": pc.chunk, "mine": pc.mine, "shape": pc.shape}
                         for pc in sh.pieces]
        out["scratch"] = scratch
        out["buckets"] = len(sh._buckets)  # pylint: disable=protected-access
        out["epsilon"] = engine.last_epsilon
        out["last_norms"] = engine.last_norms.clone()
        engine.close()
        torch.save(out, os.path.join(out_dir, "accnoise%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_accumulate_failures(rank, world, init_file, socket_path, data, C, expected, sizes,
                            out_dir, asynchronous=False):
    """Six logical steps in micro-batches of `sizes` (3 or more), sigma 0.5,
    lr 0.5; on the last rank: in step 0 micro-batch 1's loss is not finite
    (its norm pass fails in the daemon); in step 2 micro-batch 1, and in
    step 4 the commit, is changed between its norm pass and its sums (the
    daemon's re-measurement refuses the first sums step, mid-pass). Steps
    1, 3 and 5 are clean. Saves each step's error, gradients and the
    parameters after it, and how many passes were changed. asynchronous:
    make_private's (micro-batches sent without waiting: a micro-batch's
    failure is learnt late, and nothing runs between its norm pass and its
    sums, so only the commit can be changed)."""
    _init("gloo", rank, world, init_file)
    try:
        _shards._BUCKET = 256
        torch.manual_seed(5)
        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-acc-fail", C, expected,
                                      0.5, lr=0.5, asynchronous=asynchronous)
        x, y = data
        mine = torch.arange(rank, x.shape[0], world)
        out = {"before": _params(model), "errors": [], "grads": [], "after": []}
        tamper, tampered = [None], []
        orig = _host.HostPhases.norms

        def norms(io):
            res = orig(io)
            if tamper[0] == ("micro" if io.scratch else "commit"):
                # part 0's output gradients doubled after its norm pass
                tampered.append(tamper[0])
                tamper[0] = None
                lp, g_off = io.plan.parts[0], io.slots[0][1]
                n = math.prod(lp.grad_shape) * torch.empty(0, dtype=lp.grad_dtype).element_size()
                io.mem[g_off:g_off + n].view(lp.grad_dtype).mul_(2.0)
            return res

        _host.HostPhases.norms = norms
        last = rank == world - 1
        for i in range(6):
            def before(k, i=i):
                # micro-batch 1 is sent at micro-batch 2's forward; the commit at step()
                if last and i == 2 and k == 2:
                    tamper[0] = "micro"
                if last and i == 4 and k == len(sizes) - 1:
                    tamper[0] = "commit"

            def scale(k, i=i):
                return float("nan") if last and i == 0 and k == 1 else 1.0

            try:
                logical_step(model, opt, x, y, mine, sizes, loss_scale=scale, before=before)
                out["errors"].append(None)
            except DpclipError as e:
                out["errors"].append(_error(e))
            out["grads"].append(_grads(model))
            out["after"].append(_params(model))
        out["tampered"] = tampered
        engine.close()
        torch.save(out, os.path.join(out_dir, "accfail%d%s.pt" % (rank, "a" * asynchronous)))
    finally:
        dist.destroy_process_group()


def run_accumulate_logical_batches(rank, world, init_file, socket_path, data, C, q, steps,
                                   n, out_dir):
    """sharded_noise=True at sigma 0 with engine.logical_batches(loader,
    n) over this rank's DPDataLoader (its own shard and generator): saves,
    per logical step, this rank's sample indices, its micro-batch count
    and the gradient, and the expected batch size."""
    _init("gloo", rank, world, init_file)
    try:
        from torch.utils.data import TensorDataset  # pylint: disable=import-outside-toplevel
        from dpclip.data import DPDataLoader  # pylint: disable=import-outside-toplevel
        x, y = data
        ds = TensorDataset(torch.arange(x.shape[0]), x, y)
        loader = DPDataLoader(ds, q, steps=steps, generator=torch.Generator().manual_seed(
            40 + rank))
        torch.manual_seed(100)
        model = SeqModel()
        engine = PrivacyEngine(socket_path, job_id="fsdp-acc-batches", allow_insecure_seed=True)
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=loader, noise_multiplier=0.0, max_grad_norm=C, sharded_noise=True)
        out = {"idx": [], "micro": [], "grads": [], "E": engine.expected_batch_size}
        idx, micro = [], 0
        with engine.logical_batches(loader, max_physical_batch_size=n) as batches:
            for ib, xb, yb in batches:
                opt.zero_grad()
                idx += ib.tolist()
                micro += 1
                reduce_loss(per_sample_losses("seq", model(xb), yb), "mean").backward()
                before = engine.steps
                opt.step()
                if engine.steps > before:
                    out["idx"].append(idx)
                    out["micro"].append(micro)
                    out["grads"].append(_grads(model))
                    idx, micro = [], 0
        engine.close()
        torch.save(out, os.path.join(out_dir, "accbatches%d.pt" % rank))
    finally:
        dist.destroy_process_group()


# --- FSDP2 on a GPU ----------------------------------------------------------------------

def run_fsdp2_accumulate(rank, world, init_file, socket_path, data, C, expected, seed, splits,
                         out_dir, layout="one_gpu"):
    """Two NCCL ranks, on one GPU (layout "one_gpu": a host id each) or
    rank r on cuda:r ("two_gpus"), or two gloo ranks on the CPU ("cpu": the
    host transport), GPT sharded by fully_shard: for each
    (case, sizes) of splits, a logical step of this rank's samples in
    micro-batches of sizes (f32, or bf16 MixedPrecisionPolicy), its
    gradient shards and the gathered whole, and
    the reduce-scatters and all-reduces run before step() and in all
    (against one whole step's); then the noise alone (sigma 1, zero loss,
    micro-batches of the first split) and the epsilon after 3 such logical
    steps at q 0.01; engine.logical_batches' refusal; two logical steps in
    micro-batches of 2 + 2 + the rest, the first failing on the last rank
    (a loss not finite): errors and gradients (out["fail"])."""
    assert layout in ("one_gpu", "two_gpus", "cpu"), layout
    dev = "cpu" if layout == "cpu" else "cuda"
    if layout == "one_gpu":
        # NCCL refuses two ranks on one GPU unless they look like two hosts
        os.environ["NCCL_HOSTID"] = "dpclip-fsdp-acc-test-%d" % rank
    if dev == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        # before init: the mesh, NCCL and every tensor below take the current device
        torch.cuda.set_device(rank if layout == "two_gpus" else 0)
    _init("nccl" if dev == "cuda" else "gloo", rank, world, init_file)
    try:
        # pylint: disable=import-outside-toplevel
        from torch.distributed.device_mesh import init_device_mesh
        MixedPrecisionPolicy = fsdp2_api()[1]  # pylint: disable=invalid-name
        mesh = init_device_mesh(dev, (world,))
        x, y = (t.to(dev) for t in data)
        mine = torch.arange(rank, x.shape[0], world, device=dev)
        counts = count_collectives(("all_reduce", "reduce_scatter_tensor", "reduce_scatter"))
        out = {}

        def private(mp, job, sigma, **kw):
            torch.manual_seed(seed)
            model = _shard(GPT().to(dev), mesh, mp)
            engine = PrivacyEngine(socket_path, job_id=job, allow_insecure_seed=True)
            model, opt, _ = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=expected, **kw)
            return engine, model, opt

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for case, sizes in splits:
            engine, model, opt = private(bf16 if case.startswith("bf16") else None,
                                         "fsdp2-acc-%s-%s" % (case, layout), 0.0)
            logical_step(model, opt, x, y, mine, [len(mine)])  # FSDP's lazy init: not counted
            whole = logical_step(model, opt, x, y, mine, [len(mine)], counts)
            acc = logical_step(model, opt, x, y, mine, sizes[rank], counts)
            out[case] = {
                "local": {n: p.grad.to_local().cpu().clone()
                          for n, p in model.named_parameters()},
                "whole": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()},
                "dtypes": {n: p.grad.dtype for n, p in model.named_parameters()},
                "collectives": (whole, acc), "norms": engine.last_norms.clone()}
            engine.close()

        # a failed micro-batch, sent without waiting (the GPU's): the last
        # rank's first loss is not finite, so its norm pass fails in the
        # daemon, which the trainer learns when it collects the reply, two
        # micro-batches later; every rank raises and holds zeros, and the
        # next logical step is applied
        engine, model, opt = private(None, "fsdp2-acc-fail-" + layout, 0.0)
        fail = {"errors": [], "grads": []}
        for i in range(2):
            def scale(k, i=i):
                return float("nan") if rank == world - 1 and i == 0 and k == 0 else 1.0
            try:
                logical_step(model, opt, x, y, mine, [2, 2, len(mine) - 4], loss_scale=scale)
                fail["errors"].append(None)
            except DpclipError as e:
                fail["errors"].append(_error(e))
            # (cloned: the engine writes the same gradients again next step)
            fail["grads"].append({n: p.grad.to_local().cpu().clone()
                                  for n, p in model.named_parameters()})
        out["fail"] = fail
        engine.close()

        # an account per layout: both run in one daemon's session, each
        # compared with 3 steps' epsilon
        engine, model, opt = private(bf16, "fsdp2-acc-noise-" + layout, 1.0, sample_rate=0.01,
                                     target_delta=1e-5)
        try:  # each rank's split of its own batch: forwards fully_shard could not pair
            engine.logical_batches([], max_physical_batch_size=2)
            out["logical_batches"] = None
        except NotImplementedError as e:
            out["logical_batches"] = str(e)
        for _ in range(3):
            logical_step(model, opt, x, y, mine, splits[0][1][rank], loss_scale=lambda i: 0.0)
        out["noise"] = {n: p.grad.to_local().float().cpu().clone()
                        for n, p in model.named_parameters()}
        out["epsilon"] = engine.last_epsilon
        engine.close()
        torch.save(out, os.path.join(out_dir, "fsdp2acc_%d.pt" % rank))
    finally:
        dist.destroy_process_group()
