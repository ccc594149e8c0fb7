"""The learner's replay buffer and its rollout accounting (pure logic, no I/O).

Invariant: every rollout (one sampled completion) the learner receives is counted exactly once,
either as trained or as dropped with a reason, and `received == trained + dropped + buffered`
holds after every call. A message that could not even be decoded counts as one rollout dropped
as "malformed", so garbage is visible in the same ledger.

Admission follows Echo's two sync modes (protocol.staleness): in pull mode only rollouts of the
current version are admissible; in async mode a group is admissible while its oldest token's
version is >= current - S. Admissibility is checked on arrival and again when a batch is taken,
because the learner's version advances while a group waits.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.messages import RolloutGroup
from protocol.staleness import DropReason, admissible


@dataclass(slots=True)
class Ledger:
    received: int = 0
    trained: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {
            "received": self.received,
            "trained": self.trained,
            "dropped": dict(sorted(self.dropped.items())),
        }


class ReplayBuffer:
    def __init__(self, *, mode: str, staleness: int, capacity_groups: int) -> None:
        if capacity_groups < 1:
            raise ValueError("capacity_groups must be >= 1")
        self.mode = mode
        self.staleness = staleness
        self.capacity_groups = capacity_groups
        self.ledger = Ledger()
        self._groups: deque[RolloutGroup] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def buffered_rollouts(self) -> int:
        return sum(len(g.samples) for g in self._groups)

    def reject(self, reason: DropReason | str, rollouts: int = 1) -> None:
        """Count rollouts that arrived but never entered the buffer."""
        self.ledger.received += rollouts
        self._drop(reason, rollouts)

    def offer(self, group: RolloutGroup, current_version: int) -> DropReason | None:
        """Admit a verified group, or count it dropped and return the reason."""
        n = len(group.samples)
        self.ledger.received += n
        reason = admissible(group.min_version, current_version, self.staleness, self.mode)
        if reason is not None:
            self._drop(reason, n)
            return reason
        self._groups.append(group)
        while len(self._groups) > self.capacity_groups:
            # The oldest group is the closest to going stale; keep the freshest data.
            old = self._groups.popleft()
            self._drop(DropReason.OVERLOAD, len(old.samples))
        return None

    def take(self, n_groups: int, current_version: int) -> list[RolloutGroup]:
        """Pop up to `n_groups` admissible groups, freshest first; stale ones are dropped.

        Freshest = newest oldest-token version, then latest arrival. Peers produce with slack
        so the learner never waits, so the buffer holds more than a step needs: taken oldest
        first, every step would train at the full staleness S (measured: all tokens 4 versions
        old at S = 4); taken freshest first, the surplus is what ages out, counted as stale.
        """
        self.evict_stale(current_version)
        n = min(n_groups, len(self._groups))
        picked = sorted(range(len(self._groups)), key=lambda i: (self._groups[i].min_version, i), reverse=True)[:n]
        batch = [self._groups[i] for i in picked]
        chosen = set(picked)
        self._groups = deque(g for i, g in enumerate(self._groups) if i not in chosen)
        return batch

    def count_admissible(self, current_version: int) -> int:
        return sum(
            1
            for g in self._groups
            if admissible(g.min_version, current_version, self.staleness, self.mode) is None
        )

    def evict_stale(self, current_version: int) -> int:
        kept: deque[RolloutGroup] = deque()
        evicted = 0
        for g in self._groups:
            reason = admissible(g.min_version, current_version, self.staleness, self.mode)
            if reason is None:
                kept.append(g)
            else:
                self._drop(reason, len(g.samples))
                evicted += 1
        self._groups = kept
        return evicted

    def restore(self, groups: list[RolloutGroup]) -> None:
        """Put back groups taken for a step that did not happen; the next `take` picks them again."""
        self._groups.extend(reversed(groups))

    def mark_trained(self, groups: Iterable[RolloutGroup]) -> None:
        self.ledger.trained += sum(len(g.samples) for g in groups)

    def close(self) -> None:
        """At shutdown, whatever is still buffered was received but never trained on."""
        while self._groups:
            self._drop(DropReason.UNUSED_AT_EXIT, len(self._groups.popleft().samples))

    def check(self) -> None:
        total = self.ledger.trained + sum(self.ledger.dropped.values()) + self.buffered_rollouts
        assert total == self.ledger.received, f"ledger broken: {self.ledger} buffered={len(self)}"

    def _drop(self, reason: DropReason | str, rollouts: int) -> None:
        key = reason.value if isinstance(reason, DropReason) else reason
        self.ledger.dropped[key] += rollouts
