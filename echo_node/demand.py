"""How much more than it trains the learner asks its peers for: the demand's slack, by feedback.

Peers sample `demand` groups per published version: the updates' worth until the next
publication, split among the peers that deliver, times the slack (`RolloutIntake.demand_groups`).
Asking too little idles the learner; asking too much is volunteer work thrown away as stale. A
fixed slack of 1.5 did the latter: with peers that keep up, half again as much as the learner
trains arrives, and the staleness rule drops a third of everything received (13,336 of 37,784
rollouts in the demo). So the slack follows what happened since the last look:

- the learner waited for rollouts more than IDLE_HIGH of its time: slack x UP (ask more, at once:
  an idle learner is the costlier mistake);
- else more than STALE_HIGH of the rollouts received went stale: slack x DOWN (ask less, gently);
- bounded to [MIN_SLACK, MAX_SLACK]; a look with nothing trained and nothing received changes
  nothing.

Pure: the learner hands it its cumulative counters; no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemandSlack"]

IDLE_HIGH = 0.03
STALE_HIGH = 0.05
UP = 1.15
DOWN = 0.95
MIN_SLACK = 1.0
MAX_SLACK = 3.0


@dataclass(slots=True)
class DemandSlack:
    slack: float = 1.5
    _last: tuple[int, int, float, float] | None = None

    def update(self, *, received: int, stale: int, idle_s: float, train_s: float) -> float:
        """Take the cumulative rollouts received and dropped as stale and the learner's idle and
        training seconds; return the slack to ask with from now on."""
        now = (received, stale, idle_s, train_s)
        last, self._last = self._last, now
        if last is None:
            return self.slack
        d_received, d_stale = received - last[0], stale - last[1]
        d_idle, d_train = idle_s - last[2], train_s - last[3]
        if d_train <= 0 and d_received <= 0:
            return self.slack  # nothing happened: no evidence either way
        idle = d_idle / max(1e-9, d_idle + d_train)
        if idle > IDLE_HIGH:
            self.slack = min(MAX_SLACK, self.slack * UP)
        elif d_received > 0 and d_stale / d_received > STALE_HIGH:
            self.slack = max(MIN_SLACK, self.slack * DOWN)
        return self.slack
