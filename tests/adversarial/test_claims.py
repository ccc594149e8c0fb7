"""The learner's checks on every batch (echo_node/learner/spot_check.py): completions end at eos, prompts
are the ones their slots assign, rewards are the run's. A forged claim bans the publisher at
once, for versions, across restarts, and purges its buffered groups."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import trio

from echo_node.config import VerifyConfig
from echo_node.learner.banlog import BanLog
from echo_node.learner.learner import Learner
from echo_node.learner.spot_check import COPIES_PER_STRIKE, Verifier
from echo_node.ml.model import build_model, tiny_llama_config
from protocol import DropReason, RolloutBatch, RolloutGroup, seal
from tests.factories import ALICE, MALLORY, TASK, TOKENIZER, answer_ids, make_batch, make_group, offer


def verifier(**cfg: object) -> Verifier:
    torch.manual_seed(0)
    model = build_model(tiny_llama_config(TOKENIZER.vocab_size))
    return Verifier(
        VerifyConfig(**cfg), run_id="run-1", tokenizer=TOKENIZER, task=TASK, model=model, temperature=1.0, keep_versions=4  # type: ignore[arg-type]
    )


CHECK = verifier(logprobs=False)


def forged(batch: RolloutBatch, **group_changes: object) -> RolloutBatch:
    return replace(batch, groups=tuple(replace(g, **group_changes) for g in batch.groups))


def with_samples(batch: RolloutBatch, change: object) -> RolloutBatch:
    """`batch` with every sample replaced by `change(sample)`."""
    return replace(batch, groups=tuple(replace(g, samples=tuple(change(s) for s in g.samples)) for g in batch.groups))  # type: ignore[operator]


def wrong_answers_rewarded(seq: int = 9) -> RolloutBatch:
    """The forgery that taught the policy to answer "999": wrong answers claimed correct."""
    return with_samples(make_batch(identity=MALLORY, seq=seq), lambda s: replace(s, reward=1.0 - s.reward))


def injected_after_eos() -> RolloutBatch:
    """Right answers, rewarded right, with "999" riding after the eos the reward stops at (the
    default run's 4-token completions have no room for it: `too_long` refuses it there first)."""
    return with_samples(make_batch(identity=MALLORY, seq=3), lambda s: replace(
        s, completion_ids=s.completion_ids + (12, 12, 12), behaviour_logprobs=s.behaviour_logprobs + (-0.1,) * 3,
        token_versions=s.token_versions + s.token_versions[-1:] * 3,
    ))


def cherry_picked() -> RolloutBatch:
    """An easy prompt of the peer's choosing instead of its slot's, honestly answered."""
    return replace(make_batch(identity=MALLORY, seq=4), groups=(make_group(prompt="00+00="),))


def copied_from_alice() -> RolloutBatch:
    """Alice's group, re-signed under Mallory's key (same seq, so even the slot index matches)."""
    return replace(make_batch(identity=ALICE, seq=5), peer_id=MALLORY.peer_id)


def test_honest_batches_pass() -> None:
    for seq in range(20):
        for version in (0, 3):
            assert CHECK.claims(make_batch(identity=ALICE, seq=seq, version=version, groups=3)) is None
    assert CHECK.stats.failed == {}


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (wrong_answers_rewarded(), DropReason.BAD_REWARD),
        (injected_after_eos(), DropReason.BAD_COMPLETION),
        (cherry_picked(), DropReason.BAD_PROMPT),
        (copied_from_alice(), DropReason.BAD_PROMPT),
        (forged(make_batch(), prompt_ids=(1, 12, 12, 13, 12, 12, 13)), DropReason.BAD_PROMPT),  # "99+99+": no task prompt
        (forged(make_batch(), prompt_ids=make_batch().groups[0].prompt_ids[1:]), DropReason.BAD_PROMPT),  # the slot's, no bos
        # The next seq's prompt (a picker choosing among the seqs within reach): not this slot's.
        (replace(make_batch(identity=MALLORY, seq=6), groups=make_batch(identity=MALLORY, seq=7).groups), DropReason.BAD_PROMPT),
    ],
    ids=["reward", "after-eos", "cherry-picked", "copied", "not-a-prompt", "no-bos", "next-seq"],
)
def test_a_forged_claim_fails_with_evidence(batch: RolloutBatch, reason: DropReason) -> None:
    failure = CHECK.claims(batch)
    assert failure is not None and failure.reason is reason and failure.evidence


