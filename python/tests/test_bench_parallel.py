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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--blocks", "2", "--d", "32", "--heads", "2", "--vocab", "67",
         "--seq", "12", "--batch", "2", "--warmup", "1", "--steps", "1", "--repeat", "1"]


@pytest.mark.parametrize("mode,ranks", [("pipeline", 2), ("ddp", 4), ("ddp_pipeline", 4)])
def test_layout_checks_and_times(secure_daemon, mode, ranks):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_parallel.py"), "--mode", mode,
         "--socket", secure_daemon.socket, "--check"] + SMALL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    check = [line for line in lines if line.get("check")]
    assert len(check) == 1 and check[0]["ok"], proc.stdout
    assert check[0]["max_rel_err"] <= check[0]["tol"] and len(check[0]["ranks"]) == ranks
    assert 0 < check[0]["clipped"] < check[0]["samples"], check  # C between the norms
    runs = {line["run"]: line for line in lines if "run" in line}
    assert set(runs) == {"plain", "dpclip"} and all(r["step_ms"] > 0 for r in runs.values())
    ratio = [line for line in lines if line.get("ratio") == "dpclip/plain"]
    assert len(ratio) == 1 and ratio[0]["time_ratio"] > 0, proc.stdout
