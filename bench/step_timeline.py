#!/usr/bin/env python3
"""Lays a norm group's steps out in time from dpclipd's debug log: which
member's micro-batch came when, when its norm phase was done, and when its
clip phase started, ended and was answered, on the daemon's one monotonic
clock (ms), each group step's times from its first member's frame.

    dpclipd --log-level debug ... 2> daemon.log
    python3 bench/step_timeline.py daemon.log                  # every group step
    python3 bench/step_timeline.py daemon.log --last 16        # the last 16

One JSON line per group step: {"group_step", "logical", "micro_batch",
"t0" (ms, the first frame), "members": [{"session", "step", "frame",
"norms_done", "started", "ended", "answered"} ...] (ms from t0; norms_done
null where the step ran whole or fused)}, then a summary line: the median
over the group steps of the span from the first frame to the last answer
and of the wait from the last member's frame to its clip phase's start,
and how many members' steps (of those that followed one of the same
session) had waited behind the session's previous step. Steps outside a
group (group step 0) are left out."""
import argparse
import json
import re
import statistics
import sys
from typing import Dict, Iterable, List

_LINE = re.compile(
    r"session (\d+): step (\d+) \(.*?group step (\d+); at \(monotonic ms\) frame ([\d.]+), "
    r"submitted ([\d.]+), norms done ([\d.]+), started ([\d.]+), ended ([\d.]+), "
    r"answered ([\d.]+)")
MICRO_BITS = 24  # DC_GROUP_MICRO_BITS: a group step is (logical id << 24) + micro-batch


def parse(lines: Iterable[str]) -> List[dict]:
    """Every grouped step's line: session, step, group step and its times
    (absolute monotonic ms; norms_done None where there was no norm phase)."""
    out = []
    for line in lines:
        m = _LINE.search(line)
        if not m or int(m.group(3)) == 0:
            continue
        t = [float(x) for x in m.groups()[3:]]
        out.append({"session": int(m.group(1)), "step": int(m.group(2)),
                    "group_step": int(m.group(3)), "frame": t[0], "submitted": t[1],
                    "norms_done": t[2] or None, "started": t[3], "ended": t[4],
                    "answered": t[5]})
    return out


def timeline(steps: List[dict]) -> List[dict]:
    """The group steps in order, each with its members' times from its
    first frame."""
    by: Dict[int, List[dict]] = {}
    for s in steps:
        by.setdefault(s["group_step"], []).append(s)
    out = []
    for g in sorted(by):
        members = sorted(by[g], key=lambda s: s["session"])
        t0 = min(s["frame"] for s in members)

        def rel(v):
            return None if v is None else round(v - t0, 3)
        out.append({"group_step": g, "logical": g >> MICRO_BITS,
                    "micro_batch": g & ((1 << MICRO_BITS) - 1), "t0": t0,
                    "members": [{"session": s["session"], "step": s["step"],
                                 "frame": rel(s["frame"]), "norms_done": rel(s["norms_done"]),
                                 "started": rel(s["started"]), "ended": rel(s["ended"]),
                                 "answered": rel(s["answered"])} for s in members]})
    return out


BACKLOG_MS = 0.1  # a frame taken up this soon after its session's last answer waited for it


def summary(rows: List[dict]) -> dict:
    """Medians over the group steps: first frame to last answer (span_ms),
    and the last member's frame to its clip phase's start (wait_ms); and
    backlogged, the members' steps whose frame the daemon took up within
    BACKLOG_MS of its session's previous answer: sent while that step ran,
    they waited for it (a session runs its steps one at a time)."""
    spans = [max(m["answered"] for m in r["members"]) for r in rows]
    waits, last_answer, backlogged, members = [], {}, 0, 0
    for r in rows:
        last = max(r["members"], key=lambda m: m["frame"])
        waits.append(last["started"] - last["frame"])
        for m in r["members"]:
            frame = r["t0"] + m["frame"]
            prev = last_answer.get(m["session"])
            if prev is not None:
                members += 1
                backlogged += frame - prev <= BACKLOG_MS
            last_answer[m["session"]] = r["t0"] + m["answered"]
    return {"summary": True, "group_steps": len(rows),
            "span_ms": round(statistics.median(spans), 3) if spans else None,
            "wait_ms": round(statistics.median(waits), 3) if waits else None,
            "backlogged": backlogged, "followed": members}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="dpclipd's debug log ('-': standard input)")
    ap.add_argument("--last", type=int, default=0, help="only the last N group steps")
    a = ap.parse_args(argv)
    f = sys.stdin if a.log == "-" else open(a.log, errors="replace")
    try:
        rows = timeline(parse(f))
    finally:
        if f is not sys.stdin:
            f.close()
    if a.last > 0:
        rows = rows[-a.last:]
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(summary(rows)))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
