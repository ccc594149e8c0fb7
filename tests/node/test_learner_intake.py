"""The learner's rollout intake: bad input is counted, logged and penalized; good input survives.

Drives the real validator and ingest path of a `Learner` (libp2p host built but not started,
tiny model without warm-up) with the same byte strings a hostile peer could gossip.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing

from echo_node.learner.learner import Learner
from protocol import seal
from tests.factories import ALICE, MALLORY, bad_rollout_messages, make_batch, make_group, offer


@pytest.fixture(autouse=True)
def joined(learner: Learner) -> None:
    """Alice and Mallory joined the run (only joined peers may publish); bans are tested below."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    learner.peers.ban_after = 1000


def test_every_bad_message_is_counted_penalized_and_logged(learner: Learner, caplog: pytest.LogCaptureFixture) -> None:
    good = seal(make_batch(identity=ALICE, seq=1), ALICE)
    assert offer(learner, good, ALICE.peer_id)
    for name, data, reason, rollouts in bad_rollout_messages(MALLORY, "run-1"):
        before = learner.buffer.ledger.dropped[reason]
        with caplog.at_level(logging.WARNING, logger="echo_node.learner.intake"):
            assert not offer(learner, data, MALLORY.peer_id), name
        assert learner.buffer.ledger.dropped[reason] == before + rollouts, name
        assert MALLORY.peer_id in caplog.records[-1].getMessage(), name
    # Every one is a strike but another schema version (an honest peer on another release); a
    # reward its completion did not earn (the last one) bans at once.
    assert learner.peers.penalties[MALLORY.peer_id] >= len(bad_rollout_messages(MALLORY, "run-1")) - 2
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert learner.peers.penalties[ALICE.peer_id] == 0
    assert learner.peers.score(MALLORY.peer_id) < 0
    # What was accepted before the attack is untouched.
    assert len(learner.buffer) == 1 and learner.buffer.ledger.dropped.get("unused_at_exit", 0) == 0
    learner.buffer.check()


def test_signed_by_someone_else_than_the_gossip_origin(learner: Learner) -> None:
    forged = seal(make_batch(identity=MALLORY, seq=3), MALLORY)
    assert not offer(learner, forged, ALICE.peer_id, forwarder=MALLORY.peer_id)
    assert learner.buffer.ledger.dropped["wrong_sender"] == 1
    # Both the claimed origin and the forwarder that relayed it are charged.
    assert learner.peers.penalties[MALLORY.peer_id] == 1


def test_duplicates_and_group_size(learner: Learner) -> None:
    msg = seal(make_batch(seq=7, groups=2), ALICE)
    assert offer(learner, msg, ALICE.peer_id)
    assert not offer(learner, seal(make_batch(seq=8, samples=4), ALICE), ALICE.peer_id)

    async def replay() -> None:
        batch, _, _ = learner.intake.check(msg, ALICE.peer_id)
        assert batch is not None
        learner.intake.ingest(batch, ALICE.peer_id)  # e.g. delivered again by gap repair

    trio.run(replay)
    assert learner.buffer.ledger.dropped == {"bad_group": 4, "duplicate": 16}
    assert len(learner.buffer) == 2
    learner.buffer.check()


def test_one_bad_group_refuses_the_whole_signed_batch(learner: Learner) -> None:
    good = make_batch(seq=1, groups=3)
    short = make_batch(seq=1, samples=4).groups[0]
    mixed = seal(replace(good, groups=(*good.groups, short)), ALICE)
    assert not offer(learner, mixed, ALICE.peer_id)
    assert learner.buffer.ledger.dropped == {"bad_group": 3 * 8 + 4} and len(learner.buffer) == 0
    assert learner.peers.penalties[ALICE.peer_id] == 1


def test_a_validated_message_is_verified_once(learner: Learner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The validator's decoded batch goes to the consumer: one signature check per message."""
    import echo_node.learner.intake as learner_module

    opened: list[bytes] = []
    real = learner_module.open_envelope

    def counting(data: bytes, **kw: Any) -> Any:
        opened.append(data)
        return real(data, **kw)

    monkeypatch.setattr(learner_module, "open_envelope", counting)
    msgs = [seal(make_batch(seq=s, groups=2), ALICE) for s in range(3)]
    for m in msgs:
        assert offer(learner, m, ALICE.peer_id)
    assert opened == msgs and len(learner.buffer) == 6 and not learner.intake._checked


def test_demand_is_split_among_the_peers_that_deliver(learner: Learner) -> None:
    async def go() -> list[int]:
        for p in list(learner.peers.joined):
            learner.peers.leave(p)
        out = [learner._ask()]
        for i in range(4):
            learner.peers.join(f"p{i}", trio.current_time())
            learner.peers.contributed(f"p{i}", 8, trio.current_time())
        out.append(learner._ask())
        # Joined peers that only ask (status, joins) or deliver a trickle cannot cut the demand
        # of the peers that do the work.
        for i in range(12):
            learner.peers.join(f"sybil{i}", trio.current_time())
        learner.peers.contributed("sybil0", 1, trio.current_time())
        out.append(learner._ask())
        await trio.sleep(16)  # the window passes: nobody delivered lately
        out.append(learner._ask())
        return out

    # async, groups_per_step=8, κ=1, nothing buffered: this version's update and one in
    # reserve, 16 for a lone peer, 4 each for four; a sybil's one group makes four and an eighth
    # peers' worth (16 / 4.125 -> 4).
    assert trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0)) == [16, 4, 4, 16]


