"""Gradient accumulation over several processes (issue 39), gloo on the
CPU: a 2-stage pipeline under GPipe and 1F1B with 4 micro-batches per
logical step (flat clipping: each micro-batch's per-sample norms summed
over the stages), and data parallelism with each rank accumulating its own
micro-batches, each against the per-sample f64 reference of the unsplit
model on the whole logical batch (noise off); with noise, one draw and one
charge per logical step. The GPU variants run in two layouts: "one_gpu"
(both ranks on cuda:0, gloo) and "two_gpus" (rank r on cuda:r, NCCL; skips
with fewer than 2 GPUs), one dpclipd serving both; the steady-step test
runs "one_gpu_nccl" too (both on cuda:0, NCCL between them):

    python3 -m pytest -q python/tests/test_accumulate_parallel.py -k cuda
"""
import math

import pytest
import torch

from dpclip.torch import PrivacyEngine
from accum_worker import run_data_parallel, run_dropped, run_schedule, run_steady_schedule
from dpclip.pipeline import schedule
from models import pipeline_model, reference, seq_data, SeqModel
from models import between as _between, max_rel as _max_rel, spawn as _spawn

EXPECTED = 14  # the logical batch's expected size (the batch is 12)


def test_schedules():
    assert schedule("1f1b", 2, 0, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                         ("F", 3), ("B", 2), ("B", 3)]
    assert schedule("1f1b", 2, 1, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                         ("B", 2), ("F", 3), ("B", 3)]
    assert schedule("gpipe", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1),
                                          ("B", 0)]
    assert schedule("1f1b", 3, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                                         ("B", 2)]  # stages - stage - 1 = 2 to warm up
    for bad in (("zb", 2, 0, 4), ("1f1b", 2, 2, 4), ("gpipe", 2, 0, -1)):
        with pytest.raises(ValueError):
            schedule(*bad)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_pipeline_micro_batches_equal_the_unsplit_model(daemon, tmp_path, kind):
    """2 stages, 4 micro-batches (3 + 4 + 2 + 3) of a logical batch of 12:
    both stages' gradients and norms are the whole model's on the 12 (the
    daemon sums each micro-batch's per-sample norms over the stages), in
    one logical step; with noise, two logical steps cost what two steps of
    one process do."""
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(12, seed=8)
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, norms, coefs = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    assert (coefs < 1).any() and (coefs == 1).any()
    _spawn(run_schedule, (2, str(tmp_path / "init"), daemon.socket, (x, y), [3, 4, 2, 3], C,
                          EXPECTED, kind, str(tmp_path)))
    names = set()
    for r in range(2):
        got = torch.load(str(tmp_path / ("%s%d.pt" % (kind, r))))
        assert got["steps"] == 1
        # each micro-batch went once complete (before step(): 1F1B's first
        # two on stage 0, three on stage 1; GPipe's backwards run in
        # reverse, so all four at step())
        assert got["early"] == {"1f1b": [2, 3], "gpipe": [0, 0]}[kind][r], got["early"]
        # a member's micro-batches, sent without waiting, held until their
        # replies: at least one, at most all four and the commit
        assert 1 <= got["held"] <= len([3, 4, 2, 3]) + 1, got["held"]
        for n, g in got["grads"].items():
            assert _max_rel(g, want[n]) < 2e-4, (kind, r, n)
            names.add(n)
        assert _max_rel(got["norms"], norms) < 1e-4, (kind, r)
    assert names == set(want)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    m = torch.nn.Linear(2, 2)
    m, opt, _ = engine.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                    noise_multiplier=1.0, max_grad_norm=C, sample_rate=0.05,
                                    expected_batch_size=EXPECTED, target_delta=1e-5)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(3, 2)).sum().backward()
        opt.step()
    single = engine.last_epsilon
    engine.close()
    got = torch.load(str(tmp_path / ("%s0.pt" % kind)))
    assert 0 < single < math.inf and got["epsilon"] == pytest.approx(single, rel=1e-9)


