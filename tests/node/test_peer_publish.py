"""A rollout peer publishes each generation batch as one signed gossip message under the seq its
prompts were assigned for, and drops (counted, logged) a batch no gossip frame can carry without
crashing or leaving a gap in its seqs."""

from __future__ import annotations

import logging
import random
from functools import partial
from pathlib import Path

import pytest
import trio

from echo_node.config import RunConfig
from echo_node.ml.engine import Generation
from echo_node.ml.rollout import ScoredGroup
from echo_node.peer.rollout_peer import RolloutPublisher
from protocol import RolloutBatch, open_envelope
from protocol.errors import LocalProtocolError
from tests.factories import ALICE


class Recorder:
    """Stands in for the peer's libp2p node: records what it is asked to gossip."""

    peer_id = ALICE.peer_id

    def __init__(self) -> None:
        self.published: list[bytes] = []

    async def publish(self, topic: str, data: bytes) -> None:
        self.published.append(data)


def scored(tokens: int, seed: int) -> ScoredGroup:
    """8 completions of `tokens` random tokens: incompressible once `tokens` is large."""
    rng = random.Random(seed)
    gens = [
        Generation([rng.randrange(1_000_000) for _ in range(tokens)], [-rng.random() for _ in range(tokens)], [3] * tokens)
        for _ in range(8)
    ]
    return ScoredGroup("p", [1, 2, 3], gens, ["x"] * 8, [float(i % 2) for i in range(8)])


def test_batches_get_consecutive_seqs_and_an_oversize_batch_is_dropped(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    node = Recorder()
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=tmp_path), ALICE, node)
    first_seq = peer.seq
    small, oversize, last = [scored(4, 0), scored(4, 1)], [scored(4, 2), scored(4096, 3)], [scored(4, 4)]
    with caplog.at_level(logging.WARNING, logger="echo_node.peer.rollout_peer"):
        for batch in (small, oversize, last):
            trio.run(partial(peer.publish, batch, seq=peer.seq))
    opened = [open_envelope(m, expected_kind=RolloutBatch, expected_sender=ALICE.peer_id)[0] for m in node.published]
    # The oversize batch used up no seq: the learner sees no gap, and asks for nothing in vain.
    assert [b.seq for b in opened] == [first_seq, first_seq + 1] and peer.seq == first_seq + 2
    assert [len(b.groups) for b in opened] == [2, 1]
    assert [g.samples[0].completion_ids for b in opened for g in b.groups] == [
        tuple(s.generations[0].completion_ids) for s in (*small, *last)
    ]
    assert peer.unsendable_groups == 2 and peer.published_groups == 3
    assert sorted(peer.history) == [first_seq, first_seq + 1]  # what gap repair can serve
    assert "do not fit one gossip message" in caplog.records[-1].getMessage()


def test_a_batch_sampled_for_another_seq_is_refused(tmp_path: Path) -> None:
    """Its prompts were assigned for that seq: published under another, the learner would ban."""
    peer = RolloutPublisher(RunConfig(run_id="run-1", runs_dir=tmp_path), ALICE, Recorder())
    with pytest.raises(LocalProtocolError, match="sampled for seq"):
        trio.run(partial(peer.publish, [scored(4, 0)], seq=peer.seq + 1))
