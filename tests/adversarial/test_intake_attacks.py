"""Attacks on the learner's rollout intake, on a real `Learner` (host built, not started).

Each test is a hole that once existed: the victim stays alive, the drop is counted under its
reason, the attacker is charged, and honest rollouts still get in.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from echo_node.learner.intake import REPAIR_TIMEOUT_S, JoinRefused
from echo_node.learner.learner import Learner
from echo_node.net import rpc
from protocol import Identity, JoinRequest, seal
from protocol.sequence import SequenceTracker
from tests.factories import ALICE, MALLORY, bad_rollout_messages, make_batch, offer


def test_a_stranger_cannot_publish(learner: Learner) -> None:
    """No join, no rollouts: counted as not_joined, nothing kept about the stranger."""
    assert not offer(learner, seal(make_batch(identity=MALLORY, seq=1), MALLORY), MALLORY.peer_id)
    assert learner.buffer.ledger.dropped == {"not_joined": 1}
    assert MALLORY.peer_id not in learner.intake.tracker and not learner.peers.penalties


def test_three_strikes_ban_across_restarts(learner: Learner, tmp_path: Any) -> None:
    learner.cfg.run_dir.mkdir(parents=True, exist_ok=True)
    learner.peers.join(MALLORY.peer_id, 0.0)
    learner.peers.join(ALICE.peer_id, 0.0)
    for _, data, _, _ in bad_rollout_messages(MALLORY, "run-1")[-4:]:
        assert not offer(learner, data, MALLORY.peer_id)
    # Banned after the third: the fourth is dropped unopened, and so is a valid batch.
    assert learner.peers.is_banned(MALLORY.peer_id) and MALLORY.peer_id not in learner.peers.joined
    assert not offer(learner, seal(make_batch(identity=MALLORY, seq=5), MALLORY), MALLORY.peer_id)
    assert learner.buffer.ledger.dropped["banned"] == 2
    assert offer(learner, seal(make_batch(identity=ALICE, seq=5), ALICE), ALICE.peer_id)

    async def rejoin(l: Learner) -> Any:
        request = JoinRequest(run_id="run-1", peer_id=MALLORY.peer_id, data_host="127.0.0.1", data_port=9)
        with pytest.raises(rpc.RequestRefused) as refused:
            await l.door.on_join(request, MALLORY.peer_id)
        return refused.value

    assert trio.run(rejoin, learner).code == "banned"
    # The ban is on disk with the run (written within a second, and at every stop): a restarted
    # learner still refuses the peer.
    assert learner.intake.ban_log is not None
    learner.intake.ban_log.flush(learner.peers.live_bans)
    fresh = Learner(learner.cfg, Identity.from_seed(b"\x01" * 32), learner.policy)
    assert trio.run(rejoin, fresh).code == "banned"


def test_a_failing_training_step_drops_its_batch_and_training_goes_on(learner: Learner, tmp_path: Any) -> None:
    learner.peers.join(ALICE.peer_id, 0.0)
    learner.report.open()
    learner.cfg.max_versions = 1
    steps = learner.cfg.rl.groups_per_step
    for seq in range(2 * steps):
        assert offer(learner, seal(make_batch(identity=ALICE, seq=seq), ALICE), ALICE.peer_id)
    real, calls = learner.trainer.optimizer.step, []

    def step_once_broken(groups: Any) -> Any:
        calls.append(len(groups))
        if len(calls) == 1:
            raise IndexError("index out of range in self")  # what an unchecked token id did
        return real(groups)

    learner.trainer.optimizer.step = step_once_broken  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.data.run)
            await learner._train_loop()
            nursery.cancel_scope.cancel()

    learner.weights.offer(0, b"\0" * 100)
    try:
        trio.run(main)
    finally:
        learner.report.close()
    assert learner.version == 1 and learner.trainer.train_errors == 1 and calls == [steps, steps]
    assert learner.buffer.ledger.dropped["train_error"] == 8 * steps
    learner.buffer.check()


def test_forgetting_a_publisher_does_not_readmit_its_old_batches(learner: Learner) -> None:
    """The tracker is bounded; when it forgets a publisher, an old signed batch of that
    publisher replayed later is refused (too_old), while new ones are taken."""
    learner.intake.tracker = SequenceTracker(max_publishers=2)
    others = [Identity.from_seed(bytes([0x30 + i]) * 32) for i in range(2)]
    for who in (ALICE, *others):
        learner.peers.join(who.peer_id, 0.0)
    old = seal(make_batch(identity=ALICE, seq=1), ALICE)
    assert offer(learner, old, ALICE.peer_id)
    learner.trainer.version = 1  # training moved on
    for who in others:  # two more publishers: Alice is forgotten
        assert offer(learner, seal(make_batch(identity=who, seq=1, version=1), who), who.peer_id)
    assert ALICE.peer_id not in learner.intake.tracker
    assert offer(learner, old, ALICE.peer_id)  # passes the validator (a valid signed batch) ...
    assert learner.buffer.ledger.dropped["too_old"] == 8  # ... but is not trained twice
    # Newer tokens than the learner's version when Alice was forgotten prove a fresh batch.
    learner.trainer.version = 2
    assert offer(learner, seal(make_batch(identity=ALICE, seq=2, version=2), ALICE), ALICE.peer_id)
    assert learner.buffer.ledger.dropped["too_old"] == 8 and len(learner.buffer) == 4
    learner.buffer.check()


def test_silent_publishers_are_repaired_in_parallel(learner: Learner) -> None:
    """Three peers that accept a repair stream and never answer cost one timeout, not three."""
    silent = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(3)]

    class Silent:
        async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
            await trio.sleep_forever()

        def penalize(self, peer_id: str, topic: str) -> None:
            pass

    async def main() -> None:
        learner.intake.node = Silent()
        for who in silent:
            learner.peers.join(who.peer_id, trio.current_time())
            for s in (1, 4):
                batch, reason, _ = learner.intake.check(seal(make_batch(identity=who, seq=s), who), who.peer_id)
                assert reason is None and batch is not None
                learner.intake.ingest(batch, who.peer_id)
        # One repair round starts after 1 s; done in parallel, all three give up one timeout later.
        with trio.move_on_after(1.0 + REPAIR_TIMEOUT_S + 0.5):
            await learner.intake.repair_loop(1.0)
        assert all(learner.intake.tracker.missing(w.peer_id) == [] for w in silent)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert learner.intake.lost_messages == 3 * 2


def test_the_peer_table_is_bounded(learner: Learner) -> None:
    learner.peers.max_peers = 2
    learner.peers.join("a", 0.0)
    learner.peers.join("b", 10.0)
    with pytest.raises(JoinRefused) as full:
        learner.peers.join("c", 12.0)  # both active
    assert full.value.code == "full"
    learner.peers.join("c", 20.0)  # "a" idle for 20 s: it makes room
    assert list(learner.peers.joined) == ["b", "c"]


def test_stranger_penalties_are_bounded(learner: Learner) -> None:
    from echo_node.learner.intake import MAX_STRANGERS

    for i in range(MAX_STRANGERS + learner.peers.max_peers + 100):
        learner.peers.penalize(f"stranger{i}")
    assert len(learner.peers.penalties) <= MAX_STRANGERS + learner.peers.max_peers


def test_a_peer_banned_on_the_learners_data_channel_is_banned_from_the_run(learner: Learner) -> None:
    """No honest peer sends a bad frame or asks without reading: one is enough to leave the run
    (its rollouts and joins are refused), not a strike among three."""
    learner.peers.join(MALLORY.peer_id, 0.0)
    assert learner.data.on_ban is not None
    learner.data.on_ban(MALLORY.peer_id, "asks without reading")
    assert learner.peers.is_banned(MALLORY.peer_id) and MALLORY.peer_id not in learner.peers.joined
    assert not offer(learner, seal(make_batch(identity=MALLORY, seq=1), MALLORY), MALLORY.peer_id)
    assert learner.buffer.ledger.dropped == {"banned": 1}


def test_a_validated_message_the_queue_drops_is_still_counted(learner: Learner) -> None:
    """py-libp2p drops a validated message when the subscription queue is full; the intake
    hears of it and counts its rollouts as overload instead of losing them from the ledger."""
    learner.peers.join(ALICE.peer_id, 0.0)
    data = seal(make_batch(identity=ALICE, seq=1), ALICE)

    async def go() -> None:
        assert learner.intake.validate(ALICE.peer_id, ALICE.peer_id, data)
        learner.intake.overflowed(type("Msg", (), {"data": data, "sender": ALICE.peer_id})())

    trio.run(go)
    assert learner.buffer.ledger.dropped == {"overload": 8} and learner.buffer.ledger.received == 8
    learner.buffer.check()
