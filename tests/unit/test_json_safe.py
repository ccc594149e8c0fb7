"""`json_safe`: what echo-node writes as JSON is strict JSON (no NaN, no Infinity): a value that is
not a number becomes null, and the caller learns which ones did."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from echo_node.demo import strict_line
from echo_node.metrics import json_safe


def test_non_finite_floats_become_null_at_any_depth_and_the_rest_is_untouched() -> None:
    summary = {
        "versions": 0,
        "learner_idle_ratio": math.nan,
        "reward_first": None,
        "ok": True,
        "name": "NaN",  # a string that spells it stays a string
        "nested": {"t": (1.5, math.inf, -math.inf), "rows": [{"x": np.float32("nan")}, {"x": np.float64(2.0)}]},
    }
    reasons: dict[str, str] = {}
    safe = json_safe(summary, reasons=reasons)
    text = json.dumps(safe, allow_nan=False)  # would raise on NaN or inf
    assert json.loads(text) == {
        "versions": 0, "learner_idle_ratio": None, "reward_first": None, "ok": True, "name": "NaN",
        "nested": {"t": [1.5, None, None], "rows": [{"x": None}, {"x": 2.0}]},
    }
    assert reasons == {
        "learner_idle_ratio": "NaN", "nested.t[1]": "inf", "nested.t[2]": "-inf", "nested.rows[0].x": "NaN",
    }
    assert math.isnan(summary["learner_idle_ratio"])  # the input is not changed


def test_plain_values_come_back_as_they_are() -> None:
    assert json_safe(math.nan) is None
    assert json_safe(3) == 3 and json_safe(True) is True and json_safe("x") == "x"
    assert json_safe([]) == [] and json_safe({}) == {}


def test_the_demos_last_line_is_strict_json_saying_why_a_field_is_null() -> None:
    """Issue 29: the demo's last line had NaN (the idle ratio of a run that trained 0 versions)."""
    line = strict_line({"versions": 0, "learner_idle_ratio": math.nan, "reward_first": None}, {"versions": 0})
    assert json.loads(json.dumps(line, allow_nan=False)) == {
        "versions": 0, "learner_idle_ratio": None, "reward_first": None,
        "null_reasons": {"learner_idle_ratio": "NaN: no update was trained"},
    }
    # A summary.json written through json_safe already says why: its words are kept.
    summary = {"versions": 0, "null_reasons": {"learner_idle_ratio": "no update timed", "other": "x"}}
    line = strict_line({"versions": 0, "learner_idle_ratio": None}, summary)
    assert line["null_reasons"] == {"learner_idle_ratio": "no update timed"}
    assert "null_reasons" not in strict_line({"versions": 3, "learner_idle_ratio": 0.25}, {"versions": 3})


def test_status_json_is_strict_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Prometheus gauges may be NaN; `echo-node status --json` prints them as null."""
    from echo_node import status
    from echo_node.cli import main

    monkeypatch.setattr(status, "scrape", lambda address: {"echo_learner_idle_ratio": math.nan, "drops": {}})
    assert main(["status", "--learner", "127.0.0.1:9400", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"echo_learner_idle_ratio": None, "drops": {}}
