"""What a rollout batch must satisfy to be admitted to a run: pure arrival checks.

Job: the wire decoders (messages.py) bound what any run could accept; this module narrows that
to what *this* run can use, before anything touches the model. A token id outside the run's
vocabulary would end the learner at the embedding lookup; a completion longer than the run
samples would make every row of a training step that long (rows are padded to the longest);
a reward outside the task's range would skew every advantage of its group. So each is refused
on arrival, as a counted drop with its own reason.

Rules, in the order they are judged (the first that fails names the drop, so a batch is
counted once):
1. `wrong_run`: the batch names another run.
2. `bad_group`: a group has not exactly the run's group size (GRPO's baseline is the group).
3. `out_of_vocab`: a prompt or completion token id is >= the run's vocabulary size.
4. `too_long`: a completion has more tokens than the run's `max_new_tokens`, or a prompt more
   than the run's prompt bound.
5. `bad_reward`: a reward outside the task's [low, high] range.
6. `future_version`: a token claims a version the learner has not reached.

A batch is signed by its publisher, so it is honest or not as a whole: one bad group refuses
the batch. Staleness is not judged here: it is per group and changes while a group waits
(staleness.admissible).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from protocol.drops import DropReason
from protocol.limits import MAX_ABS_REWARD, MAX_GROUP_SIZE, MAX_PROMPT_TOKENS, MAX_TOKENS_PER_SEQUENCE, MAX_VOCAB, MIN_GROUP_SIZE
from protocol.messages import RolloutBatch

__all__ = ["RunBounds", "judge_batch"]


@dataclass(frozen=True, slots=True)
class RunBounds:
    """The shape of a run's rollouts, as the learner knows it from its model, task and config."""

    run_id: str
    group_size: int
    vocab_size: int
    max_new_tokens: int
    max_prompt_tokens: int
    reward_low: float
    reward_high: float

    def __post_init__(self) -> None:
        if not MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size must be in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}], got {self.group_size}")
        if not 1 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB}], got {self.vocab_size}")
        if not 1 <= self.max_new_tokens <= MAX_TOKENS_PER_SEQUENCE or not 1 <= self.max_prompt_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(f"token bounds must be in [1, {MAX_TOKENS_PER_SEQUENCE}]")
        if not (math.isfinite(self.reward_low) and math.isfinite(self.reward_high)
                and -MAX_ABS_REWARD <= self.reward_low <= self.reward_high <= MAX_ABS_REWARD):
            raise ValueError(f"reward range must be finite and ordered, got [{self.reward_low}, {self.reward_high}]")


def judge_batch(
    batch: RolloutBatch, *, run: RunBounds, current_version: int, published: Callable[[int], bool] | None = None
) -> DropReason | None:
    """None to admit a decoded, verified batch now, else the one reason it is refused.
    `published(v)` says whether the learner published version v: tokens can only have been
    sampled from versions it did (with publication every k-th version, or after a restart that
    skipped numbers, the others never existed for a peer)."""
    if batch.run_id != run.run_id:
        return DropReason.WRONG_RUN
    if any(len(g.samples) != run.group_size for g in batch.groups):
        return DropReason.BAD_GROUP
    # max() over each tuple: ids are already known to be ints in [0, MAX_VOCAB) (messages.py).
    vocab = run.vocab_size
    for g in batch.groups:
        if max(g.prompt_ids) >= vocab or any(s.completion_ids and max(s.completion_ids) >= vocab for s in g.samples):
            return DropReason.OUT_OF_VOCAB
    for g in batch.groups:
        if len(g.prompt_ids) > run.max_prompt_tokens or any(len(s.completion_ids) > run.max_new_tokens for s in g.samples):
            return DropReason.TOO_LONG
    for g in batch.groups:
        if any(not run.reward_low <= s.reward <= run.reward_high for s in g.samples):
            return DropReason.BAD_REWARD
    if batch.max_version > current_version:
        return DropReason.FUTURE_VERSION
    if published is not None:
        versions = {v for g in batch.groups for s in g.samples for v in s.token_versions}
        if not all(published(v) for v in versions):
            return DropReason.UNPUBLISHED_VERSION
    return None
