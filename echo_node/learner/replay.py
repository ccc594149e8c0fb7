"""The learner's replay buffer and its rollout accounting (pure logic, no I/O).

Invariant: every rollout (one sampled completion, or one episode) the learner receives is
counted exactly once, either as trained or as dropped with a reason, and `received == trained +
dropped + buffered` holds after every call. A message that could not even be decoded counts as one rollout dropped
as "malformed", so garbage is visible in the same ledger.

Admission follows Echo's two sync modes (protocol.staleness): in pull mode only rollouts of the
current version are admissible; in async mode a group is admissible while its oldest token's
version is >= current - S. Admissibility is checked on arrival and again when a batch is taken,
because the learner's version advances while a group waits.

Bounds (peers are untrusted, so the buffer is what a flood fills first): at most
`capacity_groups` groups and `capacity_bytes` of estimated memory (`group_bytes`). On overflow the
oldest group *of the origin holding the most* goes, as "overload": a peer that floods evicts its
own data, not its neighbours'. A step takes at most `max_share` of its groups from one origin
while other origins have admissible groups, so one fast or hostile peer cannot own the updates.
Origins the learner has not proven yet (`unproven`, echo_node/learner/spot_check.py: `Verifier.proven`)
together get at most `unproven_share` of a step's slots, and one slot each, while proven ones
have admissible groups (the step is smaller rather than filled with theirs), and beside proven
data each has at most `unproven_groups` of its groups trained until it is proven; a step with no
proven group is theirs to fill, their groups carrying a loss weight (`step_weights`) so that they
move it by at most `unproven_share` of a full one. One slot each, a few groups in all, and no
filling beside proven data, because an attacker whose lies only pooled evidence can prove (a
lowered temperature, chosen prompts, an old version) is caught after a few batches, and until
then it trains at most `unproven_groups` groups beside proven data, however much it sends.

Durability: with a `journal` (echo_node/learner/journal.py) every change to the ledger is appended to it
as it happens; each admitted group gets a serial number (`gid`) the journal's records name it by.
The `replay_*` methods rebuild the buffer from those records after a restart (no checks: they
replay what was decided then).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from typing import Any, Protocol

from protocol.episodes import EpisodeGroup
from protocol.messages import RolloutGroup
from protocol.staleness import DropReason, admissible


# What the buffer holds: one prompt's sampled completions, or one seed's episodes (echo_node/envs).
Group = RolloutGroup | EpisodeGroup
# The journal's records carry a group's wire form, then its kind where it is not a RolloutGroup
# (records written before episodes existed have none).
EPISODE_KIND = "episode"
# Per origin, the ids of its last this many trained groups (as the publisher named them), kept
# so that a publisher caught later can be told apart into what reached training and what not.
TRAINED_IDS_KEPT = 64


def group_record(group: Group) -> list[Any]:
    """A group as a journal record carries it: its wire form, and its kind (`group_from_record`)."""
    return [group.to_wire(), EPISODE_KIND] if isinstance(group, EpisodeGroup) else [group.to_wire()]


def group_from_record(fields: list[Any]) -> Group:
    """The group of `group_record`'s fields (RemoteProtocolError, ValueError if they do not decode)."""
    if len(fields) > 1 and fields[1] == EPISODE_KIND:
        return EpisodeGroup.from_wire(fields[0])
    return RolloutGroup.from_wire(fields[0])


class Journal(Protocol):
    def append(self, record: list[Any]) -> None: ...

    def tally(self, reason: str, rollouts: int) -> None: ...


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


def step_weights(unproven: list[bool], n_groups: int, share: float) -> list[float]:
    """Loss weights of a step's groups, `unproven[i]` telling whether group i's publisher is not
    proven yet: 1 for a proven one's; the unproven ones split `share` x `n_groups` (the step's
    full size) among themselves, at most 1 each. With the learning rate scaled by the mean
    weight (echo_node/ml/grpo.py), a step of unproven groups alone moves the weights by at most
    `share` of a full step, and in a mixed one they weigh at most `share` x `n_groups` groups."""
    young = sum(unproven)
    w = min(1.0, share * n_groups / young) if young else 1.0
    return [w if u else 1.0 for u in unproven]


def group_bytes(group: Group) -> int:
    """What a decoded group costs in memory, estimated from CPython's object sizes: per
    completion token a token id, a float64 log-prob object and a version (~80 B with their
    tuple slots), per prompt token ~16 B, per sample ~200 B of objects."""
    if isinstance(group, EpisodeGroup):  # as many numbers per model token; an environment token is an id
        return 256 + 16 * len(group.prompt_ids) + sum(200 + 80 * e.num_tokens for e in group.episodes)
    return 256 + 16 * len(group.prompt_ids) + sum(200 + 80 * len(s.completion_ids) for s in group.samples)


