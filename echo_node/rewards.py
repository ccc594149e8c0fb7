"""Reward functions for tasks read from datasets, with TRL's signature.

A task names them in its config as "echo_node.rewards:math_answer" (echo_node/ml/tasks.py);
each is called as `fn(prompts=..., completions=..., **columns)`, a column being the list of
that dataset column's values for the rows of the prompts, and returns one float per completion.

Rules every reward function here keeps, and a task's own reward functions should keep:
- Deterministic and a function of (prompt, its row, completion) only: the learner re-runs it
  on a peer's completions and bans the peer when the scores differ.
- No wall-clock limits. A timeout depends on the machine's load, so the learner and an honest
  peer could score one completion differently. Work is bounded by the input instead.
- Safe in any thread: rewards run in worker threads, where `signal` cannot be used.

math-verify. Its own time limit is `signal.alarm` (main thread only), so it is switched off
(`parsing_timeout=None`, `timeout_seconds=None`) and the text it sees is bounded instead: the
last MAX_ANSWER_CHARS characters of a completion, and only when they pass `_admissible`. Short
inputs are not cheap by themselves: sympy evaluates "9^{9^{9}}" (11 characters) or a factorial
without end, and the LaTeX grammar (ANTLR) backtracks exponentially on nested brackets (depth
14 takes seconds) and on "|". So a tail scores 0.0 without parsing when it has a character
outside a small set (ASCII letters, digits, spaces, common punctuation and operators, "×", "÷";
not "^", "!", "|", "&"), "**", a LaTeX command outside a short list,
brackets nested deeper than MAX_BRACKET_DEPTH or more than MAX_BRACKETS brackets. What passes
parses in well under a second of one core, and a final answer such as "so the answer is 7.",
"\\boxed{\\frac{1}{2}}" or "$7$" passes. math-verify logs, once per process, that its
timeout is disabled: that is this choice.
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

# The final answer is at the end of a completion; longer tails cost more to parse.
MAX_ANSWER_CHARS = 200
MAX_BRACKET_DEPTH = 2
MAX_BRACKETS = 16
_ALLOWED_CHARS = re.compile(r"[A-Za-z0-9 \t\r\n.,:;?'\"$%+\-*/=()\[\]{}<>_\\×÷]*")
_LATEX_COMMAND = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)
_ALLOWED_COMMANDS = frozenset({
    "boxed", "frac", "dfrac", "tfrac", "text", "textbf", "mathrm", "mathbf", "cdot", "times", "div",
    "left", "right",
    # Math delimiters \( \) \[ \], escaped $ and %, spacing.
    "(", ")", "[", "]", "$", "%", ",", ";", " ",
})
# math-verify keeps caches (lru_cache, the ANTLR parser's shared DFA) not written for concurrent
# use; the work holds the GIL anyway, so one caller at a time costs no throughput.
_LOCK = threading.Lock()


def _check_lengths(prompts: list[str], completions: list[str], answer: list[object]) -> None:
    if not len(prompts) == len(completions) == len(answer):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(answer)} answers")


def exact_answer(prompts: list[str], completions: list[str], answer: list[object], **_: object) -> list[float]:
    """1.0 when the stripped completion is the `answer` column's value (as text), else 0.0."""
    _check_lengths(prompts, completions, answer)
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def _admissible(tail: str) -> bool:
    """Whether math-verify may parse `tail` (see the module docstring for why each rule)."""
    if not _ALLOWED_CHARS.fullmatch(tail) or "**" in tail:
        return False
    if any(m.group(1) not in _ALLOWED_COMMANDS for m in _LATEX_COMMAND.finditer(tail)):
        return False
    depth = opened = 0
    for ch in tail:
        if ch in "([{":
            depth += 1
            opened += 1
            if depth > MAX_BRACKET_DEPTH or opened > MAX_BRACKETS:
                return False
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return True


def math_answer(prompts: list[str], completions: list[str], answer: list[object], **_: object) -> list[float]:
    """1.0 when the final answer of a completion equals the `answer` column mathematically
    (math-verify: "7", "7.0", "so the answer is 7.", "\\boxed{7}" all match "7"), else 0.0.

    The answers come from the local dataset and are parsed without bounds; completions are
    bounded as the module docstring says."""
    _check_lengths(prompts, completions, answer)
    out: list[float] = []
    with _LOCK:
        golds = {text: parse(text, parsing_timeout=None) for text in {str(a) for a in answer}}
        for c, a in zip(completions, answer):
            tail = c[-MAX_ANSWER_CHARS:]
            ok = _admissible(tail) and verify(golds[str(a)], parse(tail, parsing_timeout=None), timeout_seconds=None)
            out.append(1.0 if ok else 0.0)
    return out
