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
from echo_node.config import NetConfig, RLConfig, RunConfig, SyncMode
from echo_node.learner.learner import Learner, Ready
from echo_node.metrics import read_metrics
from echo_node.net.memory import MemorySwarm
from echo_node.peer.rollout_peer import Generator, RolloutPeer
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
    # The peers given their own generator (`generators`), by name.
    named: dict[str, str] = field(default_factory=dict)

    def train_records(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.learner.cfg.run_dir / "metrics.jsonl") if r.get("event") == "train"]


def run_memory_swarm(
    runs_dir: Path, *, peers: int = 3, versions: int | None = 24, run_id: str = "mem", mode: SyncMode = "async",
    extra: Extra | None = None, generators: dict[str, type[Generator]] | None = None,
    stop_when: Callable[[Learner, dict[str, str]], bool] | None = None, **cfg: Any,
) -> SwarmRun:
    """Train `versions` versions of run `run_id` with `peers` honest peers, and one more peer
    per entry of `generators` (name -> the generator it runs, e.g. an attacker's); `stop_when`:
    stop the learner (as a signal would) once it holds of the learner and those peers' ids by
    name, checked every virtual second; `cfg`:
    more RunConfig fields (the same for every node)."""
    swarm = MemorySwarm()
    rl = cfg.pop("rl", RLConfig(mode=mode, staleness=4))

    def config(**more: Any) -> RunConfig:
        return RunConfig(run_id=run_id, runs_dir=runs_dir, max_versions=versions, rl=rl, **cfg, **more)

    learner_cfg = config()
    host, net = swarm.node(LEARNER)
    learner = Learner(learner_cfg, LEARNER, learner_policy(learner_cfg), host=host, data_net=net)
    peer_ids: list[str] = []

    named: dict[str, str] = {}
    stopped = False

    async def main() -> None:
        nonlocal stopped
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as others:  # the peers and `extra`
                async with trio.open_nursery() as own:  # the learner
                    ready: Ready = await own.start(learner.run)
                    peer_cfg = config(net=NetConfig(bootstrap=list(ready["addrs"])))
                    kinds: list[tuple[str | None, type[RolloutPeer]]] = [(None, RolloutPeer)] * peers
                    for label, generator in (generators or {}).items():
                        kinds.append((label, type(f"{label}_peer", (RolloutPeer,), {"generator_class": generator})))
                    for i, (name, kind) in enumerate(kinds):
                        identity = Identity.from_seed(bytes([0x60 + i]) * 32)
                        peer_ids.append(identity.peer_id)
                        if name is not None:
                            named[name] = identity.peer_id
                        peer_host, peer_net = swarm.node(identity)
                        others.start_soon(kind(peer_cfg, identity, host=peer_host, data_net=peer_net).run)
                    if extra is not None:
                        others.start_soon(extra, swarm, ready, others)
                    if stop_when is not None:
                        while not stop_when(learner, named):
                            await trio.sleep(1)
                        stopped = True
                        own.cancel_scope.cancel()
                # Stopped, its peers wait for a restart (they would wait forever); finished,
                # they leave on their own once told.
                if stopped:
                    others.cancel_scope.cancel()

    clock = trio.testing.MockClock(autojump_threshold=0)
    with offload.inline():
        trio.run(main, clock=clock)
    peer_dir = learner_cfg.run_dir / "peers"
    records = {p: read_metrics(peer_dir / f"{p}.jsonl") for p in peer_ids if (peer_dir / f"{p}.jsonl").exists()}
    summary = json.loads((learner_cfg.run_dir / "summary.json").read_text())
    return SwarmRun(summary, learner, swarm, peer_ids, clock.current_time(), records, named)
