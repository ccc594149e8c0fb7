"""Tasks with verifiable rewards, and their registry.

A reward is a plain TRL-style callable `reward(prompts, completions) -> list[float]` over
*decoded* text; a completion's text ends where the tokenizer's `decode` stopped (at eos).

Built-in tasks: "addition" (below) and "math" (grade-school word problems, a `DatasetTask` over
echo_node/data/math_word.jsonl scored by echo_node.rewards:math_answer). Any other task is a
`DatasetTask` read from a file named by the run's `[task]` config (`build_task`).

Addition format (fixed width, so every answer has the same length and the model never has to
decide where a number ends): prompt "AB+CD=" with both operands zero-padded to 2 digits
(00..99), answer the sum zero-padded to 3 digits (000..198), then eos. Example: "37+05=" → "042".

Invariants:
- `reward` depends only on (prompt, completion) — a rollout peer and the learner score the same
  pair identically, so the learner can re-verify any reward a peer claims.
- `max_new_tokens` = answer length + 1, room for exactly the answer and its eos.
- `task_id` pins everything that decides prompts and rewards: the learner's run spec carries it
  and a joining peer refuses a run whose id differs from its own task's. A built-in's id is its
  name (its code and data ship with the package); a dataset task's id hashes its file's bytes
  and its settings (`DatasetTask`). At most MAX_TASK_ID characters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import math
import numbers
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from echo_node.config import TaskConfig

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str]], list[float]]
MAX_TASK_ID = 256


class Task(Protocol):
    name: str
    # What a run spec carries; equal ids give equal prompts and rewards (module docstring).
    task_id: str
    # Prompts are wrapped in the tokenizer's chat template (a user turn + the generation prompt).
    chat: bool
    max_new_tokens: int
    # Every reward `reward` returns lies in [low, high]; the learner refuses rollouts outside it.
    reward_range: tuple[float, float]

    def reward(self, prompts: list[str], completions: list[str], /) -> list[float]: ...

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
    task_id = "addition"
    chat = False
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


# Suffix of a dataset file -> the `datasets` builder that reads it.
DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Columns TRL keeps out of a reward function's keyword arguments (it passes the prompt as
# `prompts`); a column named like one of the arguments themselves could not be passed at all.
_TRL_RESERVED = frozenset({"prompt", "completion", "completion_ids"})
_ARGUMENTS = frozenset({"prompts", "completions"})
_REWARD_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class DatasetTask:
    """A task read from a JSONL/JSON, Parquet or CSV file, scored by TRL-style reward functions.

    Prompts. Row i's prompt is its `prompt_column`, or `prompt_template.format(**row)`; it must
    be a non-empty string. A row whose prompt repeats an earlier row's is dropped (a warning
    counts them): a prompt must determine its row, since rewards see only the prompt text.
    `prompt_for(draw)` is the prompt of row `draw % n_rows` (a pure function of the draw, every
    row reachable); `sample_prompts` draws rows uniformly.

    Rewards. Each reward function, "module:function", is called as TRL's GRPOTrainer calls it:
    `fn(prompts=..., completions=..., **columns)`, every column but "prompt", "completion" and
    "completion_ids" passed as the list of its values for the rows of the prompts. Completions
    are plain strings (also for chat tasks), and TRL's `completion_ids` and `trainer_state` are
    not passed, so a function written for TRL should take `**kwargs`. It must return a list of
    len(prompts) finite numbers or None; None ("not applicable" in TRL) counts as 0.0, as TRL's
    nansum does. A sample's reward is the `reward_weights`-weighted sum (default all 1.0), not
    clamped: `reward_range` declares its bounds and the learner refuses rewards outside them.

    Identity. `task_id` = f"{name}@{hex}", hex the first 16 bytes of SHA-256 over the file's bytes
    and every setting that changes prompts or rewards (format, prompt column or template, reward
    specs, effective weights, range, chat). The rows are read from the very bytes hashed (a
    private copy), so the id cannot describe another version of a file that changes meanwhile.
    The reward functions' code is not hashed: a peer whose code scores differently fails the
    learner's reward check instead.

    Security. Reward functions are imported only from the local config (`TaskConfig`), never from
    anything received over the network: a peer builds its task from its own config and only
    compares `task_id` with the learner's.

    `max_new_tokens` (256) is only the default of callers that pass none; a run generates up to
    its `sampling.max_new_tokens`. There are no known answers, so no supervised warm-up.
    """

    max_new_tokens = 256

    def __init__(self, cfg: TaskConfig, *, task_id: str | None = None) -> None:
        """`task_id`: a built-in's fixed id (its name); default the hash described above."""
        if cfg.dataset is None:
            raise ValueError(f"task {cfg.name!r}: a dataset task needs task.dataset")
        path = Path(cfg.dataset)
        where = f"task.dataset {str(path)!r}"
        fmt = DATASET_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(f"{where}: unknown suffix {path.suffix!r}; accepted: {', '.join(DATASET_FORMATS)}")
        if not path.is_file():
            raise ValueError(f"{where}: no such file")
        if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.rewards):
            raise ValueError(f"{where}: {len(cfg.reward_weights)} task.reward_weights for {len(cfg.rewards)} task.rewards")
        self.config = cfg
        self.name = cfg.name
        self.chat = cfg.chat
        self.reward_range = (float(cfg.reward_range[0]), float(cfg.reward_range[1]))
        self.weights = [float(w) for w in cfg.reward_weights] or [1.0] * len(cfg.rewards)
        self._fns = [_load_reward(where, spec) for spec in cfg.rewards]

        data = path.read_bytes()
        rows = _read_rows(where, path.suffix.lower(), fmt, data)
        columns = list(rows[0])
        clash = _ARGUMENTS.intersection(columns)
        if clash:
            raise ValueError(f"{where}: column(s) {sorted(clash)} would clash with the reward functions' arguments; rename them")
        self._passed = [c for c in columns if c not in _TRL_RESERVED]
        self._prompts: list[str] = []
        self._row_of: dict[str, dict[str, Any]] = {}
        for i, row in enumerate(rows):
            prompt = self._prompt_of(where, i, row, columns)
            if prompt in self._row_of:
                continue
            self._row_of[prompt] = row
            self._prompts.append(prompt)
        if len(self._prompts) < len(rows):
            log.warning(
                "%s: dropped %d of %d rows whose prompt repeats an earlier row's", where, len(rows) - len(self._prompts), len(rows)
            )

        settings = {
            "format": fmt,
            "prompt_column": None if cfg.prompt_template is not None else cfg.prompt_column,
            "prompt_template": cfg.prompt_template,
            "rewards": list(cfg.rewards),
            "reward_weights": self.weights,
            "reward_range": list(self.reward_range),
            "chat": cfg.chat,
        }
        self.task_id = _dataset_task_id(cfg.name, data, settings) if task_id is None else task_id
        if len(self.task_id) > MAX_TASK_ID:
            raise ValueError(f"{where}: task id {self.task_id[:40]!r}... is longer than {MAX_TASK_ID} characters; shorten task.name")

    def _prompt_of(self, where: str, i: int, row: dict[str, Any], columns: list[str]) -> str:
        cfg = self.config
        if cfg.prompt_template is None:
            if cfg.prompt_column not in row:
                raise ValueError(f"{where}: no prompt column {cfg.prompt_column!r}; columns: {columns}")
            prompt = row[cfg.prompt_column]
            source = f"column {cfg.prompt_column!r}"
        else:
            source = f"task.prompt_template {cfg.prompt_template!r}"
            try:
                prompt = cfg.prompt_template.format(**row)
            except KeyError as e:
                raise ValueError(f"{where}: {source} names {{{e.args[0]}}}, not a column; columns: {columns}") from None
            except (IndexError, ValueError) as e:
                raise ValueError(f"{where}: {source} is not a template of named columns: {e}") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: row {i}: {source} gives {prompt!r:.80}, not a non-empty string")
        return prompt

    @property
    def n_rows(self) -> int:
        """Rows kept (duplicates dropped)."""
        return len(self._prompts)

    def sample_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [self._prompts[rng.randrange(len(self._prompts))] for _ in range(n)]

    def prompt_for(self, draw: int) -> str:
        # Rows uniform up to a bias of n_rows / 2**64 for a 64-bit draw.
        return self._prompts[draw % len(self._prompts)]

    def reward(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        rows: list[dict[str, Any]] = []
        for p in prompts:
            try:
                rows.append(self._row_of[p])
            except KeyError:
                raise ValueError(f"task {self.task_id}: prompt {p[:80]!r} is not one of its dataset's") from None
        total = [0.0] * len(prompts)
        for spec, fn, weight in zip(self.config.rewards, self._fns, self.weights):
            # Fresh lists per function: one that mutates its arguments cannot affect the next.
            columns = {c: [r[c] for r in rows] for c in self._passed}
            got = fn(prompts=list(prompts), completions=list(completions), **columns)
            total = [t + weight * r for t, r in zip(total, _checked_rewards(spec, got, len(prompts)))]
        return total

    def answer(self, prompt: str) -> str:
        raise NotImplementedError(f"task {self.name!r}: a supervised warm-up needs a task with known answers")

    def supervised_pairs(self, n: int, rng: random.Random) -> list[tuple[str, str]]:
        raise NotImplementedError(f"task {self.name!r}: a supervised warm-up needs a task with known answers")


def _load_reward(where: str, spec: str) -> Callable[..., object]:
    """Import "module:function" from the local environment (never a spec from the network)."""
    if not _REWARD_SPEC.fullmatch(spec):
        raise ValueError(f"{where}: reward {spec!r} is not of the form 'module:function'")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import runs the module's code: any error means "not importable"
        raise ValueError(f"{where}: reward {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{where}: reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{where}: reward {spec!r} is a {type(fn).__name__}, not callable")
    return fn


def _read_rows(where: str, suffix: str, fmt: str, data: bytes) -> list[dict[str, Any]]:
    """The rows of `data` as `datasets` reads a file of this format.

    `datasets` reads a private copy in a temporary directory, with its cache there too: the rows
    come from exactly the bytes the task id hashes, nothing outlives the call, and no cache entry
    of an earlier file with the same name and time stamp can stand in for this one.
    """
    if not data.strip():
        raise ValueError(f"{where}: the file is empty")
    import datasets  # heavy (pyarrow, pandas); only dataset tasks need it

    with tempfile.TemporaryDirectory(prefix="echo-node-task-") as tmp:
        copy = Path(tmp) / f"data{suffix}"
        copy.write_bytes(data)
        try:
            ds = datasets.load_dataset(
                fmt, data_files=str(copy), split="train", cache_dir=str(Path(tmp) / "cache"), keep_in_memory=True
            )
        except Exception as e:  # of any kind: a file it cannot parse, or one without rows
            root: BaseException = e
            while root.__cause__ is not None:  # `datasets` wraps the parser's error
                root = root.__cause__
            raise ValueError(f"{where}: no rows read as {fmt}: {type(root).__name__}: {root}") from e
        rows: list[dict[str, Any]] = ds.to_list()
    if not rows:
        raise ValueError(f"{where}: no rows read as {fmt}")
    return rows


def _dataset_task_id(name: str, data: bytes, settings: dict[str, Any]) -> str:
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.sha256()
    h.update(len(blob).to_bytes(8, "big"))  # length-prefixed: settings and data cannot run into each other
    h.update(blob)
    h.update(data)
    return f"{name}@{h.hexdigest()[:32]}"


def _checked_rewards(spec: str, got: object, n: int) -> list[float]:
    """`got` as n finite floats (None -> 0.0), or a ValueError naming the function."""
    if not isinstance(got, (list, tuple)):
        raise ValueError(f"reward {spec!r} returned a {type(got).__name__}, not a list of {n} floats")
    if len(got) != n:
        raise ValueError(f"reward {spec!r} returned {len(got)} values for {n} completions")
    out: list[float] = []
    for i, r in enumerate(got):
        if r is None:
            out.append(0.0)
            continue
        try:
            value = float(r) if isinstance(r, numbers.Real) else math.nan
        except OverflowError:  # an int beyond float's range
            value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"reward {spec!r} returned {r!r:.60} at index {i}: not a finite number or None")
        out.append(value)
    return out


