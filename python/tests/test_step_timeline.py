"""bench/step_timeline.py against a real dpclipd debug log: a two-stage
pipeline (bench_parallel's CPU path, gloo, tiny GPT) of 4 micro-batches a
logical step sends its members' group steps; the timeline has each group
step with both members, in order, their times in order on the daemon's
clock, and the micro-batches numbered as the trainers sent them.

    python3 -m pytest -q python/tests/test_step_timeline.py
"""
import json
import os
import subprocess
import sys

from conftest import Daemon

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pipeline_group_steps_laid_out(tmp_path):
    log = tmp_path / "daemon.log"
    with open(str(log), "w") as err:
        d = Daemon(extra=["--log-level", "debug"], fixed_seed=False, stderr=err)
        try:
            proc = subprocess.run(
                [sys.executable, os.path.join(REPO, "bench", "bench_parallel.py"), "--mode",
                 "pipeline", "--socket", d.socket, "--microbatches", "4", "--device", "cpu",
                 "--blocks", "2", "--d", "32", "--heads", "2", "--vocab", "67", "--seq", "12",
                 "--batch", "2", "--warmup", "1", "--steps", "1", "--repeat", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                timeout=300)
        finally:
            assert d.stop() == 0
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "step_timeline.py"),
                          str(log)], stdout=subprocess.PIPE, universal_newlines=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    rows, tail = lines[:-1], lines[-1]
    # the private mode's warm-up and timed logical steps: 4 micro-batches each
    assert len(rows) == 8 and tail["summary"] and tail["group_steps"] == 8, lines
    assert [r["group_step"] for r in rows] == sorted(r["group_step"] for r in rows)
    for k, r in enumerate(rows):
        assert r["micro_batch"] == k % 4, r
        assert r["logical"] == rows[4 * (k // 4)]["logical"] > 0, r
        assert len(r["members"]) == 2 and len({m["session"] for m in r["members"]}) == 2, r
        assert min(m["frame"] for m in r["members"]) == 0, r
        for m in r["members"]:
            assert 0 <= m["frame"] <= m["started"] <= m["ended"] <= m["answered"], r
    assert rows[4]["logical"] > rows[0]["logical"]
    assert tail["span_ms"] > 0 and tail["wait_ms"] >= 0
    # every member's step after its session's first follows one
    assert tail["followed"] == 14 and 0 <= tail["backlogged"] <= 14, tail
