"""Who links to whom on the data channel: a bounded-degree overlay chosen by the learner. Pure:
no I/O, no clock (`now` is passed in), randomness from the caller's seeded `random.Random`: the
same seed and events give the same links in every process (a draw from a set is made from its
sorted members, never in the set's order, which varies with the process's string hashing).

Job: keep O(N·k) data links for N peers instead of N²/2, so that a swarm of thousands is a set of
small neighbourhoods, and keep those neighbourhoods out of any single party's hands. The learner
owns one `Overlay` per run; it tells each peer its neighbours (the `peers` frame) and which peers
it serves itself (`source_links`).

Rules (each is a test in tests/unit/test_protocol_overlay.py or
tests/adversarial/test_overlay_sybils.py):
1. Degree: every peer aims at `degree` links (k, `DEGREE_RANGE`); a swarm of at most k + 1
   peers is a full mesh. No peer ever holds more than `max_degree` links.
2. The learner picks, the newcomer does not: a newcomer's neighbours are drawn at random by the
   learner. Half of the draws (rounded up) come from settled members (joined at least
   `settle_s` before), the rest from every member. So identities created in a burst just before
   a victim joins (Sybils) fill at most the unsettled half, and in the settled half they count
   only with the share of settled members they already had: surrounding a chosen newcomer is
   not a choice anybody but the learner makes.
3. Room: a drawn member with fewer than k links takes the newcomer as is. One that is full gives
   up one of its links (m, x) to make two: (m, newcomer) and (x, newcomer) ("edge split"), so
   degrees stay at k and nobody's count grows. A full member is linked on top only when no split
   is possible, and never beyond `max_degree`.
4. Reachability: two peers nobody can dial (behind a NAT; `reachable=False`) are never linked;
   an unreachable peer links only to reachable ones, which it dials.
5. Healing: a peer that leaves takes its links; each former neighbour is refilled at once by the
   same draws (its other former neighbours first: they lost a link too).
6. Rotation: `rotate(swaps)` rewires random pairs of links (a-b, c-d become a-c, b-d): every
   degree stays, so no bad neighbourhood persists and nobody's count moves. The learner calls it
   slowly (a few % of the links per version).
7. The learner's own links: at most `source_degree` peers receive pieces from the learner
   (`source_links`), drawn like a newcomer's neighbours (rule 2) and rotated by
   `rotate_source`: which peers the learner feeds is its choice, never a claim of the peers.

Cost: `join` and `leave` are O(k²) expected (random draws from an indexed list), `rotate` O(1)
per swap, whatever N.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from protocol.errors import LocalProtocolError

__all__ = ["DEFAULT_DEGREE", "DEGREE_RANGE", "Change", "Overlay"]

DEFAULT_DEGREE: Final = 16
# The degrees the configuration accepts: below 12 a random graph leaves some peers with a poor
# neighbourhood after churn (k = 4 cost 22 % of the bound in a piece-level model); above 24 the
# per-link state and the have-traffic grow for no gain.
DEGREE_RANGE: Final = (12, 24)
# Draws per link wanted before a peer is left short (every candidate may already be linked).
_DRAWS_PER_LINK: Final = 8


@dataclass(slots=True)
class Change:
    """Links opened and closed by one event, each as a sorted (a, b) pair."""

    added: set[tuple[str, str]] = field(default_factory=set)
    removed: set[tuple[str, str]] = field(default_factory=set)

    def merge(self, other: Change) -> None:
        for edge in other.added:
            self.add(edge)
        for edge in other.removed:
            self.remove(edge)

    def add(self, edge: tuple[str, str]) -> None:
        if edge in self.removed:
            self.removed.discard(edge)
        else:
            self.added.add(edge)

    def remove(self, edge: tuple[str, str]) -> None:
        if edge in self.added:
            self.added.discard(edge)
        else:
            self.removed.add(edge)


def _edge(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


class _Pool:
    """A set with O(1) add, remove and uniform draw."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[str] = []
        self.pos: dict[str, int] = {}

    def add(self, item: str) -> None:
        if item not in self.pos:
            self.pos[item] = len(self.items)
            self.items.append(item)

    def discard(self, item: str) -> None:
        i = self.pos.pop(item, None)
        if i is None:
            return
        last = self.items.pop()
        if last != item:
            self.items[i] = last
            self.pos[last] = i

    def draw(self, rng: random.Random) -> str | None:
        return self.items[rng.randrange(len(self.items))] if self.items else None

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item: object) -> bool:
        return item in self.pos


@dataclass(slots=True)
class _Member:
    joined: float
    reachable: bool
    links: set[str] = field(default_factory=set)


