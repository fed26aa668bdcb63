"""The per-rank halves of the gradient-accumulation tests over several
processes (spawned processes import this module by name; it must not be a
test module): a 2-stage pipeline run under GPipe or 1F1B with M
micro-batches per logical step, and data parallelism with each rank
accumulating its own micro-batches.

The device layout (`layout`): "cpu" and "one_gpu" (both ranks on cuda:0)
join over gloo; "one_gpu_nccl" puts both on cuda:0 over NCCL (told apart
as hosts: its socket transport), and "two_gpus" rank r on cuda:r over
NCCL (the pipeline's activations and gradients then go GPU to GPU)."""
import datetime
import math
import os
import warnings

import torch
import torch.distributed as dist

from dpclip import _lib
from dpclip.pipeline import schedule
from dpclip.torch import PrivacyEngine, reduce_loss
from models import SeqModel, per_sample_losses, pipeline_model


def _init(rank, world, init_file, layout="cpu"):
    """Joins the ranks in `layout`; returns this rank's device."""
    backend, device = "gloo", torch.device("cpu")
    if layout == "one_gpu":
        # gloo: NCCL refuses two ranks on one GPU unless told apart as hosts
        device = torch.device("cuda", 0)
    elif layout in ("two_gpus", "one_gpu_nccl"):
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        gpu = rank if layout == "two_gpus" else 0
        if layout == "one_gpu_nccl":  # NCCL refuses two ranks on one GPU of one host
            os.environ["NCCL_HOSTID"] = "dpclip-test-%d-%d" % (os.getppid(), rank)
        # before init: NCCL's communicators and the object collectives
        # make_private runs take the current device as the rank's
        torch.cuda.set_device(gpu)
        backend, device = "nccl", torch.device("cuda", gpu)
    else:
        assert layout == "cpu", layout
    # a timeout well past any step: ranks that fall out of step (or a
    # pipeline that deadlocks) fail the test instead of hanging it
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    return device


def _links(layout):
    """The pipeline's links: None (gloo, through host memory), or under
    NCCL a process group per direction, activations 0 -> 1 and gradients
    1 -> 0. NCCL runs a pair's sends and receives on one stream per
    communicator, in the order issued, and a send may wait on the device
    for its receive; 1F1B's crossing sends (stage 0's next activation,
    stage 1's gradient) would then wait for each other. One communicator
    per direction keeps each in the same order on both stages. Every rank
    calls it alike (new_group is collective)."""
    if layout not in ("two_gpus", "one_gpu_nccl"):
        return None
    return dist.new_group([0, 1]), dist.new_group([0, 1])


def pipeline_step(stage_mod, opt, rank, x, y, sizes, kind, d=16, commit=True, links=None,
                  fresh=None):
    """One logical step of a 2-stage pipeline (global ranks 0 and 1) over
    micro-batches of `sizes` samples, run in `kind`'s order. Activations and
    gradients go with isend (never waited on inside the schedule: a
    blocking send would deadlock 1F1B) and recv: through host memory
    (links None: gloo sends no CUDA tensors), or from the stage's GPU over
    links' NCCL groups (_links: activations on the first, gradients on the
    second). fresh (a list, CUDA): stage 1 takes each micro-batch's input in
    an allocation of its own, held there, which the daemon has not seen
    (a trainer's allocator handing out new memory mid-step)."""
    dev = next(stage_mod.parameters()).device
    x, y = x.to(dev), y.to(dev)
    wire = torch.device("cpu") if links is None else dev  # where sent tensors live
    fwd, bwd = links if links is not None else (None, None)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    sends, outs, ins, losses = [], {}, {}, {}
    opt.zero_grad()
    for op, i in schedule(kind, 2, rank, len(sizes)):
        sl = slice(bounds[i], bounds[i + 1])
        if rank == 0 and op == "F":
            outs[i] = stage_mod(x[sl])
            h = outs[i].detach().to(wire).contiguous()
            sends.append((dist.isend(h, 1, group=fwd), h))
        elif rank == 0:
            g = torch.empty(outs[i].shape, device=wire)
            dist.recv(g, 1, group=bwd)
            outs.pop(i).backward(g.to(dev))
        elif op == "F":
            shape = (sizes[i], x.shape[1], d)
            if fresh is not None:  # (past 10 MiB: a segment of its own, while held)
                fresh.append(torch.empty(3 << 20, device=dev))
                h = fresh[-1][:math.prod(shape)].view(shape)
            else:
                h = torch.empty(shape, device=dev)
            if wire == dev:
                dist.recv(h, 0, group=fwd)
            else:
                got = torch.empty(shape, device=wire)
                dist.recv(got, 0, group=fwd)
                h.copy_(got)
            ins[i] = h.requires_grad_(True)
            losses[i] = reduce_loss(per_sample_losses("seq", stage_mod(ins[i]), y[sl]), "mean")
        else:
            losses.pop(i).backward()
            g = ins.pop(i).grad.to(wire).contiguous()
            sends.append((dist.isend(g, 0, group=bwd), g))
    for work, _ in sends:
        work.wait()
    early = opt.engine._acc.sent  # micro-batches sent during the schedule
    if commit:
        opt.step()  # the commit: waits in the daemon for the other stage's
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad()  # drops the logical step
        assert any("dropped it" in str(w.message) for w in caught), caught
    return early


