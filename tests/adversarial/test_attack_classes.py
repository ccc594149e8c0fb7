"""Each attack class of benchmarks/attackers.py against the learner's intake, batches built as
the attacker peer builds them (real engine, real model, the attack's own code): with
verification on the attacker is refused and banned on its first batch while an honest peer is
taken; with it off, the attacker's batch is taken. The benchmark runs the same attackers as
processes in a swarm (benchmarks/verification.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.attackers import easy_prompts, flip_rewards, garbage, perturb, poison
from echo_node.config import RunConfig, VerifyConfig
from echo_node.learner.learner import Learner
from echo_node.ml.model import state_to_bytes
from echo_node.policy import Policy
from protocol import DropReason, Identity, RolloutBatch, seal
from tests.factories import ALICE, MALLORY, TASK, TOKENIZER, offer
from tests.sampling import RUN, sample_batch, sample_groups, sharpened, tiny_model, to_batch


def lie(attack: str, model: torch.nn.Module, seq: int) -> RolloutBatch:
    """Mallory's batch `seq`, as attacker `attack` builds it on the learner's version 0."""
    rng = random.Random(seq)
    if attack == "copier":  # Alice's batch, re-published under Mallory's key and seq
        alice = sample_batch(model, seq=seq)
        return RolloutBatch(run_id=RUN, peer_id=MALLORY.peer_id, seq=seq, groups=alice.groups)
    if attack == "other_model":
        model = sharpened(tiny_model(1))
        perturb(model, 0)
    prompts = easy_prompts(4, rng) if attack == "cherry_picked" else None
    groups = sample_groups(model, identity=MALLORY, seq=seq, prompts=prompts)
    change: dict[str, Callable[[], None]] = {
        "fake_rewards": lambda: flip_rewards(groups),
        "garbage": lambda: garbage(groups, TOKENIZER, TASK, rng),
        "poison": lambda: poison(groups, Policy(model, TOKENIZER, TASK, {}, {}), temperature=1.0, max_new_tokens=4),
    }
    change.get(attack, lambda: None)()
    return to_batch(groups, identity=MALLORY, seq=seq)


CAUGHT_AS = {
    "fake_rewards": DropReason.BAD_REWARD,
    "garbage": DropReason.BAD_LOGPROBS,
    "other_model": DropReason.BAD_LOGPROBS,
    "cherry_picked": DropReason.BAD_PROMPT,
    "copier": DropReason.BAD_PROMPT,
    "poison": DropReason.BAD_SAMPLING,
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return sharpened(tiny_model())  # confident, as a trained policy is


def learner_on(model: torch.nn.Module, tmp_path: Path, *, verify: bool) -> Learner:
    cfg = RunConfig(run_id=RUN, runs_dir=tmp_path, verify=VerifyConfig(enabled=verify))
    policy = Policy(model, TOKENIZER, TASK, {"kind": "embedded"}, TOKENIZER.to_dict())
    learner = Learner(cfg, Identity.from_seed(b"\x01" * 32), policy)
    if learner.verifier is not None:
        learner.verifier.remember(0, state_to_bytes(model))
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    return learner


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("attack", list(CAUGHT_AS))
def test_verification_refuses_the_attack_and_only_it(attack: str, model: torch.nn.Module, tmp_path: Path) -> None:
    learner = learner_on(model, tmp_path / "on", verify=True)
    assert offer(learner, seal(sample_batch(model, seq=1), ALICE), ALICE.peer_id)
    offer(learner, seal(lie(attack, model, 2), MALLORY), MALLORY.peer_id)
    reason = CAUGHT_AS[attack]
    assert learner.buffer.ledger.dropped == {reason.value: 32}, learner.buffer.ledger.dropped
    assert learner.peers.is_banned(MALLORY.peer_id) and not learner.peers.is_banned(ALICE.peer_id)
    assert {learner.buffer.origin(g) for g in learner.buffer.take(100, 0)} == {ALICE.peer_id}
    assert learner.verifier is not None and learner.verifier.stats.failed[reason.value.removeprefix("bad_")] == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("attack", list(CAUGHT_AS))
def test_without_verification_the_attack_is_taken(attack: str, model: torch.nn.Module, tmp_path: Path) -> None:
    learner = learner_on(model, tmp_path / "off", verify=False)
    assert offer(learner, seal(lie(attack, model, 2), MALLORY), MALLORY.peer_id)
    assert {learner.buffer.origin(g) for g in learner.buffer.take(100, 0)} == {MALLORY.peer_id}
    assert not learner.peers.is_banned(MALLORY.peer_id)
