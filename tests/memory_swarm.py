"""A learner and N rollout peers in one `trio.run`, over echo_node/net/memory.py, on virtual time.

The nodes are the ones a user runs (`Learner`, `RolloutPeer`, the embedded policy, verification
on); only the network is in memory and the clock is trio's `MockClock(autojump_threshold=0)`,
with blocking work inline (echo_node/offload.py). A run's outcome therefore depends on versions,
never on how loaded the machine is: a timeout fires after its virtual seconds, whatever the
wall-clock time the steps took.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from echo_node import offload
from echo_node.config import NetConfig, RLConfig, RunConfig
from echo_node.learner.learner import Learner, Ready
from echo_node.metrics import read_metrics
from echo_node.net.memory import MemorySwarm
from echo_node.peer.rollout_peer import RolloutPeer
from echo_node.policy import learner_policy
from protocol import Identity

LEARNER = Identity.from_seed(b"\x51" * 32)
# A run that is stuck ends here, in virtual seconds (a run of N versions takes far fewer).
DEADLINE_S = 3600.0

# What a test adds to the swarm once the learner is ready: (swarm, the learner's Ready, a
# nursery cancelled when the run ends).
Extra = Callable[[MemorySwarm, Ready, trio.Nursery], Awaitable[None]]


@dataclass
class SwarmRun:
    summary: dict[str, Any]
    learner: Learner
    swarm: MemorySwarm
    peer_ids: list[str]
    virtual_s: float
    peer_records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def train_records(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.learner.cfg.run_dir / "metrics.jsonl") if r.get("event") == "train"]


def run_memory_swarm(
    runs_dir: Path, *, peers: int = 3, versions: int = 24, run_id: str = "mem", mode: str = "async",
    extra: Extra | None = None, **cfg: Any,
) -> SwarmRun:
    """Train `versions` versions of run `run_id` with `peers` honest peers; `cfg`: more
    RunConfig fields (the same for every node)."""
    swarm = MemorySwarm()
    rl = cfg.pop("rl", RLConfig(mode=mode, staleness=4))

    def config(**more: Any) -> RunConfig:
        return RunConfig(run_id=run_id, runs_dir=runs_dir, max_versions=versions, rl=rl, **cfg, **more)

    learner_cfg = config()
    host, net = swarm.node(LEARNER)
    learner = Learner(learner_cfg, LEARNER, learner_policy(learner_cfg), host=host, data_net=net)
    peer_ids = []
    summary: dict[str, Any] = {}

    async def main() -> None:
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                ready: Ready = await nursery.start(run_learner)
                peer_cfg = config(net=NetConfig(bootstrap=list(ready["addrs"])))
                async with trio.open_nursery() as others:
                    for i in range(peers):
                        identity = Identity.from_seed(bytes([0x60 + i]) * 32)
                        peer_ids.append(identity.peer_id)
                        peer_host, peer_net = swarm.node(identity)
                        others.start_soon(RolloutPeer(peer_cfg, identity, host=peer_host, data_net=peer_net).run)
                    if extra is not None:
                        others.start_soon(extra, swarm, ready, others)

    async def run_learner(*, task_status: trio.TaskStatus[Ready]) -> None:
        summary.update(await learner.run(task_status=task_status))

    clock = trio.testing.MockClock(autojump_threshold=0)
    with offload.inline():
        trio.run(main, clock=clock)
    peer_dir = learner_cfg.run_dir / "peers"
    records = {p: read_metrics(peer_dir / f"{p}.jsonl") for p in peer_ids if (peer_dir / f"{p}.jsonl").exists()}
    on_disk = json.loads((learner_cfg.run_dir / "summary.json").read_text())
    assert on_disk["versions"] == summary["versions"]
    return SwarmRun(summary, learner, swarm, peer_ids, clock.current_time(), records)