def test_pipeline_after_a_dropped_logical_step(daemon, tmp_path):
    """A logical step dropped by zero_grad() after its schedule, when stage
    1 had sent a micro-batch and stage 0 none: the next step, of one
    micro-batch, is sent alike by both (a logical step of the same id) and
    equals the reference on its samples alone."""
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(7, seed=8)
    C = 1.0
    want, norms, _ = reference(whole, "seq", (x[:5],), y[:5], C, "mean", EXPECTED)
    _spawn(run_dropped, (2, str(tmp_path / "init"), daemon.socket, (x, y), C, EXPECTED,
                         str(tmp_path)))
    for r in range(2):
        got = torch.load(str(tmp_path / ("dropped%d.pt" % r)))
        assert got["early"] == [0, 1][r] and got["steps"] == 1
        for n, g in got["grads"].items():
            assert _max_rel(g, want[n]) < 2e-4, (r, n)
        assert _max_rel(got["norms"], norms) < 1e-4, r


def test_data_parallel_accumulation_equals_one_process(daemon, tmp_path):
    """Two ranks, each accumulating its shard of a logical batch of 12 in
    micro-batches of its own (rank 0: 3 + 1 + 2, rank 1: 4 + 2): every rank
    holds the union's gradient of one process, all-reduced once after the
    commits; with noise and zero gradients, one rank's noise (std
    sigma * C / E), not one per rank or micro-batch."""
    (x,), y = seq_data(12, seed=5)
    torch.manual_seed(100)
    model = SeqModel()
    _, norms, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, _, coefs = reference(model, "seq", (x,), y, C, "mean", EXPECTED)
    assert (coefs < 1).any() and (coefs == 1).any()
    pieces = [[[0, 2, 4], [6], [8, 10]], [[1, 3, 5, 7], [9, 11]]]
    _spawn(run_data_parallel, (2, str(tmp_path / "init"), daemon.socket, (x, y), pieces, C,
                               EXPECTED, str(tmp_path)))
    got = [torch.load(str(tmp_path / ("dp%d.pt" % r))) for r in range(2)]
    for r in range(2):
        assert got[r]["steps"] == 1
        for n, w in want.items():
            assert _max_rel(got[r]["grads"][n], w) < 2e-4, (r, n)
        assert got[r]["norms"].shape == (6,)
    assert torch.equal(got[0]["noise"], got[1]["noise"])
    noise = got[0]["noise"].double()
    want_std = 2.0 * C / EXPECTED
    assert abs(float(noise.std()) - want_std) < 6 * want_std / math.sqrt(2 * noise.numel())


LAYOUTS = ["one_gpu", "two_gpus"]


def _cuda_daemon(daemon, layout):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if layout == "two_gpus":
        if torch.cuda.device_count() < 2:
            pytest.skip("two_gpus needs 2 CUDA devices, this machine has %d"
                        % torch.cuda.device_count())
        if not torch.distributed.is_nccl_available():
            pytest.skip("two_gpus runs NCCL: this torch has none")
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    try:
        if not engine.client.info.has_cuda:
            pytest.skip("this dpclipd has no CUDA backend")
    finally:
        engine.close()
    return daemon


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_micro_batches_on_cuda(daemon, tmp_path, kind, layout):
    """The same two stages on one GPU (gloo between them through host
    memory), or stage r on cuda:r (NCCL sends and receives GPU to GPU): a
    flat norm group's GPU micro-batches have no early notice and are sent
    detached, their tensors held until collected."""
    _cuda_daemon(daemon, layout)
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(12, seed=8)
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, norms, _ = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    _spawn(run_schedule, (2, str(tmp_path / "init"), daemon.socket, (x, y), [3, 4, 2, 3], C,
                          EXPECTED, kind, str(tmp_path), layout))
    for r in range(2):
        got = torch.load(str(tmp_path / ("%s%d.pt" % (kind, r))))
        assert got["steps"] == 1
        for n, g in got["grads"].items():
            assert _max_rel(g, want[n]) < 3e-3, (kind, r, n)  # TF32
        assert _max_rel(got["norms"], norms) < 3e-3, (kind, r)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("layout", ["cpu"] + LAYOUTS + ["one_gpu_nccl"])
