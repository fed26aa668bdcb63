"""Data parallel: two gloo ranks, each with its own session, give the same
gradients as one process on the union batch (noise off); a step that fails
on one rank is applied on none; loaders must sample for the engine's ranks,
independently."""
import math
import os

import torch

from dpclip import _lib
from dpclip.torch import PrivacyEngine, reduce_loss
from dp_worker import run_rank, run_rank_failure, run_rank_gate, run_rank_job_id, run_rank_loader
from models import SeqModel, per_sample_losses, seq_data
from models import spawn as _spawn


def _union_reference(socket, x, y, C, expected):
    """The noiseless gradient of one process on the union batch, at rank 0's
    initial weights (seed 100)."""
    torch.manual_seed(100)
    model = SeqModel()
    engine = PrivacyEngine(socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
        loss_reduction="mean", expected_batch_size=expected, distributed=False)
    reduce_loss(per_sample_losses("seq", model(x), y), "mean").backward()
    opt.step()
    assert (engine.last_coefs < 1).any() and (engine.last_coefs >= 1 - 1e-6).any()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.close()
    return want


def test_two_ranks_equal_one_process_on_the_union(daemon, tmp_path):
    (x,), y = seq_data(7, seed=5)
    C, expected = 0.95, 7
    want = _union_reference(daemon.socket, x, y, C, expected)
    _spawn(run_rank, (2, str(tmp_path / "init"), daemon.socket, (x, y), C, expected,
                      str(tmp_path)))
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


def test_gradient_buckets_keep_order_dtype_and_size():
    from dpclip._gate import grad_buckets as buckets
    sizes = [(3, torch.float32), (60, torch.float32), (10, torch.float32), (100, torch.float32),
             (5, torch.bfloat16), (7, torch.bfloat16), (2, torch.float32)]
    params = []
    for n, dt in sizes:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dt))
        p.grad = torch.zeros(n, dtype=dt)
        params.append(p)
    got = buckets(params, limit=64)
    assert [p for b in got for p in b] == params  # every parameter once, in order
    for b in got:
        assert len({p.grad.dtype for p in b}) == 1
        assert len(b) == 1 or sum(p.numel() for p in b) <= 64
    assert [len(b) for b in got] == [2, 1, 1, 2, 1]


def test_gate_sums_an_arena_in_place_and_touches_no_gap(tmp_path):
    """Gradients end to end in one arena (the CUDA transport's outputs) are
    all-reduced in place, one collective over the run; one past a gap and
    one of its own through a gathered copy; the gap's memory is left alone.
    A step failing on one rank zeroes every gradient and raises on both."""
    from dpclip import _gate
    _spawn(run_rank_gate, (2, str(tmp_path / "init"), str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "gate%d.pt" % r)) for r in range(2)]
    for r in range(2):
        g = got[r]
        assert g["same"]  # param.grad still the arena's views
        assert g["gathered"] == [9]  # only the bucket past the gap went through a copy
        want = [3.0 * (i + 1) for i in range(4)] + [30.0]  # (1 + 2) * value of rank 0
        for t, w in zip(g["grads"], want):
            assert torch.equal(t, torch.full_like(t, w)), (r, t, w)
        assert torch.equal(g["arena"][20:24], torch.full((4,), 99.0))  # the gap untouched
        assert torch.equal(g["arena"][0:20], torch.cat(g["grads"][:3]))  # summed in place
        assert g["error"] is not None and "applied on no rank" in g["error"], g["error"]
        assert all(float(t.abs().max()) == 0.0 for t in g["failed"])
        assert torch.equal(g["arena_failed"][20:24], torch.full((4,), 99.0))
    params = [torch.zeros(6), torch.zeros(10)]
    assert _gate.span(params) is None  # two tensors: gathered, as before