def test_the_version_a_batch_begins_on_gives_no_choice_of_prompts() -> None:
    """A publisher may begin a batch on any admissible version (S + 1 in async mode). The slot
    does not name the version, so every choice owes the seq's one set of prompts: the learner
    takes it begun on any version, and refuses the prompts of another version's old-rule slot
    just like any prompt of the publisher's choosing."""
    for seq in range(20):
        for version in range(5):
            batch = make_batch(identity=MALLORY, seq=seq, version=version, groups=3)
            assert CHECK.claims(batch) is None
            assert [g.prompt_ids for g in batch.groups] == [g.prompt_ids for g in make_batch(identity=MALLORY, seq=seq, groups=3).groups]
    # The easiest prompt among the S + 1 a version-naming slot would have offered (here: the easiest).
    easiest = "00+00="
    begun_on_2 = make_batch(identity=MALLORY, seq=3, version=2)
    assert tuple(TOKENIZER.encode_prompt(easiest)) != begun_on_2.groups[0].prompt_ids
    failure = CHECK.claims(replace(begun_on_2, groups=(make_group(prompt=easiest, version=2),)))
    assert failure is not None and failure.reason is DropReason.BAD_PROMPT


def test_samples_that_began_on_two_versions_fail() -> None:
    batch = make_batch(version=2)
    g = batch.groups[0]
    mixed = replace(g, samples=(replace(g.samples[0], token_versions=(1,) * 4), *g.samples[1:]))
    failure = CHECK.claims(replace(batch, groups=(mixed,)))
    assert failure is not None and failure.reason is DropReason.BAD_PROMPT and "different versions" in failure.evidence


def test_a_forger_is_banned_at_once_for_versions_and_its_buffered_groups_purged(learner: Learner) -> None:
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    assert offer(learner, seal(make_batch(identity=MALLORY, seq=1, groups=2), MALLORY), MALLORY.peer_id)  # honest-looking
    assert offer(learner, seal(make_batch(identity=ALICE, seq=1), ALICE), ALICE.peer_id)
    assert not offer(learner, seal(wrong_answers_rewarded(), MALLORY), MALLORY.peer_id)
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert learner.peers.banned_until_version[MALLORY.peer_id] == learner.cfg.verify.ban_versions
    assert learner.buffer.ledger.dropped == {"bad_reward": 8, "purged": 16}
    assert [learner.buffer.origin(g) for g in learner.buffer.take(10, 0)] == [ALICE.peer_id]
    # Alice's answers were right and stay so: honest peers are never flagged.
    assert not learner.peers.penalties.get(ALICE.peer_id)
    assert learner.intake.ban_log is not None
    learner.intake.ban_log.flush(learner.peers.live_bans)  # what the ban log's task or a stop does
    assert BanLog(learner.cfg.run_dir / "bans.log").load()[1] == {MALLORY.peer_id: learner.cfg.verify.ban_versions}


def test_the_caught_record_says_which_of_the_publishers_groups_were_trained(learner: Learner) -> None:
    """The damage a caught publisher did, for the operator (and the benchmark's count of lies
    trained): how many of its groups reached a step, and the ids of the last of them."""
    records: list[dict[str, object]] = []
    write = learner.intake.on_caught
    learner.intake.on_caught = lambda record: (records.append(record), write(record))[1]
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    honest = make_batch(identity=MALLORY, seq=1, groups=2)
    assert offer(learner, seal(honest, MALLORY), MALLORY.peer_id)
    learner.buffer.mark_trained(learner.buffer.take(10, 0))
    assert offer(learner, seal(make_batch(identity=MALLORY, seq=2), MALLORY), MALLORY.peer_id)  # buffered, then purged
    assert not offer(learner, seal(wrong_answers_rewarded(), MALLORY), MALLORY.peer_id)
    [caught] = records
    assert caught["peer"] == MALLORY.peer_id and caught["reason"] == "bad_reward"
    assert caught["trained_groups"] == 2
    assert sorted(caught["trained_recent"]) == sorted(g.group_id for g in honest.groups)  # (in the order trained)


def test_a_version_ban_survives_a_restart_and_ends_at_its_version(learner: Learner) -> None:
    learner.peers.join(MALLORY.peer_id, 0.0)
    assert not offer(learner, seal(wrong_answers_rewarded(), MALLORY), MALLORY.peer_id)
    assert learner.intake.ban_log is not None
    learner.intake.ban_log.flush(learner.peers.live_bans)
    again = Learner(learner.cfg, learner.identity, learner.policy)
    assert again.peers.is_banned(MALLORY.peer_id)
    again.trainer.version = learner.cfg.verify.ban_versions
    assert not again.peers.is_banned(MALLORY.peer_id)


