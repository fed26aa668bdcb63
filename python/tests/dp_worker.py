"""The per-rank half of the data-parallel test (spawned processes import
this module by name; it must not be a test module)."""
import contextlib
import datetime
import io
import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from dpclip import DpclipError, _gate
from dpclip.data import DPDataLoader
from dpclip.torch import PrivacyEngine, reduce_loss
from models import SeqModel, per_sample_losses


def run_rank(rank, world, init_file, socket_path, data, C, expected, out_dir):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    # Buckets of a few parameters (and parameters alone past the size): the
    # all-reduce's staging through flat buffers is compared with the union.
    _gate.BUCKET_ELEMS = 64
    try:
        # Different initial weights on purpose: make_private broadcasts rank 0's.
        torch.manual_seed(100 + rank)
        model = SeqModel()
        engine = PrivacyEngine(socket_path, job_id="dp-test", allow_insecure_seed=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        model, opt, _ = engine.make_private(module=model, optimizer=opt, noise_multiplier=0.0,
                                            max_grad_norm=C, loss_reduction="mean",
                                            expected_batch_size=expected)
        assert engine.distributed and engine.world_size == world
        x, y = data
        mine = torch.arange(rank, x.shape[0], world)  # uneven shards
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", model(x[mine]), y[mine]), "mean").backward()
        opt.step()
        torch.save({n: p.grad for n, p in model.named_parameters()},
                   os.path.join(out_dir, "rank%d.pt" % rank))
        engine.close()

        # Noise on, zero gradients: the all-reduced result must carry one
        # rank's noise (std sigma*C/expected), not world of them.
        model2 = SeqModel()
        engine2 = PrivacyEngine(socket_path, job_id="dp-test", allow_insecure_seed=True)
        model2, opt2, _ = engine2.make_private(
            module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.0),
            noise_multiplier=2.0, max_grad_norm=C, loss_reduction="mean",
            expected_batch_size=expected)
        (model2(x[mine]) * 0.0).sum().backward()
        opt2.step()
        torch.save(torch.cat([p.grad.reshape(-1) for p in model2.parameters()]),
                   os.path.join(out_dir, "noise%d.pt" % rank))
        engine2.close()
    finally:
        dist.destroy_process_group()


