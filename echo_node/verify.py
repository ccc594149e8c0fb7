"""What the learner re-checks of a peer's claims before training on them.

Rules:
- Prompts: a group's prompt must decode to text the run's task can score, and re-encode to the
  very same ids (`Tokenizer.encode_prompt`): a prompt of the peer's own making, or an encoding
  the run would never produce, is `bad_prompt`.
- Rewards: every completion is re-scored with the run's own reward function on the text the
  tokenizer decodes from its ids (the task's rule: a reward depends only on prompt and
  completion); a claimed reward further than `REWARD_TOLERANCE` from the learner's is
  `bad_reward`.

A batch is signed by its publisher, so one failed group fails the batch; the intake then bans
the publisher at once and purges its groups still waiting in the replay buffer: no honest peer
claims a reward its completion did not earn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_node.ml.tasks import Task
from echo_node.ml.tokenizer import Tokenizer
from protocol.drops import DropReason
from protocol.messages import RolloutBatch

# Rewards travel as float64; a reward function is deterministic, so only float noise separates
# an honest claim from the learner's own score.
REWARD_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Failure:
    reason: DropReason
    evidence: str


class RewardCheck:
    def __init__(self, tokenizer: Tokenizer, task: Task) -> None:
        self.tokenizer = tokenizer
        self.task = task
        self.checked_groups = 0

    def __call__(self, batch: RolloutBatch) -> Failure | None:
        for g in batch.groups:
            self.checked_groups += 1
            try:
                prompt = self.tokenizer.decode(g.prompt_ids)
                canonical = self.tokenizer.encode_prompt(prompt) == list(g.prompt_ids)
            except ValueError as exc:
                return Failure(DropReason.BAD_PROMPT, f"group {g.group_id}: prompt does not decode ({exc})")
            if not canonical:
                return Failure(DropReason.BAD_PROMPT, f"group {g.group_id}: prompt {prompt!r} is not encoded as the run encodes it")
            completions = [self.tokenizer.decode(s.completion_ids) for s in g.samples]
            try:
                rewards = self.task.reward([prompt] * len(completions), completions)
            except ValueError as exc:
                return Failure(DropReason.BAD_PROMPT, f"group {g.group_id}: the task cannot score prompt {prompt!r} ({exc})")
            for i, (s, r) in enumerate(zip(g.samples, rewards)):
                if not math.isclose(s.reward, r, rel_tol=0.0, abs_tol=REWARD_TOLERANCE):
                    return Failure(
                        DropReason.BAD_REWARD,
                        f"group {g.group_id} sample {i}: claimed reward {s.reward:g} for {completions[i]!r} "
                        f"on {prompt!r}, the run's reward is {r:g}",
                    )
        return None
