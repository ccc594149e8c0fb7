"""A whole swarm in one process on virtual time (tests/memory_swarm.py): the learner and its
peers as users run them, over the in-memory transport. What the process-level tests
(tests/integration/) show over libp2p and TCP, shown here by versions, independent of load."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from echo_node.learner.learner import Ready
from echo_node.net import rpc
from echo_node.net.memory import MemorySwarm
from echo_node.net.transport import PeerAddr
from echo_node.policy import learner_policy
from echo_node.topics import rollouts_topic
from protocol import Identity, JoinRequest, JoinResponse
from tests.factories import bad_rollout_messages, sampled_reward
from tests.memory_swarm import run_memory_swarm

# Learning is judged on the same prompts and noise for the run's starting and final weights
# (tests/factories.py: sampled_reward): the quarter-mean gain of the run's own sampled rewards
# ranged 0.012-0.138 in 6 runs of this test (2 under the 0.04 it asserted; CI failed on 0.031),
# the paired gain 0.056-0.142.
VERSIONS = 60
MIN_GAIN = 0.03
STALENESS = 4  # tests/memory_swarm.py's default


@pytest.mark.parametrize("mode", ["async", "pull"])
def test_a_learner_and_three_peers_learn_in_one_process_on_virtual_time(tmp_path: Path, mode: str) -> None:
    run = run_memory_swarm(tmp_path, peers=3, versions=VERSIONS, mode=mode)
    s = run.summary
    assert s["versions"] == VERSIONS
    assert s["rollouts_received"] == s["rollouts_accepted"] + sum(s["rollouts_dropped"].values()) + s["rollouts_buffered"]
    # Its starting weights, built again as its learner built them (seeded, warm-up cached).
    before, after = sampled_reward(learner_policy(run.learner.cfg)), sampled_reward(run.learner.policy)
    assert after - before >= MIN_GAIN, (before, after, s["reward_first"], s["reward_last"])
    # Every honest peer contributed, none was penalized, every check it faced passed.
    assert sorted(s["trained_groups"]) == sorted(run.peer_ids) and min(s["trained_groups"].values()) > 0
    assert s["banned"] == [] and s["penalties"] == {}
    checks = s["verification"]["checks"]
    assert checks["logprobs"]["pass"] > 0 and all(c["fail"] == 0 for c in checks.values())
    # The weights went out through the broadcast: the peers relayed pieces to each other and
    # followed to the end (the last versions come out faster than a peer's batch: a peer may
    # hear of the end a few versions after its last install).
    for peer in run.peer_ids:
        installs = [r for r in run.peer_records[peer] if r["event"] == "installed"]
        assert installs[-1]["version"] >= VERSIONS - 2 * STALENESS, installs[-1]
        assert any(r["pieces"].get("peers", 0) > 0 for r in installs), "no piece came from another peer"
        assert run.peer_records[peer][-1]["event"] == "run_finished"
    if mode == "pull":
        assert all(r["staleness_max"] == 0 for r in run.train_records())
    # Virtual time moved (the run's timers ran) though no test waited on the wall clock.
    assert run.virtual_s > 0


def test_a_hostile_peer_is_banned_and_the_honest_ones_train_on(tmp_path: Path) -> None:
    """A joined peer gossips every malformed or invalid batch it can make, over the same
    in-memory network; three strikes ban it, and the honest peers' run goes on to the end."""
    attacker = Identity.from_seed(b"\x6f" * 32)
    sent: list[str] = []

    async def attack(swarm: MemorySwarm, ready: Ready, nursery: trio.Nursery) -> None:
        host, _ = swarm.node(attacker)
        async with trio.open_nursery() as own:
            await own.start(host.run)
            await trio.sleep(1)
            learner = ready["peer_id"]
            await host.connect(PeerAddr(learner, tuple(ready["addrs"])))
            request = JoinRequest(run_id="mem", peer_id=attacker.peer_id, data_host=host.advertise_host, data_port=9)
            with trio.fail_after(30):
                await rpc.call(host, learner, rpc.JOIN, request, JoinResponse)
            for name, data, _, _ in bad_rollout_messages(attacker, "mem"):
                await host.publish(rollouts_topic("mem"), data)
                sent.append(name)
                await trio.sleep(0.05)
            own.cancel_scope.cancel()

    run = run_memory_swarm(tmp_path, peers=2, versions=20, extra=attack)
    s = run.summary
    assert len(sent) == len(bad_rollout_messages(attacker, "mem"))
    assert s["versions"] == 20
    assert s["banned"] == [attacker.peer_id]
    assert s["penalties"].get(attacker.peer_id, 0) >= 3
    assert set(s["penalties"]) == {attacker.peer_id}
    assert s["rollouts_dropped"].get("malformed", 0) >= 1
    assert sorted(s["trained_groups"]) == sorted(run.peer_ids)
