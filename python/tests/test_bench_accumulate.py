"""bench/bench_accumulate.py's CPU path (a tiny GPT, a logical batch of 16
in micro-batches of 4): both modes run, the private one is charged once
per logical step (its epsilon is that of 2 steps at q = 1, sigma = 1: the
warm-up and the timed one), and the ratio line is printed; with --opacus
(where Opacus imports: never on CI, which has Debian's packages only) a
third mode's line, a result or a reason it was skipped, and the other
modes still run. The GPU measurement itself is not run here; no test reads
a timing beyond its being positive.

    python3 -m pytest -q python/tests/test_bench_accumulate.py
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--blocks", "2", "--d", "32", "--heads", "2", "--vocab", "67",
         "--seq", "12", "--logical", "16", "--micro", "4", "--warmup", "1", "--steps", "1",
         "--rounds", "1"]


def bench(daemon, *extra):
    """The bench's JSON lines, its stderr."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_accumulate.py"),
         "--socket", daemon.socket] + SMALL + list(extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], \
        proc.stderr


def test_both_modes_and_the_ratio(secure_daemon):
    lines, _ = bench(secure_daemon)
    runs = {line["run"]: line for line in lines if "run" in line}
    assert set(runs) == {"plain", "dpclip"} and all(r["tokens_per_s"] > 0 for r in runs.values())
    # one charge per logical step: 2 logical steps (warm-up, timed) at q = 1,
    # sigma = 1 give this epsilon at delta 1e-5 (the daemon's accountant)
    from dpclip.torch import PrivacyEngine  # noqa: F401  (the package imports)
    eps = runs["dpclip"]["epsilon"]
    assert 6.5 < eps < 7.5, eps
    ratio = [line for line in lines if line.get("ratio") == "dpclip/plain"]
    assert len(ratio) == 1 and ratio[0]["time_ratio"] > 0, lines
    assert not [line for line in lines if line.get("mode") == "opacus"]  # only when asked


def test_opacus_mode(secure_daemon):
    # in this process only to decide skipping: the bench imports it itself
    pytest.importorskip("opacus.utils.batch_memory_manager")
    lines, err = bench(secure_daemon, "--opacus", "--rounds", "2", "--opacus-rounds", "2")
    runs = {line["run"]: line for line in lines if "tokens_per_s" in line}
    assert {"plain", "dpclip"} <= set(runs), (lines, err)  # whatever Opacus did
    opacus = [line for line in lines if line.get("mode") == "opacus"]
    assert len(opacus) == 1, lines
    line = opacus[0]
    if "skipped" in line:  # a reason, and no ratio without a result
        assert line["skipped"], line
        assert not [r for r in lines if r.get("ratio") == "opacus/plain"], lines
        return
    assert line["grad_sample_mode"] == "ghost" and line["precision"] == "fp32", line  # CPU
    assert line["rounds_run"] == len(line["rounds"]) >= 1 and line["rounds_asked"] == 2, line
    assert line["tokens_per_s"] > 0 and all(t > 0 for t in line["rounds"]), line
    assert line["sample_rate"] == 0.25 and "device_mem_mib" in line, line
    # Poisson logical batches: one size per timed step (1 a round), each at
    # most the pool of 4 logical batches' samples
    assert len(line["logical_sizes"]) == line["rounds_run"], line
    assert all(0 < n <= 64 for n in line["logical_sizes"]), line
    ratio = [r for r in lines if r.get("ratio") == "opacus/plain"]
    assert len(ratio) == 1 and ratio[0]["time_ratio"] > 0, lines
