"""Procedural single-turn tasks from reasoning-gym (the optional extra `echo-node[rgym]`).

`[task] name = "rg:NAME"` names one of `RG_TASKS`. Its generator builds ROWS problems from a
fixed seed, offline and in process (reasoning-gym generates and scores in code, nothing is
downloaded); a group's prompt is row `draw % ROWS`, as for a dataset task. A prompt is the
question with reasoning-gym's own "direct" instruction (the final answer between <answer> and
</answer>); the reward is the task's own scorer (`score_answer`, in [0, 1]) of the answer inside
the last such tags, or of the whole completion when it has none.

Why these tasks: their scorers are pure functions of (answer, row), their answers are short (a
number or a short list, within a small model's token budget), they generate thousands of rows in
well under a second, and they span arithmetic, algebra, counting and sorting. Tasks whose
answers are long free text, or whose scorers accept several answers by search, are left out:
the learner re-scores every claimed reward and must get the same number as the peer.

The task id pins the generator: f"rg:NAME@{reasoning-gym version}/{ROWS}/{SEED}", so a peer with
another reasoning-gym version, which may generate other problems, is refused at join.
"""

from __future__ import annotations

import random
import threading
from typing import Any

RG_TASKS = ("basic_arithmetic", "chain_sum", "simple_equations", "leg_counting", "letter_counting", "number_sorting")
ROWS = 4096
SEED = 0
# The answer between these tags is scored; longer tails are cut (a scorer's input is bounded).
MAX_ANSWER_CHARS = 256
_LOCK = threading.Lock()


class ReasoningGymTask:
    chat = False
    max_new_tokens = 64
    reward_range = (0.0, 1.0)

    def __init__(self, name: str) -> None:
        task = name.removeprefix("rg:")
        if task not in RG_TASKS:
            raise ValueError(f"reasoning-gym task {task!r} is not exposed; choose one of {', '.join(RG_TASKS)}")
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError:
            raise ValueError("reasoning-gym tasks need the extra: pip install 'echo-node[rgym]'") from None
        self.name = f"rg:{task}"
        self.task_id = f"{self.name}@{reasoning_gym.__version__}/{ROWS}/{SEED}"
        self._data = reasoning_gym.create_dataset(task, size=ROWS, seed=SEED)
        self._instruction = SYSTEM_PROMPTS["direct"]
        self._rows: list[dict[str, Any]] = [self._data[i] for i in range(ROWS)]
        self._prompts = [self._prompt(r) for r in self._rows]
        self._row_of = {p: r for p, r in zip(self._prompts, self._rows)}

    def _prompt(self, row: dict[str, Any]) -> str:
        return f"{self._instruction}\n\n{row['question']}"

    def sample_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [self._prompts[rng.randrange(ROWS)] for _ in range(n)]

    def prompt_for(self, draw: int) -> str:
        return self._prompts[draw % ROWS]

    def answer(self, prompt: str) -> str:
        return f"<answer>{self._row_of[prompt]['answer']}</answer>"

    def supervised_pairs(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        return [(p, self.answer(p)) for p in self.sample_prompts(n, rng)]

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        from reasoning_gym.utils import extract_answer

        out: list[float] = []
        with _LOCK:  # scorers keep module-level caches not written for threads
            for p, c in zip(prompts, completions):
                row = self._row_of.get(p)
                if row is None:
                    raise ValueError(f"task {self.task_id}: prompt {p[:80]!r} is not one of its rows")
                tail = c[-MAX_ANSWER_CHARS:]
                answer = extract_answer(tail) if "<answer>" in tail else tail.strip()
                score = self._data.score_answer(answer, row)
                out.append(min(1.0, max(0.0, float(score or 0.0))))
        return out
