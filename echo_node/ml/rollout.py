"""From prompts to scored groups: the glue a rollout peer (and an evaluation) runs around an Engine.

Invariants:
- One `generate` call per batch of groups: prompt p is repeated `group_size` times in a row, so
  group k is rows [k·G, (k+1)·G) and the engine batches everything at once.
- Rewards are computed on decoded text with the task's reward, the same function the learner
  can re-run on the same (prompt, completion) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo_node.ml.engine import Engine, Generation, SwapHook
from echo_node.ml.grpo import TrainGroup
from echo_node.ml.tasks import Task
from echo_node.ml.tokenizer import Tokenizer


@dataclass(slots=True)
class ScoredGroup:
    """One prompt's sampled completions with their rewards (what a peer ships, before encoding)."""

    prompt: str
    prompt_ids: list[int]
    generations: list[Generation]
    completions: list[str]
    rewards: list[float]

    def to_train_group(self) -> TrainGroup:
        return TrainGroup(
            prompt_ids=self.prompt_ids,
            completions=[g.completion_ids for g in self.generations],
            behaviour_logprobs=[g.logprobs for g in self.generations],
            rewards=self.rewards,
        )


def generate_groups(
    engine: Engine,
    tokenizer: Tokenizer,
    task: Task,
    prompts: list[str],
    *,
    group_size: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
    swap: SwapHook | None = None,
    max_new_tokens: int | None = None,
) -> list[ScoredGroup]:
    """`swap`: the engine's hook for weights that arrive mid-generation (see `Engine.generate`).
    `max_new_tokens`: the run's (its spec's), which the learner enforces; default the task's."""
    prompt_ids = [tokenizer.encode_prompt(p) for p in prompts]
    batch = [ids for ids in prompt_ids for _ in range(group_size)]
    gens = engine.generate(
        batch,
        max_new_tokens=task.max_new_tokens if max_new_tokens is None else max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        swap=swap,
    )
    texts = [tokenizer.decode(g.completion_ids) for g in gens]
    rewards = task.reward([p for p in prompts for _ in range(group_size)], texts)
    out: list[ScoredGroup] = []
    for k, (p, ids) in enumerate(zip(prompts, prompt_ids)):
        rows = slice(k * group_size, (k + 1) * group_size)
        out.append(ScoredGroup(p, ids, gens[rows], texts[rows], rewards[rows]))
    return out


def mean_reward(
    engine: Engine,
    tokenizer: Tokenizer,
    task: Task,
    prompts: list[str],
    *,
    temperature: float,
    seed: int | None = None,
) -> float:
    """Mean reward of one completion per prompt; temperature 0 gives greedy accuracy."""
    groups = generate_groups(
        engine, tokenizer, task, prompts, group_size=1, temperature=temperature, seed=seed
    )
    return sum(g.rewards[0] for g in groups) / max(len(groups), 1)
