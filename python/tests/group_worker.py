"""The per-rank half of the norm-group tests (spawned processes import this
module by name; it must not be a test module). Each function saves what its
rank saw under out_dir for the test to compare with the reference."""
import datetime
import os

import torch
import torch.distributed as dist

from torch.utils.data import TensorDataset

from dpclip.data import DPDataLoader
from dpclip.torch import PrivacyEngine, reduce_loss
from models import TPModel, TPShard, per_sample_losses, pipeline_model


def _init(rank, world, init_file):
    # A timeout well past any step: ranks that fall out of step fail the test
    # instead of hanging it.
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))


def _grads(module, prefix):
    return {prefix + n: p.grad.clone() if p.grad is not None else None
            for n, p in module.named_parameters()}


def _pipeline_pass(stage, opt, rank, x, y, d=16, first=0, scale=1.0):
    """One training step of a 2-stage pipeline on global ranks first and
    first + 1: stage 0 sends its output to stage 1, which computes the loss
    (times scale) and sends back its input gradient (through host memory:
    gloo sends no CUDA tensors)."""
    opt.zero_grad()
    dev = next(stage.parameters()).device
    if rank == first:
        h = stage(x.to(dev))
        dist.send(h.detach().cpu().contiguous(), first + 1)
        g = torch.empty(h.shape)
        dist.recv(g, first + 1)
        h.backward(g.to(dev))
    else:
        h = torch.empty(x.shape[0], x.shape[1], d)
        dist.recv(h, first)
        h = h.to(dev).requires_grad_(True)
        (reduce_loss(per_sample_losses("seq", stage(h), y.to(dev)), "mean") * scale).backward()
        dist.send(h.grad.cpu().contiguous(), first)
    opt.step()


