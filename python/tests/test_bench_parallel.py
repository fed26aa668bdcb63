"""bench/bench_parallel.py's CPU path (gloo ranks, tiny GPT): in every
layout, --check agrees with the unsplit model's per-sample f64 reference
and the timing prints both modes and their ratio. The GPU measurement
itself (NCCL, one GPU a rank) is not run here.

    python3 -m pytest -q python/tests/test_bench_parallel.py
"""
import json
import os
import subprocess
import sys

import pytest

from dpclip import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--blocks", "2", "--d", "32", "--heads", "2", "--vocab", "67",
         "--seq", "12", "--batch", "2", "--warmup", "1", "--steps", "1", "--repeat", "1"]


@pytest.mark.parametrize("mode,ranks", [("pipeline", 2), ("ddp", 4), ("ddp_pipeline", 4)])
def test_layout_checks_and_times(secure_daemon, mode, ranks):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_parallel.py"), "--mode", mode,
         "--socket", secure_daemon.socket, "--check", "--trace"] + SMALL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        for r in line.get("ranks", []) if "run" in line else []:
            # one micro-batch: a replica's forward and backward, or a stage's
            labels = list(r["trace"])
            assert labels[-2:] == ["step", "end"] and labels[:-2] in (
                ["FB0"], ["F0", "B0"]), (mode, r["stage"], labels)
    check = [line for line in lines if line.get("check")]
    assert len(check) == 1 and check[0]["ok"], proc.stdout
    assert check[0]["max_rel_err"] <= check[0]["tol"] and len(check[0]["ranks"]) == ranks
    assert 0 < check[0]["clipped"] < check[0]["samples"], check  # C between the norms
    runs = {line["run"]: line for line in lines if "run" in line}
    assert set(runs) == {"plain", "dpclip"} and all(r["step_ms"] > 0 for r in runs.values())
    ratio = [line for line in lines if line.get("ratio") == "dpclip/plain"]
    assert len(ratio) == 1 and ratio[0]["time_ratio"] > 0, proc.stdout


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_microbatches_check_and_time(secure_daemon, schedule):
    """A logical step of 4 micro-batches under each schedule: the check
    compares every rank's .grad (and the 8 samples' norms, in the
    micro-batches' order) with the unsplit model's reference over the whole
    logical batch; every line says the micro-batching. --trace: each
    rank's line marks its ops' starts in the schedule's order, then the
    step and its end, in time order."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_parallel.py"), "--mode", "pipeline",
         "--socket", secure_daemon.socket, "--check", "--microbatches", "4",
         "--schedule", schedule, "--trace"] + SMALL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 4, proc.stdout  # check, plain, dpclip, ratio
    for line in lines:
        assert (line["microbatches"], line["schedule"], line["logical_batch"]) == \
            (4, schedule, 8), line
    check = lines[0]
    assert check["check"] and check["ok"] and check["samples"] == 8, check
    assert check["max_rel_err"] <= check["tol"] and check["norms_max_rel_err"] <= check["tol"]
    # the same sums with the daemon's own coefficients: its arithmetic alone
    # (the host path's, in double), and the coefficients next to the rule's
    assert check["max_rel_err_given_coefs"] <= check["tol"], check
    assert 0 <= check["coefs_max_abs_err"] <= check["tol"], check
    assert not check["coefs_above_rule"] and 0 <= check["coefs_max_rel_shortfall"] <= 1e-2
    assert len(check["ranks"]) == 2 and all(r["ok"] for r in check["ranks"])
    assert 0 < check["clipped"] < 8, check
    runs = {line["run"]: line for line in lines if "run" in line}
    assert set(runs) == {"plain", "dpclip"}
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in runs.values())
    # the commit's round trip (the daemon's own figures come with GPU steps' replies)
    assert all(r["daemon_call_ms"] > 0 for r in runs["dpclip"]["ranks"])
    ratio = lines[3]
    assert ratio["ratio"] == "dpclip/plain", ratio
    assert 0 < ratio["time_ratio_best"] <= ratio["time_ratio_median"] <= \
        ratio["time_ratio_worst"], ratio
    # each stage held its micro-batches until their replies: at least one at
    # once, at most the four and the commit
    held = ratio["micro_batches_held_peak"]
    assert len(held) == 2 and all(1 <= h <= 5 for h in held), ratio
    # (one round: the ratio line's most over the rounds is that round's)
    assert held == [r["micro_batches_held_peak"] for r in runs["dpclip"]["ranks"]], ratio
    for run in runs.values():
        for r in run["ranks"]:
            want = ["%s%d" % op for op in pipeline.schedule(schedule, 2, r["stage"], 4)]
            trace = r["trace"]
            assert list(trace) == want + ["step", "end"], (run["run"], r["stage"], trace)
            host = [h for h, _ in trace.values()]
            assert host[0] == 0 and host == sorted(host) and host[-1] > 0, trace
            assert all(g == 0 for _, g in trace.values()), trace  # no GPU: no events


def test_coefficient_verdict():
    """The check's rule for the daemon's coefficients: never above the
    rule's (beyond the slack), and how far below, relative."""
    import torch
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import bench_parallel as bp
    finally:
        sys.path.pop(0)
    want = torch.tensor([1.0, 0.5, 0.25])
    assert bp.coef_verdict(want.clone(), want, 1e-6) == (0.0, False)
    short, above = bp.coef_verdict(torch.tensor([1.0, 0.5 * (1 - 4e-3), 0.25]), want, 1e-6)
    assert not above and abs(short - 4e-3) < 1e-6
    assert bp.coef_verdict(torch.tensor([1.0, 0.5, 0.25 * (1 + 1e-4)]), want, 1e-6)[1]
    assert not bp.coef_verdict(torch.tensor([1.0, 0.5, 0.25 * (1 + 1e-4)]), want, 1e-3)[1]
    assert bp.coef_verdict(torch.tensor([1.0, 0.5]), want, 1e-6) == (float("inf"), True)


def test_pipeline_microbatches_check_can_fail(secure_daemon):
    """The check is a comparison: a tolerance below f32's rounding fails it
    (exit 1, ok false), and nothing is timed."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_parallel.py"), "--mode", "pipeline",
         "--socket", secure_daemon.socket, "--check", "--tol", "1e-12", "--microbatches", "4"]
        + SMALL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and lines[0]["check"] and not lines[0]["ok"], proc.stdout
    assert lines[0]["max_rel_err"] > 1e-12
