"""The built-in multi-turn environment: additions posed turn by turn, with a calculator tool.

Written in the embedded model's alphabet ("0123456789+= ", echo_node/ml/tokenizer.py), so the
embedded tiny Llama, warmed up on one addition, can learn it:

- `reset(seed)` poses the first of `problems` additions, "AB+CD=" (operands 00..99, drawn from
  `random.Random(seed)`: deterministic, and independent of any global state).
- The model's turn is either an answer (the sum, three digits: "042") or a call of the
  calculator tool, written as the key presses "AB+CD=" (two 2-digit operands, "+", "=").
- A call is answered with the tool's result as a "tool" message ("042"); calls are free but
  each costs a turn of the run's budget, and at most `problems` calls are allowed.
- An answer scores 1 / problems when right; either way the next problem is posed (a "user"
  message), and after the last one the episode is done. Anything else is a wrong answer.

The return is the share of problems answered right, in [0, 1]. The sum is exact integer
arithmetic on digits: the same on every machine.
"""

from __future__ import annotations

import random
import re

from echo_node.envs import Message, Step, ToolCall, ToolEnv

_ANSWER = re.compile(r"[0-9]{3}")
_KEYS = re.compile(r"([0-9]{2})\+([0-9]{2})=")


def calculator(arguments: object) -> str:
    """The tool: "AB+CD" (or a pair of ints) -> the sum as three digits."""
    if isinstance(arguments, (list, tuple)) and len(arguments) == 2 and all(type(a) is int and 0 <= a <= 99 for a in arguments):
        a, b = arguments
        return f"{a + b:03d}"
    return "error"


class CalcEnv(ToolEnv):
    deterministic = True
    reward_range = (0.0, 1.0)
    tools = {"calculator": calculator}
    # Load-time probe (echo_node.envs.load_env): an answer, a tool call, a wrong answer.
    probe_actions = ("042", "12+34=", "046", "x")

    def __init__(self, problems: int = 2) -> None:
        super().__init__()
        if type(problems) is not int or not 1 <= problems <= 16:
            raise ValueError(f"problems must be an int in 1..16, got {problems!r}")
        self.problems = problems
        self.max_tool_calls = problems
        self._todo: list[tuple[int, int]] = []
        self._score = 0

    def reset(self, seed: int) -> Message:
        rng = random.Random(seed)
        self._todo = [(rng.randrange(100), rng.randrange(100)) for _ in range(self.problems)]
        self._score = 0
        self.tool_calls = 0
        return self._pose()

    def _pose(self) -> Message:
        a, b = self._todo[0]
        return Message(role="user", content=f"{a:02d}+{b:02d}=")

    def parse_tool_call(self, action: str) -> ToolCall | None:
        m = _KEYS.fullmatch(action.strip())
        return None if m is None else ToolCall("calculator", [int(m.group(1)), int(m.group(2))])

    def answer(self, action: str) -> Step:
        if not self._todo:
            raise RuntimeError("step() after the episode ended")
        a, b = self._todo.pop(0)
        text = action.strip()
        right = _ANSWER.fullmatch(text) is not None and int(text) == a + b
        reward = 1.0 / self.problems if right else 0.0
        if not self._todo:
            return Step(None, reward, True, {"right": right})
        return Step(self._pose(), reward, False, {"right": right})
