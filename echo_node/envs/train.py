"""Episodes as the learner trains them: one GRPO group per (environment, seed).

An episode is one sequence: its first observation is the prompt, and its turns, model and
environment alike, are the "completion" the forward runs over. Only the model's tokens enter the
loss (`TrainGroup.loss_masks`); an environment token's log-prob is a placeholder (0.0) that the
mask keeps out of every weight and statistic. Advantages are relative within the group, from
the episodes' returns.
"""

from __future__ import annotations

from echo_node.ml.grpo import TrainGroup
from protocol.episodes import Episode, EpisodeGroup


def flatten(episode: Episode) -> tuple[list[int], list[float], list[int | None]]:
    """An episode as one sequence after its first observation: every turn's token ids, their
    behaviour log-probs and versions. An environment token has a placeholder log-prob (0.0) and
    no version (None): it carries no claim and enters no loss."""
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int | None] = []
    for turn in episode.turns:
        ids.extend(turn.token_ids)
        logprobs.extend(turn.logprobs if not turn.from_env else [0.0] * len(turn.token_ids))
        versions.extend(turn.versions if not turn.from_env else [None] * len(turn.token_ids))
    return ids, logprobs, versions


def train_group(group: EpisodeGroup) -> TrainGroup:
    completions: list[list[int]] = []
    logprobs: list[list[float]] = []
    masks: list[list[bool]] = []
    for episode in group.episodes:
        ids, lps, versions = flatten(episode)
        completions.append(ids)
        logprobs.append(lps)
        masks.append([v is not None for v in versions])
    return TrainGroup(
        prompt_ids=list(group.prompt_ids),
        completions=completions,
        behaviour_logprobs=logprobs,
        rewards=[e.reward for e in group.episodes],
        loss_masks=masks,
    )