class ReplayBuffer:
    def __init__(
        self, *, mode: str, staleness: int, capacity_groups: int, capacity_bytes: int = 1 << 62, max_share: float = 1.0,
        journal: Journal | None = None,
    ) -> None:
        if capacity_groups < 1 or capacity_bytes < 1:
            raise ValueError("capacity_groups and capacity_bytes must be >= 1")
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.mode = mode
        self.staleness = staleness
        self.capacity_groups = capacity_groups
        self.capacity_bytes = capacity_bytes
        self.max_share = max_share
        self.ledger = Ledger()
        self._groups: deque[Group] = deque()
        # Per buffered (or taken, until marked trained or restored) group: its origin and size.
        self._origin: dict[int, str] = {}
        self._size: dict[int, int] = {}
        self.bytes = 0
        # Groups trained per origin, over the run (one count per peer that ever had one trained).
        self.trained_groups: Counter[str] = Counter()
        # ... and the ids of the last TRAINED_IDS_KEPT of them, since this start of the learner.
        self.trained_ids: dict[str, deque[str]] = {}
        self.journal = journal
        self._gid: dict[int, int] = {}
        self.next_gid = 0

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def buffered_rollouts(self) -> int:
        return sum(g.num_rollouts for g in self._groups)

    def origin(self, group: Group) -> str:
        return self._origin.get(id(group), "")

    def gid(self, group: Group) -> int:
        """The serial number the journal knows a buffered (or taken) group by."""
        return self._gid[id(group)]

    def reject(self, reason: DropReason | str, rollouts: int = 1) -> None:
        """Count rollouts that arrived but never entered the buffer."""
        self.ledger.received += rollouts
        self._drop(reason, rollouts)
        if self.journal is not None:
            self.journal.tally(_key(reason), rollouts)

    def _record(self, record: list[Any]) -> None:
        if self.journal is not None:
            self.journal.append(record)

    def _dropped(self, reason: DropReason | str, groups: list[Group]) -> None:
        """Journal buffered (or taken) groups leaving with a reason; before they are released."""
        if groups:
            self._record(["drop", _key(reason), [self._gid[id(g)] for g in groups]])

    def offer(self, group: Group, current_version: int, origin: str = "") -> DropReason | None:
        """Admit a verified group from `origin`, or count it dropped and return the reason."""
        n = group.num_rollouts
        reason = admissible(group.min_version, current_version, self.staleness, self.mode)
        if reason is not None:
            self.reject(reason, n)
            return reason
        self.ledger.received += n
        self._add(group, origin, self.next_gid)
        self._record(["admit", self._gid[id(group)], origin, *group_record(group)])
        while len(self._groups) > self.capacity_groups or self.bytes > self.capacity_bytes:
            self._evict_one()
        return None

    def _add(self, group: Group, origin: str, gid: int) -> None:
        self._groups.append(group)
        self._origin[id(group)] = origin
        self._gid[id(group)] = gid
        self.next_gid = max(self.next_gid, gid + 1)
        self._size[id(group)] = size = group_bytes(group)
        self.bytes += size

    def _evict_one(self) -> None:
        """Drop the oldest group of the origin holding the most bytes (the oldest is the
        closest to going stale; the heaviest origin is the one flooding, if any)."""
        load: Counter[str] = Counter()
        for g in self._groups:
            load[self._origin[id(g)]] += self._size[id(g)]
        heaviest = load.most_common(1)[0][0]
        victim = next(g for g in self._groups if self._origin[id(g)] == heaviest)
        self._groups.remove(victim)
        self._dropped(DropReason.OVERLOAD, [victim])
        self._forget(victim)
        self._drop(DropReason.OVERLOAD, victim.num_rollouts)

    def _release(self, group: Group) -> int:
        """Stop tracking a group's origin and size (it left the ledger's care); its size."""
        self._origin.pop(id(group), None)
        self._gid.pop(id(group), None)
        return self._size.pop(id(group), 0)

    def _forget(self, group: Group) -> None:
        """A buffered group leaves: release it and its bytes."""
        self.bytes -= self._release(group)

    def take(
        self, n_groups: int, current_version: int, *, unproven: Callable[[str], bool] = lambda origin: False,
        unproven_share: float = 1.0, unproven_groups: int | None = None, rescue: int = 0,
        clean: Callable[[str], bool] = lambda origin: True,
    ) -> list[Group]:
        """Pop up to `n_groups` admissible groups (up to `rescue` more to keep groups from
        expiring): first the oldest, as many as must go now, then the freshest; stale ones are
        dropped.

        Freshest = newest oldest-token version, then latest arrival: taken oldest first, a
        buffer that holds more than a step needs would make every step train at the full
        staleness S. But a group skipped for fresher ones until it is too old is dropped as
        stale: volunteer work thrown away while it could have been trained. So each update
        first takes the oldest groups that later updates, `n_groups` each, could not all take
        before they expire (earliest deadline first: the groups with at most d updates left,
        this one included, must number at most n_groups·d). A peer's batches begun on the same
        weights arrive together and expire together: when more must go now than `n_groups`,
        the update takes up to `rescue` more rather than drop them (a larger step, averaged
        over more tokens). Async only: in pull mode every group expires with its version.
        """
        self.evict_stale(current_version)
        order, must = self._take_order(n_groups, current_version)
        n_groups = max(n_groups, min(must, n_groups + max(0, rescue)))
        # First pass: at most `share` groups per proven origin and one per unproven origin (none
        # for one that had `unproven_groups` trained already), and `young_slots` of unproven
        # origins together; second: fill up from whatever is left, proven origins' groups first
        # (so a lone peer still fills a step), unproven ones only into a step that has no proven
        # group, and past their `unproven_groups` only while `clean` (no evidence that they
        # chose their slots: the fill is for a run's honest start, not a free ride).
        share = max(1, math.floor(n_groups * self.max_share))
        young_slots = math.floor(n_groups * unproven_share)
        young = {o: unproven(o) for o in {self._origin[id(g)] for g in self._groups}}
        per_origin: Counter[str] = Counter()
        picked: list[int] = []
        taken_young = 0
        for i in order:
            origin = self._origin[id(self._groups[i])]
            cap = share if not young[origin] else 0 if self._spent(origin, unproven_groups) else 1
            if len(picked) < n_groups and per_origin[origin] < cap and (not young[origin] or taken_young < young_slots):
                picked.append(i)
                per_origin[origin] += 1
                taken_young += young[origin]
        chosen = set(picked)
        rest = [i for i in order if i not in chosen]
        rest.sort(key=lambda i: young[self._origin[id(self._groups[i])]])  # stable: proven first, in rank order
        if any(not young[self._origin[id(self._groups[i])]] for i in picked + rest):
            rest = [i for i in rest if not young[self._origin[id(self._groups[i])]]]
        dirty = {o for o, y in young.items() if y and not clean(o)}
        for i in rest:
            if len(picked) >= n_groups:
                break
            origin = self._origin[id(self._groups[i])]
            if origin in dirty and self._spent(origin, unproven_groups, taken=per_origin[origin]):
                continue
            picked.append(i)
            per_origin[origin] += 1
        chosen = set(picked)
        batch = [self._groups[i] for i in picked]
        self._groups = deque(g for i, g in enumerate(self._groups) if i not in chosen)
        for g in batch:
            self.bytes -= self._size[id(g)]  # no longer held here; forgotten when trained
        return batch

    def _spent(self, origin: str, unproven_groups: int | None, *, taken: int = 0) -> bool:
        """Whether an unproven `origin` had its `unproven_groups` trained, counting `taken` more
        of this step (None: no such cap)."""
        return unproven_groups is not None and self.trained_groups[origin] + taken >= unproven_groups

    def _take_order(self, n_groups: int, current_version: int) -> tuple[list[int], int]:
        """The buffered groups' indices in the order `take` prefers them, and how many of the
        first must go now for none to expire (`take`'s rule): those, oldest first, then the
        rest, freshest first."""
        fresh = sorted(range(len(self._groups)), key=lambda i: (self._groups[i].min_version, i), reverse=True)
        if self.mode != "async" or not fresh:
            return fresh, 0
        # Updates left to each group, this one included: 1 for a group this update is the last chance for.
        left = {i: self._groups[i].min_version + self.staleness - current_version + 1 for i in fresh}
        by_deadline = sorted(fresh, key=lambda i: (left[i], -i))
        must = 0
        for count, i in enumerate(by_deadline, start=1):  # `count` groups have at most left[i] updates left
            must = max(must, count - n_groups * (left[i] - 1))
        first = by_deadline[:must]
        chosen = set(first)
        return first + [i for i in fresh if i not in chosen], must

    def count_admissible(self, current_version: int) -> int:
        return sum(
            1
            for g in self._groups
            if admissible(g.min_version, current_version, self.staleness, self.mode) is None
        )

    def evict_stale(self, current_version: int) -> int:
        kept: deque[Group] = deque()
        evicted = 0
        for g in self._groups:
            reason = admissible(g.min_version, current_version, self.staleness, self.mode)
            if reason is None:
                kept.append(g)
            else:
                self._dropped(reason, [g])
                self._forget(g)
                self._drop(reason, g.num_rollouts)
                evicted += 1
        self._groups = kept
        return evicted

    def purge(self, origin: str) -> int:
        """Drop every buffered group from `origin` (its publisher was caught cheating), counted
        as "purged"; returns the rollouts dropped."""
        victims = [g for g in self._groups if self._origin.get(id(g)) == origin]
        self._dropped(DropReason.PURGED, victims)
        for g in victims:
            self._groups.remove(g)
            self._forget(g)
            self._drop(DropReason.PURGED, g.num_rollouts)
        return sum(g.num_rollouts for g in victims)

    def restore(self, groups: list[Group]) -> None:
        """Put back groups taken for a step that did not happen; the next `take` picks them again."""
        for g in reversed(groups):
            self._groups.append(g)
            self.bytes += self._size.get(id(g), 0)

    def mark_trained(self, groups: Iterable[Group]) -> None:
        for g in groups:
            self.ledger.trained += g.num_rollouts
            origin = self._origin.get(id(g))
            if origin is not None:
                self.trained_groups[origin] += 1
                ids = self.trained_ids.get(origin)
                if ids is None:
                    ids = self.trained_ids[origin] = deque(maxlen=TRAINED_IDS_KEPT)
                ids.append(g.group_id)
            self._release(g)

    def mark_failed(self, groups: Iterable[Group], reason: DropReason) -> None:
        """Count taken groups that were not trained as dropped with `reason`: their step failed
        (not put back: a batch that broke a step once would break it again), or their batch had
        no reward variance at all (nothing to learn from)."""
        groups = list(groups)
        self._dropped(reason, groups)
        for g in groups:
            self._release(g)
            self._drop(reason, g.num_rollouts)

    def live(self) -> list[tuple[int, str, Group]]:
        """(gid, origin, group) of every buffered group, oldest first."""
        return [(self._gid[id(g)], self._origin[id(g)], g) for g in self._groups]

    # -- replaying the journal (echo_node/learner/recovery.py) -------------------------------------------

    def replay_admit(self, gid: int, group: Group, origin: str, *, received: bool = True) -> None:
        """A group the journal says entered the buffer (`received`: counted then; a carried
        group was counted in the checkpoint's ledger)."""
        if any(self._gid.get(id(g)) == gid for g in self._groups):
            return
        if received:
            self.ledger.received += group.num_rollouts
        self._add(group, origin, gid)

    def replay_reject(self, reason: str, rollouts: int) -> None:
        self.ledger.received += rollouts
        self._drop(reason, rollouts)

    def take_gids(self, gids: list[int]) -> list[Group] | None:
        """Take exactly these buffered groups, in this order (a journaled step), or None if
        one is not here (the journal lost it)."""
        by_gid = {self._gid[id(g)]: g for g in self._groups}
        if any(gid not in by_gid for gid in gids):
            return None
        batch = [by_gid[gid] for gid in gids]
        chosen = {id(g) for g in batch}
        self._groups = deque(g for g in self._groups if id(g) not in chosen)
        for g in batch:
            self.bytes -= self._size[id(g)]
        return batch

    def replay_drop(self, reason: str, gids: list[int]) -> None:
        wanted = set(gids)
        victims = [g for g in self._groups if self._gid.get(id(g)) in wanted]
        for g in victims:
            self._groups.remove(g)
            self._forget(g)
            self._drop(reason, g.num_rollouts)

    def close(self) -> None:
        """At shutdown, whatever is still buffered was received but never trained on."""
        while self._groups:
            g = self._groups.popleft()
            self._forget(g)
            self._drop(DropReason.UNUSED_AT_EXIT, g.num_rollouts)

    def check(self) -> None:
        total = self.ledger.trained + sum(self.ledger.dropped.values()) + self.buffered_rollouts
        assert total == self.ledger.received, f"ledger broken: {self.ledger} buffered={len(self)}"

    def _drop(self, reason: DropReason | str, rollouts: int) -> None:
        self.ledger.dropped[_key(reason)] += rollouts


def _key(reason: DropReason | str) -> str:
    return reason.value if isinstance(reason, DropReason) else reason
