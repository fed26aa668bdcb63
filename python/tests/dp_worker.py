"""The per-rank half of the data-parallel test (spawned processes import
this module by name; it must not be a test module)."""
import os

import torch
import torch.distributed as dist

from dpclip.torch import PrivacyEngine, reduce_loss
from models import SeqModel, per_sample_losses


def run_rank(rank, world, init_file, socket_path, data, C, expected, out_dir):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    try:
        # Different initial weights on purpose: make_private broadcasts rank 0's.
        torch.manual_seed(100 + rank)
        model = SeqModel()
        engine = PrivacyEngine(socket_path, job_id="dp-test")
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
        engine2 = PrivacyEngine(socket_path, job_id="dp-test")
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
