"""A publisher that chooses its own prompts by leaving out the seqs whose assigned prompts it
dislikes (protocol/assignment.py: every seq's prompts are fixed, so skipping is the only choice
it has). The learner counts skipped seqs (gaps that repair never recovers, jumps over owed seqs)
against those delivered (echo_node/learner/intake.py): beyond SKIP_ALLOWANCE + SKIP_SHARE the
publisher is caught like a prompt forger, and beyond DISOWN_ALLOWANCE seqs it says it never
published (repair's "unavailable" within the horizon every publisher keeps), while honest loss
and restarts cost nothing."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import trio
import trio.testing

from echo_node.config import RunConfig
from echo_node.learner.intake import DISOWN_ALLOWANCE, REPAIR_TIMEOUT_S, SKIP_ALLOWANCE, SKIP_SHARE
from echo_node.learner.learner import Learner
from echo_node.net import rpc
from echo_node.peer.rollout_peer import RolloutPublisher
from protocol import Identity, seal
from protocol.limits import MAX_FRAME_BYTES, MAX_REPAIR_SEQS, MAX_SEQ, SEQ_WINDOW
from protocol.messages import JoinRequest, RepairResponse, pack_repair_response, repair_response_had_room
from tests.factories import ALICE, MALLORY, learner_tasks, make_batch, new_learner
from tests.factories import start_learner as start
from tests.node.test_gap_repair import Link
from tests.node.test_learner_reachability import attach


class Silent:
    """A publisher's side of gap repair that never answers (what a skipper says about the seqs
    it left out: it cannot produce them)."""

    async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
        await trio.sleep_forever()

    def penalize(self, peer_id: str, topic: str) -> None:
        pass


def deliver(learner: Learner, who: Identity, seq: int) -> None:
    deliver_sealed(learner, who, seal(make_batch(identity=who, seq=seq), who))


def deliver_sealed(learner: Learner, who: Identity, sealed: bytes) -> None:
    batch, reason, _ = learner.intake.check(sealed, who.peer_id)
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
    restarts once (a new process numbering from the clock, rebased by its join's answer) is
    never charged."""
    learner.peers.join(ALICE.peer_id, 0.0)
    alice = publisher_of(learner, ALICE, first=0)

    def publish(r: int) -> None:
        nonlocal alice
        if r == 4:  # it restarted: its own counter is far ahead, the learner names where it goes on
            alice = publisher_of(learner, ALICE, first=10 * SEQ_WINDOW)
            alice.rebase(learner.intake.tracker.resume_at(ALICE.peer_id))  # the join's seq_from
        for _ in range(250):
            seq, alice.seq = alice.seq, alice.seq + 1
            if seq % 50 != 7:  # lost in transit, and repair finds nothing
                deliver(learner, ALICE, seq)

    run_with_repairs(learner, publish, rounds=8)
    skipped, delivered = learner.intake.tracker.skips(ALICE.peer_id)
    assert learner.intake.tracker.highest(ALICE.peer_id) == 8 * 250 - 1  # no seq left out, none jumped over
    assert skipped > 0 and skipped <= SKIP_SHARE * delivered
    assert not learner.peers.is_banned(ALICE.peer_id) and not learner.peers.penalties


