"""Norm groups (model parallelism): two gloo ranks, each holding part of one
model, clipped as the whole model is (noise off): a pipeline split of a
small sequence model and a tensor-parallel split of a Linear with a
replicated LayerNorm, each against the single-process per-sample reference
of the unsplit model; group-wise clipping against its own reference (each
stage clipped alone to C / sqrt(2)); the ledger charged once per group
step; make_private's refusals."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from dpclip.torch import PrivacyEngine
from conftest import REPO
from group_worker import run_pipeline, run_replicated_pipeline, run_tensor_parallel
from models import TPModel, pipeline_model, reference, seq_data, tp_data
from models import between as _between, max_rel as _max_rel, spawn as _spawn

B, EXPECTED = 7, 9  # the divisor is the expected batch size, not the batch


def _pipeline_reference():
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(B, seed=8)
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    return whole, x, y, _between(norms)


def test_pipeline_split_is_clipped_as_the_whole_model(daemon, tmp_path):
    whole, x, y, C = _pipeline_reference()
    want, norms, coefs = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    assert (coefs < 1).any() and (coefs == 1).any()
    _spawn(run_pipeline, (2, str(tmp_path / "init"), daemon.socket, (x, y), C, EXPECTED, "flat",
                          str(tmp_path)))
    got = [torch.load(str(tmp_path / ("pp%d.pt" % r))) for r in range(2)]
    names = set()
    for r in range(2):
        for n, g in got[r]["grads"].items():
            assert g is not None, n
            assert _max_rel(g, want[n]) < 2e-4, (r, n)
            names.add(n)
        # each stage's norms are the whole model's: the group summed them
        assert _max_rel(got[r]["norms"], norms) < 1e-4, r
        assert got[r]["expected"] == EXPECTED  # stage 1 took rank 0's
    assert names == set(want)
    assert got[0]["group"] == got[1]["group"] and got[0]["group"]
    # Noise on, two group steps: one job, charged once per group step, as
    # one process taking two steps at the same (q, sigma) is.
    assert got[0]["job"] == got[1]["job"]
    assert got[1]["sample_rate"] == 0.05
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
    assert 0 < single < math.inf
    assert abs(got[0]["epsilon"] - single) <= 1e-9 * single, (got[0]["epsilon"], single)
    assert got[1]["epsilon"] <= got[0]["epsilon"]


def test_group_wise_clips_each_stage_alone(daemon, tmp_path):
    whole, x, y, _ = _pipeline_reference()
    stages = [{n for n, _ in whole.named_parameters() if n.startswith("%d." % r)}
              for r in range(2)]
    # C / sqrt(2) between stage 0's own norms (stage 1's are larger)
    _, norms0, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1, only=stages[0])
    C = math.sqrt(2) * _between(norms0)
    _spawn(run_pipeline, (2, str(tmp_path / "init"), daemon.socket, (x, y), C, EXPECTED,
                          "group_wise", str(tmp_path)))
    for r in range(2):
        got = torch.load(str(tmp_path / ("pp%d.pt" % r)))
        want, norms, coefs = reference(whole, "seq", (x,), y, C / math.sqrt(2), "mean", EXPECTED,
                                       only=stages[r])
        assert (coefs < 1).any() and (r == 1 or (coefs == 1).any()), r
        assert set(got["grads"]) == stages[r]
        for n, g in got["grads"].items():
            assert _max_rel(g, want[n]) < 2e-4, (r, n)
        assert _max_rel(got["norms"], norms) < 1e-4, r  # its own norms, not the sum


def test_tensor_parallel_split_with_a_replicated_layernorm(daemon, tmp_path):
    torch.manual_seed(4)
    whole = TPModel()
    (x,), y = tp_data(B, seed=9)
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    C = _between(norms)
    want, norms, coefs = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    assert (coefs < 1).any() and (coefs == 1).any()
    _spawn(run_tensor_parallel, (2, str(tmp_path / "init"), daemon.socket, ((x,), y), C,
                                 EXPECTED, str(tmp_path)))
    p = whole.fc.out_features // 2
    for r in range(2):
        got = torch.load(str(tmp_path / ("tp%d.pt" % r)))
        g = got["grads"]
        # the LayerNorm, counted once in the norms, whole on both ranks
        assert _max_rel(g["ln.weight"], want["ln.weight"]) < 2e-4, r
        assert _max_rel(g["ln.bias"], want["ln.bias"]) < 2e-4, r
        assert _max_rel(g["fc.weight"], want["fc.weight"][r * p:(r + 1) * p]) < 2e-4, r
        assert _max_rel(g["fc.bias"], want["fc.bias"][r * p:(r + 1) * p]) < 2e-4, r
        assert _max_rel(got["norms"], norms) < 1e-4, r
        # refusals, alike on both members
        msg = got["rep_differ"]
        assert msg is not None and "replicated_modules" in msg and "'ln'" in msg, (r, msg)
        msg = got["c_differ"]
        assert msg is not None and "max_grad_norm" in msg, (r, msg)
        msg = got["rep_wise"]
        assert msg is not None and "replicated_modules" in msg and "group_wise" in msg, (r, msg)
        msg = got["rep_outside"]
        assert msg is not None and "replicated_modules" in msg and "not a submodule" in msg, \
            (r, msg)
        msg = got["one_fails"]
        assert msg is not None and "not a submodule" in msg and \
            (r == 0 or "failed on member 0" in msg), (r, msg)
        msg = got["clipping"]
        assert msg is not None and "norm_group_clipping" in msg and "'by-layer'" in msg, (r, msg)


def test_replicas_of_a_pipeline_are_data_parallel(daemon, tmp_path):
    """4 ranks: 2 data-parallel replicas of a 2-stage pipeline give the
    union batch's gradient of the whole model on every rank, and with noise
    on, one replica's noise (std sigma * C / expected), not two."""
    whole, x, y, C = _pipeline_reference()
    want, norms, coefs = reference(whole, "seq", (x,), y, C, "mean", EXPECTED)
    assert (coefs < 1).any() and (coefs == 1).any()
    _spawn(run_replicated_pipeline, (4, str(tmp_path / "init"), daemon.socket, (x, y), C,
                                     EXPECTED, str(tmp_path)), nprocs=4)
    got = [torch.load(str(tmp_path / ("dp%d.pt" % r))) for r in range(4)]
    for r in range(4):
        assert got[r]["replica"] == (r // 2, 2), r
        for n, g in got[r]["grads"].items():
            assert _max_rel(g, want[n]) < 2e-4, (r, n)
        assert _max_rel(got[r]["norms"], norms[r // 2::2]) < 1e-4, r
        assert got[r]["job"] == got[0]["job"]
    for part in range(2):  # both replicas apply the same noised update
        assert torch.equal(got[part]["noise"], got[2 + part]["noise"])
    noise = torch.cat([got[0]["noise"], got[1]["noise"]]).double()
    want_std = 2.0 * C / EXPECTED
    assert abs(float(noise.std()) - want_std) < 6 * want_std / math.sqrt(2 * noise.numel())
    assert 0 < got[0]["epsilon"] < math.inf


def test_norm_group_needs_torch_distributed(daemon):
    """norm_group without an initialized process group: a clear error."""
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as ei:
        engine.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                            noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                            norm_group=object())
    assert "norm_group" in str(ei.value) and "init_process_group" in str(ei.value)
    engine.close()


def test_pipeline_example_trains(secure_daemon):
    """examples/train_pipeline.py, 20 steps against the suite's (secure) daemon:
    both stages train, and stage 0 prints the epoch's loss, epsilon and
    tokens/s, and the steps the ledger charged."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_pipeline.py"),
                        "--socket", secure_daemon.socket, "--steps", "20"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"^epoch 1: loss ([0-9.]+), epsilon ([0-9.]+), ([0-9]+) tokens/s$", p.stdout,
                  re.M)
    assert m, p.stdout
    loss, eps, rate = float(m.group(1)), float(m.group(2)), int(m.group(3))
    assert 0 < loss < 10 and 0 < eps < math.inf and rate > 0, m.group(0)
    assert "after 20 steps" in p.stdout, p.stdout


def test_daemon_layout():
    """Members are placed on daemons by the daemon each uses: daemons
    numbered by their lowest member (rank 0's daemon is daemon 0)."""
    from dpclip._group import daemon_layout
    keys = ["h:/b", "h:/a", "h:/b", "g:/a"]
    assert daemon_layout(keys, 0) == (3, 0, 2)
    assert daemon_layout(keys, 1) == (3, 1, 1)
    assert daemon_layout(keys, 2) == (3, 0, 2)
    assert daemon_layout(keys, 3) == (3, 2, 1)
    assert daemon_layout(["x"] * 3, 1) == (1, 0, 3)