class Overlay:
    """The run's data-link graph (rules: module doc)."""

    def __init__(
        self,
        rng: random.Random,
        *,
        degree: int = DEFAULT_DEGREE,
        max_degree: int | None = None,
        source_degree: int = 32,
        settle_s: float = 60.0,
    ) -> None:
        max_degree = degree + degree // 2 if max_degree is None else max_degree
        if type(degree) is not int or degree < 2:
            raise LocalProtocolError(f"degree must be an int >= 2, got {degree!r}")
        if type(max_degree) is not int or max_degree < degree:
            raise LocalProtocolError(f"max_degree must be an int >= degree ({degree}), got {max_degree!r}")
        if type(source_degree) is not int or source_degree < 1:
            raise LocalProtocolError(f"source_degree must be an int >= 1, got {source_degree!r}")
        if not settle_s >= 0:
            raise LocalProtocolError(f"settle_s must be >= 0, got {settle_s!r}")
        self.rng = rng
        self.degree: Final = degree
        self.max_degree: Final = max_degree
        self.source_degree: Final = source_degree
        self.settle_s: Final = float(settle_s)
        self._members: dict[str, _Member] = {}
        self._all = _Pool()
        self._reachable = _Pool()
        self._settled = _Pool()  # members joined at least settle_s ago
        self._settled_reachable = _Pool()
        self._unsettled: list[tuple[float, str]] = []  # (joined, peer) in join order
        self._source = _Pool()

    # --- queries ----------------------------------------------------------------------------

    def __contains__(self, peer: object) -> bool:
        return peer in self._members

    def __len__(self) -> int:
        return len(self._members)

    def neighbours(self, peer: str) -> frozenset[str]:
        m = self._members.get(peer)
        return frozenset(m.links) if m is not None else frozenset()

    def members(self) -> list[str]:
        """Every member, in join order."""
        return list(self._members)

    def is_reachable(self, peer: str) -> bool | None:
        """Whether `peer` joined as dialable (None: not a member)."""
        m = self._members.get(peer)
        return None if m is None else m.reachable

    def links(self) -> set[tuple[str, str]]:
        return {_edge(a, b) for a, m in self._members.items() for b in m.links}

    def source_links(self) -> frozenset[str]:
        return frozenset(self._source.items)

    # --- events -----------------------------------------------------------------------------

    def join(self, peer: str, *, reachable: bool, now: float) -> Change:
        """`peer` joins: its neighbours are drawn (rules 2-4); it may also become one of the
        learner's own links (rule 7)."""
        if peer in self._members:
            raise LocalProtocolError(f"{peer} is in the overlay already")
        self._settle(now)
        self._members[peer] = _Member(joined=now, reachable=reachable)
        self._all.add(peer)
        if reachable:
            self._reachable.add(peer)
        if self.settle_s > 0:
            self._unsettled.append((now, peer))
        else:
            self._settle_one(peer)
        change = Change()
        self._fill(peer, change, first=())
        if len(self._source) < self.source_degree:
            self._source.add(peer)
        return change

    def leave(self, peer: str, *, now: float) -> Change:
        """`peer` left: its links close and its former neighbours are refilled (rule 5)."""
        m = self._members.pop(peer, None)
        change = Change()
        if m is None:
            return change
        self._settle(now)
        for pool in (self._all, self._reachable, self._settled, self._settled_reachable, self._source):
            pool.discard(peer)
        self._unsettled = [(t, p) for t, p in self._unsettled if p != peer]
        orphans = sorted(m.links)
        for other in orphans:
            self._members[other].links.discard(peer)
            change.remove(_edge(peer, other))
        self.rng.shuffle(orphans)
        for other in orphans:
            self._fill(other, change, first=orphans)
        self._refill_source()
        return change

    def rotate(self, swaps: int, *, now: float) -> Change:
        """Rewire up to `swaps` random pairs of links, every degree kept (rule 6)."""
        self._settle(now)
        change = Change()
        pool, rng, members = self._all, self.rng, self._members
        for _ in range(swaps):
            a, c = pool.draw(rng), pool.draw(rng)
            if a is None or c is None or a == c:
                continue
            ma, mc = members[a], members[c]
            if not ma.links or not mc.links or c in ma.links:
                continue
            b = rng.choice(sorted(ma.links))
            d = rng.choice(sorted(mc.links))
            if len({a, b, c, d}) < 4 or d in members[b].links:
                continue
            if not (self._may_link(a, c) and self._may_link(b, d)):
                continue
            self._unlink(a, b, change)
            self._unlink(c, d, change)
            self._link(a, c, change)
            self._link(b, d, change)
        return change

    def rotate_source(self, count: int) -> tuple[set[str], set[str]]:
        """Replace up to `count` of the learner's own links by members it does not serve yet
        (rule 7); returns (added, removed)."""
        added: set[str] = set()
        removed: set[str] = set()
        if len(self._all) <= len(self._source):
            return added, removed
        for _ in range(count):
            out = self._source.draw(self.rng)
            new = self._draw_member(settled=True, exclude=self._source)
            if out is None or new is None:
                break
            self._source.discard(out)
            self._source.add(new)
            added.add(new)
            removed.add(out)
        return added - removed, removed - added

    # --- internals --------------------------------------------------------------------------

    def _settle(self, now: float) -> None:
        cut = now - self.settle_s
        done = 0
        for joined, peer in self._unsettled:
            if joined > cut:
                break
            done += 1
            if peer in self._members:
                self._settle_one(peer)
        if done:
            del self._unsettled[:done]

    def _settle_one(self, peer: str) -> None:
        self._settled.add(peer)
        if self._members[peer].reachable:
            self._settled_reachable.add(peer)

    def _may_link(self, a: str, b: str) -> bool:
        return a != b and (self._members[a].reachable or self._members[b].reachable)

    def _link(self, a: str, b: str, change: Change) -> None:
        self._members[a].links.add(b)
        self._members[b].links.add(a)
        change.add(_edge(a, b))

    def _unlink(self, a: str, b: str, change: Change) -> None:
        self._members[a].links.discard(b)
        self._members[b].links.discard(a)
        change.remove(_edge(a, b))

    def _draw_member(self, *, settled: bool, exclude: Iterable[str] | _Pool, reachable_only: bool = False) -> str | None:
        if settled:
            pool = self._settled_reachable if reachable_only else self._settled
        else:
            pool = self._reachable if reachable_only else self._all
        for _ in range(_DRAWS_PER_LINK):
            peer = pool.draw(self.rng)
            if peer is None:
                return None
            if peer not in exclude:
                return peer
        return None

    def _fill(self, peer: str, change: Change, *, first: Iterable[str]) -> None:
        """Draw links for `peer` until it holds `degree` (rules 2-4)."""
        me = self._members[peer]
        k = self.degree
        for former in first:  # former neighbours of a peer that left: they lost a link too
            if len(me.links) >= k:
                return
            if former != peer and former not in me.links and self._may_link(peer, former) and len(self._members[former].links) < k:
                self._link(peer, former, change)
        n = len(self._members)
        if n - 1 <= k:  # a small swarm: a full mesh (rule 1)
            for member in list(self._members):
                if member != peer and member not in me.links and self._may_link(peer, member) \
                        and len(self._members[member].links) < self.max_degree:
                    self._link(peer, member, change)
            return
        draws = picks = 0
        limit = _DRAWS_PER_LINK * k
        # Rule 2: the first picks are settled members. A split (rule 3) brings two links per
        # pick, so counting picks rather than links keeps the settled ones at least half.
        settled_quota = (k + 1) // 2
        while len(me.links) < k and draws < limit:
            draws += 1
            settled = picks < settled_quota
            other = self._draw_member(settled=settled, exclude=me.links, reachable_only=not me.reachable)
            if other is None and settled and draws > settled_quota * 2:
                other = self._draw_member(settled=False, exclude=me.links, reachable_only=not me.reachable)
            if other is None or other == peer:
                continue
            picks += 1
            them = self._members[other]
            if len(them.links) < k:
                self._link(peer, other, change)
                continue
            if len(me.links) <= k - 2:
                x = self._split_partner(peer, other)
                if x is not None:  # rule 3: (other, x) becomes (other, peer) and (x, peer)
                    self._unlink(other, x, change)
                    self._link(peer, other, change)
                    self._link(peer, x, change)
                    continue
            if len(them.links) < self.max_degree and draws > limit // 2:
                self._link(peer, other, change)

    def _split_partner(self, peer: str, other: str) -> str | None:
        me = self._members[peer]
        candidates = [x for x in sorted(self._members[other].links) if x != peer and x not in me.links and self._may_link(peer, x)]
        return self.rng.choice(candidates) if candidates else None

    def _refill_source(self) -> None:
        while len(self._source) < min(self.source_degree, len(self._all)):
            new = self._draw_member(settled=False, exclude=self._source)
            if new is None:
                missing = [p for p in self._all.items if p not in self._source]
                if not missing:
                    return
                new = self.rng.choice(missing)
            self._source.add(new)