def test_a_known_publisher_jumping_over_owed_seqs_is_caught_at_once_rejoined_or_not(learner: Learner) -> None:
    """Beyond the window nothing can be repaired: a jump there is counted whole. A join first
    excuses nothing: through the learner's own join handler, each rejoins and is told to go on
    at seq 1; Alice does, Mallory jumps to a seq of its choosing."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)

    async def main() -> list[int]:
        for who in (ALICE, MALLORY):
            deliver(learner, who, 0)
        answers = []
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            for who in (ALICE, MALLORY):
                request = JoinRequest(run_id="run-1", peer_id=who.peer_id, data_host="127.0.0.1", data_port=4003)
                answers.append((await learner.door.on_join(request, who.peer_id)).seq_from)
            nursery.cancel_scope.cancel()
        for who, seq in ((ALICE, answers[0]), (MALLORY, 2 * SEQ_WINDOW)):
            batch, reason, _ = learner.intake.check(seal(make_batch(identity=who, seq=seq), who), who.peer_id)
            assert reason is None and batch is not None
            learner.intake.ingest(batch, who.peer_id)
        return answers

    assert trio.run(main) == [1, 1]
    assert learner.peers.is_banned(MALLORY.peer_id) and not learner.peers.is_banned(ALICE.peer_id)
    assert learner.intake.tracker.skips(ALICE.peer_id) == (0, 2)
    assert learner.buffer.ledger.dropped["banned"] == 8  # the jumping batch itself is not taken


def test_rejoining_at_will_launders_no_skips(learner: Learner) -> None:
    """A slot picker that rejoins before each batch it likes (joins are rate-limited, not
    refused) and jumps to that batch's seq, never answering repair. Were a rejoin to excuse the
    next gap, every jump would be free; the join's answer names the seq to go on at instead, so
    every seq it passed over is skipped, rejoins or not, and it is caught like any skipper."""
    caught: list[dict[str, object]] = []
    learner.intake.on_caught = caught.append
    learner.peers.join(MALLORY.peer_id, 0.0)
    delivered = 0

    async def main() -> None:
        nonlocal delivered
        learner.intake.node = Silent()
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            for r in range(20):
                for seq in range(50 * r, 50 * r + 50, 5):  # it likes one slot in five
                    if learner.peers.is_banned(MALLORY.peer_id):
                        break  # (a banned peer's join is refused)
                    await trio.sleep(2.0)  # within the join rate limit (0.5/s)
                    request = JoinRequest(run_id="run-1", peer_id=MALLORY.peer_id, data_host="127.0.0.1", data_port=4003)
                    told = (await learner.door.on_join(request, MALLORY.peer_id)).seq_from
                    assert told == (0 if seq == 0 else seq - 4)  # where it should go on; it goes elsewhere
                    deliver(learner, MALLORY, seq)
                    delivered += 1
                with trio.move_on_after(1.0 + REPAIR_TIMEOUT_S + 0.5):
                    await learner.intake.repair_loop(1.0)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert [c["reason"] for c in caught] == ["bad_prompt"] and "left out" in str(caught[0]["evidence"])
    # 4 skipped per batch delivered: caught as soon as its skips pass the allowance (a round late at most).
    assert delivered <= SKIP_ALLOWANCE // 4 + 10 + 10, delivered


def test_a_restart_of_the_learner_counts_the_same_skips(tmp_path: Any) -> None:
    """An excused gap in the journal: a learner that resumes replays it as excused, so what an
    older release excused is not counted against the peer after the learner's own restart."""
    first = new_learner(tmp_path / "run")

    async def before() -> None:
        await start(first)
        deliver(first, ALICE, 0)
        first.intake.tracker.excuse_next_gap(ALICE.peer_id)
        # What Door.on_join wrote on a rejoin before join answers named the seq to go on at: a
        # journal from then replays the same.
        first.state.journal.append(["excuse", ALICE.peer_id])
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


def publisher_of(learner: Learner, who: Identity, *, first: int) -> RolloutPublisher:
    """The reference peer's publisher (and repair server) for `who`, as a process that started
    at seq `first`."""
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=learner.cfg.runs_dir), who, node=None)
    peer.seq = peer.numbered_from = first
    return peer


