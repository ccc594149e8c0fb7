"""Agentic RL throughput: episodes/s and learner idle, pull vs async, as the environment slows.

Two processes, pinned one core each: a rollout peer playing the built-in calculator environment
(echo_node/envs: the embedded model in a TorchEngine, `play_batch`, environment steps bounded in
threads) and a learner (`EpisodeGate`: envelope, budgets, versions, the re-run of every episode,
then a GRPO step on the masked episodes). Sealed episode batches go peer -> learner and weights
learner -> peer over pipes; no network, so what differs between the runs is the sync mode and
the environment's latency, added to every `step` (a sleep, as a remote tool or sandbox costs):

- pull: the peer plays one batch on the learner's newest version, the learner waits for it, trains
  and publishes the next version: each side waits while the other works.
- async: the peer plays batches back to back, taking the newest weights between batches; the
  learner trains on whatever is admissible (staleness S) and drops the rest as stale.

Reported per (mode, latency): episodes trained per second, the learner's idle share (waiting for
a batch / wall), and the share of the learner's busy time spent verifying episodes (the re-run).
The ratios async / pull are per latency.

    .venv/bin/python -m benchmarks.agentic                    # 0, 50, 500 ms; 20 s per run
    .venv/bin/python -m benchmarks.agentic --latency-ms 0 50 --seconds 10

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from echo_node.envs.local import GROUP_SIZE, GROUPS_PER_STEP, STALENESS, learner_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="measured time per run (default 20)")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0, 500.0], help="environment step latencies")
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for latency in args.latency_ms:
        for mode in ("pull", "async"):
            r = learner_run(mode, latency / 1000, args.seconds)
            print(json.dumps(r), flush=True)
            runs.append(r)
    ratios = {}
    for latency in args.latency_ms:
        by = {r["mode"]: r for r in runs if r["latency_ms"] == round(latency)}
        pull, asy = by["pull"]["episodes_per_s"], by["async"]["episodes_per_s"]
        ratios[f"{round(latency)}ms"] = round(asy / pull, 3) if pull else None
    print(json.dumps({"benchmark": "agentic", "async_over_pull_episodes_per_s": ratios, "runs": runs,
                      "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "staleness": STALENESS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
