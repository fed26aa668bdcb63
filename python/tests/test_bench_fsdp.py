"""bench/bench_fsdp.py's CPU path (gloo ranks, plain models with
sharded_noise), which any torch runs: --check agrees with the one-process
reference and exits 0; a timing run prints a line per rank and mode,
Opacus's skipped line and the ratios; likewise with gradient accumulation
(--logical, --micro), whose check also fails where the ranks do not
accumulate. The GPU measurement itself (fully_shard, NCCL) is not run
here.

    python3 -m pytest -q python/tests/test_bench_fsdp.py
"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--device", "cpu", "--world", "2", "--blocks", "1", "--d", "32", "--heads", "2",
         "--ffn", "64", "--vocab", "67", "--seq", "12", "--batch", "2"]


def _bench(daemon, *extra, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_fsdp.py"), "--socket",
         daemon.socket] + SMALL + list(extra), env=dict(os.environ, **(env or {})),
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


# a logical step of 8 samples: 4 a rank, in 2 micro-batches of 2
LOGICAL = ["--logical", "8", "--micro", "2"]


def test_accumulation_timing_lines(secure_daemon):
    proc, lines = _bench(secure_daemon, *LOGICAL, "--warmup", "1", "--steps", "1",
                         "--repeat", "2", "--opacus")
    assert proc.returncode == 0, proc.stderr
    config = [line["config"] for line in lines if "config" in line]
    assert config and (config[0]["logical"], config[0]["micro"]) == (8, 2), proc.stdout
    runs = [line for line in lines if "ms_per_step" in line]
    assert sorted((r["rank"], r["mode"]) for r in runs) == \
        [(0, "ddp"), (0, "dpclip"), (1, "ddp"), (1, "dpclip")], proc.stdout
    for r in runs:
        assert (r["logical"], r["micro"], r["world"], r["micro_batches"]) == (8, 2, 2, 2), r
        assert r["tokens_per_s"] > 0 and len(r["ms_rounds"]) == 2, r
        assert "device_used_peak_mib" not in r, r  # the GPU's memory: not on the CPU
    opacus = [line for line in lines if line.get("mode") == "opacus"]
    assert len(opacus) == 1 and "--logical" in opacus[0]["skipped"], proc.stdout
    ratio = [line for line in lines if line.get("ratios")]
    assert len(ratio) == 1, proc.stdout
    ratio = ratio[0]
    assert (ratio["logical"], ratio["micro"], ratio["world"]) == (8, 2, 2), ratio
    assert ratio["plain_tokens_per_s"] > 0 and ratio["private_tokens_per_s"] > 0, ratio
    assert ratio["time_ratio_best_round"] <= ratio["time_ratio_median_round"] <= \
        ratio["time_ratio_worst_round"], ratio


def test_accumulation_check_passes_and_can_fail(secure_daemon):
    """Micro-batches against the one-process whole-batch reference: within
    tolerance; and not where each micro-batch's zero_grad() drops the ones
    before it (only the last counts)."""
    proc, lines = _bench(secure_daemon, "--model", "llama1b", *LOGICAL, "--check")
    assert proc.returncode == 0, proc.stderr
    res = [line for line in lines if line.get("check")]
    assert len(res) == 1, proc.stdout
    res = res[0]
    assert res["passed"] and (res["logical"], res["micro"], res["batch_per_rank"]) == (8, 2, 4)
    assert res["max_abs_update"] > 0 and res["max_tensor_l2_rel_diff"] <= 5e-3, res
    proc, lines = _bench(secure_daemon, "--model", "llama1b", *LOGICAL, "--check",
                         env={"BENCH_FSDP_CHECK_FAULT": "zero_grad"})
    assert proc.returncode == 1, proc.stderr
    res = [line for line in lines if line.get("check")]
    assert len(res) == 1 and not res[0]["passed"] and res[0]["fault"] == "zero_grad", proc.stdout
    assert res[0]["max_tensor_l2_rel_diff"] > 0.1, res[0]
