"""A rollout peer answers gap repair to its learner only, and only for its own messages: a
repair response can be ~1000x its request, so anyone else asking would make it an amplifier."""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import trio
import trio.testing

from echo_node.config import RunConfig
from echo_node.net import rpc
from echo_node.peer.rollout_peer import RolloutPublisher
from protocol import RepairRequest, RepairResponse, seal
from tests.factories import ALICE, MALLORY, make_batch
from tests.node.test_gap_repair import MemoryPeerStream

# Where the publisher reserves its sequence numbers.
SCRATCH = Path(tempfile.mkdtemp(prefix="echo-node-repair-"))
LEARNER_ID = "12D3KooWLearnerLearnerLearnerLearnerLearnerLearner1"


def ask(asker: str, publisher: str) -> object:
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=SCRATCH), ALICE, node=None)
    peer.history[7] = seal(make_batch(identity=ALICE, seq=7), ALICE)

    class Opener:
        def __init__(self, nursery: trio.Nursery) -> None:
            self.nursery = nursery

        async def open_stream(self, peer_id: str, protocol_id: str) -> MemoryPeerStream:
            ours, theirs = trio.testing.memory_stream_pair()
            self.nursery.start_soon(partial(peer.serve_repair, learner=LEARNER_ID), MemoryPeerStream(theirs, asker))
            return MemoryPeerStream(ours, peer_id)

    async def main() -> object:
        async with trio.open_nursery() as nursery:
            request = RepairRequest(run_id="run-1", peer_id=publisher, seqs=(7,))
            try:
                return await rpc.call(Opener(nursery), ALICE.peer_id, rpc.REPAIR, request, RepairResponse)
            except rpc.RequestFailed as exc:
                return str(exc)

    return trio.run(main)


def test_the_learner_gets_the_frames() -> None:
    response = ask(LEARNER_ID, ALICE.peer_id)
    assert isinstance(response, RepairResponse) and len(response.envelopes) == 1


def test_anyone_else_is_refused() -> None:
    assert str(ask(MALLORY.peer_id, ALICE.peer_id)).startswith("not_learner")


def test_a_request_for_another_publisher_is_refused() -> None:
    assert str(ask(LEARNER_ID, MALLORY.peer_id)).startswith("bad_request")
