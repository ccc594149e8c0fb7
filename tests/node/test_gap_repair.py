"""Gap repair over a request/response stream: the learner asks a publisher for missing seqs.

The learner and the rollout peer run their real handlers; the libp2p stream between them is a
trio memory stream pair, and time is trio's virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
import trio.testing

from echo_node.config import RunConfig
from echo_node.learner.intake import REPAIR_TIMEOUT_S
from echo_node.learner.learner import Learner
from echo_node.peer.rollout_peer import RolloutPublisher
from protocol import RolloutBatch, open_envelope, seal
from protocol.messages import RepairRequest, RepairResponse
from tests.factories import ALICE, make_batch, make_group


@dataclass
class MemoryPeerStream:
    stream: Any
    remote_peer_id: str

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Link:
    """Stands in for the learner's libp2p node: each stream opened is served by the peer."""

    def __init__(self, nursery: trio.Nursery, peer: RolloutPublisher, learner_id: str) -> None:
        self.nursery, self.peer, self.learner_id = nursery, peer, learner_id
        self.opened = 0
        self.penalized: list[str] = []

    async def open_stream(self, peer_id: str, protocol_id: str) -> MemoryPeerStream:
        self.opened += 1
        ours, theirs = trio.testing.memory_stream_pair()
        self.nursery.start_soon(partial(self.peer.serve_repair, learner=self.learner_id), MemoryPeerStream(theirs, self.learner_id))
        return MemoryPeerStream(ours, peer_id)

    def penalize(self, peer_id: str, topic: str) -> None:
        self.penalized.append(peer_id)


def test_missing_sequence_numbers_are_repaired_or_given_up(learner: Learner) -> None:
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=learner.cfg.runs_dir), ALICE, node=None)
    # The publisher (a process that began at seq 10) holds seqs 11 and 13 of what it sent; it
    # never published 12 (so it disowns it: one of DISOWN_ALLOWANCE).
    peer.seq = peer.numbered_from = 10
    sealed = {s: seal(make_batch(identity=ALICE, seq=s), ALICE) for s in (10, 11, 13, 14)}
    peer.history.update({s: sealed[s] for s in (11, 13)})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            link = Link(nursery, peer, learner.node.peer_id)
            learner.intake.node = link  # type: ignore[assignment]
            learner.peers.join(ALICE.peer_id, 0.0)
            for s in (10, 14):  # what gossip delivered
                batch, reason, _ = learner.intake.check(sealed[s], ALICE.peer_id)
                assert reason is None and batch is not None
                learner.intake.ingest(batch, ALICE.peer_id)
            missing = learner.intake.tracker.missing(ALICE.peer_id)
            assert missing == [11, 12, 13]
            with trio.fail_after(5):
                await learner.intake.repair(ALICE.peer_id, missing)
            assert link.opened == 1 and link.penalized == []
            assert learner.intake.tracker.missing(ALICE.peer_id) == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(g.group_id for g in learner.buffer.take(10, 0)) == [f"g{s}000" for s in (10, 11, 13, 14)]
    assert learner.intake.lost_messages == 1  # seq 12: the publisher says it never published it
    assert learner.intake.tracker.disowned(ALICE.peer_id) == 1 and not learner.peers.is_banned(ALICE.peer_id)
    assert learner.buffer.ledger.received == 32


def test_a_dead_publisher_costs_only_a_bounded_wait(learner: Learner) -> None:

    class Dead:
        async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
            await trio.sleep_forever()  # the dial hangs: the peer vanished

    async def main() -> float:
        learner.intake.node = Dead()  # type: ignore[assignment]
        learner.peers.join(ALICE.peer_id, 0.0)
        for s in (2, 5):
            batch, _, _ = learner.intake.check(seal(make_batch(identity=ALICE, seq=s), ALICE), ALICE.peer_id)
            assert batch is not None
            learner.intake.ingest(batch, ALICE.peer_id)
        start = trio.current_time()
        await learner.intake.repair(ALICE.peer_id, learner.intake.tracker.missing(ALICE.peer_id))
        return trio.current_time() - start

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert elapsed == REPAIR_TIMEOUT_S
    # Given up: counted as lost in transit and never asked for again.
    assert learner.intake.lost_messages == 2 and learner.intake.tracker.missing(ALICE.peer_id) == []


class Gossip:
    """The publisher's side of its libp2p node: what it gossips, kept."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.sent.append(data)


def test_a_rebased_publisher_reuses_only_seqs_the_learner_never_had_and_vouches_only_for_its_own(tmp_path: Any) -> None:
    """A restarted peer joins and is told to go on at 70 (the learner saw up to 69 from its
    earlier process): it numbers from 70, not from its clock. After a later join that names 72
    (73 and 74 never reached the learner), 72 on are published anew. Asked for repairs, it
    sends what it holds, says it never published a seq of its own it does not hold, and leaves
    out what may be its earlier process's (below 70): lost in its restart, never disowned."""
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=tmp_path), ALICE, node=Gossip())  # type: ignore[arg-type]
    assert peer.seq > 10**12  # a fresh process numbers from the clock
    peer.rebase(70)
    assert (peer.seq, peer.numbered_from) == (70, 70)

    async def main() -> RepairResponse:
        for seq in range(70, 75):
            await peer.publish_groups((make_group(n=seq),), seq=seq)
        peer.rebase(72)
        assert (peer.seq, peer.numbered_from, sorted(peer.history)) == (72, 70, [70, 71])
        await peer.publish_groups((make_group(n=1000),), seq=72)
        request = RepairRequest(run_id="run-1", peer_id=ALICE.peer_id, seqs=(69, 70, 72, 73))
        return await peer._on_repair(request, "learner", learner="learner")

    answer = trio.run(main)
    assert [open_envelope(e, expected_kind=RolloutBatch)[0].seq for e in answer.envelopes] == [70, 72]
    assert answer.unavailable == (73,)
    assert len(peer.node.sent) == 6  # type: ignore[attr-defined]
