"""The typed config tree: TOML, CLI overrides, and clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_node.config import RunConfig, load_config


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert cfg.rl.mode == "async" and cfg.threads == 1
    assert cfg.run_dir == Path("runs") / "default"


def test_toml_tables_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('run_id = "exp-1"\n[rl]\nmode = "pull"\nlr = 1\n[net]\nbootstrap = ["/ip4/1.2.3.4/tcp/1/p2p/x"]\n')
    cfg = load_config(f, rl__staleness=7, run_id=None)
    assert cfg.run_id == "exp-1"  # None overrides keep the file's value
    assert cfg.rl.mode == "pull" and cfg.rl.staleness == 7
    assert cfg.rl.lr == 1.0 and isinstance(cfg.rl.lr, float)
    assert cfg.net.bootstrap == ["/ip4/1.2.3.4/tcp/1/p2p/x"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[rl]\nmdoe = 'pull'\n", r"unknown config key\(s\) rl\.mdoe"),
        ("[rl]\nmode = 'sync'\n", "rl.mode must be one of"),
        ("[rl]\nstaleness = 'four'\n", "rl.staleness must be int"),
        ("[rl]\ngroup_size = 1\n", "group_size must be in 2..64"),
        ("[rl]\npublish_every = 0\n", "publish_every must be >= 1"),
        ("[rl]\nmode = 'pull'\npublish_every = 2\n", "needs async mode"),
        ("[rl]\nstaleness = 2\npublish_every = 3\n", "staleness >= it"),
        ("run_id = 'a b'\n", "run id 'a b' is invalid"),
        ("rl = 3\n", r"\[rl\] must be a table"),
        ("[rl\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_problem(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "run.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config(f)


def test_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ValueError, match="threads"):
        RunConfig(threads=0)


@pytest.mark.parametrize(
    "overrides",
    [{"run_id": "abc\n"}, {"rl__staleness": 70_000}, {"sampling__temperature": 200.0}, {"sampling__max_new_tokens": 5000}],
)
def test_the_config_refuses_what_the_wire_would(overrides: dict[str, object]) -> None:
    """A value the run spec cannot carry fails at start-up, not when the first peer joins."""
    with pytest.raises(ValueError):
        load_config(None, **overrides)


def test_a_run_saved_before_an_option_existed_resumes_under_its_default() -> None:
    """A checkpoint's config from before `[task]` became a table and `model.dtype`/`device`
    existed still matches today's defaults; where the model computes may change on resume."""
    from echo_node.config import to_dict
    from echo_node.learner.recovery import config_difference

    current = to_dict(RunConfig())
    old = to_dict(RunConfig())
    old["task"] = "addition"
    del old["model"]["dtype"], old["model"]["device"]
    assert config_difference(old, current) == []
    moved = to_dict(load_config(None, model__device="cpu"))
    assert config_difference(current, moved) == []
    other = to_dict(load_config(None, model__dtype="bfloat16", task="math"))
    assert sorted(config_difference(old, other)) == ["model.dtype: 'auto' -> 'bfloat16'", "task.name: 'addition' -> 'math'"]
