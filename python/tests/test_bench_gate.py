"""bench/bench_gate.py's CPU path (gloo, a tiny GPT): it runs both ways of
the gate's all-reduce on two ranks, finds every bucket of the arena's
gradients end to end (so the in-place way is the one timed), and prints a
ratio of the two. No test reads a timing beyond its being positive (issue
40 takes the figures on the GPU machine)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_both_ways_on_two_ranks():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bench_gate.py"), "--device", "cpu",
         "--world", "2", "--blocks", "1", "--d", "32", "--heads", "2", "--vocab", "67",
         "--seq", "12", "--ffn", "64", "--steps", "2", "--repeat", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    ways = {l["way"]: l for l in lines if "way" in l}
    assert set(ways) == {"in_place", "gathered"}, lines
    for l in ways.values():
        assert l["world"] == 2 and l["ms"] > 0 and len(l["ms_rounds"]) == 2, l
        assert l["buckets"] >= 1 and l["buckets_end_to_end"] == l["buckets"], l
    (ratio,) = [l for l in lines if l.get("ratio") == "in_place/gathered"]
    assert ratio["time_ratio"] > 0 and len(ratio["round_ratios"]) == 2, ratio