def run_pipeline(rank, world, init_file, socket_path, data, C, expected, clipping, out_dir,
                 device="cpu"):
    """SeqModel cut into 2 stages, one per rank, in one norm group (the
    default group): stage 0 alone is given the expected batch size (stage 1
    takes it from the group's rank 0). Noise off. Then (flat clipping),
    noise on, two steps whose epsilon is saved: rank 0's job, charged once
    per group step."""
    _init(rank, world, init_file)
    if isinstance(socket_path, (list, tuple)):  # one daemon per rank
        socket_path = socket_path[rank]
    try:
        torch.manual_seed(3)
        stage = pipeline_model()[rank].to(device)
        engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
        kw = {"expected_batch_size": expected} if rank == 0 else {}
        stage, opt, _ = engine.make_private(
            module=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=0.0),
            noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean",
            norm_group=dist.group.WORLD, norm_group_clipping=clipping, **kw)
        assert not engine.distributed or engine.world_size == 1  # no data parallelism
        x, y = data
        _pipeline_pass(stage, opt, rank, x, y)
        out = {"grads": {n: g.cpu() for n, g in _grads(stage, "%d." % rank).items()},
               "norms": engine.last_norms, "daemons": engine.norm_group.daemons,
               "expected": engine.expected_batch_size, "group": engine.norm_group_name}
        engine.close()

        if clipping == "flat":
            torch.manual_seed(3)
            stage = pipeline_model()[rank]
            engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
            kw = {"expected_batch_size": expected, "sample_rate": 0.05} if rank == 0 else {}
            stage, opt, _ = engine.make_private(
                module=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=0.1),
                noise_multiplier=1.0, max_grad_norm=C, loss_reduction="mean",
                norm_group=dist.group.WORLD, target_delta=1e-5, **kw)
            for _ in range(2):
                _pipeline_pass(stage, opt, rank, x, y)
            out["epsilon"], out["job"] = engine.last_epsilon, engine.job_id
            out["sample_rate"] = engine.sample_rate
            engine.close()
        torch.save(out, os.path.join(out_dir, "pp%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_tensor_parallel(rank, world, init_file, socket_path, data, C, expected, out_dir):
    """A TPModel split over a 2-rank group made with new_group: the
    LayerNorm replicated, the Linear's output features halved. Then what
    make_private raises (None: accepted) for members that disagree on the
    replicated modules or on the threshold, and for replicated modules
    under group-wise clipping or outside the model."""
    _init(rank, world, init_file)
    try:
        tp = dist.new_group([0, 1])
        torch.manual_seed(4)
        whole = TPModel()
        shard = TPShard(whole, tp)
        engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
        shard, opt, _ = engine.make_private(
            module=shard, optimizer=torch.optim.SGD(shard.parameters(), lr=0.0),
            noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean",
            expected_batch_size=expected, norm_group=tp, replicated_modules=[shard.ln])
        x, y = data
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", shard(*x), y), "mean").backward()
        opt.step()
        out = {"grads": _grads(shard, ""), "norms": engine.last_norms}
        engine.close()

        def attempt(**kw):
            e = PrivacyEngine(socket_path, allow_insecure_seed=True)
            m = TPShard(whole, tp)
            args = dict(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.0),
                        noise_multiplier=0.0, max_grad_norm=C, loss_reduction="mean",
                        expected_batch_size=expected, norm_group=tp,
                        replicated_modules=[m.ln])
            for k, v in kw.items():
                args[k] = v(m) if callable(v) else v
            try:
                e.make_private(**args)
                return None
            except (ValueError, NotImplementedError) as err:
                return str(err)
            finally:
                e.close()

        out["rep_differ"] = attempt(replicated_modules=lambda m: [m.ln] if rank == 0 else [])
        out["c_differ"] = attempt(max_grad_norm=C * (1 + rank))
        out["rep_wise"] = attempt(norm_group_clipping="group_wise")
        out["rep_outside"] = attempt(replicated_modules=[whole.ln])
        # one member's own mistake: both raise (the other one names it)
        out["one_fails"] = attempt(replicated_modules=lambda m: [whole.ln] if rank == 0 else
                                   [m.ln])
        out["clipping"] = attempt(norm_group_clipping="by-layer")
        torch.save(out, os.path.join(out_dir, "tp%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_replicated_pipeline(rank, world, init_file, socket_path, data, C, expected, out_dir):
    """Data parallelism over norm groups: 2 replicas of the 2-stage
    pipeline (ranks 0, 1 and 2, 3), each its own norm group, each on its
    half of the batch; replica 1 starts from other weights (make_private
    broadcasts replica 0's). Stage 0 of each replica passes a DPDataLoader
    for its replica (checked, not used). Noise off; then noise on with zero
    gradients: the update must carry one replica's noise."""
    _init(rank, world, init_file)
    try:
        pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replica, part = rank // 2, rank % 2
        out = {}
        for sigma in (0.0, 2.0):
            torch.manual_seed(3 + 10 * replica)
            stage = pipeline_model()[part]
            engine = PrivacyEngine(socket_path, allow_insecure_seed=True)
            kw = {"expected_batch_size": expected} if part == 0 else {}
            if part == 0:
                kw["data_loader"] = DPDataLoader(TensorDataset(torch.arange(16)), 0.5,
                                                 rank=replica, world_size=2)
            stage, opt, _ = engine.make_private(
                module=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=0.0),
                noise_multiplier=sigma, max_grad_norm=C, loss_reduction="mean",
                norm_group=pipes[replica], **kw)
            out["replica"] = (engine.rank, engine.world_size)
            x, y = data
            mine = torch.arange(replica, x.shape[0], 2)
            _pipeline_pass(stage, opt, rank, x[mine], y[mine], first=2 * replica,
                           scale=1.0 if sigma == 0 else 0.0)
            if sigma == 0:
                out["grads"] = _grads(stage, "%d." % part)
                out["norms"] = engine.last_norms
            else:
                out["noise"] = torch.cat([p.grad.reshape(-1) for p in stage.parameters()])
                out["epsilon"], out["job"] = engine.last_epsilon, engine.job_id
            engine.close()
        torch.save(out, os.path.join(out_dir, "dp%d.pt" % rank))
    finally:
        dist.destroy_process_group()
