"""Episodes as the learner trains them: one GRPO group per (environment, seed).

An episode is one sequence: its first observation is the prompt, and its turns, model and
environment alike, are the "completion" the forward runs over. Only the model's tokens enter the
loss (`TrainGroup.loss_masks`); an environment token's log-prob is a placeholder (0.0) that the
mask keeps out of every weight and statistic. Advantages are relative within the group, from
the episodes' returns.
"""

from __future__ import annotations

from echo_node.ml.grpo import TrainGroup
from protocol.episodes import EpisodeGroup


def train_group(group: EpisodeGroup) -> TrainGroup:
    completions: list[list[int]] = []
    logprobs: list[list[float]] = []
    masks: list[list[bool]] = []
    for episode in group.episodes:
        ids: list[int] = []
        lps: list[float] = []
        mask: list[bool] = []
        for turn in episode.turns:
            ids.extend(turn.token_ids)
            lps.extend(turn.logprobs if not turn.from_env else [0.0] * len(turn.token_ids))
            mask.extend([not turn.from_env] * len(turn.token_ids))
        completions.append(ids)
        logprobs.append(lps)
        masks.append(mask)
    return TrainGroup(
        prompt_ids=list(group.prompt_ids),
        completions=completions,
        behaviour_logprobs=logprobs,
        rewards=[e.reward for e in group.episodes],
        loss_masks=masks,
    )