def test_a_copy_of_a_group_is_dropped_and_the_first_sender_keeps_it(learner: Learner) -> None:
    """Two publishers sending one group (same prompt, same samples): the second is `copied`,
    not banned (two honest peers can, rarely, sample the same)."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    assert offer(learner, seal(make_batch(identity=ALICE, seq=7), ALICE), ALICE.peer_id)
    copy = replace(make_batch(identity=MALLORY, seq=7), groups=make_batch(identity=ALICE, seq=7).groups)
    learner.intake.ingest(copy, MALLORY.peer_id)  # as if its slot had assigned the same prompt
    assert learner.buffer.ledger.dropped == {"copied": 8}
    assert [learner.buffer.origin(g) for g in learner.buffer.take(10, 0)] == [ALICE.peer_id]
    assert not learner.peers.is_banned(MALLORY.peer_id)


def with_logprobs(batch: RolloutBatch, per_token: float) -> RolloutBatch:
    return with_samples(batch, lambda s: replace(s, behaviour_logprobs=(per_token,) * len(s.completion_ids)))


def disguised_copy(group: RolloutGroup, n: int) -> RolloutGroup:
    """`group` as a copier would resend it: samples reversed, its own name, log-probs and
    rewards nudged, nothing a reward or a tokenizer would see changed."""
    samples = tuple(replace(s, behaviour_logprobs=tuple(x - 1e-3 for x in s.behaviour_logprobs), reward=s.reward + 1e-9)
                    for s in reversed(group.samples))
    return replace(group, group_id=f"copy{n}", samples=samples)


def test_a_reordered_and_perturbed_copy_is_still_a_copy_and_repeats_are_strikes(learner: Learner) -> None:
    """The fingerprint is over the prompt's and the completions' tokens as a multiset: a copier
    who reorders samples and perturbs log-probs and rewards is caught as `copied`. Alice's
    completions are unlikely ones (3 nats a token), so honest sampling would hardly give them
    twice: every COPIES_PER_STRIKE such copies cost a strike, and strikes ban."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)
    copies = learner.cfg.net.ban_after * COPIES_PER_STRIKE
    originals = [with_logprobs(make_batch(identity=ALICE, seq=seq), -3.0) for seq in range(copies)]
    for batch in originals:
        assert offer(learner, seal(batch, ALICE), ALICE.peer_id)
    for seq, batch in enumerate(originals):
        assert not learner.peers.is_banned(MALLORY.peer_id), f"banned before its {seq + 1}th copy"
        copy = replace(make_batch(identity=MALLORY, seq=seq), groups=tuple(disguised_copy(g, seq) for g in batch.groups))
        learner.intake.ingest(copy, MALLORY.peer_id)  # as if its slots had assigned the same prompts
    assert learner.buffer.ledger.dropped == {"copied": 8 * copies}
    assert learner.peers.is_banned(MALLORY.peer_id)
    assert not learner.peers.is_banned(ALICE.peer_id)


def test_plausible_collisions_cost_no_strike(learner: Learner) -> None:
    """Two honest peers assigned one prompt by a small task's pool sample the same completions
    often when the policy is sure of them (0.05 nats a token): the second group is dropped as
    `copied`, never a strike (a pull swarm of three honest peers had 33 such in a minute)."""
    for who in (ALICE, MALLORY):
        learner.peers.join(who.peer_id, 0.0)

    async def go() -> None:  # ingesting reads trio's clock
        for seq in range(3 * COPIES_PER_STRIKE * learner.cfg.net.ban_after):
            batch = with_logprobs(make_batch(identity=ALICE, seq=seq), -0.05)
            learner.intake.ingest(batch, ALICE.peer_id)
            twin = replace(make_batch(identity=MALLORY, seq=seq), groups=tuple(disguised_copy(g, seq) for g in batch.groups))
            learner.intake.ingest(twin, MALLORY.peer_id)

    trio.run(go)
    assert learner.buffer.ledger.dropped["copied"] > 0
    assert learner.peers.penalties.get(MALLORY.peer_id, 0) == 0 and not learner.peers.is_banned(MALLORY.peer_id)


def test_with_verification_off_the_forgeries_are_trained(learner: Learner) -> None:
    """What the checks buy: without them the learner takes every one of these."""
    learner.intake.verify = None
    learner.peers.join(MALLORY.peer_id, 0.0)
    for batch in (wrong_answers_rewarded(), cherry_picked(), copied_from_alice()):
        assert offer(learner, seal(batch, MALLORY), MALLORY.peer_id)
    assert len(learner.buffer) == 3


def test_factory_groups_earn_their_rewards() -> None:
    group = make_group(prompt="37+05=")
    assert [s.reward for s in group.samples] == [float(s.completion_ids == answer_ids("37+05=")) for s in group.samples]
    assert any(s.reward for s in group.samples) and not all(s.reward for s in group.samples)


class _RaisingTask:
    """The addition task with a plug-in reward that raises on some completions (a hostile one
    may be crafted to): the claim fails as bad_reward, the learner's validator does not crash."""

    def __init__(self) -> None:
        self.inner = TASK

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        raise ZeroDivisionError("the plug-in's bug")


def test_a_reward_function_that_raises_is_a_failed_claim_not_a_crash() -> None:
    check = Verifier(
        VerifyConfig(logprobs=False), run_id="run-1", tokenizer=TOKENIZER, task=_RaisingTask(),  # type: ignore[arg-type]
        model=build_model(tiny_llama_config(TOKENIZER.vocab_size)), temperature=1.0, keep_versions=4,
    )
    failure = check.claims(make_batch(identity=MALLORY, seq=5))
    assert failure is not None and failure.reason is DropReason.BAD_REWARD
    assert "ZeroDivisionError" in failure.evidence