def repair_rounds(learner: Learner, peers: dict[str, RolloutPublisher], rounds: list[Callable[[], None]]) -> None:
    """Each round publishes (gossip delivers what it chooses), then the learner asks every
    publisher for what it misses; repairs are answered by the publishers' real handler (the
    process `peers` holds at that moment)."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            class Route:
                async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
                    return await Link(nursery, peers[peer_id], learner.node.peer_id).open_stream(peer_id, protocol_id)

                def penalize(self, peer_id: str, topic: str) -> None:
                    pass

            learner.intake.node = Route()  # type: ignore[assignment]
            for publish in rounds:
                publish()
                for peer_id in peers:
                    missing = learner.intake.tracker.missing(peer_id)
                    if missing and not learner.peers.is_banned(peer_id):
                        with trio.fail_after(REPAIR_TIMEOUT_S):
                            await learner.intake.repair(peer_id, missing)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_publisher_that_disowns_the_seqs_it_left_out_is_caught_within_a_few_batches(learner: Learner) -> None:
    """The reference repair server answers "unavailable" for a seq it never published. Within
    the horizon every publisher keeps, that is a publisher saying it left the seq out: a skipper
    that answers repairs gets DISOWN_ALLOWANCE of them, not SKIP_ALLOWANCE + 5 %. This one
    likes one slot in five (benchmarks/attackers.py's slot_picker's rate)."""
    caught: list[dict[str, object]] = []
    learner.intake.on_caught = caught.append
    learner.peers.join(MALLORY.peer_id, 0.0)
    mallory = publisher_of(learner, MALLORY, first=0)
    delivered = []

    def publish(r: int) -> None:
        for seq in range(10 * r, 10 * r + 10):
            if seq % 5 == 0 and not learner.peers.is_banned(MALLORY.peer_id):
                mallory.history[seq] = sealed = seal(make_batch(identity=MALLORY, seq=seq), MALLORY)
                deliver_sealed(learner, MALLORY, sealed)
                delivered.append(seq)

    repair_rounds(learner, {MALLORY.peer_id: mallory}, [partial(publish, r) for r in range(20)])
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert [c["reason"] for c in caught] == ["bad_prompt"] and "never published" in str(caught[0]["evidence"])
    # 4 disowned per batch delivered: caught once more than DISOWN_ALLOWANCE are, one round late at most.
    assert len(delivered) <= DISOWN_ALLOWANCE // 4 + 1 + 2, delivered
    assert learner.buffer.ledger.dropped["purged"] > 0  # what it had buffered went with the ban


def test_honest_loss_repaired_and_a_restarted_publisher_disown_nothing(learner: Learner) -> None:
    """An honest publisher's messages lost in transit are in its history: repair recovers them.
    After it restarts (a new process, empty history, seqs from a later base) it does not list
    its old seqs as unavailable: they are given up as lost in a restart (skips within the
    allowance), nothing is disowned, no strike. (The reference peer answers repairs only once
    joined; this is the race before that.) Joined, it goes on where the learner says."""
    learner.peers.join(ALICE.peer_id, 0.0)
    peers = {ALICE.peer_id: publisher_of(learner, ALICE, first=0)}

    def publish(seqs: range) -> None:
        for seq in seqs:
            peers[ALICE.peer_id].history[seq] = sealed = seal(make_batch(identity=ALICE, seq=seq), ALICE)
            if seq % 7 != 3:  # lost in transit: repair fetches it from the history
                deliver_sealed(learner, ALICE, sealed)

    def restart() -> None:
        # Seq 59 was lost last (nothing above it had arrived, so it was not known to be
        # missing); 60-69 were published, 60 and 69 delivered, then the process died: 59 and
        # 61-68 are owed, and asked of the new process before its rejoin reaches the learner.
        assert learner.intake.tracker.skips(ALICE.peer_id) == (0, 59)
        publish(range(60, 61))
        deliver_sealed(learner, ALICE, seal(make_batch(identity=ALICE, seq=69), ALICE))
        peers[ALICE.peer_id] = publisher_of(learner, ALICE, first=200)
        assert len(learner.intake.tracker.missing(ALICE.peer_id)) == 9

    def rejoin() -> None:
        # Left out of an answer with room for more: lost, not disowned.
        assert learner.intake.tracker.skips(ALICE.peer_id) == (9, 61)
        assert learner.intake.tracker.missing(ALICE.peer_id) == []
        alice = peers[ALICE.peer_id]
        alice.rebase(learner.intake.tracker.resume_at(ALICE.peer_id))  # its join's seq_from
        assert alice.seq == 70
        publish(range(70, 80))

    rounds: list[Callable[[], None]] = [partial(publish, range(10 * r, 10 * r + 10)) for r in range(6)]
    rounds += [restart, rejoin] + [partial(publish, range(70 + 10 * r, 80 + 10 * r)) for r in range(1, 3)]
    repair_rounds(learner, peers, rounds)
    skipped, delivered = learner.intake.tracker.skips(ALICE.peer_id)
    assert (skipped, learner.intake.tracker.disowned(ALICE.peer_id), delivered) == (9, 0, 91)
    assert not learner.peers.is_banned(ALICE.peer_id) and not learner.peers.penalties


def test_a_skipper_that_leaves_its_skipped_seqs_out_of_answers_is_charged_for_them(learner: Learner) -> None:
    """A responder may leave out what did not fit and be asked again; one that leaves seqs out
    of an answer with room for more does not get them asked for forever (and never counted):
    they are given up as lost, skips against the SKIP_ALLOWANCE + 5 %. (This publisher claims
    every seq is from before its restart, so the reference handler leaves them all out.)"""
    learner.peers.join(MALLORY.peer_id, 0.0)
    mallory = publisher_of(learner, MALLORY, first=10**9)

    def publish(r: int) -> None:
        for seq in range(10 * r, 10 * r + 10, 5):
            mallory.history[seq] = sealed = seal(make_batch(identity=MALLORY, seq=seq), MALLORY)
            deliver_sealed(learner, MALLORY, sealed)

    repair_rounds(learner, {MALLORY.peer_id: mallory}, [partial(publish, r) for r in range(3)])
    assert learner.intake.tracker.skips(MALLORY.peer_id) == (4 * 5, 6) and learner.intake.tracker.missing(MALLORY.peer_id) == []
    assert learner.intake.tracker.disowned(MALLORY.peer_id) == 0 and learner.intake.lost_messages == 20


def test_a_publisher_owing_many_seqs_is_asked_at_once_not_at_the_next_round(learner: Learner) -> None:
    """The repair loop wakes when a publisher owes more than DISOWN_ALLOWANCE seqs: a skipper
    answers for them (and is caught) within its next batches, not a whole interval later."""
    caught: list[dict[str, object]] = []
    learner.intake.on_caught = caught.append
    learner.peers.join(MALLORY.peer_id, 0.0)
    mallory = publisher_of(learner, MALLORY, first=0)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            learner.intake.node = Link(nursery, mallory, learner.node.peer_id)  # type: ignore[assignment]
            nursery.start_soon(learner.intake.repair_loop, 60.0)
            await trio.sleep(1.0)
            start = trio.current_time()
            for seq in range(0, 200, 5):
                mallory.history[seq] = sealed = seal(make_batch(identity=MALLORY, seq=seq), MALLORY)
                deliver_sealed(learner, MALLORY, sealed)
                await trio.sleep(0.1)  # (a batch every 0.1 s)
                if learner.peers.is_banned(MALLORY.peer_id):
                    nursery.cancel_scope.cancel()
                    return trio.current_time() - start
        raise AssertionError("never caught")

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [c["reason"] for c in caught] == ["bad_prompt"]
    assert elapsed <= 0.5, elapsed  # its 3rd-5th batch, against a 60 s interval


class Answering:
    """A publisher's repair server that answers every request with `response`, whatever it asks."""

    def __init__(self, response: RepairResponse) -> None:
        self.response = response

    async def serve_repair(self, stream: Any, *, learner: str) -> None:
        async def answer(request: Any, remote: str) -> RepairResponse:
            return self.response

        await rpc.serve_one(stream, answer, on_bad=lambda p, e: None)