def _private_stage(rank, device, socket_path, C, lr, sigma, first, once=False, **kw):
    """(engine, stage, optimizer): pipeline stage `rank` of the same model
    on every call (seed 3; once: Stage1Once), private in a norm group of
    every rank (flat clipping, mean loss), SGD at lr; `first`:
    make_private's arguments that rank 0 alone passes (the expected batch,
    the sample rate), kw every rank's."""
    torch.manual_seed(3)
    stage = pipeline_model(once=once)[rank].to(device)
    engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
    stage, opt, _ = engine.make_private(
        module=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=lr),
        noise_multiplier=sigma, max_grad_norm=C, loss_reduction="mean",
        norm_group=dist.group.WORLD, **(first if rank == 0 else {}), **kw)
    return engine, stage, opt


def _grads(rank, stage):
    """The stage's gradients by their name in the whole model ("rank.name")."""
    return {"%d.%s" % (rank, n): p.grad.cpu() for n, p in stage.named_parameters()}


def run_schedule(rank, world, init_file, socket_path, data, sizes, C, expected, kind, out_dir,
                 layout="cpu"):
    """SeqModel's 2 stages in one norm group (flat clipping), noise off,
    one logical step of len(sizes) micro-batches under `kind`; then, noise
    on, two logical steps whose epsilon is saved."""
    device = _init(rank, world, init_file, layout)
    try:
        links = _links(layout)
        engine, stage, opt = _private_stage(rank, device, socket_path, C, 0.0, 0.0,
                                            {"expected_batch_size": expected})
        x, y = data
        early = pipeline_step(stage, opt, rank, x, y, sizes, kind, links=links)
        out = {"early": early, "grads": _grads(rank, stage), "norms": engine.last_norms,
               "steps": engine.steps, "held": engine.micro_batches_held_peak}
        engine.close()

        engine, stage, opt = _private_stage(
            rank, device, socket_path, C, 0.1, 1.0,
            {"expected_batch_size": expected, "sample_rate": 0.05}, target_delta=1e-5)
        for _ in range(2):
            pipeline_step(stage, opt, rank, x, y, sizes, kind, links=links)
        out["epsilon"] = engine.last_epsilon
        engine.close()
        torch.save(out, os.path.join(out_dir, "%s%d.pt" % (kind, rank)))
    finally:
        dist.destroy_process_group()


