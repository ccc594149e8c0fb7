"""Time from `echo-node join` starting to the learner accepting that peer's first rollouts.

Starts a bootstrap and a learner (core 0), then N rollout peers at once (core 1; all peers
share it, as volunteers' machines would not, so this is an upper bound under contention),
and reads the learner's `first_accept` events. Also reports the size on the wire of one
signed rollout message of the embedded task. Prints one JSON object as its last line.

    .venv/bin/python -m benchmarks.join_latency --peers 2
    .venv/bin/python -m benchmarks.join_latency --peers 8
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.swarm import metrics_path, start_learner, start_peer
from echo_node.demo import Swarm
from echo_node.metrics import read_metrics
from echo_node.config import RolloutConfig
from protocol import Identity, RolloutBatch, RolloutGroup, Sample, seal
from protocol.identity import load_or_create_key_file


def rollout_message_bytes() -> dict[str, int]:
    """One message of the embedded task as a peer publishes it: the groups of one generation
    batch, 8 samples of 4 tokens each."""
    me = Identity.generate()
    groups = RolloutConfig().groups_per_batch
    batch = RolloutBatch(
        run_id="demo-async-20261129-000000",
        peer_id=me.peer_id,
        seq=time.time_ns() // 1_000_000,
        groups=tuple(
            RolloutGroup(
                group_id=f"{me.peer_id[-8:]}-1.{g}",
                prompt_ids=(1, 6, 10, 13, 3, 8, 14),
                samples=tuple(
                    Sample(
                        completion_ids=(3 + (i + g) % 10, 4, 5, 2),
                        behaviour_logprobs=(-0.0123 * (i + 1), -0.51, -1.7, -0.003),
                        token_versions=(412, 412, 412, 412),
                        reward=float(i % 2),
                    )
                    for i in range(8)
                ),
            )
            for g in range(groups)
        ),
    )
    return {"rollout_message_bytes": len(seal(batch, me)), "rollouts_per_message": batch.num_samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        swarm = Swarm(root)
        try:
            common, _ = start_learner(swarm, root, "join-bench", ["--seconds", "3600"], cpus={0})
            started: dict[str, float] = {}
            for i in range(args.peers):
                peer_id = load_or_create_key_file(root / f"peer{i}.key").peer_id
                started[peer_id] = time.time()
                start_peer(swarm, root, common, i, cpus={1})
            metrics = metrics_path(root, "join-bench")
            deadline = time.monotonic() + args.timeout
            first: dict[str, float] = {}
            while len(first) < args.peers and time.monotonic() < deadline:
                first = {r["peer"]: r["wall"] for r in read_metrics(metrics) if r.get("event") == "first_accept"}
                time.sleep(0.1)
        finally:
            swarm.stop_all()
    latencies = sorted(first[p] - started[p] for p in first if p in started)
    result = {
        "peers": args.peers,
        "peers_accepted": len(latencies),
        "join_to_first_accept_s": [round(x, 2) for x in latencies],
        "median_s": round(statistics.median(latencies), 2) if latencies else None,
        "max_s": round(max(latencies), 2) if latencies else None,
        **rollout_message_bytes(),
    }
    print(json.dumps(result))
    sys.exit(0 if len(latencies) == args.peers else 1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
