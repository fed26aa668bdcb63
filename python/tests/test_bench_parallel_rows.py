"""bench/run_parallel_rows.sh, the README's multi-GPU table row by row, on
the CPU with tiny models on gloo ranks (--cpu): each row against daemons of
its own, its bench's JSON lines tagged with the row and MPS; a row that
needs a GPU per daemon says it was skipped, one that fails or runs past
--timeout says so, the others go on, and the script fails. No test reads a
timing beyond its being positive (the figures are taken on the GPU
machine).

    python3 -m pytest -q python/tests/test_bench_parallel_rows.py
"""
import functools

from conftest import run_rows

_run = functools.partial(run_rows, "run_parallel_rows.sh")


def test_rows_each_tagged_and_per_gpu_rows_skipped():
    proc, lines = _run("--rows", "ddp2,pipe,pipe_step,fsdp_logical2", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert {l["row"] for l in lines} == {"ddp2", "pipe", "pipe_step", "fsdp_logical2"}
    assert all(l["mps"] is False for l in lines)
    for row, mode in (("ddp2", "ddp"), ("pipe", "pipeline")):
        (ratio,) = [l for l in lines if l["row"] == row and l.get("ratio") == "dpclip/plain"]
        assert ratio["mode"] == mode and ratio["time_ratio"] > 0, ratio
    (pipe,) = [l for l in lines if l["row"] == "pipe" and l.get("ratio")]
    assert pipe["microbatches"] == 4 and pipe["daemons"] == 1, pipe
    (step,) = [l for l in lines if l["row"] == "pipe_step"]
    assert "one daemon per GPU" in step["skipped"], step
    (fsdp,) = [l for l in lines if l["row"] == "fsdp_logical2" and l.get("ratios")]
    assert fsdp["world"] == 2 and fsdp["private_over_plain_time"] > 0, fsdp


def test_a_failing_row_is_said_and_the_others_go_on(tmp_path):
    """A Python that fails every bench: each row says so, in order (the
    daemons of the failed one are stopped before the next starts)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    proc, lines = _run("--rows", "ddp2,fsdp2", python=str(fake))
    assert proc.returncode == 1
    assert [(l["row"], l["failed"]) for l in lines] == [("ddp2", 3), ("fsdp2", 3)]
    assert "row ddp2 (MPS false) failed with status 3" in proc.stderr and "broken" in proc.stderr


def test_a_row_past_its_time_is_killed(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    proc, lines = _run("--rows", "pipe", "--timeout", "1", python=str(fake))
    assert proc.returncode == 1
    assert [(l["row"], l["failed"]) for l in lines] == [("pipe", 137)]


def test_an_unknown_row_is_refused():
    proc, lines = _run("--rows", "ddp2,ddp3")
    assert proc.returncode == 2 and "unknown row ddp3" in proc.stderr and not lines
