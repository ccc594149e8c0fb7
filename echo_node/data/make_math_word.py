"""Generate `math_word.jsonl`, the built-in "math" task's grade-school word problems.

`python -m echo_node.data.make_math_word [PATH]` rewrites the file (default: next to this module).

Invariants:
- Deterministic: a fixed seed and fixed word lists give the same bytes on every machine and
  Python version (only `randrange` and `choice` of a seeded `random.Random`, whose outputs for
  a given seed Python keeps stable), so a test can regenerate the file and compare bytes.
- Each row is {"question": str, "answer": str}; questions are distinct, plain ASCII and at most
  MAX_QUESTION_CHARS characters; answers are non-negative integers in decimal.
- Small operands (sums and differences of numbers up to 20, products of 2..9 by 2..9), so a
  small model can learn part of the task and GRPO sees groups with mixed rewards.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

PATH = Path(__file__).resolve().parent / "math_word.jsonl"
SEED = 20240601
N_PROBLEMS = 1200
MAX_QUESTION_CHARS = 120

NAMES = (
    ("Tom", "he"), ("Ana", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lea", "she"),
    ("Max", "he"), ("Zoe", "she"), ("Leo", "he"), ("Ivy", "she"), ("Raj", "he"), ("Eva", "she"),
    ("Omar", "he"), ("Lily", "she"), ("Noah", "he"), ("Emma", "she"),
)
OBJECTS = (
    "apples", "pencils", "marbles", "cookies", "stickers", "books", "shells", "cards",
    "coins", "balloons", "stamps", "toy cars", "eggs", "flowers", "crayons", "candies",
)
CONTAINERS = ("bags", "boxes", "packs", "baskets", "jars", "rows")

Row = dict[str, str]
# A template takes the generator and returns (question, answer).
Template = Callable[[random.Random], tuple[str, int]]


def _who(rng: random.Random) -> tuple[str, str]:
    return rng.choice(NAMES)


def _two(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    """Two different people."""
    i = rng.randrange(len(NAMES))
    return NAMES[i], NAMES[(i + 1 + rng.randrange(len(NAMES) - 1)) % len(NAMES)]


def _add_buy(rng: random.Random) -> tuple[str, int]:
    (name, he), obj = _who(rng), rng.choice(OBJECTS)
    a, b = rng.randrange(1, 21), rng.randrange(1, 21)
    return f"{name} has {a} {obj} and buys {b} more. How many {obj} does {he} have now?", a + b


def _add_two_days(rng: random.Random) -> tuple[str, int]:
    (name, _), obj = _who(rng), rng.choice(OBJECTS)
    a, b = rng.randrange(1, 21), rng.randrange(1, 21)
    return f"{name} found {a} {obj} on Monday and {b} on Tuesday. How many {obj} did {name} find in all?", a + b


def _add_friends(rng: random.Random) -> tuple[str, int]:
    (name, _), (friend, _) = _two(rng)
    obj = rng.choice(OBJECTS)
    a, b = rng.randrange(1, 21), rng.randrange(1, 21)
    return f"{name} has {a} {obj} and {friend} has {b}. How many {obj} do they have together?", a + b


def _sub_give(rng: random.Random) -> tuple[str, int]:
    (name, he), (friend, _) = _two(rng)
    obj = rng.choice(OBJECTS)
    a = rng.randrange(2, 21)
    b = rng.randrange(1, a + 1)
    return f"{name} had {a} {obj} and gave {b} to {friend}. How many {obj} does {he} have left?", a - b


def _sub_lose(rng: random.Random) -> tuple[str, int]:
    (name, he), obj = _who(rng), rng.choice(OBJECTS)
    a = rng.randrange(2, 21)
    b = rng.randrange(1, a + 1)
    return f"{name} had {a} {obj}. {he.capitalize()} lost {b} of them. How many {obj} are left?", a - b


def _sub_more(rng: random.Random) -> tuple[str, int]:
    (name, _), (friend, _) = _two(rng)
    obj = rng.choice(OBJECTS)
    a = rng.randrange(2, 21)
    b = rng.randrange(1, a)
    return f"{name} has {a} {obj} and {friend} has {b}. How many more {obj} does {name} have?", a - b


def _mul_containers(rng: random.Random) -> tuple[str, int]:
    (name, he), obj, box = _who(rng), rng.choice(OBJECTS), rng.choice(CONTAINERS)
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    return f"{name} has {a} {box} with {b} {obj} in each. How many {obj} does {he} have?", a * b


def _mul_days(rng: random.Random) -> tuple[str, int]:
    (name, he), obj = _who(rng), rng.choice(OBJECTS)
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    return f"{name} makes {b} {obj} every day for {a} days. How many {obj} does {he} make?", a * b


def _two_steps(rng: random.Random) -> tuple[str, int]:
    (name, he), obj = _who(rng), rng.choice(OBJECTS)
    a, b = rng.randrange(1, 16), rng.randrange(1, 11)
    c = rng.randrange(1, a + b + 1)
    return f"{name} has {a} {obj}, gets {b} more, then gives away {c}. How many {obj} does {he} have?", a + b - c


TEMPLATES: tuple[Template, ...] = (
    _add_buy, _add_two_days, _add_friends, _sub_give, _sub_lose, _sub_more, _mul_containers, _mul_days,
    _two_steps,
)


def generate(n: int = N_PROBLEMS, seed: int = SEED) -> list[Row]:
    """`n` distinct problems, templates drawn uniformly (a repeated question is redrawn)."""
    rng = random.Random(seed)
    rows: list[Row] = []
    seen: set[str] = set()
    while len(rows) < n:
        question, answer = rng.choice(TEMPLATES)(rng)
        if question in seen:
            continue
        if len(question) > MAX_QUESTION_CHARS or not question.isascii():
            raise AssertionError(f"template produced an out-of-format question: {question!r}")
        seen.add(question)
        rows.append({"question": question, "answer": str(answer)})
    return rows


def render(rows: list[Row]) -> bytes:
    """JSON Lines: one object per row, keys in a fixed order, "\\n" line ends on every OS."""
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows).encode("ascii")


def write(path: Path = PATH) -> None:
    path.write_bytes(render(generate()))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    write(Path(args[0]) if args else PATH)


if __name__ == "__main__":
    main()