def test_steady_pipeline_steps_with_new_allocations(daemon, tmp_path, kind, layout):
    """Three logical steps of the same 4 micro-batches (steady: each
    backward's tensors named for the daemon at its end), stage 1's inputs
    in allocations the daemon has not seen. Under 1F1B stage 1's earlier
    micro-batch is in flight at that point, waiting in the daemon for stage
    0's, which waits on the GPU for the gradient this stage sends after the
    backward: a registration queued behind it was never answered (the
    pipeline hung from its second logical step). Every step's gradients
    and norms are the unsplit model's, and the lookups that met a new
    allocation left it to the step's submission (on the CPU, a stand-in
    lookup answers so; the run and the daemon's sums are the same)."""
    if layout != "cpu":
        _cuda_daemon(daemon, layout if layout != "one_gpu_nccl" else "one_gpu")
    if layout == "one_gpu_nccl" and not torch.distributed.is_nccl_available():
        pytest.skip("one_gpu_nccl runs NCCL: this torch has none")
    torch.manual_seed(3)
    whole = pipeline_model(once=True)
    (x,), y = seq_data(12, seed=8)
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, norms, _ = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    _spawn(run_steady_schedule, (2, str(tmp_path / "init"), daemon.socket, (x, y), [3, 3, 3, 3],
                                 C, EXPECTED, kind, str(tmp_path), layout), timeout=300)
    for r in range(2):
        got = torch.load(str(tmp_path / ("steady-%s%d.pt" % (kind, r))))
        assert got["steps"] == 3 and len(got["grads"]) == 3
        tol = 2e-4 if layout == "cpu" else 3e-3  # (TF32)
        for k in range(3):
            assert set(got["grads"][k]) == {n for n in want if n.startswith("%d." % r)}
            for n, g in got["grads"][k].items():
                assert _max_rel(g, want[n]) < tol, (kind, r, k, n)
            assert _max_rel(got["norms"][k], norms) < tol, (kind, r, k)
        if r == 1 and kind == "1f1b":  # (GPipe's backwards follow all forwards: none staged)
            # steps 2 and 3 staged each micro-batch, and each met a new allocation
            assert got["later"] == got["seals"] >= 2 * 4, (got["later"], got["seals"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_parallel_accumulation_on_cuda(daemon, tmp_path, layout):
    """Two ranks on one GPU (gloo), or rank r on cuda:r (NCCL), each
    accumulating asynchronous GPU micro-batches (early notices), all-reduced
    once after the commits."""
    _cuda_daemon(daemon, layout)
    (x,), y = seq_data(12, seed=5)
    torch.manual_seed(100)
    model = SeqModel()
    _, norms, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, _, _ = reference(model, "seq", (x,), y, C, "mean", EXPECTED)
    pieces = [[[0, 2, 4], [6], [8, 10]], [[1, 3, 5, 7], [9, 11]]]
    _spawn(run_data_parallel, (2, str(tmp_path / "init"), daemon.socket, (x, y), pieces, C,
                               EXPECTED, str(tmp_path), layout))
    got = [torch.load(str(tmp_path / ("dp%d.pt" % r))) for r in range(2)]
    for r in range(2):
        for n, w in want.items():
            assert _max_rel(got[r]["grads"][n], w) < 3e-3, (r, n)
    noise = got[0]["noise"].double()
    want_std = 2.0 * C / EXPECTED
    assert abs(float(noise.std()) - want_std) < 6 * want_std / math.sqrt(2 * noise.numel())
