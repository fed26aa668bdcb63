"""bench/run_step_rows.sh, the README's one-GPU table row by row, on the
CPU with tiny models (--cpu): each row against a daemon of its own, its
bench's JSON lines tagged with the row and MPS; a row that fails says so,
the others go on, and the script fails. No test reads a timing beyond its
being positive (the figures are taken on the GPU machine).

    python3 -m pytest -q python/tests/test_bench_rows.py
"""
import functools

from conftest import run_rows

_run = functools.partial(run_rows, "run_step_rows.sh")


def test_rows_each_tagged(tmp_path):
    proc, lines = _run("--rows", "gpt,host", "--repeat", "2")
    assert proc.returncode == 0, proc.stderr
    assert {l["row"] for l in lines} == {"gpt", "host"}
    assert all(l["mps"] is False for l in lines)
    (ratio,) = [l for l in lines if l["row"] == "gpt" and l.get("ratio") == "dpclip/plain"]
    assert len(ratio["round_ratios"]) == 2 and all(r > 0 for r in ratio["round_ratios"])
    (host,) = [l for l in lines if l["row"] == "host"]
    assert host["bench"] == "host_overhead" and host["step_ms"] > 0


def test_a_failing_row_is_said_and_the_others_go_on(tmp_path):
    """A Python that fails every bench (but the row after it still runs:
    the daemon of the failed one is stopped first)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    proc, lines = _run("--rows", "gpt,llama1b", "--repeat", "2", python=str(fake))
    assert proc.returncode == 1
    assert [(l["row"], l["failed"]) for l in lines] == [("gpt", 3), ("llama1b", 3)]
    assert "row gpt (MPS false) failed with status 3" in proc.stderr and "broken" in proc.stderr


def test_the_unkept_row_runs_its_own_daemon():
    """llama1b_nokept: the Llama's bench against a daemon started with
    DPCLIP_CUDA_SGRAD=0 (on the CPU a tiny model, the switch unread), tagged
    with its own row."""
    proc, lines = _run("--rows", "llama1b_nokept", "--repeat", "2")
    assert proc.returncode == 0, proc.stderr
    assert lines and {l["row"] for l in lines} == {"llama1b_nokept"}
    (ratio,) = [l for l in lines if l.get("ratio") == "dpclip/plain"]
    assert ratio["model"] == "llama1b" and len(ratio["round_ratios"]) == 2


def test_an_unknown_row_is_refused():
    proc, _ = _run("--rows", "gpt3")
    assert proc.returncode == 2 and "unknown row gpt3" in proc.stderr
