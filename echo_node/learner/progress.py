"""The learner's progress line: what changed since the last one, every `report.progress_s`.

Pure bookkeeping (no I/O): the learner hands `Progress` each update's reward and staleness as it
trains and, at every tick, its running totals (`Totals`); `Progress.tick` returns the line it
logs at INFO and the `progress` record it writes to metrics.jsonl. Rules:
- Figures are over the window since the previous line, not since the start: updates/s is versions
  made in the window over its wall time (so a resumed run reads its present speed), rollouts
  accepted and dropped are the window's, by reason; bytes out is the total and the window's.
- The learner's idle share counts a wait still in progress (`Totals.idle_s` includes it), so a
  learner starved for the whole window reads 100 %, not 0 %.
- A figure with nothing behind it (no update in the window, no evaluation yet) is "-" in the
  line and null in the record, never 0 or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Totals:
    """The learner's running totals at one instant."""

    t: float  # monotonic seconds
    version: int
    accepted: int  # rollouts trained (the ledger's `trained`)
    dropped: dict[str, int] = field(default_factory=dict)  # by reason, cumulative
    idle_s: float = 0.0  # waiting for rollouts, a wait in progress included
    bytes_up: int = 0


@dataclass(slots=True)
class Progress:
    last: Totals
    _rewards: list[float] = field(default_factory=list)
    _staleness: list[float] = field(default_factory=list)

    def trained(self, reward: float | None, staleness: float | None) -> None:
        """One update's mean reward and mean staleness (None: not known)."""
        if reward is not None:
            self._rewards.append(reward)
        if staleness is not None:
            self._staleness.append(staleness)

    def tick(
        self, now: Totals, *, eval_version: int | None = None, eval_accuracy: float | None = None,
        active: int | None = None, standby: int | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The line and the record for the window since the last tick; starts the next window."""
        last, dt = self.last, max(1e-9, now.t - self.last.t)
        versions = now.version - last.version
        dropped = {k: n - last.dropped.get(k, 0) for k, n in now.dropped.items() if n - last.dropped.get(k, 0) > 0}
        reward = sum(self._rewards) / len(self._rewards) if self._rewards else None
        staleness = sum(self._staleness) / len(self._staleness) if self._staleness else None
        idle = min(1.0, max(0.0, (now.idle_s - last.idle_s) / dt))
        record: dict[str, Any] = {
            "event": "progress",
            "version": now.version,
            "window_s": round(dt, 3),
            "updates_per_s": round(versions / dt, 4),
            "reward_mean": None if reward is None else round(reward, 4),
            "eval_accuracy": eval_accuracy,
            "eval_version": eval_version,
            "accepted_window": now.accepted - last.accepted,
            "dropped_window": dict(sorted(dropped.items())),
            "idle_window": round(idle, 4),
            "staleness_mean": None if staleness is None else round(staleness, 3),
            "active_peers": active,
            "standby_peers": standby,
            "bytes_up": now.bytes_up,
            "bytes_up_window": now.bytes_up - last.bytes_up,
        }
        self.last = now
        self._rewards.clear()
        self._staleness.clear()
        return format_line(record), record


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_line(r: dict[str, Any]) -> str:
    """A `progress` record as one log line."""
    dropped = r["dropped_window"]
    reasons = f" ({', '.join(f'{k} {n:,}' for k, n in dropped.items())})" if dropped else ""
    held_out = "-" if r["eval_accuracy"] is None else f"{r['eval_accuracy']:.3f} at v{r['eval_version']}"
    peers = "-" if r["active_peers"] is None else f"{r['active_peers']} active, {r['standby_peers']} standby"
    return (
        f"progress: v{r['version']} · {r['updates_per_s']:.2f} updates/s · reward {_num(r['reward_mean'], '.3f')}"
        f" · held-out {held_out} · rollouts +{r['accepted_window']:,} accepted, +{sum(dropped.values()):,} dropped{reasons}"
        f" · idle {r['idle_window']:.0%} · staleness {_num(r['staleness_mean'], '.2f')} · peers {peers}"
        f" · {r['bytes_up'] / 1e6:,.1f} MB out (+{r['bytes_up_window'] / 1e6:,.1f})"
    )
