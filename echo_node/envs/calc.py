"""The built-in multi-turn environment: additions posed turn by turn, with a calculator tool.

Written in the embedded model's alphabet ("0123456789+= ", echo_node/ml/tokenizer.py), so the
embedded tiny Llama, warmed up on one addition, can learn it:

- `reset(seed)` poses the first of `problems` additions, "AB+CD=" (operands 00..99, drawn from
  `random.Random(seed)`: deterministic, and independent of any global state).
- The model's turn is either an answer (the sum, three digits: "042") or a call of the
  calculator tool, written as the key presses "AB+CD=" (two 2-digit operands, "+", "=").
  A chat model may call it in the Hermes form its template asks for instead,
  `<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 34}}</tool_call>`
  (`tool_schemas` describes it to templates that list tools).
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
    """The tool: two operands (a pair of ints, or {"a": int, "b": int}) in 0..99 -> the sum as
    three digits; "error" for anything else."""
    if isinstance(arguments, dict) and set(arguments) == {"a", "b"}:
        arguments = [arguments["a"], arguments["b"]]
    if isinstance(arguments, (list, tuple)) and len(arguments) == 2 and all(type(a) is int and 0 <= a <= 99 for a in arguments):
        a, b = arguments
        return f"{a + b:03d}"
    return "error"


_OPERAND = {"type": "integer", "minimum": 0, "maximum": 99}
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Adds two numbers from 0 to 99 and returns the sum as three digits.",
        "parameters": {"type": "object", "properties": {"a": _OPERAND, "b": _OPERAND}, "required": ["a", "b"]},
    },
}


class CalcEnv(ToolEnv):
    deterministic = True
    reward_range = (0.0, 1.0)
    tools = {"calculator": calculator}
    tool_schemas = (CALCULATOR_SCHEMA,)
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
        return super().parse_tool_call(action) if m is None else ToolCall("calculator", [int(m.group(1)), int(m.group(2))])

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
