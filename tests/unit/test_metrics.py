"""Run metrics: `summarize_run` aggregates train records exactly; `plot_run` never crashes on old files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from echo_node.metrics import MetricsWriter, first_last_update_rewards, plot_run, read_metrics, summarize_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FILES = {"idle.png", "staleness.png", "tokens.png", "is_weights.png", "drops.png", "verification.png"}


def old_step(
    *, t: float, version: int, wait_s: float, train_s: float, idle_ratio: float, dropped: dict[str, int]
) -> dict[str, Any]:
    """A train record as learners wrote it before the staleness/IS keys existed."""
    return {
        "event": "train", "t": t, "version": version, "reward_mean": 0.5, "loss": 0.1, "groups": 2,
        "staleness_mean": 0.0, "staleness_max": 0, "wait_s": wait_s, "train_s": train_s,
        "idle_ratio": idle_ratio, "received": 16, "trained": 16, "dropped": dropped, "buffered": 0, "peers": 2,
    }


def new_step(
    *, tokens: float, hist: dict[str, float], is_mean: float, is_min: float, is_max: float, trunc: float,
    spanning: int = 0, **old: Any,
) -> dict[str, Any]:
    return {
        **old_step(**old), "tokens": tokens, "staleness_hist": hist, "is_weight_mean": is_mean,
        "is_weight_min": is_min, "is_weight_max": is_max, "is_truncated_frac": trunc, "spanning": spanning,
    }


def mixed_run() -> list[dict[str, Any]]:
    """Two new-style updates, other events, then an old-style update that was skipped (no tokens)."""
    return [
        new_step(
            t=1.0, version=1, wait_s=3.0, train_s=1.0, idle_ratio=0.75, dropped={},
            tokens=100.0, hist={"0": 60, "1": 40}, is_mean=1.0, is_min=0.5, is_max=2.0, trunc=0.0, spanning=3,
        ),
        {"event": "first_accept", "peer": "p", "wall": 0.0, "version": 1},
        new_step(
            t=2.0, version=2, wait_s=1.0, train_s=1.0, idle_ratio=0.625, dropped={"stale": 8, "overload": 4},
            tokens=300.0, hist={"1": 200, "2": 100}, is_mean=2.0, is_min=0.25, is_max=8.0, trunc=0.5, spanning=5,
        ),
        # Neither waited nor trained: no per-update idle share, and it must not count as 0.
        old_step(t=3.0, version=3, wait_s=0.0, train_s=0.0, idle_ratio=0.6, dropped={"stale": 16, "overload": 4}),
        {"event": "summary", "versions": 3, "rollouts_dropped": {"stale": 99}},
    ]


def test_summarize_run_aggregates_over_train_records_weighting_by_tokens() -> None:
    s = summarize_run(mixed_run())
    assert s == {
        "updates": 3,
        "tokens_total": 400.0,
        "staleness_hist": {0: 60.0, 1: 240.0, 2: 100.0},
        "staleness_token_mean": 440 / 400,
        "spanning": 8,
        "idle_ratio_update_mean": (0.75 + 0.5) / 2,
        "idle_ratio_final": 0.6,
        "dropped": {"overload": 4, "stale": 16},
        "is_weight_mean": (1.0 * 100 + 2.0 * 300) / 400,
        "is_truncated_frac": (0.0 * 100 + 0.5 * 300) / 400,
        "is_weight_min": 0.25,
        "is_weight_max": 8.0,
    }
    assert list(s["staleness_hist"]) == [0, 1, 2] and list(s["dropped"]) == ["overload", "stale"]


def test_summarize_run_on_records_without_the_new_keys() -> None:
    s = summarize_run([old_step(t=1.0, version=1, wait_s=1.0, train_s=3.0, idle_ratio=0.25, dropped={"stale": 2})])
    assert s == {
        "updates": 1,
        "tokens_total": 0,
        "staleness_hist": {},
        "staleness_token_mean": None,
        "spanning": 0,
        "idle_ratio_update_mean": 0.25,
        "idle_ratio_final": 0.25,
        "dropped": {"stale": 2},
        "is_weight_mean": None,
        "is_truncated_frac": None,
        "is_weight_min": None,
        "is_weight_max": None,
    }


def test_summarize_run_on_no_records() -> None:
    s = summarize_run([])
    assert s["updates"] == 0 and s["tokens_total"] == 0 and s["staleness_hist"] == {} and s["dropped"] == {}
    assert s["idle_ratio_update_mean"] is None and s["is_weight_mean"] is None


def test_non_finite_values_from_the_file_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    # An update whose token mask was empty reports an infinite max weight; json round-trips it.
    bad = new_step(
        t=1.0, version=1, wait_s=1.0, train_s=1.0, idle_ratio=0.5, dropped={},
        tokens=10.0, hist={"0": 10, "x": 5, "-1": 3}, trunc=0.0,
        is_mean=float("nan"), is_min=float("inf"), is_max=float("-inf"),
    )
    writer.write(bad)
    writer.write(new_step(
        t=2.0, version=2, wait_s=1.0, train_s=1.0, idle_ratio=0.5, dropped={},
        tokens=30.0, hist={"1": 30}, is_mean=1.5, is_min=1.0, is_max=3.0, trunc=0.25,
    ))
    writer.close()
    with path.open("a", encoding="utf-8") as fh:
        fh.write('{"event": "train", "ver')  # the learner was killed mid-line
    s = summarize_run(read_metrics(path))
    assert s["updates"] == 2 and s["tokens_total"] == 40.0
    assert s["staleness_hist"] == {0: 10.0, 1: 30.0}
    assert (s["is_weight_mean"], s["is_weight_min"], s["is_weight_max"]) == (1.5, 1.0, 3.0)
    assert s["is_truncated_frac"] == 0.25 * 30 / 40


def assert_pngs(paths: list[Path], run_dir: Path) -> None:
    assert {p.name for p in paths} == RUN_FILES
    for p in paths:
        assert p.parent == run_dir
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000


def test_plot_run_writes_every_figure(tmp_path: Path) -> None:
    assert_pngs(plot_run(mixed_run(), tmp_path, title="run-1 (async)"), tmp_path)


@pytest.mark.parametrize(
    "records",
    [
        [],
        [old_step(t=1.0, version=1, wait_s=0.5, train_s=0.5, idle_ratio=0.5, dropped={})],
        [{"event": "train"}, {"event": "summary"}],
    ],
    ids=["empty", "old-keys-only", "bare-train-event"],
)
def test_plot_run_tolerates_missing_data(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    run_dir = tmp_path / "run"
    assert_pngs(plot_run(records, run_dir, title="old"), run_dir)


def _train(version: int, reward: object) -> dict[str, Any]:
    return {"event": "train", "version": version, "reward_mean": reward, "groups": 2}


def test_reward_first_and_last_are_the_first_and_last_updates_by_version() -> None:
    # The run that reported 0.0 -> 0.0: per-update means 0, 0.25, 0.125, 0.125 (the old fields
    # averaged the first and last 10% of *samples*, all zeros here).
    records = [{"event": "published", "version": 0}] + [_train(v, r) for v, r in zip(range(1, 5), (0.0, 0.25, 0.125, 0.125))]
    assert first_last_update_rewards(records) == (0.0, 0.125)
    # Order in the file does not matter, the version does; a version redone after a restart
    # counts once, as its latest record says.
    assert first_last_update_rewards([_train(3, 0.5), _train(2, 0.25), _train(3, 0.75)]) == (0.25, 0.75)
    assert first_last_update_rewards([_train(7, 0.5)]) == (0.5, 0.5)


def test_reward_first_and_last_are_null_without_an_update_never_nan() -> None:
    assert first_last_update_rewards([]) == (None, None)
    # Records with a non-finite, missing or non-numeric reward or version are not updates to report.
    bad = [_train(1, float("nan")), _train(2, None), _train(3, "0.5"), {"event": "train", "reward_mean": 0.5},
           {**_train(4, 0.5), "version": True}, {"event": "caught", "version": 5, "reward_mean": 0.5}]
    first, last = first_last_update_rewards(bad)
    assert (first, last) == (None, None)
    json.dumps({"reward_first": first, "reward_last": last}, allow_nan=False)
    assert first_last_update_rewards([*bad, _train(6, 0.25)]) == (0.25, 0.25)


def test_the_learners_last_line_says_when_no_update_was_trained() -> None:
    from echo_node.cli import _reward_change

    assert _reward_change({"reward_first": None, "reward_last": None}) == "no update trained"
    assert _reward_change({"reward_first": 0.0, "reward_last": 0.125}) == "reward 0.000 -> 0.125"


def test_summary_fields_without_an_update_stay_null() -> None:
    from echo_node.metrics import rounded

    assert rounded(None) is None and rounded(0.123456) == 0.1235
