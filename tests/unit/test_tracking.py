"""`--report-to` (echo_node/learner/tracking.py): the run report's scalars through TensorBoard and W&B,
read back from the files those libraries wrote."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from echo_node.learner import tracking
from echo_node.learner.report import RunReport
from echo_node.learner.tracking import Tracking, open_tracker, scalars
from tests.tracking_files import tensorboard_scalars, wandb_history


def records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"event": "start", "version": 0}]
    for v in range(1, 9):
        out.append({"event": "train", "version": v, "reward_mean": v / 16, "loss": 1.0 / v, "staleness_mean": 0.5,
                    "idle_ratio": 0.25, "wall": 1_700_000_000.0 + v})
        if v % 4 == 0:
            out.append({"event": "eval", "version": v - 2, "eval_accuracy": v / 10, "eval_prompts": 16})
    out.append({"event": "progress", "version": 8, "updates_per_s": 2.5, "reward_mean": None, "accepted_window": 640,
                "dropped_window": {"stale": 3, "duplicate": 1}, "idle_window": 0.1, "bytes_up": 123})
    out.append({"event": "capacity", "version": 8, "mu_active": 3.0})
    return out


def test_records_map_to_the_scalars_of_metrics_jsonl() -> None:
    assert scalars({"event": "train", "version": 3, "reward_mean": 0.5, "loss": float("nan"), "groups": True}) == (
        3, {"train/reward_mean": 0.5})  # NaN and bools are not numbers to chart
    assert scalars({"event": "eval", "version": 4, "eval_accuracy": 0.25}) == (4, {"eval/accuracy": 0.25})
    version, values = scalars(records()[-2])  # type: ignore[misc]
    assert version == 8 and values["progress/dropped_window"] == 4 and "progress/reward_mean" not in values
    assert scalars({"event": "capacity", "version": 8, "mu_active": 3.0}) is None
    assert scalars({"event": "train", "reward_mean": 0.5}) is None  # no version: no x


def _report(tmp_path: Path, report_to: str) -> RunReport:
    report = RunReport(tmp_path, "t")
    report.open(open_tracker(report_to, tmp_path / "tracking", run_id="r1", config={"rl": {"staleness": 4}}, wandb_mode="offline"))
    for r in records():
        report.write(r)
    report.close()
    return report


def test_tensorboard_event_files_hold_every_train_and_eval_scalar(tmp_path: Path) -> None:
    _report(tmp_path, "tensorboard")
    got = tensorboard_scalars(tmp_path / "tracking" / "tensorboard")
    assert got["train/reward_mean"] == pytest.approx({v: v / 16 for v in range(1, 9)})
    assert got["train/loss"] == pytest.approx({v: 1.0 / v for v in range(1, 9)})
    # An evaluation is charted at the version it scored, though it was written later.
    assert got["eval/accuracy"] == pytest.approx({2: 0.4, 6: 0.8})
    assert got["progress/updates_per_s"] == pytest.approx({8: 2.5})
    assert got["progress/dropped_window"] == {8: 4}
    assert not any(tag.startswith("capacity") for tag in got)


def test_wandb_offline_run_holds_the_same_rows(tmp_path: Path) -> None:
    # Offline (the default): no W&B account or network is needed.
    _report(tmp_path, "wandb")
    rows = wandb_history(tmp_path / "tracking")
    train = {r["version"]: r["train/reward_mean"] for r in rows if "train/reward_mean" in r}
    assert train == pytest.approx({v: v / 16 for v in range(1, 9)})
    assert {r["version"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r} == pytest.approx({2: 0.4, 6: 0.8})
    progress = [r for r in rows if "progress/updates_per_s" in r]
    assert len(progress) == 1 and progress[0]["progress/accepted_window"] == 640
    assert all(not math.isnan(float(v)) for r in rows for v in r.values() if isinstance(v, float))


def test_a_missing_library_is_refused_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking.PACKAGES, "wandb", ("no_such_package_for_echo_node",))
    with pytest.raises(ValueError, match=r"--report-to wandb needs the no_such_package_for_echo_node package: pip install"):
        tracking.check_available("wandb")
    tracking.check_available("none")


def test_a_tracker_that_fails_stops_tracking_not_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        calls = 0

        def log(self, version: int, values: dict[str, float], wall: float | None) -> None:
            Broken.calls += 1
            raise OSError("disk full")

        def close(self) -> None:
            raise AssertionError("a failed tracker is not closed again")

    t = Tracking(Broken())
    for r in records():
        t.record(r)
    t.close()
    assert Broken.calls == 1 and t.failed == "OSError: disk full"
    assert "experiment tracking stopped" in caplog.text
