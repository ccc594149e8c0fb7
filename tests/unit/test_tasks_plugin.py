"""Tasks as plug-ins: DatasetTask over JSONL/CSV/Parquet with TRL-style reward functions, its
task id and load errors; the built-in math task and its math-verify reward."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from echo_node.config import TaskConfig
from echo_node.data import make_math_word
from echo_node.ml.tasks import AdditionTask, DatasetTask, build_task, get_task
from echo_node.rewards import exact_answer, math_answer

HERE = "tests.unit.test_tasks_plugin"
ROWS = [
    {"prompt": "2+2=", "answer": "4", "level": 1},
    {"prompt": "3+3=", "answer": "6", "level": 2},
    {"prompt": "4+4=", "answer": "8", "level": 3},
]

# -- reward functions, referenced by spec as f"{HERE}:name" ----------------------------------

CALLS: list[dict[str, object]] = []


def record(prompts: list[str], completions: list[str], **columns: list[object]) -> list[float]:
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [0.0] * len(prompts)


def correct(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def level(prompts: list[str], completions: list[str], level: list[int], **_: object) -> list[float]:
    return [float(x) for x in level]


def not_applicable(prompts: list[str], completions: list[str], **_: object) -> list[float | None]:
    return [None] * len(prompts)


def wrong_length(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [1.0]


def gives_nan(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [math.nan] * len(prompts)


def gives_strings(prompts: list[str], completions: list[str], **_: object) -> list[str]:
    return ["1.0"] * len(prompts)


def gives_scalar(prompts: list[str], completions: list[str], **_: object) -> float:
    return 1.0


NOT_CALLABLE = 3


# -- helpers ---------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(path: Path, **kw: Any) -> TaskConfig:
    kw.setdefault("rewards", [f"{HERE}:correct"])
    return TaskConfig(name="toy", dataset=str(path), **kw)


# -- loading ---------------------------------------------------------------------------------


def test_jsonl_csv_parquet_load_the_same_task(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    csv = tmp_path / "d.csv"
    pd.DataFrame(ROWS).to_csv(csv, index=False)
    parquet = tmp_path / "d.parquet"
    pd.DataFrame(ROWS).to_parquet(parquet)
    tasks = [DatasetTask(cfg(p, rewards=[f"{HERE}:level"])) for p in (jsonl, csv, parquet)]
    for task in tasks:
        assert task.n_rows == 3
        assert [task.prompt_for(i) for i in range(3)] == ["2+2=", "3+3=", "4+4="]
        assert task.reward(["3+3=", "4+4="], ["x", "y"]) == [2.0, 3.0]
        assert task.chat is False and task.reward_range == (0.0, 1.0) and task.max_new_tokens == 256
    # Different bytes (formats), so different ids; all of the form name@32 hex digits.
    ids = {t.task_id for t in tasks}
    assert len(ids) == 3 and all(i.startswith("toy@") and len(i) == 4 + 32 for i in ids)


def test_prompt_template_formats_the_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "How much is 2+2?", "answer": "4"}])
    task = DatasetTask(cfg(path, prompt_template="Q: {question}\nA:"))
    assert task.prompt_for(0) == "Q: How much is 2+2?\nA:"
    assert task.reward(["Q: How much is 2+2?\nA:"] * 2, [" 4", "5"]) == [1.0, 0.0]
    # A built-in's config cannot be confused with it: the template decides the prompt.
    column = DatasetTask(cfg(path, prompt_column="question"))
    assert column.prompt_for(0) == "How much is 2+2?"
    assert column.task_id != task.task_id


def test_reward_functions_get_the_rows_columns_as_trl_passes_them(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = DatasetTask(cfg(path, rewards=[f"{HERE}:record"]))
    CALLS.clear()
    assert task.reward(["4+4=", "2+2=", "4+4="], ["a", "b", "c"]) == [0.0, 0.0, 0.0]
    # Every column but "prompt" (TRL passes that as `prompts`), in the order of the prompts.
    assert CALLS == [
        {"prompts": ["4+4=", "2+2=", "4+4="], "completions": ["a", "b", "c"], "answer": ["8", "4", "8"], "level": [3, 1, 3]}
    ]


def test_weights_sum_rewards_and_none_counts_zero(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    rewards = [f"{HERE}:correct", f"{HERE}:level", f"{HERE}:not_applicable"]
    task = DatasetTask(cfg(path, rewards=rewards, reward_weights=[2.0, 0.5, 3.0], reward_range=[0.0, 4.0]))
    assert task.reward(["2+2=", "4+4="], ["4", "9"]) == [2.0 + 0.5, 1.5]
    assert task.reward_range == (0.0, 4.0)
    unweighted = DatasetTask(cfg(path, rewards=rewards))
    assert unweighted.reward(["2+2="], ["4"]) == [2.0]


def test_prompt_for_is_a_pure_function_of_the_draw_and_covers_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(50)])
    a, b = DatasetTask(cfg(path)), DatasetTask(cfg(path))
    draws = [random.Random(7).getrandbits(64) for _ in range(5)] + [0, 2**64 - 1, 12345]
    assert [a.prompt_for(d) for d in draws] == [b.prompt_for(d) for d in draws]
    assert [a.prompt_for(d) for d in draws] == [a.prompt_for(d) for d in draws]
    assert {a.prompt_for(d) for d in range(50)} == {f"p{i}" for i in range(50)}
    sampled = a.sample_prompts(2000, random.Random(0))
    assert set(sampled) == {f"p{i}" for i in range(50)}


def test_task_id_pins_dataset_bytes_and_settings(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    base = DatasetTask(cfg(path)).task_id
    assert DatasetTask(cfg(path)).task_id == base
    # The path is not part of the id: the same bytes elsewhere are the same task.
    elsewhere = tmp_path / "sub"
    elsewhere.mkdir()
    write_jsonl(elsewhere / "d.jsonl", ROWS)
    assert DatasetTask(cfg(elsewhere / "d.jsonl")).task_id == base
    # Explicit default weights are the defaults.
    assert DatasetTask(cfg(path, reward_weights=[1.0])).task_id == base
    changed = [
        DatasetTask(cfg(path, rewards=[f"{HERE}:level"])),
        DatasetTask(cfg(path, reward_weights=[2.0])),
        DatasetTask(cfg(path, reward_range=[0.0, 2.0])),
        DatasetTask(cfg(path, chat=True)),
        DatasetTask(cfg(path, prompt_template="{prompt}")),
    ]
    write_jsonl(path, [*ROWS, {"prompt": "5+5=", "answer": "10", "level": 4}])
    changed.append(DatasetTask(cfg(path)))
    ids = [t.task_id for t in changed]
    assert base not in ids and len(set(ids)) == len(ids)
    assert changed[3].chat is True


def test_duplicate_prompts_are_dropped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = [*ROWS, {"prompt": "2+2=", "answer": "5", "level": 9}, {"prompt": "3+3=", "answer": "7", "level": 9}]
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="echo_node.ml.tasks"):
        task = DatasetTask(cfg(path))
    assert task.n_rows == 3
    assert task.reward(["2+2="], ["4"]) == [1.0]  # the first row's columns
    assert "dup.jsonl" in caplog.text and "dropped 2 of 5 rows" in caplog.text


# -- load errors: each names the file and the column or function -----------------------------


def _error(tmp_path: Path, **kw: Any) -> str:
    path = kw.pop("path", None) or write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError) as e:
        DatasetTask(cfg(path, **kw))
    return str(e.value)


def test_file_errors(tmp_path: Path) -> None:
    msg = _error(tmp_path, path=tmp_path / "missing.jsonl")
    assert "missing.jsonl" in msg and "no such file" in msg
    (tmp_path / "d.txt").write_text("x")
    msg = _error(tmp_path, path=tmp_path / "d.txt")
    assert "d.txt" in msg and ".jsonl" in msg and ".parquet" in msg and ".csv" in msg
    (tmp_path / "empty.jsonl").write_text("\n")
    msg = _error(tmp_path, path=tmp_path / "empty.jsonl")
    assert "empty.jsonl" in msg and "empty" in msg
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(tmp_path / "none.parquet")
    msg = _error(tmp_path, path=tmp_path / "none.parquet")
    assert "none.parquet" in msg and "no rows read as parquet" in msg
    (tmp_path / "none.json").write_text("[]")
    msg = _error(tmp_path, path=tmp_path / "none.json")
    assert "none.json" in msg and "no rows read as json" in msg
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    msg = _error(tmp_path, path=tmp_path / "bad.jsonl")
    assert "bad.jsonl" in msg and "no rows read as json" in msg and "JSON parse error" in msg


def test_prompt_errors(tmp_path: Path) -> None:
    msg = _error(tmp_path, prompt_column="question")
    assert "d.jsonl" in msg and "'question'" in msg and "['prompt', 'answer', 'level']" in msg
    msg = _error(tmp_path, prompt_template="{question}: ")
    assert "d.jsonl" in msg and "{question}" in msg and "['prompt', 'answer', 'level']" in msg
    msg = _error(tmp_path, prompt_template="{0}")
    assert "d.jsonl" in msg and "task.prompt_template" in msg
    msg = _error(tmp_path, prompt_column="level")
    assert "d.jsonl" in msg and "'level'" in msg and "row 0" in msg
    msg = _error(tmp_path, path=write_jsonl(tmp_path / "blank.jsonl", [{"prompt": "a"}, {"prompt": " "}]))
    assert "blank.jsonl" in msg and "row 1" in msg and "'prompt'" in msg
    msg = _error(tmp_path, path=write_jsonl(tmp_path / "clash.jsonl", [{"prompt": "a", "completions": "b"}]))
    assert "clash.jsonl" in msg and "completions" in msg


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_colon", ["'no_colon'", "module:function"]),
        ("a:b:c", ["'a:b:c'", "module:function"]),
        ("no_such_module_xyz:fn", ["'no_such_module_xyz:fn'", "cannot import"]),
        (f"{HERE}:missing_fn", [f"'{HERE}:missing_fn'", "no attribute 'missing_fn'"]),
        (f"{HERE}:NOT_CALLABLE", [f"'{HERE}:NOT_CALLABLE'", "not callable"]),
    ],
)
def test_reward_spec_errors(tmp_path: Path, spec: str, words: list[str]) -> None:
    msg = _error(tmp_path, rewards=[spec])
    assert "d.jsonl" in msg and all(w in msg for w in words), msg


def test_weights_must_match_rewards(tmp_path: Path) -> None:
    msg = _error(tmp_path, reward_weights=[1.0, 2.0])
    assert "d.jsonl" in msg and "reward_weights" in msg


# -- hostile reward functions and prompts ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("wrong_length", ["1 values for 2 completions"]),
        ("gives_nan", ["nan", "index 0"]),
        ("gives_strings", ["'1.0'", "index 0"]),
        ("gives_scalar", ["float, not a list"]),
    ],
)
def test_bad_reward_values_name_the_function(tmp_path: Path, name: str, words: list[str]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = DatasetTask(cfg(path, rewards=[f"{HERE}:correct", f"{HERE}:{name}"]))
    with pytest.raises(ValueError) as e:
        task.reward(["2+2=", "3+3="], ["4", "6"])
    assert f"{HERE}:{name}" in str(e.value) and all(w in str(e.value) for w in words)


def test_unknown_prompt_and_length_mismatch_raise(tmp_path: Path) -> None:
    task = DatasetTask(cfg(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    with pytest.raises(ValueError, match="not one of its dataset's"):
        task.reward(["9+9="], ["18"])
    with pytest.raises(ValueError, match="1 prompts but 2 completions"):
        task.reward(["2+2="], ["4", "4"])
    with pytest.raises(NotImplementedError, match="known answers"):
        task.supervised_pairs(1, random.Random(0))


# -- build_task and the built-ins ------------------------------------------------------------


def test_build_task(tmp_path: Path) -> None:
    assert isinstance(build_task(TaskConfig()), AdditionTask)
    assert build_task(TaskConfig()).task_id == "addition"
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert build_task(cfg(path)).task_id == DatasetTask(cfg(path)).task_id
    with pytest.raises(ValueError, match=r"'nope'.*'addition', 'math'.*task.dataset"):
        build_task(TaskConfig(name="nope"))
    with pytest.raises(ValueError, match="no chat form"):
        build_task(TaskConfig(chat=True))
    math_chat = build_task(TaskConfig(name="math", chat=True))
    assert math_chat.chat is True and math_chat.task_id.startswith("math@")
    assert math_chat.task_id != get_task("math").task_id


def test_math_task_is_registered() -> None:
    task = get_task("math")
    # The id hashes the bundled file: another echo-node's problems are another task.
    assert task.task_id.startswith("math@") and task.name == "math" and task.chat is False
    rows = make_math_word.generate()
    assert isinstance(task, DatasetTask) and task.n_rows == len(rows)
    prompt = task.prompt_for(0)
    assert prompt == rows[0]["question"] + "\nAnswer:"
    answer = rows[0]["answer"]
    assert task.reward([prompt] * 3, [f" {answer}", f" The answer is {answer}.", " 1000"]) == [1.0, 1.0, 0.0]


def test_math_data_file_is_the_generators_output(tmp_path: Path) -> None:
    out = tmp_path / "math_word.jsonl"
    make_math_word.main([str(out)])
    assert out.read_bytes() == make_math_word.PATH.read_bytes()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 300 <= len(rows) <= 2000 and len({r["question"] for r in rows}) == len(rows)
    assert all(len(r["question"]) <= 120 and r["answer"].isdigit() for r in rows)


# -- the math reward -------------------------------------------------------------------------


def test_math_answer_extracts_the_final_answer() -> None:
    completions = ["3 + 4 apples, so the answer is 7.", "7", "\\boxed{7}", "8", "$\\frac{14}{2}$", "no idea"]
    assert math_answer([""] * 6, completions, ["7"] * 6) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert math_answer(["p"], ["7"], [7]) == [1.0]  # a numeric column (CSV) works too
    assert exact_answer(["p"] * 3, [" 7\n", "7.0", "the answer is 7"], ["7"] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="1 prompts, 2 completions, 1 answers"):
        math_answer(["p"], ["7", "7"], ["7"])


def test_math_answer_works_off_the_main_thread() -> None:
    result: list[list[float]] = []
    thread = threading.Thread(target=lambda: result.append(math_answer(["p", "p"], ["so 7", "\\boxed{8}"], ["7", "7"])))
    thread.start()
    thread.join(timeout=60)
    assert result == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "completion",
    [
        "x" * 100_000 + " so the answer is 7.",
        "(" * 100_000 + "7",
        "$9^{9^{9^{9}}}$",  # sympy would evaluate the power without end
        "9**9**9",
        "\\boxed{99999999!}",
        "$\\binom{99999999}{9999999}$",
        "$" + "{" * 30 + "7" + "}" * 30 + "$",  # the LaTeX parser backtracks exponentially on nesting
        "$" + "|{|{7}|}|" * 20 + "$",
    ],
)
def test_math_answer_is_bounded_on_hostile_completions(completion: str) -> None:
    t0 = time.perf_counter()
    scores = math_answer(["p"], [completion], ["7"])
    assert time.perf_counter() - t0 < 2.0
    assert scores in ([0.0], [1.0])