def run_steady_schedule(rank, world, init_file, socket_path, data, sizes, C, expected, kind,
                        out_dir, layout, steps=3):
    """SeqModel's 2 stages in one norm group, noise off, `steps` logical
    steps of the same micro-batches (a steady step: staged, its tensors
    named at each backward's end), stage 1's inputs in fresh allocations
    (pipeline_step's `fresh`). Saves each step's gradients and norms, and
    how many of the backward's-end lookups met an allocation not
    registered yet (left to the step's submission: the daemon may hold
    this stage's earlier micro-batch, which waits for the other stage's,
    which waits for this stage's next gradient)."""
    device = _init(rank, world, init_file, layout)
    try:
        links = _links(layout)
        engine, stage, opt = _private_stage(rank, device, socket_path, C, 0.0, 0.0,
                                            {"expected_batch_size": expected}, once=True,
                                            norm_group_timeout_ms=20000)
        rp, later = engine._replanner, []
        # (a host model names nothing: a stand-in answers as the lookup does
        # for a new allocation, and the host step goes as ever)
        resolve = rp.resolve or (lambda n, ptrs, refs: _lib.EAGAIN)

        def counted(n, ptrs, refs):
            rc = resolve(n, ptrs, refs)
            later.append(rc == _lib.EAGAIN)
            return rc
        rp.resolve = counted
        x, y = data
        fresh = [] if device.type == "cuda" else None
        out = {"grads": [], "norms": []}
        for _ in range(steps):
            pipeline_step(stage, opt, rank, x, y, sizes, kind, links=links, fresh=fresh)
            out["grads"].append(_grads(rank, stage))
            out["norms"].append(engine.last_norms)
        out["steps"], out["later"], out["seals"] = engine.steps, sum(later), len(later)
        engine.close()
        torch.save(out, os.path.join(out_dir, "steady-%s%d.pt" % (kind, rank)))
    finally:
        dist.destroy_process_group()


def run_data_parallel(rank, world, init_file, socket_path, data, pieces, C, expected, out_dir,
                      layout="cpu"):
    """Each rank accumulates its shard of the logical batch in its own
    micro-batches (pieces[rank]: lists of sample indices; the ranks take
    different numbers) and steps once: noise off, then noise on with zero
    gradients (one rank's noise, once). The gate's all-reduces run over the
    layout's backend (NCCL on two GPUs)."""
    device = _init(rank, world, init_file, layout)
    job = "dp-accumulate-test-" + layout  # an account per layout: a session runs them all
    try:
        torch.manual_seed(100 + rank)  # make_private broadcasts rank 0's
        model = SeqModel().to(device)
        engine = PrivacyEngine(socket_path, job_id=job, allow_insecure_seed=True)
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean",
            expected_batch_size=expected)
        assert engine.distributed and engine.world_size == world
        x, y = data[0].to(device), data[1].to(device)
        opt.zero_grad()
        for idx in pieces[rank]:
            reduce_loss(per_sample_losses("seq", model(x[idx]), y[idx]), "mean").backward()
        opt.step()
        out = {"grads": {n: p.grad.cpu() for n, p in model.named_parameters()},
               "norms": engine.last_norms, "steps": engine.steps}
        engine.close()

        model = SeqModel().to(device)
        engine = PrivacyEngine(socket_path, job_id=job, allow_insecure_seed=True)
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            noise_multiplier=2.0, max_grad_norm=C, loss_reduction="mean",
            expected_batch_size=expected)
        opt.zero_grad()
        for idx in pieces[rank]:
            (model(x[idx]) * 0.0).sum().backward()
        opt.step()
        engine.synchronize()
        out["noise"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu()
        engine.close()
        torch.save(out, os.path.join(out_dir, "dp%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_dropped(rank, world, init_file, socket_path, data, C, expected, out_dir):
    """1F1B with 2 micro-batches, dropped by zero_grad() instead of a step:
    stage 1 sent its first micro-batch during the schedule, stage 0 none.
    Then a logical step of one micro-batch (the first 5 samples), which
    both stages must send alike (a logical step, the same id)."""
    device = _init(rank, world, init_file)
    try:
        engine, stage, opt = _private_stage(rank, device, socket_path, C, 0.0, 0.0,
                                            {"expected_batch_size": expected})
        x, y = data
        early = pipeline_step(stage, opt, rank, x, y, [4, 3], "1f1b", commit=False)
        pipeline_step(stage, opt, rank, x[:5], y[:5], [5], "1f1b")
        out = {"early": early, "grads": _grads(rank, stage), "norms": engine.last_norms,
               "steps": engine.steps}
        engine.close()
        torch.save(out, os.path.join(out_dir, "dropped%d.pt" % rank))
    finally:
        dist.destroy_process_group()