MATH_DATA = Path(__file__).resolve().parent.parent / "data" / "math_word.jsonl"


def math_task() -> DatasetTask:
    """The built-in "math" task (see echo_node/data/make_math_word.py)."""
    cfg = TaskConfig(
        name="math", dataset=str(MATH_DATA), prompt_template="{question}\nAnswer:", rewards=["echo_node.rewards:math_answer"]
    )
    # Its id hashes the bundled file like any dataset task's: a peer whose echo-node ships
    # other problems is refused at join instead of failing every batch's prompt check.
    return DatasetTask(cfg)


TASKS: dict[str, Callable[[], Task]] = {"addition": AdditionTask, "math": math_task}


def get_task(name: str) -> Task:
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
    return factory()


def build_task(cfg: TaskConfig) -> Task:
    """The task a run's `[task]` config describes: the built-in `cfg.name`, or with
    `cfg.dataset` a `DatasetTask` over that file.

    A built-in with `chat` unlike its own becomes a dataset task over the built-in's file (its id
    then hashes the file and settings, chat included); a built-in without a file has no chat form.
    """
    if cfg.dataset is not None:
        return DatasetTask(cfg)
    if cfg.name.startswith("rg:"):  # a reasoning-gym generator (echo_node/envs/rgym.py)
        if cfg.chat:
            raise ValueError(f"task {cfg.name!r} (a reasoning-gym generator) has no chat form: set task.chat = false")
        from echo_node.envs.rgym import ReasoningGymTask

        return ReasoningGymTask(cfg.name)
    if cfg.name not in TASKS:
        raise ValueError(
            f"unknown built-in task {cfg.name!r}; built-ins: {sorted(TASKS)}; a task read from a file needs task.dataset"
        )
    task = get_task(cfg.name)
    if cfg.chat == task.chat:
        return task
    if isinstance(task, DatasetTask):
        return DatasetTask(dataclasses.replace(task.config, chat=cfg.chat))
    raise ValueError(f"task {cfg.name!r} has no chat form: set task.chat = false")
