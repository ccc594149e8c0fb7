"""The learner's account of a run, for its operator and for whoever studies it.

`metrics.jsonl` grows as the run goes: one JSON record per event (`train` per update,
`reachability`, `first_accept`, `train_error`, ... and `summary` last), each with `wall` (the
wall clock, so a benchmark can line learner and peer records up). At the end `summary.json`
holds the ledger and the run's totals, next to reward and run plots. With `--report-to`, the
train, eval and progress records' scalars also go to TensorBoard or W&B (echo_node/learner/tracking.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from echo_node.learner.tracking import Tracker, Tracking
from echo_node.metrics import MetricsWriter, plot_rewards, plot_run, read_metrics

log = logging.getLogger(__name__)


class RunReport:
    def __init__(self, run_dir: Path, title: str) -> None:
        self.run_dir = run_dir
        self.title = title
        self._writer: MetricsWriter | None = None
        self.unwritten = 0
        self.tracking = Tracking(None)

    @property
    def path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def open(self, tracker: Tracker | None = None) -> None:
        self._writer = MetricsWriter(self.path)
        self.tracking = Tracking(tracker)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (dropped if the report is not open: nothing to write it to yet).
        A record that cannot be written (a full disk) is counted and dropped: the metrics are
        the operator's view, not the run's state, and must never stop training."""
        if self._writer is None:
            return
        record = {**record, "wall": record.get("wall", round(time.time(), 4))}
        self.tracking.record(record)
        try:
            self._writer.write(record)
        except OSError as exc:
            self.unwritten += 1
            if self.unwritten == 1 or self.unwritten % 1000 == 0:
                log.error("could not write %s (%s): %d records lost so far", self.path, exc, self.unwritten)

    def close(self) -> None:
        self.tracking.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def finish(self, summary: dict[str, Any]) -> None:
        """The `summary` record, summary.json (with the config) and the plots."""
        self.write({"event": "summary", **{k: v for k, v in summary.items() if k != "config"}})
        self.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str, allow_nan=False))
        records = read_metrics(self.path)
        plot_rewards(records, self.run_dir / "reward.png", title=self.title)
        plot_run(records, self.run_dir, title=self.title)
