"""Experiment tracking the way the ecosystem does it: `--report-to tensorboard|wandb|none`, as
TRL's `report_to`, through the real libraries.

Rules:
- The same numbers as metrics.jsonl: `scalars` maps a learner record (`train`, `eval`,
  `progress`) to named scalars and the policy version they belong to; everything else
  (joins, capacity decisions, the summary) stays in metrics.jsonl only.
- The x axis is the policy version. TensorBoard takes each scalar at its version (an
  evaluation finishes after later versions trained: it is drawn at the version it scored);
  W&B wants its own step to grow, so every row carries `version` and every metric is charted
  against it (`define_metric`).
- W&B runs offline unless `report.wandb_mode = "online"`: the run is written under the run
  folder and nothing needs the network (`wandb sync` uploads it later).
- Tracking is the operator's view, never the run's state: a library error is logged once and
  tracking stops; training goes on. A missing library is refused at start (`check_available`),
  before any heavy import, with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

# The packages each backend needs, and the extra that installs them.
PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",)}
INSTALL_HINT = "pip install 'echo-node[tracking]'"

# Per record kind: (prefix, keys). Keys are those of metrics.jsonl's records.
_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "train": ("train", ("reward_mean", "loss", "staleness_mean", "tokens", "idle_ratio", "wait_s", "train_s",
                        "is_weight_mean", "is_truncated_frac", "groups", "buffered")),
    "eval": ("eval", ("eval_accuracy",)),
    "progress": ("progress", ("updates_per_s", "reward_mean", "accepted_window", "idle_window", "staleness_mean",
                              "active_peers", "standby_peers", "bytes_up")),
}


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(version, {"train/reward_mean": 0.4, ...}) of a record tracking shows, or None. Values
    that are absent or not finite numbers are left out; a progress record's drops are summed."""
    spec = _KEYS.get(str(record.get("event")))
    version = record.get("version")
    if spec is None or not isinstance(version, int) or isinstance(version, bool):
        return None
    prefix, keys = spec
    out: dict[str, float] = {}
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}/{key.removeprefix('eval_')}"] = float(value)
    dropped = record.get("dropped_window") if prefix == "progress" else None
    if isinstance(dropped, dict):
        out["progress/dropped_window"] = float(sum(v for v in dropped.values() if isinstance(v, int)))
    return (version, out) if out else None


class Tracker(Protocol):
    def log(self, version: int, values: dict[str, float], wall: float | None) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under `directory` (one per start of the run), as `tensorboard --logdir` reads."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self._writer = SummaryWriter(log_dir=str(directory), flush_secs=10)

    def log(self, version: int, values: dict[str, float], wall: float | None) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, global_step=version, walltime=wall)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named after the run id (grouped by it across restarts), under `directory`."""

    def __init__(self, directory: Path, *, run_id: str, config: dict[str, Any], mode: Literal["offline", "online"]) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        # console "off": the learner's stdout carries its `ready` line, which W&B must not wrap.
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True)
        self._run = wandb.init(project="echo-node", name=run_id, group=run_id, dir=str(directory), mode=mode,
                               config=config, settings=settings)
        self._run.define_metric("version")
        self._run.define_metric("*", step_metric="version")

    def log(self, version: int, values: dict[str, float], wall: float | None) -> None:
        self._run.log({**values, "version": version})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # The W&B service writes the run file's last records as it shuts down: without this, at
        # interpreter exit (a run file read before then lacks its history).
        wandb.teardown()


def check_available(report_to: str) -> None:
    """ValueError, with the install command, when `report_to`'s library is not installed."""
    missing = [p for p in PACKAGES.get(report_to, ()) if importlib.util.find_spec(p) is None]
    if missing:
        raise ValueError(f"--report-to {report_to} needs the {', '.join(missing)} package: {INSTALL_HINT}")


def open_tracker(
    report_to: str, directory: Path, *, run_id: str, config: dict[str, Any], wandb_mode: Literal["offline", "online"],
) -> Tracker | None:
    """The tracker `report_to` names, writing under `directory` (None for "none")."""
    if report_to == "none":
        return None
    check_available(report_to)
    if report_to == "tensorboard":
        return TensorBoardTracker(directory / "tensorboard")
    if report_to == "wandb":
        return WandbTracker(directory, run_id=run_id, config=config, mode=wandb_mode)
    raise ValueError(f"--report-to must be tensorboard, wandb or none, got {report_to!r}")


class Tracking:
    """The run's tracker behind RunReport.write: failures logged once, then tracking stops."""

    def __init__(self, tracker: Tracker | None) -> None:
        self.tracker = tracker
        self.failed: str | None = None

    def record(self, record: dict[str, Any]) -> None:
        if self.tracker is None:
            return
        found = scalars(record)
        if found is None:
            return
        wall = record.get("wall")
        try:
            self.tracker.log(found[0], found[1], float(wall) if isinstance(wall, (int, float)) else None)
        except Exception as exc:  # a library's own error; metrics.jsonl still has every number
            self._fail(exc)

    def close(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.close()
        except Exception as exc:
            self._fail(exc)
        self.tracker = None

    def _fail(self, exc: Exception) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.error("experiment tracking stopped (%s); metrics.jsonl has every number", self.failed)
        self.tracker = None