def run_rank_failure(rank, world, init_file, socket_path, data, C, sigma, expected, out_dir):
    """Step 1 fails on rank 0 only (a non-finite gradient there); step 2 is
    clean. Saves what each rank saw: step 1's error, the parameters before
    and after each step, step 1's gradients."""
    # A timeout well past any step: ranks that fall out of step fail the test
    # instead of hanging it.
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(100 + rank)
        model = SeqModel()
        engine = PrivacyEngine(socket_path, job_id="dp-fail-test", allow_insecure_seed=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt, _ = engine.make_private(module=model, optimizer=opt,
                                            noise_multiplier=sigma, max_grad_norm=C,
                                            loss_reduction="mean", expected_batch_size=expected)
        x, y = data
        mine = torch.arange(rank, x.shape[0], world)
        out = {"before": _params(model)}
        opt.zero_grad()
        loss = reduce_loss(per_sample_losses("seq", model(x[mine]), y[mine]), "mean")
        if rank == 0:
            loss = loss * float("nan")
        loss.backward()
        try:
            opt.step()
            out["error"] = None
        except DpclipError as e:
            out["error"] = (e.code, str(e))
        out["grads1"] = {n: p.grad.clone() if p.grad is not None else None
                         for n, p in model.named_parameters()}
        out["after1"] = _params(model)
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", model(x[mine]), y[mine]), "mean").backward()
        opt.step()
        out["grads2"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["after2"] = _params(model)
        engine.close()
        torch.save(out, os.path.join(out_dir, "fail%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_rank_cuda_failure(rank, world, init_file, socket_path, out_dir):
    """Asynchronous GPU steps (both ranks on one GPU, gloo): steps 1 and 3
    fail on the device on rank 0 only (non-finite), after their notices, so
    no rank knows of it before its update is queued; rank 0 reads
    last_coefs after step 1 (meeting its error early), not after step 3;
    step 5 is clean. Saves each step's error and parameters after it."""
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(7)
        model = torch.nn.Linear(32, 16).cuda()
        engine = PrivacyEngine(socket_path, job_id="dp-cuda-fail-test", allow_insecure_seed=True)
        model, opt, _ = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8)
        assert engine.asynchronous
        x = torch.randn(4, 32, device="cuda")
        out = {"before": _cpu(_params(model)), "errors": [], "after": [], "peek": None}
        for i in range(5):
            opt.zero_grad()
            loss = model(x).sum()
            if i in (0, 2) and rank == 0:
                loss = loss * float("nan")
            loss.backward()
            try:
                opt.step()
                out["errors"].append(None)
            except DpclipError as e:
                out["errors"].append((e.code, str(e)))
            if i == 0 and rank == 0:
                try:
                    engine.last_coefs
                except DpclipError as e:
                    out["peek"] = (e.code, str(e))
            torch.cuda.synchronize()
            out["after"].append(_cpu(_params(model)))
        engine.close()
        torch.save(out, os.path.join(out_dir, "cudafail%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def _cpu(params):
    return {n: p.cpu() for n, p in params.items()}


def run_rank_loader(rank, world, init_file, socket_path, out_dir):
    """make_private's checks of a DPDataLoader against the engine's ranks:
    what each attempt raised (None: accepted), and the first batches of a
    good loader on ranks whose global RNGs are seeded alike."""
    ds = TensorDataset(torch.arange(64))
    early = DPDataLoader(ds, 0.5)  # before init_process_group: one process's loader
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)

        def attempt(loader):
            engine = PrivacyEngine(socket_path, job_id="dp-loader-test", allow_insecure_seed=True)
            model = torch.nn.Linear(2, 2)
            try:
                engine.make_private(module=model, optimizer=torch.optim.SGD(
                    model.parameters(), lr=0.1), data_loader=loader, noise_multiplier=1.0,
                    max_grad_norm=1.0)
                return None
            except ValueError as e:
                return str(e)
            finally:
                engine.close()

        good = DPDataLoader(ds, 0.5)
        out = {"early": attempt(early),
               "local": attempt(DPDataLoader(ds, 0.5, distributed=False)),
               "alike": attempt(DPDataLoader(ds, 0.5, generator=torch.Generator().manual_seed(3))),
               "good": attempt(good),
               "shard": sorted({i for idx, in good for i in idx.tolist()}),
               "masks": [[i // world for i in idx.tolist()] for idx, in good]}
        torch.save(out, os.path.join(out_dir, "loader%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_rank_job_id(rank, world, init_file, socket_path, out_dir):
    """Engines without a job id: one made before init_process_group (each
    rank generates its own), whose make_private adopts rank 0's; what each
    rank printed; rank 1's sigma-0 step as a share of rank 0's job (finite
    epsilon); and ranks given different job ids."""
    engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
    out = {"before": engine.job_id}
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            model, opt, _ = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                sample_rate=0.01, target_delta=1e-5)
        out["after"], out["printed"] = engine.job_id, err.getvalue()
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        out["epsilon"] = engine.last_epsilon
        engine.close()

        other = PrivacyEngine(socket_path, job_id="pytest-explicit-%d" % rank,
                              allow_insecure_seed=True)
        try:
            m = torch.nn.Linear(4, 2)
            other.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                               noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
            out["mismatch"] = None
        except ValueError as e:
            out["mismatch"] = str(e)
        finally:
            other.close()
        torch.save(out, os.path.join(out_dir, "job%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_rank_gate(rank, world, init_file, out_dir):
    """The gate's all-reduce of gradients that lie end to end in one arena
    (the CUDA transport's outputs) and of ones that do not: each rank's
    gradients are (rank + 1) * (index + 1); a sentinel sits in the arena's
    gap, which no collective may touch. Then a step failing on rank 1
    (its flag 0). Saves the results and whether the arena was summed in place."""
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        arena = torch.zeros(64)
        params, spans = [], [(0, 6), (6, 16), (16, 20), (24, 30)]  # a gap at 20..24
        for i, (a, b) in enumerate(spans):
            p = torch.nn.Parameter(torch.zeros(b - a))
            p.grad = arena[a:b]
            p.grad.fill_((rank + 1) * (i + 1))
            params.append(p)
        loose = torch.nn.Parameter(torch.zeros(3))  # a tensor of its own
        loose.grad = torch.full((3,), 10.0 * (rank + 1))
        params.append(loose)
        arena[20:24] = 99.0
        ptrs = [p.grad.data_ptr() for p in params]
        # buckets: the run of 20 end to end; the one past the gap with the loose one
        _gate.BUCKET_ELEMS = 20
        gathered = []
        cat = torch.cat

        def counted(ts, *a, **k):
            gathered.append(sum(t.numel() for t in ts))
            return cat(ts, *a, **k)

        torch.cat = counted
        gate = _gate.Gate(world)
        try:
            gate.reduce(params, torch.ones(1), None, 1, False)
        finally:
            torch.cat = cat
        out = {"grads": [p.grad.clone() for p in params], "arena": arena.clone(),
               "same": [p.grad.data_ptr() for p in params] == ptrs, "gathered": gathered}
        ok = torch.zeros(1) if rank == 1 else torch.ones(1)
        try:
            gate.reduce(params, ok, None, 2, False)
            out["error"] = None
        except DpclipError as e:
            out["error"] = e.message
        out["failed"] = [p.grad.clone() for p in params]
        out["arena_failed"] = arena.clone()
        torch.save(out, os.path.join(out_dir, "gate%d.pt" % rank))
    finally:
        dist.destroy_process_group()
