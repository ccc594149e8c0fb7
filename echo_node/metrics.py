"""Run metrics: one JSON object per line in `metrics.jsonl`, a summary, and a reward-curve PNG.

Lines are flushed as they are written so that `echo-node demo` (and a researcher's `tail -f`)
can follow a live run; a reader must tolerate a partial last line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a partially written last line
    return out


def first_last_mean(values: Sequence[float], fraction: float = 0.1) -> tuple[float, float]:
    """Mean over the first and the last `fraction` of a sequence (at least one element each)."""
    if not values:
        return math.nan, math.nan
    k = max(1, int(len(values) * fraction))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def plot_rewards(records: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("event") == "train"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if steps:
        xs = [r["version"] for r in steps]
        ys = [r["reward_mean"] for r in steps]
        ax.plot(xs, ys, color="#9bb7d4", linewidth=1, label="per update")
        window = max(1, len(ys) // 10)
        smooth = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, color="#1f4e79", linewidth=2, label=f"moving mean ({window})")
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean sampled reward of trained rollouts")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if steps:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
