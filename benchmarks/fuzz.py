"""Fuzzing every decoder that takes a peer's bytes, at volume: >= 1M inputs, none may crash or hang.

The targets, mutators and rules are tests/fuzz/targets.py's, the same as the short run in `make
test` (tests/fuzz/test_fuzz.py): every protocol decoder (messages of every kind, signed envelopes
and manifests, zstd frames, length-prefixed streams, deltas, peer ids, signatures, addresses),
the data channel (hellos, frames, peer entries, probe answers, and a rollout peer's Receiver fed
a whole link), both ends of the request/response streams, and a real learner's gossip validator
and consumer. Mutations range from byte havoc to msgpack-aware and re-signed ones that reach past
the signatures. A *crash* is any exception other than the decoder's documented protocol error (or
a failed oracle); a *hang* is one input running past 1 s (signal.setitimer per input, on the
worker's CPU time, since the machine is shared, and at 10 s of wall-clock time for one that blocks).

Inputs are spread evenly over the targets and over `--workers` processes, each pinned to its own
core (os.sched_setaffinity): worker w runs inputs w, w + W, w + 2W, ... of every target, in
round-robin blocks, so that a `--seconds` cap still covers every target. Input i of a target is
the same in every run (`tests.fuzz.targets.input_for(target, seed, i)`), so each finding replays
from its index. Reports inputs, crashes, hangs, per-target counts and rates (inputs per second of
one core), and the peak RSS of any worker (resource.getrusage); each distinct finding is listed
with its target, minimized input (hex) and error, and whether test_fuzz.py already knows it
(KNOWN_CRASH). Prints one JSON object as its last line and writes it to
benchmarks/results/fuzz.json; exits 1 on a crash or hang the tests do not already know.

    .venv/bin/python -m benchmarks.fuzz
    .venv/bin/python -m benchmarks.fuzz --inputs 100000 --workers 1 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import pathlib
import resource
import sys
import time
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "fuzz.json"
BLOCK = 256  # inputs of one target a worker runs before moving on to the next target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs in all, spread evenly over the targets")
    parser.add_argument("--seconds", type=float, default=540.0, help="stop (reporting what ran) after this long")
    parser.add_argument("--workers", type=int, default=None, help="processes, one per core (default: all usable cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default="", help="comma-separated substrings: only targets whose name has one")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where to write the JSON ('-': nowhere)")
    return parser.parse_args()


def _worker(w: int, workers: int, cpu: int | None, names: list[str], per_target: int, seed: int, deadline: float) -> dict[str, Any]:
    """Worker w's share of every target; returns its stats, findings and peak RSS."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    from tests.fuzz.targets import Stats, all_targets, fuzz, quiet_logs

    targets = all_targets()
    stats = {name: Stats(name) for name in names}
    seen: set[tuple[str, str, str]] = set()
    with quiet_logs():
        for name in names:
            targets[name].prepare()  # the learner imports torch and builds its model: not timed per input
        start = {name: w for name in names}  # the next index this worker runs, per target
        while time.monotonic() < deadline and any(start[n] < per_target for n in names):
            for name in names:
                if start[name] >= per_target:
                    continue
                stop = min(per_target, start[name] + BLOCK * workers)
                got = fuzz(targets[name], inputs=stop, seed=seed, start=start[name], step=workers, deadline=deadline, seen=seen)
                stats[name].inputs += got.inputs
                stats[name].crashes += got.crashes
                stats[name].hangs += got.hangs
                stats[name].seconds += got.seconds
                stats[name].findings += got.findings
                start[name] += got.inputs * workers  # it ran start, start + W, ... (fewer at the deadline)
                if time.monotonic() > deadline:
                    break
    return {
        "worker": w,
        "cpu": cpu,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "stats": {
            n: {"inputs": s.inputs, "crashes": s.crashes, "hangs": s.hangs, "seconds": s.seconds} for n, s in stats.items()
        },
        "findings": [
            {"target": f.target, "kind": f.kind, "index": f.index, "bytes": len(f.data), "hex": f.data.hex()[:4096],
             "error": f.error, "where": f.where}
            for s in stats.values() for f in s.findings
        ],
    }


def main() -> None:
    args = parse_args()
    began = time.monotonic()
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    sys.path.insert(0, root)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the learner's torch, in every worker: one core each
    from tests.fuzz.targets import all_targets
    from tests.fuzz.test_fuzz import KNOWN_CRASH

    wanted = [s for s in args.targets.split(",") if s]
    names = [n for n in all_targets() if not wanted or any(s in n for s in wanted)]
    if not names:
        raise SystemExit(f"no target matches {args.targets!r}")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    workers = args.workers or len(cpus)
    per_target = math.ceil(args.inputs / len(names))
    deadline = began + args.seconds
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no state forked from this one
    with ctx.Pool(workers) as pool:
        jobs = [
            pool.apply_async(_worker, (w, workers, cpus[w % len(cpus)] if workers <= len(cpus) else None, names, per_target,
                                       args.seed, deadline))
            for w in range(workers)
        ]
        results = [job.get() for job in jobs]

    per_target_out: dict[str, dict[str, Any]] = {}
    for name in names:
        rows = [r["stats"][name] for r in results]
        busy = sum(r["seconds"] for r in rows)
        n = sum(r["inputs"] for r in rows)
        per_target_out[name] = {
            "inputs": n,
            "crashes": sum(r["crashes"] for r in rows),
            "hangs": sum(r["hangs"] for r in rows),
            "inputs_per_s": round(n / busy) if busy else None,
        }
    findings: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in results:
        for f in r["findings"]:
            key = (f["target"], f["kind"], f["error"].split(":", 1)[0], f["where"])
            if key not in findings or f["bytes"] < findings[key]["bytes"]:
                findings[key] = {**f, "known": f["target"] in KNOWN_CRASH}
    crashes = sum(t["crashes"] for t in per_target_out.values())
    hangs = sum(t["hangs"] for t in per_target_out.values())
    new = sum(t["crashes"] + t["hangs"] for name, t in per_target_out.items() if name not in KNOWN_CRASH)
    out = {
        "inputs": sum(t["inputs"] for t in per_target_out.values()),
        "crashes": crashes,
        "hangs": hangs,
        "unknown_crashes_and_hangs": new,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "seconds": round(time.monotonic() - began, 1),
        "workers": workers,
        "cpus": [r["cpu"] for r in results],
        "seed": args.seed,
        "targets": len(names),
        "per_target": per_target_out,
        "known_crash_targets": sorted(set(KNOWN_CRASH) & set(names)),
        "findings": list(findings.values()),
        "command": "python -m benchmarks.fuzz " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
    }
    line = json.dumps(out)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(line)
    sys.exit(1 if new else 0)


if __name__ == "__main__":
    main()
