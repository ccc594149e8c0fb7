"""`json_safe`: what echo-node writes as JSON is strict JSON (no NaN, no Infinity): a value that is
not a number becomes null, and the caller learns which ones did."""

from __future__ import annotations

import json
import math

import numpy as np

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
