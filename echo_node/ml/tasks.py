"""Tasks with verifiable rewards, and their registry.

A reward is a plain TRL-style callable `reward(prompts, completions) -> list[float]` over
*decoded* text; a completion's text ends where the tokenizer's `decode` stopped (at eos).

Addition format (fixed width, so every answer has the same length and the model never has to
decide where a number ends): prompt "AB+CD=" with both operands zero-padded to 2 digits
(00..99), answer the sum zero-padded to 3 digits (000..198), then eos. Example: "37+05=" → "042".

Invariants:
- `reward` depends only on (prompt, completion) — a rollout peer and the learner score the same
  pair identically, so the learner can re-verify any reward a peer claims.
- `max_new_tokens` = answer length + 1, room for exactly the answer and its eos.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

RewardFn = Callable[[list[str], list[str]], list[float]]


class Task(Protocol):
    name: str
    max_new_tokens: int
    reward: RewardFn
    # Every reward `reward` returns lies in [low, high]; the learner refuses rollouts outside it.
    reward_range: tuple[float, float]

    def sample_prompts(self, n: int, rng: random.Random) -> list[str]: ...

    def prompt_for(self, draw: int) -> str:
        """The prompt a 64-bit draw poses (protocol/assignment.py): how the learner and every
        peer agree on a group's prompt. A pure function of `draw`, for any draw."""
        ...

    def answer(self, prompt: str) -> str: ...

    def supervised_pairs(self, n: int, rng: random.Random) -> list[tuple[str, str]]: ...


@dataclass(frozen=True, slots=True)
class ExactMatchReward:
    """1.0 when the stripped completion equals the task's answer for the prompt, else 0.0.

    A class rather than a closure so it pickles (process pools, spawn).
    """

    answer_of: Callable[[str], str]

    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return [
            1.0 if c.strip() == self.answer_of(p) else 0.0 for p, c in zip(prompts, completions)
        ]


def addition_answer(prompt: str) -> str:
    """The expected completion for an addition prompt "AB+CD="."""
    if len(prompt) != 6 or prompt[2] != "+" or prompt[5] != "=":
        raise ValueError(f"not an addition prompt 'AB+CD=': {prompt!r}")
    a, b = prompt[0:2], prompt[3:5]
    if not (a.isdigit() and b.isdigit()):
        raise ValueError(f"not an addition prompt 'AB+CD=': {prompt!r}")
    return f"{int(a) + int(b):03d}"


exact_match_reward: RewardFn = ExactMatchReward(addition_answer)


class AdditionTask:
    """Fixed-width 2-digit addition: "37+05=" → "042" (see the module docstring)."""

    name = "addition"
    answer_len = 3
    max_new_tokens = answer_len + 1  # the answer and its eos
    reward: RewardFn = exact_match_reward
    reward_range = (0.0, 1.0)

    def sample_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [f"{rng.randrange(100):02d}+{rng.randrange(100):02d}=" for _ in range(n)]

    def prompt_for(self, draw: int) -> str:
        # Both operands uniform on 00..99 (2**64 is not a multiple of 10,000: a bias of 1e-15).
        return f"{draw % 100:02d}+{draw // 100 % 100:02d}="

    def answer(self, prompt: str) -> str:
        return addition_answer(prompt)

    def supervised_pairs(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        return [(p, addition_answer(p)) for p in self.sample_prompts(n, rng)]


TASKS: dict[str, Callable[[], Task]] = {"addition": AdditionTask}


def get_task(name: str) -> Task:
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
    return factory()
