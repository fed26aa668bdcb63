#!/usr/bin/env python3
"""The trainer's host time per step of two versions of the dpclip package,
taking turns against one daemon (issue 40: a change to the host path is
judged against the version before it on the same machine, whose host
speed varies more between machines than the change itself).

    python3 bench/host_ab.py --socket S --base eeea58a              # GPT-2-small-like, GPU
    python3 bench/host_ab.py --socket S --base /tmp/old             # python/, bench/, client/
    python3 bench/host_ab.py --socket S --base HEAD --rounds 1 -- --device cpu \\
        --blocks 1 --d 32 --heads 2 --vocab 67 --seq 12 --batch 3 --steps 2 --warmup 1

The base version's package (python/, bench/ and client/dpclip.h, which
names its version) is taken from git at --base into a temporary tree, with
this tree's bench_host_overhead.py beside it, so that both are timed by
the same bench; both use the library and daemon of this build
(DPCLIP_LIBRARY). Each round runs the base, then this tree's package, each
a whole bench_host_overhead.py --bare process (its arguments after --).
Prints one JSON line per version: the median, least and most over the
rounds of before_submit_less_wait_ms (the host time before the step is
sent, less the wait for the last reply: the issue's target),
overhead_less_wait_ms (all of optimizer.step() but the update, less the
wait) and backward_ms (the backward call's host time, where the staged
plan's work runs); then one line of this tree's medians over the base's."""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("before_submit_less_wait_ms", "overhead_less_wait_ms", "backward_ms")


def base_tree(rev: str, into: str) -> str:
    """The package at git revision rev (or in the directory rev, a tree
    holding python/, bench/ and client/dpclip.h: a copy without git), with
    this tree's bench, in `into`."""
    if os.path.isdir(rev):
        for d in ("python", "bench", "client"):
            if os.path.isdir(os.path.join(rev, d)):
                shutil.copytree(os.path.join(rev, d), os.path.join(into, d))
    else:
        arch = subprocess.run(["git", "-C", ROOT, "archive", rev, "python", "bench",
                               "client/dpclip.h"], stdout=subprocess.PIPE, check=True).stdout
        subprocess.run(["tar", "-x", "-C", into], input=arch, check=True)
    shutil.copy(os.path.join(ROOT, "bench", "bench_host_overhead.py"),
                os.path.join(into, "bench", "bench_host_overhead.py"))
    return into


def run(tree: str, socket: str, extra: list) -> dict:
    cmd = [sys.executable, os.path.join(tree, "bench", "bench_host_overhead.py"),
           "--socket", socket, "--bare"] + extra
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit("host_ab.py: %s failed (status %d)" % (" ".join(cmd), proc.returncode))
    return json.loads(lines[-1])


def summary(version: str, rows: list) -> dict:
    out = {"bench": "host_ab", "version": version, "rounds": len(rows)}
    for k in FIELDS:
        v = sorted(r[k] for r in rows)
        out[k] = {"median": round(statistics.median(v), 4), "min": v[0], "max": v[-1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=os.environ.get("DPCLIP_SOCKET"), help="dpclipd socket")
    ap.add_argument("--base", required=True,
                    help="the git revision to compare against (or a directory holding its "
                    "python/, bench/ and client/dpclip.h)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="bench_host_overhead.py's arguments (after --)")
    args = ap.parse_args()
    if not args.socket:
        ap.error("--socket (or DPCLIP_SOCKET) is needed")
    rows: dict = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="dpclip-host-ab.") as tmp:
        base = base_tree(args.base, tmp)
        for _ in range(args.rounds):
            rows["base"].append(run(base, args.socket, args.extra))
            rows["this"].append(run(ROOT, args.socket, args.extra))
    lines = [summary("base " + args.base, rows["base"]), summary("this tree", rows["this"])]
    for line in lines:
        print(json.dumps(line), flush=True)
    ratio = {"bench": "host_ab", "ratio": "this/base", "base": args.base,
             "gpu": rows["this"][0].get("gpu"), "mps_active": rows["this"][0].get("mps_active")}
    for k in FIELDS:
        b = lines[0][k]["median"]
        ratio[k] = round(lines[1][k]["median"] / b, 3) if b > 0 else None
    print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
