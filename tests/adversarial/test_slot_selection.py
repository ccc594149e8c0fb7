"""A publisher that chooses its own prompts by leaving out the seqs whose assigned prompts it
dislikes (protocol/assignment.py: every seq's prompts are fixed, so skipping is the only choice
it has). The learner counts skipped seqs (gaps that repair never recovers, jumps over owed seqs)
against those delivered (echo_node/learner/intake.py): beyond SKIP_ALLOWANCE + SKIP_SHARE the publisher
is caught like a prompt forger, while honest loss and restarts cost nothing."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from echo_node.learner.intake import REPAIR_TIMEOUT_S, SKIP_ALLOWANCE, SKIP_SHARE
from echo_node.learner.learner import Learner
from protocol import Identity, seal
from protocol.limits import SEQ_WINDOW
from tests.factories import ALICE, MALLORY, learner_tasks, make_batch, new_learner
from tests.factories import start_learner as start


class Silent:
    """A publisher's side of gap repair that never answers (what a skipper says about the seqs
    it left out: it cannot produce them)."""

    async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
        await trio.sleep_forever()

    def penalize(self, peer_id: str, topic: str) -> None:
        pass


def deliver(learner: Learner, who: Identity, seq: int) -> None:
    batch, reason, _ = learner.intake.check(seal(make_batch(identity=who, seq=seq), who), who.peer_id)
    assert reason is None and batch is not None, reason
    learner.intake.ingest(batch, who.peer_id)


def dislikes(seq: int) -> bool:
    """The skipper's taste: half of its slots, fixed by the seq as an assignment would be."""
    return seq % 2 == 1


def run_with_repairs(learner: Learner, publish: Any, rounds: int) -> None:
    """`publish(seq_round)` delivers one round of batches, then a repair round gives up on what
    is missing (every repair times out)."""

    async def main() -> None:
        learner.intake.node = Silent()
        for r in range(rounds):
            publish(r)
            with trio.move_on_after(1.0 + REPAIR_TIMEOUT_S + 0.5):
                await learner.intake.repair_loop(1.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_publisher_that_skips_the_seqs_it_dislikes_is_caught(learner: Learner) -> None:
    caught: list[dict[str, object]] = []
    learner.intake.on_caught = caught.append
    learner.peers.join(MALLORY.peer_id, 0.0)
    per_round = 128
    delivered = 0

    def publish(r: int) -> None:
        nonlocal delivered
        for seq in range(r * per_round, (r + 1) * per_round):
            if not dislikes(seq) and not learner.peers.is_banned(MALLORY.peer_id):
                deliver(learner, MALLORY, seq)
                delivered += 1

    run_with_repairs(learner, publish, rounds=8)
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert [c["reason"] for c in caught] == ["bad_prompt"] and "left out" in str(caught[0]["evidence"])
    # Caught as soon as its skips passed the allowance: about as many batches as it skipped.
    assert delivered <= 2 * (SKIP_ALLOWANCE + per_round), delivered
    assert learner.buffer.ledger.dropped["purged"] > 0  # what it had buffered went with the ban


def test_honest_loss_and_a_restart_cost_nothing(learner: Learner) -> None:
    """An honest publisher whose messages are lost now and then (2 %, none recovered) and which
    restarts once (a rejoin, and its seqs jump to the clock) is never charged."""
    learner.peers.join(ALICE.peer_id, 0.0)
    base = [0]

    def publish(r: int) -> None:
        if r == 4:  # it restarted: it joins again, and its counter moved far ahead
            learner.intake.tracker.excuse_next_gap(ALICE.peer_id)
            base[0] = 10 * SEQ_WINDOW
        for i in range(r * 250, (r + 1) * 250):
            if i % 50 != 7:  # lost in transit, and repair finds nothing
                deliver(learner, ALICE, base[0] + i)

    run_with_repairs(learner, publish, rounds=8)
    skipped, delivered = learner.intake.tracker.skips(ALICE.peer_id)
    assert skipped > 0 and skipped <= SKIP_SHARE * delivered
    assert not learner.peers.is_banned(ALICE.peer_id) and not learner.peers.penalties


def test_a_known_publisher_jumping_over_owed_seqs_is_caught_at_once(learner: Learner) -> None:
    """Beyond the window nothing can be repaired: a jump there is counted whole, unless the
    publisher rejoined first."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)

    async def main() -> None:
        for who in (ALICE, MALLORY):
            deliver(learner, who, 0)
        learner.intake.tracker.excuse_next_gap(ALICE.peer_id)  # Alice rejoined
        for who in (ALICE, MALLORY):
            batch, reason, _ = learner.intake.check(seal(make_batch(identity=who, seq=2 * SEQ_WINDOW), who), who.peer_id)
            assert reason is None and batch is not None
            learner.intake.ingest(batch, who.peer_id)

    trio.run(main)
    assert learner.peers.is_banned(MALLORY.peer_id) and not learner.peers.is_banned(ALICE.peer_id)
    assert learner.buffer.ledger.dropped["banned"] == 8  # the jumping batch itself is not taken


def test_a_restart_of_the_learner_counts_the_same_skips(tmp_path: Any) -> None:
    """An excused gap is journaled: a learner that resumes replays it as excused, so an honest
    peer's restart is not counted against it after the learner's own restart."""
    first = new_learner(tmp_path / "run")

    async def before() -> None:
        await start(first)
        deliver(first, ALICE, 0)
        first.intake.tracker.excuse_next_gap(ALICE.peer_id)
        first.state.journal.append(["excuse", ALICE.peer_id])  # what Learner._on_join does on a rejoin
        deliver(first, ALICE, 3 * SEQ_WINDOW)
        async with learner_tasks(first):
            await first._flush_journal()

    trio.run(before)
    assert first.intake.tracker.skips(ALICE.peer_id) == (0, 2)
    first.report.close()
    second = new_learner(tmp_path / "run")
    trio.run(start, second)
    second.report.close()
    assert second.intake.tracker.skips(ALICE.peer_id) == (0, 2)
