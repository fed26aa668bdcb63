"""bench/bench_torch_step.py's CPU path (a tiny GPT): the modes take turns,
each round's own private/plain ratio is reported with their median, and
the daemon's time per step by phase comes from its status socket
(bench/daemon_phases.py). No test reads a timing beyond its being
positive (the figures are taken on the GPU machine).

    python3 -m pytest -q python/tests/test_bench_torch_step.py
"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rounds_ratios_and_daemon_phases(secure_daemon):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_torch_step.py"),
         "--socket", secure_daemon.socket, "--device", "cpu", "--blocks", "1", "--d", "32",
         "--heads", "2", "--vocab", "67", "--seq", "12", "--batch", "3", "--steps", "2",
         "--warmup", "1", "--repeat", "3", "--precision", "fp32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    (phases,) = [l for l in lines if "daemon_phase_ms" in l]
    ph = phases["daemon_phase_ms"]
    for k in ("validate", "queue", "run", "reply", "norms", "clipping", "noise"):
        assert ph[k] > 0, (k, ph)
    assert ph["norms"] + ph["clipping"] <= ph["run"] * 1.001, ph  # parts of run
    runs = {l["mode"]: l for l in lines if "mode" in l}
    (ratio,) = [l for l in lines if l.get("ratio") == "dpclip/plain"]
    r = ratio["round_ratios"]
    assert len(r) == 3 and r == sorted(r) and all(x > 0 for x in r), ratio
    assert ratio["round_ratio_median"] == r[1]
    assert len(runs["plain"]["step_ms_runs"]) == len(runs["dpclip"]["step_ms_runs"]) == 3