def test_a_step_failing_on_rank_0_is_applied_nowhere(daemon, tmp_path):
    """Rank 0's step fails (a non-finite gradient there); rank 1's succeeds
    with sigma 0. Neither rank may apply rank 1's noiseless clipped sum: both
    raise, neither moves, both hold zero gradients; the next step works on
    both, in step, with rank 0's noise in it."""
    (x,), y = seq_data(7, seed=5)
    C, sigma, expected = 0.95, 1.0, 7
    want = _union_reference(daemon.socket, x, y, C, expected)
    _spawn(run_rank_failure, (2, str(tmp_path / "init"), daemon.socket, (x, y), C, sigma,
                              expected, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "fail%d.pt" % r)) for r in range(2)]
    assert got[0]["error"] is not None and got[0]["error"][0] == _lib.ENONFINITE, got[0]["error"]
    assert got[1]["error"] is not None and got[1]["error"][0] == _lib.EUNAVAIL and \
        "applied on no rank" in got[1]["error"][1], got[1]["error"]
    for r in range(2):
        for n, p in got[r]["before"].items():
            assert torch.equal(got[r]["after1"][n], p), (r, n)  # no update at all
            g = got[r]["grads1"][n]
            assert g is not None and float(g.abs().max()) == 0.0, (r, n)
    # Step 2: the same update on both ranks, the union's gradient plus one
    # rank's noise (std sigma*C/expected), and the parameters moved by it.
    diff = []
    for n, g in want.items():
        assert torch.equal(got[0]["grads2"][n], got[1]["grads2"][n]), n
        assert torch.equal(got[0]["after2"][n], got[1]["after2"][n]), n
        assert not torch.equal(got[0]["after2"][n], got[0]["before"][n]), n
        diff.append((got[0]["grads2"][n].double() - g.double()).reshape(-1))
    diff = torch.cat(diff)
    want_std = sigma * C / expected
    assert abs(float(diff.std()) - want_std) < 6 * want_std / math.sqrt(2 * diff.numel())


def test_loaders_must_sample_for_the_engines_ranks(daemon, tmp_path):
    """A DPDataLoader made before init_process_group, or with
    distributed=False, samples the whole dataset on every rank while the
    ledger accounts q once: refused, naming the world sizes. So are loaders
    whose generators are in the same state on two ranks (their masks would
    be alike). The default loaders of ranks seeded alike draw apart."""
    _spawn(run_rank_loader, (2, str(tmp_path / "init"), daemon.socket, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "loader%d.pt" % r)) for r in range(2)]
    for r in range(2):
        for case in ("early", "local"):
            msg = got[r][case]
            assert msg is not None and "world size 1" in msg and "2 ranks" in msg and \
                "init_process_group" in msg, (r, case, msg)
        assert got[r]["alike"] is not None and "generator" in got[r]["alike"], got[r]["alike"]
        assert got[r]["good"] is None, got[r]["good"]
        assert got[r]["shard"] and all(i % 2 == r for i in got[r]["shard"])
    assert got[0]["masks"] != got[1]["masks"]


def test_ranks_without_a_job_id_use_rank_0s(daemon, tmp_path):
    """Engines made without job_id, before init_process_group, each with
    its own fresh id: make_private gives every rank rank 0's (printed once,
    by rank 0), so rank 1's noiseless steps are shares of rank 0's account
    (a finite epsilon, not a job of its own without privacy). Ranks given
    different job ids are refused, naming both."""
    _spawn(run_rank_job_id, (2, str(tmp_path / "init"), daemon.socket, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "job%d.pt" % r)) for r in range(2)]
    assert got[0]["before"] != got[1]["before"]
    assert got[0]["after"] == got[1]["after"] == got[0]["before"]
    assert got[0]["printed"] == "dpclip: job id %s (pass job_id= to share an account)\n" % \
        got[0]["after"]
    assert got[1]["printed"] == ""
    assert 0 < got[0]["epsilon"] < math.inf, got[0]["epsilon"]
    # a share's reply carries the job's epsilon so far (0 where it came
    # first); a sigma-0 job of its own would be charged as no privacy (inf)
    assert 0 <= got[1]["epsilon"] < math.inf, got[1]["epsilon"]
    assert got[0]["mismatch"] is None
    msg = got[1]["mismatch"]
    assert msg is not None and "job_id" in msg and "'pytest-explicit-1'" in msg and \
        "'pytest-explicit-0'" in msg, msg
