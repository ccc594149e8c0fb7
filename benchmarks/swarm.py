"""A swarm of real `echo-node` processes on loopback for benchmarks: bootstrap, learner, peers.

Every process is pinned (oversubscribing the two cores is the largest slowdown here:
docs/platform.md) and stopped by `Swarm.stop_all` (peers, then the learner, with SIGTERM: it
writes its summary as on Ctrl-C, and SIGINT is ignored by a benchmark run as a background job).
"""

from __future__ import annotations

import json
from pathlib import Path

from echo_node.demo import Child, Swarm, _is_ready, _wait_line


def start_learner(
    swarm: Swarm, root: Path, run_id: str, learner_args: list[str], *, cpus: set[int], ready_timeout: float = 300.0,
    module: str = "echo_node.cli", module_args: list[str] | None = None,
) -> tuple[list[str], Child]:
    """Bootstrap and learner on `cpus`; returns the arguments a peer needs to join, and the learner.
    `module` runs the learner (e.g. benchmarks.paced, with its own `module_args` first)."""
    boot = swarm.spawn("bootstrap", ["bootstrap", "--key-file", str(root / "boot.key")], cpus=cpus)
    addr = _wait_line(boot, lambda line: "/p2p/" in line, 30, "its address").strip()
    common = ["--bootstrap", addr, "--run-id", run_id]
    learner = swarm.spawn(
        "learner",
        [*(module_args or []), "learn", *common, "--key-file", str(root / "learner.key"), "--runs-dir", str(root / "runs"), *learner_args],
        cpus=cpus, module=module,
    )
    ready = json.loads(_wait_line(learner, _is_ready, ready_timeout, "ready"))
    return ["--bootstrap", addr, "--run-id", f"{run_id}@{ready['peer_id']}"], learner  # peers pinned to this learner


def start_peer(
    swarm: Swarm, root: Path, common: list[str], index: int, *, cpus: set[int], args: list[str] | None = None,
    module: str = "echo_node.cli", module_args: list[str] | None = None,
) -> Child:
    key = root / f"peer{index}.key"
    return swarm.spawn(
        f"peer{index}",
        [*(module_args or []), "join", *common, "--key-file", str(key), "--runs-dir", str(root / "runs"), *(args or [])],
        cpus=cpus, module=module,
    )


def metrics_path(root: Path, run_id: str) -> Path:
    return root / "runs" / run_id / "metrics.jsonl"