def in_trio(fn: Callable[[], Any]) -> Any:
    """`fn()` inside a trio run (delivering a batch reads trio's clock)."""

    async def main() -> Any:
        return fn()

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def repair_once(learner: Learner, server: Any, missing: list[int]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner.intake.node = Link(nursery, server, learner.node.peer_id)  # type: ignore[assignment]
            with trio.fail_after(REPAIR_TIMEOUT_S + 1):
                await learner.intake.repair(MALLORY.peer_id, missing)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_repair_answer_charges_nothing_but_the_responders_own_owed_seqs(learner: Learner) -> None:
    """`unavailable` naming seqs that were not asked, were delivered, lie below the floor, above
    the highest, or at the largest seq the wire allows, counts nothing; seqs far below the
    highest are skips, not disowned. (Whatever a hostile answer says, it can only charge the
    responder, and only for what it owes.)"""
    learner.peers.join(MALLORY.peer_id, 0.0)
    in_trio(lambda: [deliver(learner, MALLORY, seq) for seq in (1000, 1400, 1500)])
    assert learner.intake.tracker.owed(MALLORY.peer_id) == 399 + 99  # 1001-1399, 1401-1499
    asked = [1001, 1002, 1450, 1451]
    noise = [5, 999, 1000, 1400, 1500, 1501, MAX_SEQ]  # below the floor, delivered, above the highest, the largest
    repair_once(learner, Answering(RepairResponse(envelopes=(), unavailable=(*noise, *asked))), asked)
    # 1001, 1002: 498-499 below the highest it had (1500): lost, not disowned; 1450, 1451: disowned.
    assert learner.intake.tracker.skips(MALLORY.peer_id) == (4, 3)
    assert learner.intake.tracker.disowned(MALLORY.peer_id) == 2
    assert not learner.peers.is_banned(MALLORY.peer_id)


def test_a_full_answer_keeps_its_left_out_seqs_owed_and_a_padded_one_does_not_hide_them(learner: Learner) -> None:
    """What a full answer leaves out is asked again (it did not fit); an answer with room that
    leaves seqs out gives them up as lost. Padding an answer with copies of delivered batches
    to look full only keeps its seqs owed: asked again, and counted when they leave the window."""
    learner.peers.join(MALLORY.peer_id, 0.0)
    sealed = {s: seal(make_batch(identity=MALLORY, seq=s), MALLORY) for s in (0, 10)}
    in_trio(lambda: [deliver_sealed(learner, MALLORY, sealed[s]) for s in (0, 10)])
    asked = learner.intake.tracker.missing(MALLORY.peer_id)
    assert asked == list(range(1, 10))
    padding = pack_repair_response([sealed[0]] * MAX_REPAIR_SEQS)  # as full as it gets: duplicates
    assert not repair_response_had_room(padding, frame_bytes=MAX_FRAME_BYTES)
    repair_once(learner, Answering(padding), asked)
    assert learner.intake.tracker.missing(MALLORY.peer_id) == asked and learner.intake.tracker.skips(MALLORY.peer_id) == (0, 2)
    repair_once(learner, Answering(RepairResponse(envelopes=(sealed[10],), unavailable=())), asked)
    assert learner.intake.tracker.missing(MALLORY.peer_id) == [] and learner.intake.tracker.skips(MALLORY.peer_id) == (9, 2)
    assert learner.intake.tracker.disowned(MALLORY.peer_id) == 0


def test_a_responder_that_never_answers_disowns_nothing(learner: Learner) -> None:
    """A repair that times out gives its seqs up as lost (the 256 + 5 % allowance), never as
    disowned: an honest peer the learner cannot reach looks the same."""
    learner.peers.join(MALLORY.peer_id, 0.0)

    async def main() -> float:
        for seq in (0, 20):
            deliver(learner, MALLORY, seq)
        learner.intake.node = Silent()
        start = trio.current_time()
        await learner.intake.repair(MALLORY.peer_id, learner.intake.tracker.missing(MALLORY.peer_id))
        return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == REPAIR_TIMEOUT_S
    assert learner.intake.tracker.skips(MALLORY.peer_id) == (19, 2) and learner.intake.tracker.disowned(MALLORY.peer_id) == 0


def test_a_publisher_that_leaves_out_or_jumps_over_seqs_loses_the_fill_of_unproven_steps(learner: Learner) -> None:
    """`Learner._clean`, what lets an unproven publisher fill a step nobody proven can fill past
    `verify.unproven_groups` (echo_node/learner/replay.py), is read from the seqs peers send: a
    gap it owes or a seq given up after repair makes it dirty (a jump beyond the window is
    caught outright); an honest publisher delivering in order stays clean, and a gap repaired
    makes it clean again."""

    async def main() -> None:
        carol = Identity.generate()
        for who in (ALICE, MALLORY, carol):
            learner.peers.join(who.peer_id, 0.0)
        for seq in range(5):
            deliver(learner, ALICE, seq)
        assert learner._clean(ALICE.peer_id)
        deliver(learner, MALLORY, 0)
        deliver(learner, MALLORY, 3)  # 1 and 2 owed
        assert not learner._clean(MALLORY.peer_id)
        deliver(learner, MALLORY, 1)
        deliver(learner, MALLORY, 2)  # repaired: owes nothing again
        assert learner._clean(MALLORY.peer_id)
        deliver(learner, carol, 0)
        deliver(learner, carol, 2 * SEQ_WINDOW)  # a jump beyond the window counts whole: caught at once
        # Banned and purged, its record forgotten: it has no groups left for any step to take.
        assert learner.peers.is_banned(carol.peer_id) and not any(learner.buffer.origin(g) == carol.peer_id for g in learner.buffer._groups)
        deliver(learner, MALLORY, 10)
        learner.intake.tracker.mark_given_up(MALLORY.peer_id, range(4, 10))  # repair gave up on them
        assert learner.intake.tracker.owed(MALLORY.peer_id) == 0 and not learner._clean(MALLORY.peer_id)

    trio.run(main)
