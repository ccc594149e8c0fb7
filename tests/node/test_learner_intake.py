"""The learner's rollout intake: bad input is counted, logged and penalized; good input survives.

Drives the real validator and ingest path of a `Learner` (libp2p host built but not started,
tiny model without warm-up) with the same byte strings a hostile peer could gossip.
"""

from __future__ import annotations

import logging

import pytest
import trio

from echo_node.learner import Learner
from protocol import seal
from tests.factories import ALICE, MALLORY, bad_rollout_messages, make_group


def offer(learner: Learner, data: bytes, origin: str, forwarder: str | None = None) -> bool:
    """What the gossip path does: validate, and ingest what passes."""

    async def go() -> bool:
        if not learner._validate(forwarder or origin, origin, data):
            return False
        group, reason, _ = learner._check(data, origin)
        assert reason is None and group is not None
        learner._ingest(group, origin)
        return True

    return trio.run(go)


def test_every_bad_message_is_counted_penalized_and_logged(learner: Learner, caplog: pytest.LogCaptureFixture) -> None:
    good = seal(make_group(identity=ALICE, seq=1), ALICE)
    assert offer(learner, good, ALICE.peer_id)
    for name, data, reason, rollouts in bad_rollout_messages(MALLORY, "run-1"):
        before = learner.buffer.ledger.dropped[reason]
        with caplog.at_level(logging.WARNING, logger="echo_node.learner"):
            assert not offer(learner, data, MALLORY.peer_id), name
        assert learner.buffer.ledger.dropped[reason] == before + rollouts, name
        assert MALLORY.peer_id in caplog.records[-1].getMessage(), name
    assert learner.peers.penalties[MALLORY.peer_id] == len(bad_rollout_messages(MALLORY, "run-1"))
    assert learner.peers.penalties[ALICE.peer_id] == 0
    assert learner.peers.score(MALLORY.peer_id) < 0
    # What was accepted before the attack is untouched.
    assert len(learner.buffer) == 1 and learner.buffer.ledger.dropped.get("unused_at_exit", 0) == 0
    learner.buffer.check()


def test_signed_by_someone_else_than_the_gossip_origin(learner: Learner) -> None:
    forged = seal(make_group(identity=MALLORY, seq=3), MALLORY)
    assert not offer(learner, forged, ALICE.peer_id, forwarder=MALLORY.peer_id)
    assert learner.buffer.ledger.dropped["wrong_sender"] == 1
    # Both the claimed origin and the forwarder that relayed it are charged.
    assert learner.peers.penalties[MALLORY.peer_id] == 1


def test_duplicates_and_group_size(learner: Learner) -> None:
    msg = seal(make_group(seq=7), ALICE)
    assert offer(learner, msg, ALICE.peer_id)
    assert not offer(learner, seal(make_group(seq=8, samples=4), ALICE), ALICE.peer_id)

    async def replay() -> None:
        group, _, _ = learner._check(msg, ALICE.peer_id)
        assert group is not None
        learner._ingest(group, ALICE.peer_id)  # e.g. delivered again by gap repair

    trio.run(replay)
    assert learner.buffer.ledger.dropped == {"bad_group": 4, "duplicate": 8}
    assert len(learner.buffer) == 1
    learner.buffer.check()


def test_demand_is_split_among_active_peers(learner: Learner) -> None:
    async def go() -> list[int]:
        out = [learner.demand_groups()]
        for i in range(4):
            learner.peers.last_seen[f"p{i}"] = trio.current_time()
        out.append(learner.demand_groups())
        return out

    # groups_per_step=8 with 1.5x slack: 12 for a lone peer, 3 each for four.
    assert trio.run(go) == [12, 3]


def test_a_deadline_between_take_and_step_loses_nothing(learner: Learner, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The run's deadline can fall right after a batch left the buffer: the update completes
    and is counted (this once dropped 64 rollouts from the ledger at the end of a demo)."""
    from echo_node.metrics import MetricsWriter

    learner.metrics = MetricsWriter(tmp_path / "m.jsonl")
    for seq in range(8):
        assert offer(learner, seal(make_group(identity=ALICE, seq=seq), ALICE), ALICE.peer_id)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.data.run)
            with trio.CancelScope() as scope:
                take = learner.buffer.take

                def take_then_deadline(n: int, version: int):  # type: ignore[no-untyped-def]
                    scope.cancel()
                    return take(n, version)

                learner.buffer.take = take_then_deadline  # type: ignore[method-assign]
                await learner._train_loop()
            nursery.cancel_scope.cancel()

    learner._offer_version(0, b"\0" * 100)
    try:
        trio.run(main)
    finally:
        learner.metrics.close()
    learner.buffer.close()
    learner.buffer.check()
    assert learner.buffer.ledger.trained == 64 and learner.version == 1
