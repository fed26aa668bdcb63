"""scripts/gpu_suite.sh, the GPU suite in parts under a limit each, on the
CPU: its parts are listed, each part's line says its result and counts
(the CUDA tests skip here, as they say), a part cut short by its limit
says "timed out" with its progress and fails the script, and an unknown
part is refused.

    python3 -m pytest -q python/tests/test_gpu_suite.py
"""
import json
import os
import subprocess
import sys

from conftest import DPCLIPD

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_suite.sh")


def _run(*args):
    env = dict(os.environ, DPCLIP_PYTHON=sys.executable)
    proc = subprocess.run(["sh", SCRIPT, os.path.dirname(DPCLIPD), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=600, env=env)
    return proc, [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]


def test_parts_listed_and_each_said():
    proc, _ = _run("--list")
    assert proc.returncode == 0 and "fsdp_accumulate" in proc.stdout.split(), proc.stdout
    proc, lines = _run("--only", "outputs,cuda")
    assert proc.returncode == 0, proc.stderr
    assert [l["part"] for l in lines] == ["outputs", "cuda"]
    outs, cuda = lines
    assert outs["result"] == "passed" and outs["passed"] >= 4 and outs["failed"] == 0, outs
    assert cuda["result"] == "passed" and cuda["passed"] + cuda["skipped"] > 0, cuda


def test_a_part_past_its_limit_is_said_and_fails():
    proc, lines = _run("--only", "planner", "--timeout", "1")
    (line,) = lines
    assert line["result"] == "timed out" and line["limit"] == 1, line
    assert proc.returncode == 1 and "part planner timed out" in proc.stderr


def test_an_unknown_part_is_refused():
    proc, lines = _run("--only", "nonesuch")
    assert proc.returncode == 2 and not lines and "no part nonesuch" in proc.stderr