def test_a_pull_peer_whose_checked_groups_come_late_still_counts_in_the_split(learner: Learner) -> None:
    """In pull mode a peer that is always the last to finish gets its (checked) groups dropped
    as stale: they still count as its work, or the split would leave it out and starve it."""

    async def go() -> tuple[float, float]:
        learner.buffer.mode = "pull"
        learner.trainer.version = 3
        now = trio.current_time()
        learner.intake.ingest(make_batch(identity=ALICE, seq=0, groups=4, version=3), ALICE.peer_id)
        learner.intake.ingest(make_batch(identity=MALLORY, seq=0, groups=4, version=2), MALLORY.peer_id)
        pull = learner.peers.effective_peers(now)
        # In async mode a peer whose groups are all too old is not a working head.
        learner.buffer.mode, learner.buffer.staleness = "async", 0
        learner.intake.ingest(make_batch(identity=MALLORY, seq=1, groups=4, version=2), MALLORY.peer_id)
        await trio.sleep(20)  # the window passes, and so does the cached answer
        learner.intake.ingest(make_batch(identity=ALICE, seq=1, groups=4, version=3), ALICE.peer_id)
        learner.intake.ingest(make_batch(identity=MALLORY, seq=2, groups=4, version=2), MALLORY.peer_id)
        return pull, learner.peers.effective_peers(trio.current_time())

    pull, asynchronous = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    assert learner.buffer.ledger.dropped["stale"] == 3 * 4 * 8
    assert (pull, asynchronous) == (2.0, 1.0)


def test_demand_counts_what_the_learner_holds(learner: Learner) -> None:
    """What is buffered and admissible is not asked for again; the ask stays >= 1 (wire floor)
    and is the same in every status answer until the next publication."""
    for p in list(learner.peers.joined):
        learner.peers.leave(p)
    cfg = learner.cfg.rl
    for n in range(cfg.groups_per_step + 3):
        assert learner.buffer.offer(make_group(version=learner.version, n=n), learner.version) is None
    # κ = 1: one update and one in reserve, less the g + 3 held.
    assert trio.run(lambda: _ask_now(learner)) == cfg.groups_per_step - 3
    for n in range(20):
        learner.buffer.offer(make_group(version=learner.version, n=100 + n), learner.version)
    assert trio.run(lambda: _ask_now(learner)) == 1
    learner.publication.demand = 5
    assert learner.demand_groups() == 5


async def _ask_now(learner: Learner) -> int:
    return learner._ask()


def test_a_deadline_between_take_and_step_loses_nothing(learner: Learner, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The run's deadline can fall right after a batch left the buffer: the update completes
    and is counted (this once dropped 64 rollouts from the ledger at the end of a demo)."""
    learner.report.open()
    for seq in range(8):
        assert offer(learner, seal(make_batch(identity=ALICE, seq=seq), ALICE), ALICE.peer_id)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.data.run)
            with trio.CancelScope() as scope:
                take = learner.buffer.take

                def take_then_deadline(n: int, version: int, **how):  # type: ignore[no-untyped-def]
                    scope.cancel()
                    return take(n, version, **how)

                learner.buffer.take = take_then_deadline  # type: ignore[method-assign]
                await learner._train_loop()
            nursery.cancel_scope.cancel()

    learner.weights.offer(0, b"\0" * 100)
    try:
        trio.run(main)
    finally:
        learner.report.close()
    learner.buffer.close()
    learner.buffer.check()
    assert learner.buffer.ledger.trained == 64 and learner.version == 1


def test_publish_every_k_publishes_only_every_kth_version(learner: Learner, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """rl.publish_every = 2: three updates make versions 1..3, of which only 2 is snapshotted
    and served; peers are told about version 2 and asked for what two updates and the reserve need."""
    from echo_node.weights.broadcast import FULL
    from protocol.messages import StatusRequest

    learner.capacity.kappa = 2  # rl.publish_every = 2, as the learner takes it at start
    learner.cfg.max_versions = 3
    learner.report.open()
    for seq in range(3 * learner.cfg.rl.groups_per_step):
        assert offer(learner, seal(make_batch(identity=ALICE, seq=seq), ALICE), ALICE.peer_id)

    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.data.run)
            await learner._train_loop()
            status = await learner.door.on_status(StatusRequest(run_id="run-1"), ALICE.peer_id)
            nursery.cancel_scope.cancel()
        return status

    learner.weights.offer(0, b"\0" * 100)
    try:
        status = trio.run(main)
    finally:
        learner.report.close()
    assert learner.version == 3 and learner.weights.published == 2
    assert sorted(v for v, base in learner.weights.sources if base == FULL) == [0, 2]
    assert status.version == 2
    assert status.weights_sha256 == learner.weights.sources[(2, FULL)].store.manifest.weights_sha256
    # 8 groups per update, 2 updates per version and one in reserve, less the 8 still buffered.
    assert status.demand_groups == 16
    assert learner.spec().current_version == 2
