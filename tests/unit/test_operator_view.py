"""The demo's live table and the run's plots as an operator reads them (echo_node/demo.py,
echo_node/metrics.py)."""

from __future__ import annotations

import argparse
import io
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402

from echo_node.demo import TABLE_WIDTH, Swarm, _Progress  # noqa: E402
from echo_node.metrics import (  # noqa: E402
    _draw_drops,
    _draw_idle,
    _draw_verification,
    first_last_update_rewards,
    plot_run,
    run_figure,
)

WALL0 = 1_796_000_000.0


def train_records(n: int = 12, *, failed: dict[str, int] | None = None) -> list[dict[str, Any]]:
    out = []
    for v in range(1, n + 1):
        out.append({
            "event": "train", "version": v, "t": 2.0 * v, "wall": WALL0 + 2.0 * v, "reward_mean": (v % 5) / 8,
            "trained": 64 * v, "idle_ratio": 0.25, "wait_s": 0.1, "train_s": 0.3,
            "dropped": {"stale": 1_234_567 * v, "overload": 98_765, "duplicate": 4_321, "unpublished_version": 17,
                        "future_version": 3, "bad_signature": 2},
            "verify": {"failed": dict(failed or {}), "banned": 1 if failed else 0, "spot_rate": 0.1, "share": 0.02},
        })
    return out


def rendered(progress: _Progress, records: list[dict[str, Any]]) -> str:
    console = Console(width=TABLE_WIDTH, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(progress._render(records, Swarm(Path("/nonexistent"))))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_live_table_fits_80_columns_and_cuts_nothing() -> None:
    progress = _Progress(argparse.Namespace(mode="async", staleness=4, seconds=150.0), Path("/nonexistent"), enabled=False)
    progress.capacity = {"active": ["a"] * 12, "standby": ["b"] * 3, "cost_per_hour": 1234.5}
    progress.held_out = {"version": 10, "eval_accuracy": 0.6875}
    records = train_records()
    text = rendered(progress, records)
    assert max(len(line) for line in text.splitlines()) <= TABLE_WIDTH
    assert "…" not in text and "..." not in text
    flat = " ".join(text.split())
    for figure in ("stale 14,814,804", "overload 98,765", "bad_signature 2", "12 active, 3 standby, 1234.5/h", "0.688 at version 10"):
        assert figure in flat, figure
    # Its reward is the last update's, as summary.json's reward_last says at the end.
    _, last = first_last_update_rewards(records)
    assert f"{last:.3f} last update" in flat


def test_the_live_tables_caption_follows_the_run() -> None:
    progress = _Progress(argparse.Namespace(mode="async", staleness=4, seconds=150.0), Path("/nonexistent"), enabled=False)
    progress.note("learner ready; starting 2 rollout peers")
    assert "learner ready; starting 2 rollout peers" in rendered(progress, [])
    records = train_records(3)
    assert "training, 6 of 150s" in rendered(progress, records)
    assert "training, 20 of 150s" in rendered(progress, train_records(10))
    progress.note("learner stopped: writing the summary and stopping the peers")
    assert "learner stopped" in " ".join(rendered(progress, records).split())


def test_a_figure_without_data_says_so_instead_of_drawing_empty_axes() -> None:
    fig = run_figure(_draw_idle, [], title="t")
    try:
        ax = fig.axes[0]
        assert not ax.axison and [t.get_text() for t in ax.texts] == ["no data yet"]
    finally:
        plt.close(fig)
    fig = run_figure(_draw_idle, train_records(), title="t")
    try:
        assert fig.axes[0].axison and not fig.axes[0].texts
    finally:
        plt.close(fig)


def test_verification_without_failures_draws_no_axis_of_zeros() -> None:
    fig = run_figure(_draw_verification, train_records(), title="t")
    try:
        left = fig.axes[0]
        assert list(left.get_yticks()) == [] and not left.get_lines()
        assert "no batch failed a check" in left.texts[0].get_text()
    finally:
        plt.close(fig)
    fig = run_figure(_draw_verification, train_records(failed={"reward": 2}), title="t")
    try:
        labels = [line.get_label() for line in fig.axes[0].get_lines()]
        assert labels == ["failed: reward", "peers banned"] and not fig.axes[0].texts
    finally:
        plt.close(fig)


def test_time_is_drawn_on_the_wall_clock() -> None:
    records = train_records()
    for draw in (_draw_idle, _draw_drops):
        fig = run_figure(draw, records, title="t")
        try:
            ax = fig.axes[0]
            assert isinstance(ax.xaxis.get_major_formatter(), mdates.ConciseDateFormatter)
            assert ax.get_xlabel() == "wall clock (local time)"
            xs = ax.get_lines()[0].get_xdata()
            assert list(xs) == [datetime.fromtimestamp(r["wall"]) for r in records]
        finally:
            plt.close(fig)


def test_a_clock_axis_over_one_instant_still_has_ticks(tmp_path: Path) -> None:
    """One update, or several within a second (a test), is drawn without a locator warning
    (pytest turns warnings into errors)."""
    one = train_records(1)
    same_second = [dict(r, wall=WALL0) for r in train_records(3)]
    for records in (one, same_second):
        plot_run(records, tmp_path, title="t")
