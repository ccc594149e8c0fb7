"""The learner re-scores what peers claim: a reward its completion did not earn, or a prompt
the task does not pose, bans the publisher at once and purges its buffered groups."""

from __future__ import annotations

from dataclasses import replace

import pytest

from echo_node.learner import Learner
from echo_node.ml.tasks import get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.verify import RewardCheck
from protocol import DropReason, RolloutBatch, seal
from tests.factories import ALICE, ANSWER_IDS, MALLORY, make_batch, make_group, offer

CHECK = RewardCheck(CharTokenizer(), get_task("addition"))


def forged(batch: RolloutBatch, **group_changes: object) -> RolloutBatch:
    return replace(batch, groups=tuple(replace(g, **group_changes) for g in batch.groups))


def wrong_answers_rewarded() -> RolloutBatch:
    """The forgery that taught the policy to answer "999": wrong answers claimed correct."""
    group = make_group()
    samples = tuple(replace(s, reward=1.0 - s.reward) for s in group.samples)
    return RolloutBatch(run_id="run-1", peer_id=MALLORY.peer_id, seq=9, groups=(replace(group, samples=samples),))


def test_an_honest_batch_passes() -> None:
    assert CHECK(make_batch(groups=3)) is None


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (wrong_answers_rewarded(), DropReason.BAD_REWARD),
        (forged(make_batch(), prompt_ids=(1, 12, 12, 13, 12, 12, 13)), DropReason.BAD_PROMPT),  # "99+99+": not a task prompt
        (forged(make_batch(), prompt_ids=(5, 6, 13, 3, 4, 14)), DropReason.BAD_PROMPT),  # no bos: not how the run encodes
        (forged(make_batch(), prompt_ids=(1, 5, 2, 6, 13, 3, 4, 14)), DropReason.BAD_PROMPT),  # eos inside the prompt
    ],
    ids=["reward", "prompt", "encoding", "eos"],
)
def test_a_forged_claim_fails_with_evidence(batch: RolloutBatch, reason: DropReason) -> None:
    failure = CHECK(batch)
    assert failure is not None and failure.reason is reason and failure.evidence


def test_a_forger_is_banned_at_once_and_its_buffered_groups_purged(learner: Learner) -> None:
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    assert offer(learner, seal(make_batch(identity=MALLORY, seq=1, groups=2), MALLORY), MALLORY.peer_id)  # honest-looking
    assert offer(learner, seal(make_batch(identity=ALICE, seq=1), ALICE), ALICE.peer_id)
    assert not offer(learner, seal(wrong_answers_rewarded(), MALLORY), MALLORY.peer_id)
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert learner.buffer.ledger.dropped == {"bad_reward": 8, "purged": 16}
    assert [learner.buffer.origin(g) for g in learner.buffer.take(10, 0)] == [ALICE.peer_id]
    # Alice's answer was right and stays so: honest peers are never flagged.
    assert not learner.peers.penalties.get(ALICE.peer_id)


def test_with_verification_off_the_forgery_is_trained(learner: Learner) -> None:
    """What the check buys: without it the learner takes the forged rewards."""
    learner.intake.verify = None
    learner.peers.join(MALLORY.peer_id, 0.0)
    assert offer(learner, seal(wrong_answers_rewarded(), MALLORY), MALLORY.peer_id)
    assert len(learner.buffer) == 1


def test_factory_groups_earn_their_rewards() -> None:
    group = make_group()
    assert [s.reward for s in group.samples] == [float(s.completion_ids == ANSWER_IDS) for s in group.samples]
    assert any(s.reward for s in group.samples) and not all(s.reward for s in group.samples)
