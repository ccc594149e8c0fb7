"""Weight bytes a live swarm sends per published version, bf16 publication against fp32.

Two swarms of real `echo-node` processes on loopback, one after the other, identical but for
`--dtype`: bootstrap, learner and `--peers` rollout peers train for `--seconds` after the last
peer started. Per swarm: the bytes the learner's data channel sent (summary
`learner_bytes_up`) plus the bytes every peer relayed to other peers (its last `installed`
record's `relayed_bytes`), per published version, divided by the size of one full snapshot in
that dtype. 1.0 means every version cost one full snapshot's bytes for the whole swarm; deltas
and relaying push it down. `bytes_ratio` is the bf16 swarm's (target <= 0.05); the fp32 swarm's
is `bytes_ratio_fp32`, measured in the same run.

Both swarms train at `--lr` (default 1e-6, TRL's GRPO default and the order of LLM RL rates):
how many bf16 values an update flips, hence what a delta costs, scales with it. The embedded
run's own default (1e-4, tuned to move a 0.8M-parameter model within minutes) flips a fifth to
a third of them per step, where deltas no longer pay.

The learner runs on core 0, bootstrap and peers on core 1. One JSON object as the last line.

    .venv/bin/python -m benchmarks.live_bytes
    .venv/bin/python -m benchmarks.live_bytes --seconds 90 --peers 3 --model DIR --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.swarm import metrics_path, start_learner, start_peer
from echo_node.demo import Swarm
from echo_node.metrics import read_metrics, rounded

LEARNER_CPUS, OTHER_CPUS = {0}, {1}


def measure(root: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    run_id = f"bytes-{dtype}"
    swarm = Swarm(root / "runs" / run_id)
    extra = ["--dtype", dtype, *(["--model", str(args.model)] if args.model else [])]
    config = root / f"{run_id}.toml"
    config.write_text(f"[rl]\nlr = {args.lr!r}\n")
    try:
        common, learner = start_learner(
            swarm, root, run_id, ["--seconds", "3600", "--mode", "async", "--config", str(config), *extra], cpus=LEARNER_CPUS
        )
        peers = [start_peer(swarm, root, common, i, cpus=OTHER_CPUS, args=extra) for i in range(args.peers)]
        time.sleep(args.seconds)
        for peer in peers:
            swarm.stop(peer)
        swarm.stop(learner, sig=2)
    finally:
        swarm.stop_all()
    run_dir = root / "runs" / run_id
    summary = json.loads((run_dir / "summary.json").read_text())
    published = [r for r in read_metrics(metrics_path(root, run_id)) if r.get("event") == "published"]
    relayed, installed, deltas, size = 0, 0, 0, 0
    for path in sorted((run_dir / "peers").glob("*.jsonl")):
        records = [r for r in read_metrics(path) if r.get("event") == "installed"]
        if records:
            relayed += int(records[-1].get("relayed_bytes", 0))
            size = max(size, int(records[-1]["bytes"]))
        installed += len(records)
        deltas += sum(1 for r in records if r.get("delta"))
    versions = max(1, len(published))
    sent = int(summary["learner_bytes_up"]) + relayed
    return {
        "dtype": dtype,
        "published_versions": len(published),
        "snapshot_bytes": size,
        "learner_bytes_up": int(summary["learner_bytes_up"]),
        "peers_relayed_bytes": relayed,
        "installs": installed,
        "installs_as_delta": deltas,
        "bytes_per_version": round(sent / versions),
        "bytes_ratio": round(sent / versions / max(size, 1), 4),
        "reward_first": rounded(summary["reward_first"]),
        "reward_last": rounded(summary["reward_last"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="training time per swarm after its peers started")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--model", type=Path, default=None, help="a local HF model directory (default: the embedded model)")
    p.add_argument("--lr", type=float, default=1e-6, help="the learner's learning rate (rl.lr)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="echo-bytes-") as tmp:
        root = Path(tmp)
        runs = {dtype: measure(root, dtype, args) for dtype in ("bfloat16", "float32")}
    bf16, fp32 = runs["bfloat16"], runs["float32"]
    result = {
        "bytes_ratio": bf16["bytes_ratio"],
        "bytes_ratio_fp32": fp32["bytes_ratio"],
        "target": 0.05,
        "snapshot_bytes_ratio_bf16_to_fp32": round(bf16["snapshot_bytes"] / max(1, fp32["snapshot_bytes"]), 4),
        "seconds": args.seconds,
        "lr": args.lr,
        "peers": args.peers,
        "model": str(args.model) if args.model else "embedded",
        "runs": runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
