"""FSDP2 (torch.distributed.fsdp.fully_shard) models: two NCCL ranks on one
GPU (a distinct NCCL_HOSTID each, NVLink multicast off), and two gloo ranks
on the CPU (the host transport), train a GPT-2-like
model sharded per block and at the root; each rank's gradient is its
shard, a DTensor, equal to its rows of the single-process per-sample
reference (f32, and bf16 MixedPrecisionPolicy with f32 master weights); the
noise is once per coordinate, added by the daemon in the owner's sums
steps on its rows alone (Python adds none); the ledger charges once per
step; the loss
falls; make_private before fully_shard and FSDP1 are refused. Skipped, with
the reason, without fully_shard (torch < 2.4: Debian's 1.13 tests the same
steps in test_fsdp_sharded.py); the GPU case without a GPU, NCCL or a
CUDA-built dpclipd.

    python3 -m pytest -q python/tests/test_fsdp.py
"""
import math
import os

import pytest
import torch
import torch.nn as nn

import dpclip
from dpclip import _fsdp
from dpclip.torch import PrivacyEngine
from fsdp_worker import GPT, run_fsdp2
from models import PHASED_MARGIN, reference, spawn

pytestmark = pytest.mark.skipif(_fsdp._classes()[2] is None,  # pylint: disable=W0212
                                reason="torch %s has no fully_shard (FSDP2: torch >= 2.4)"
                                % torch.__version__)
needs_gpu = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not (torch.distributed.is_available() and
                            torch.distributed.is_nccl_available()), reason="no NCCL"),
]

WORLD, B, SEED, C = 2, 8, 11, 1.86


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 67, (B, 12), generator=g)
    return x, torch.randint(0, 67, (B, 12), generator=g)


def _rows(n, rank):
    """fully_shard's dim-0 chunk of rank: rows [start, stop)."""
    chunk = -(-n // WORLD)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


@pytest.mark.parametrize("dev", [pytest.param("cuda", marks=needs_gpu), "cpu"])
def test_fully_shard_two_ranks(daemon, tmp_path, dev):
    """Two ranks of one GPU over NCCL (a CUDA-built dpclipd), or of the CPU
    over gloo (the host transport): the same cases and checks."""
    if dev == "cuda":
        with dpclip.Client(daemon.socket) as c:
            if not c.info.has_cuda:
                pytest.skip("this dpclipd has no CUDA backend")
    x, y = _data()
    torch.manual_seed(SEED)
    want, _, _ = reference(GPT(), "seq", (x,), y, C, "mean", B, margin=PHASED_MARGIN)
    spawn(run_fsdp2, (WORLD, str(tmp_path / "init"), daemon.socket, (x, y), C, B, SEED,
                      str(tmp_path), dev), nprocs=WORLD, timeout=300)
    got = [torch.load(os.path.join(str(tmp_path), "fsdp2_%d.pt" % r)) for r in range(WORLD)]

    # Each rank's gradient: a DTensor sharded on dim 0, in the master dtype,
    # holding exactly its rows of the union batch's private gradient. The
    # daemon's f32 GEMMs use TF32; bf16 runs the whole forward in bf16
    # (LayerNorm and softmax too: no autocast keeps them in f32).
    for case, tol in (("f32", 3e-3), ("bf16", 0.1)):
        for r in range(WORLD):
            res = got[r][case]
            if case == "bf16":
                assert res["sharded_dtype"] == torch.bfloat16  # the sums reduced in bf16
            for n, g in want.items():
                start, stop = _rows(g.shape[0], r)
                local, whole = res["local"][n], res["whole"][n]
                assert res["sharded"][n], (case, n)  # placements (Shard(0),)
                assert res["dtypes"][n] == torch.float32, (case, n)
                assert local.shape == g[start:stop].shape, (case, r, n, local.shape)
                scale = float(g.abs().max())
                assert float((local.double() - g[start:stop]).abs().max()) < tol * scale, \
                    (case, r, n)
                assert float((whole.double() - g).abs().max()) < tol * scale, (case, r, n)

    # The noise alone (zero loss, sigma 1): the ranks' shards make up the
    # whole gradient once; std sigma*C/B per coordinate (a coordinate noised
    # on both ranks would show sqrt(2) times that), and each owner draws its
    # own (the shards' first rows differ).
    noise = torch.cat([torch.cat([got[r]["noise"][n] for r in range(WORLD)]).double().reshape(-1)
                       for n in want])
    assert noise.numel() == sum(g.numel() for g in want.values())
    want_std = 1.0 * C / B
    assert abs(float(noise.std()) - want_std) < 6 * want_std / math.sqrt(2 * noise.numel()), \
        (float(noise.std()), want_std)
    tok0, tok1 = got[0]["noise"]["tok.weight"], got[1]["noise"]["tok.weight"]
    assert not torch.equal(tok0[:tok1.shape[0]], tok1)
    # ... added by the daemon in each rank's sums steps, on exactly the rows
    # the rank owns, and applied as the reduce-scatter left it: each rank's
    # shard is its own daemon output's rows (the other rank's are zeros)
    for r in range(WORLD):
        for n, (zero_elsewhere, noised, applied) in got[r]["owned"].items():
            assert zero_elsewhere and noised and applied, (r, n, zero_elsewhere, noised, applied)

    for r in range(WORLD):
        losses = got[r]["losses"]
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (r, losses)

    # Charged once per logical step: rank 0's job spent what one process's
    # 3 steps at the same (q, sigma, delta) spend.
    single = PrivacyEngine(daemon.socket, job_id="fsdp2-ledger-single-" + dev,
                           allow_insecure_seed=True)
    model = nn.Linear(3, 2)
    _, opt, _ = single.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=C,
        expected_batch_size=B, sample_rate=0.01, target_delta=1e-5, distributed=False)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert 0 < single.last_epsilon < math.inf
    assert got[0]["epsilon"] == pytest.approx(single.last_epsilon, rel=1e-9)
    single.close()

    for r in range(WORLD):
        late = got[r]["late"]
        assert late is not None and "fully_shard" in late and "make_private" in late, late
        if got[r]["fsdp1"] != "skipped":
            msg = got[r]["fsdp1"]
            assert msg is not None and "use_orig_params=False" in msg and \
                "fully_shard" in msg, msg
