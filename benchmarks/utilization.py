"""Does decoupling keep the hardware busy? Pull vs async, learner and one rollout peer, one core each.

Runs the real swarm twice (bootstrap + learner pinned to core 0, one rollout peer to core 1),
once in `pull` mode and once in `async` mode, each for the same training time, and reads the
learner's metrics.jsonl. Over the steady window (after the first `--settle` seconds of updates):
- samples/s: rollouts trained per second of the learner's clock;
- learner idle: time waiting for a batch / (waiting + training), summed over the window's updates.
In pull mode the peer samples only from the learner's newest version, so each side waits while
the other works; in async mode the peer samples while the learner trains. Counting compute
alone the ratio's ceiling is 2 (two cores), reached when sampling a batch takes as long as
training on it. A measured ratio passes it: pull also waits for each version's transfer to the
peer, which async hides behind training, and pull's core snapshots, hashes and serves every
version. Pull's updates also trained slower, 41-43 ms each against async's 27-29 (one snapshot
per update explains ~1.5 ms; another suspect, not confirmed: the peer's surplus batch for the
same version arrives during the step and is checked on the learner's core, then dropped as
stale — 20 256 rollouts in one run).

Async runs at staleness S = 6 and the learner publishes every 4th version (`--staleness`,
`--publish-every`, K = S - 2, see RLConfig.publish_every; pull must publish every one), as
vs_trl does: its peer then fetches a quarter of the versions, and the learner's core spends a
quarter as much on publishing. Measured, async idle: 0.017 at S = 6, K = 4; 0.037-0.047 at
S = 4, K = 2; 0.16 with every version published (the peer fetching one version per update).

    .venv/bin/python -m benchmarks.utilization                 # 60 s per mode
    .venv/bin/python -m benchmarks.utilization --seconds 20    # a quick look

Last stdout line: one JSON object with `pull_samples_per_s`, `async_samples_per_s`, `ratio`,
`learner_idle_pull`, `learner_idle_async` and per-mode details, among them the learner's
`profile`: wall and CPU seconds per stage of its work over the whole run and their shares
(echo_node/learner/profile.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.swarm import metrics_path, start_learner, start_peer
from echo_node.demo import Swarm
from echo_node.metrics import read_metrics, summarize_run


# async only: publishing every K-th version (K <= S - 2, see RLConfig.publish_every) is a freedom
# pull does not have; S only bounds async (pull trains on the newest version alone).
STALENESS = 6
PUBLISH_EVERY = 4


def steady_window(records: list[dict[str, Any]], settle_s: float) -> dict[str, Any]:
    steps = [r for r in records if r.get("event") == "train"]
    if len(steps) < 3:
        raise RuntimeError(f"only {len(steps)} updates were recorded; nothing to measure")
    t0 = steps[0]["t"] + settle_s
    window = [r for r in steps if r["t"] >= t0]
    if len(window) < 2:
        raise RuntimeError(f"no updates after the first {settle_s:g}s; run longer")
    first, last = window[0], window[-1]
    span = last["t"] - first["t"]
    # Samples trained by the updates after `first`, over the time they took.
    trained = last["trained"] - first["trained"]
    wait = sum(r["wait_s"] for r in window[1:])
    train = sum(r["train_s"] for r in window[1:])
    summary = summarize_run(window)
    return {
        "samples_per_s": round(trained / span, 2),
        "learner_idle": round(wait / max(1e-9, wait + train), 4),
        "updates": len(window) - 1,
        "window_s": round(span, 2),
        "train_s_per_update": round(train / max(1, len(window) - 1), 4),
        "wait_s_per_update": round(wait / max(1, len(window) - 1), 4),
        "staleness_hist": {str(k): v for k, v in summary["staleness_hist"].items()},
        "reward_last": window[-1]["reward_mean"],
        "dropped": window[-1]["dropped"],
        # Received rollouts dropped as stale: over the whole run, and over the steady window.
        "stale_share": round(last["dropped"].get("stale", 0) / max(1, last["received"]), 4),
        "stale_share_window": round(
            (last["dropped"].get("stale", 0) - first["dropped"].get("stale", 0)) / max(1, last["received"] - first["received"]), 4),
    }


def run_mode(mode: str, seconds: float, settle_s: float, publish_every: int = 1, staleness: int | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        swarm = Swarm(root)
        run_id = f"util-{mode}"
        args = ["--mode", mode, "--seconds", str(seconds), "--publish-every", str(publish_every)]
        if staleness is not None:
            args += ["--staleness", str(staleness)]
        try:
            common, learner = start_learner(swarm, root, run_id, args, cpus={0})
            start_peer(swarm, root, common, 0, cpus={1})
            # The learner's clock starts with its first batch; it exits by itself when done.
            deadline = time.monotonic() + seconds + 120
            while learner.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            swarm.stop_all()
        result = steady_window(read_metrics(metrics_path(root, run_id)), settle_s)
        summary = metrics_path(root, run_id).with_name("summary.json")
        if summary.is_file():  # where the learner's time went, per stage (echo_node/learner/profile.py)
            result["profile"] = json.loads(summary.read_text()).get("profile")
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="training time per mode")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of updates left out at the start")
    p.add_argument(
        "--publish-every", type=int, default=PUBLISH_EVERY, metavar="K",
        help="async: the learner publishes every K-th version (pull needs every one)",
    )
    p.add_argument("--staleness", type=int, default=STALENESS, metavar="S", help="async: the staleness bound S")
    p.add_argument("--modes", nargs="+", choices=["pull", "async"], default=["pull", "async"],
                   help="run only these (the ratio needs both)")
    a = p.parse_args(argv)
    started = time.monotonic()
    results = {}
    for mode in a.modes:
        if mode == "async":
            results[mode] = run_mode(mode, a.seconds, a.settle, a.publish_every, a.staleness)
        else:
            results[mode] = run_mode(mode, a.seconds, a.settle)
        print(f"{mode}: {results[mode]}", file=sys.stderr, flush=True)
    pull, asy = results.get("pull", {}), results.get("async", {})
    print(json.dumps({
        "pull_samples_per_s": pull.get("samples_per_s"),
        "async_samples_per_s": asy.get("samples_per_s"),
        "ratio": round(asy["samples_per_s"] / pull["samples_per_s"], 3) if pull and asy else None,
        "learner_idle_pull": pull.get("learner_idle"),
        "learner_idle_async": asy.get("learner_idle"),
        "seconds_per_mode": a.seconds,
        "publish_every_async": a.publish_every,
        "staleness_async": a.staleness,
        "pull": pull,
        "async": asy,
        "wall_s": round(time.monotonic() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
