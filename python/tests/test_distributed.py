"""Data parallel: two gloo ranks, each with its own session, give the same
gradients as one process on the union batch (noise off)."""
import math
import os

import torch
import torch.multiprocessing as mp

from dpclip.torch import PrivacyEngine, reduce_loss
from dp_worker import run_rank
from models import SeqModel, per_sample_losses, seq_data


def test_two_ranks_equal_one_process_on_the_union(daemon, tmp_path):
    (x,), y = seq_data(7, seed=5)
    C, expected = 0.95, 7

    torch.manual_seed(100)  # rank 0's initial weights
    model = SeqModel()
    engine = PrivacyEngine(daemon.socket)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
        loss_reduction="mean", expected_batch_size=expected, distributed=False)
    reduce_loss(per_sample_losses("seq", model(x), y), "mean").backward()
    opt.step()
    assert (engine.last_coefs < 1).any() and (engine.last_coefs >= 1 - 1e-6).any()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.close()

    ctx = mp.start_processes(run_rank, nprocs=2, join=False, start_method="spawn",
                             args=(2, str(tmp_path / "init"), daemon.socket, (x, y), C,
                                   expected, str(tmp_path)))
    while not ctx.join(timeout=120):
        pass
    for rank in range(2):
        got = torch.load(os.path.join(str(tmp_path), "rank%d.pt" % rank))
        for n, g in want.items():
            err = float((got[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
            assert err < 1e-4, (rank, n, err)
    n0 = torch.load(os.path.join(str(tmp_path), "noise0.pt")).double()
    n1 = torch.load(os.path.join(str(tmp_path), "noise1.pt")).double()
    assert torch.equal(n0, n1)  # every rank holds the same all-reduced gradient
    want_std = 2.0 * C / expected
    assert abs(float(n0.std()) - want_std) < 6 * want_std / math.sqrt(2 * n0.numel())
