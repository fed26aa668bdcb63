"""bench/bench_host_overhead.py's CPU path (a tiny GPT): it runs, names every
stage of a private step's host time, counts the step's parts, and its
stages add up to no more than the step. No test reads a timing beyond its
being positive (issue 40 takes the figures on the GPU machine).

    python3 -m pytest -q python/tests/test_bench_host.py
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ("collect", "wait", "guard", "plan", "check", "refs", "add_layers", "rebind", "send",
          "optimizer", "count_batch", "wire", "events", "layout", "drop", "wrapper", "mode",
          "commit", "whole", "run", "outputs", "alias", "finish", "other")


def test_stages_of_a_step(secure_daemon):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_host_overhead.py"),
         "--socket", secure_daemon.socket, "--device", "cpu", "--blocks", "2", "--d", "32",
         "--heads", "2", "--vocab", "67", "--seq", "12", "--batch", "3", "--warmup", "1",
         "--steps", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert line["bench"] == "host_overhead" and line["steps"] == 2
    # 2 blocks of LayerNorm, qkv, proj, LayerNorm, fc, out; the token and
    # position embeddings, the final norm and the head
    assert line["layers"] == 16 and line["parts"] >= line["layers"], line
    # the host path's stages, and the functions around them, timed
    for s in ("plan", "refs", "add_layers", "send", "count_batch", "drop", "wrapper", "mode",
              "commit", "whole", "run", "finish"):
        assert line[s] > 0, (s, line)
    assert sum(line[s] for s in STAGES) <= line["step_ms"] * 1.001, line
    assert line["other"] >= 0, line
    assert line["optimizer"] > 0 and line["path"] == "rebind", line
    assert abs(line["overhead_ms"] - (line["step_ms"] - line["optimizer"])) < 1e-3, line
    assert line["wait"] >= 0 and abs(line["overhead_less_wait_ms"] - (
        line["overhead_ms"] - line["wait"])) < 1e-3, line
    # the steps' submissions: after the plan and the layers, before the step ended
    assert line["plan"] + line["add_layers"] < line["before_submit_ms"] < line["step_ms"], line
    # the steady steps' plans staged during the backward: timed apart from step()
    assert line["staged_in_backward_ms"] > 0, line


def test_bare_timers(secure_daemon):
    """--bare: only the step, its submission and the wait are timed (the
    stages read 0), so the totals carry no stage timer's own cost."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_host_overhead.py"),
         "--socket", secure_daemon.socket, "--device", "cpu", "--blocks", "1", "--d", "32",
         "--heads", "2", "--vocab", "67", "--seq", "12", "--batch", "3", "--warmup", "1",
         "--steps", "2", "--bare"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert line["timers"] == "bare" and line["send"] > 0, line
    assert all(line[s] == 0 for s in ("plan", "guard", "drop", "wrapper", "run")), line
    assert line["optimizer"] > 0, line  # (overhead_ms is the step less the optimizer)
    assert 0 < line["before_submit_ms"] < line["step_ms"], line
    assert abs(line["before_submit_less_wait_ms"] - (line["before_submit_ms"] - line["wait"])) \
        < 1e-3, line


@pytest.mark.parametrize("given", ["git", "directory"])
def test_two_versions_take_turns(secure_daemon, tmp_path, given):
    """bench/host_ab.py: the package at a git revision (here HEAD), or in a
    directory (a copy of this tree's python/, bench/ and client/dpclip.h),
    and this tree's, each round a bare bench of each, summed up as one line
    per version (median, least, most of its rounds) and their ratio."""
    rev = "HEAD"
    if given == "directory":
        rev = str(tmp_path / "old")
        for d in ("python", "bench"):
            shutil.copytree(os.path.join(REPO, d), os.path.join(rev, d),
                            ignore=shutil.ignore_patterns("__pycache__"))
        os.makedirs(os.path.join(rev, "client"))
        shutil.copy(os.path.join(REPO, "client", "dpclip.h"), os.path.join(rev, "client"))
    elif subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode != 0:
        pytest.skip("not a git checkout: host_ab.py takes its base version from git")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "host_ab.py"), "--socket",
         secure_daemon.socket, "--base", rev, "--rounds", "2", "--", "--device", "cpu",
         "--blocks", "1", "--d", "32", "--heads", "2", "--vocab", "67", "--seq", "12",
         "--batch", "3", "--warmup", "1", "--steps", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    base, this, ratio = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert base["version"] == "base " + rev and this["version"] == "this tree", (base, this)
    for line in (base, this):
        assert line["rounds"] == 2
        for k in ("before_submit_less_wait_ms", "overhead_less_wait_ms", "backward_ms"):
            v = line[k]
            assert 0 < v["min"] <= v["median"] <= v["max"], (k, line)
    for k in ("before_submit_less_wait_ms", "overhead_less_wait_ms", "backward_ms"):
        assert abs(ratio[k] - this[k]["median"] / base[k]["median"]) < 2e-3, (k, ratio)
