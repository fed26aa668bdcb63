"""bench/bench_accumulate.py's CPU path (a tiny GPT, a logical batch of 16
in micro-batches of 4): both modes run, the private one is charged once
per logical step (its epsilon is that of 2 steps at q = 1, sigma = 1: the
warm-up and the timed one), and the ratio line is printed. The GPU
measurement itself is not run here.

    python3 -m pytest -q python/tests/test_bench_accumulate.py
"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--blocks", "2", "--d", "32", "--heads", "2", "--vocab", "67",
         "--seq", "12", "--logical", "16", "--micro", "4", "--warmup", "1", "--steps", "1",
         "--rounds", "1"]


def test_both_modes_and_the_ratio(secure_daemon):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_accumulate.py"),
         "--socket", secure_daemon.socket] + SMALL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    runs = {line["run"]: line for line in lines if "run" in line}
    assert set(runs) == {"plain", "dpclip"} and all(r["tokens_per_s"] > 0 for r in runs.values())
    # one charge per logical step: 2 logical steps (warm-up, timed) at q = 1,
    # sigma = 1 give this epsilon at delta 1e-5 (the daemon's accountant)
    from dpclip.torch import PrivacyEngine  # noqa: F401  (the package imports)
    eps = runs["dpclip"]["epsilon"]
    assert 6.5 < eps < 7.5, eps
    ratio = [line for line in lines if line.get("ratio") == "dpclip/plain"]
    assert len(ratio) == 1 and ratio[0]["time_ratio"] > 0, proc.stdout
