"""bench/bench_fsdp.py's CPU path (gloo ranks, plain models with
sharded_noise), which any torch runs: --check agrees with the one-process
reference and exits 0; a timing run prints a line per rank and mode,
Opacus's skipped line and the ratios. The GPU measurement itself
(fully_shard, NCCL) is not run here.

    python3 -m pytest -q python/tests/test_bench_fsdp.py
"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--world", "2", "--blocks", "1", "--d", "32", "--heads", "2",
         "--ffn", "64", "--vocab", "67", "--seq", "12", "--batch", "2"]


def _bench(daemon, *extra):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_fsdp.py"), "--socket",
         daemon.socket] + SMALL + list(extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, lines


def test_check_against_one_process(secure_daemon):
    proc, lines = _bench(secure_daemon, "--model", "llama1b", "--check")
    assert proc.returncode == 0, proc.stderr
    res = [line for line in lines if line.get("check")]
    assert len(res) == 1, proc.stdout
    res = res[0]
    assert res["passed"] and res["precision"] == "fp32" and not res["fully_shard"], res
    assert res["max_abs_update"] > 0 and res["max_tensor_l2_rel_diff"] <= 5e-3, res
    for a, b in zip(res["losses"], res["reference_losses"]):
        assert abs(a - b) < 1e-4, res


def test_timing_lines(secure_daemon):
    proc, lines = _bench(secure_daemon, "--warmup", "1", "--steps", "1", "--repeat", "2",
                         "--opacus")
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in lines if "ms_per_step" in line]
    assert sorted((r["rank"], r["mode"]) for r in runs) == \
        [(0, "ddp"), (0, "dpclip"), (1, "ddp"), (1, "dpclip")], proc.stdout
    assert all(len(r["ms_runs"]) == 2 for r in runs), runs
    assert [line for line in lines if line.get("mode") == "opacus"][0]["skipped"], proc.stdout
    ratio = [line for line in lines if line.get("ratios")]
    assert len(ratio) == 1 and ratio[0]["baseline"] == "ddp", proc.stdout
    assert {"private_over_plain_time", "private_over_plain_peak", "time_within_target",
            "peak_within_target"} <= set(ratio[0]), ratio
