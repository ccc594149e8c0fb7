"""Per-publisher sequence tracking: duplicates, gaps to repair, bounded memory. Pure.

Job: GossipSub loses messages silently (bursts, 32-message queues, the ~1 MB cliff:
docs/platform.md), so every rollout carries its publisher's sequence number and the learner
asks for the gaps.
`SequenceTracker` answers, per (publisher, seq): is this new, a duplicate, or too old to tell;
and which seqs are missing.

Rules:
- Window: for each publisher we remember which of the last `window` seqs (ending at the highest
  seen) arrived, as a bitmap (window bits per publisher). A seq below that is `TOO_OLD`: we can
  no longer tell whether it is a duplicate, so callers should drop it.
- Floor: the first seq seen from a publisher sets its floor. We never report seqs below the floor
  as missing (a publisher first seen at 57 joined before us or we restarted; 0..56 are not ours
  to ask for). A late arrival below the floor but inside the window is still `NEW`.
- Jumps: a seq more than `window` ahead of the highest seen resets the publisher to that seq as
  a new floor (it restarted with a fresh counter base, or we lost contact for longer than repair
  can cover): nothing from before can be asked for anyway.
- Skips are counted: a publisher owes every seq in order (its prompts are assigned per seq,
  protocol/assignment.py), so a seq it never delivers is one it may have left out to avoid its
  prompts. `skips` counts, per publisher, the seqs given up after repair, those a jump passed
  over and those still owed when they fall out of the window, against the seqs it delivered; a
  given-up seq that arrives after all is taken off. Of those, `disowned` counts the seqs the
  publisher itself said it never published (the caller judges that from the repair answer):
  an honest publisher has none, so they are kept apart and never taken off. A publisher that
  joins again goes on at `resume_at` (this side names it), so its own rejoin excuses nothing.
  One gap is excused after this side restarted (`excuse_next_gap`): the next forward move then
  sets a new floor and costs nothing. `forgive_owed` gives up what is owed
  now at no cost: for this side's restart only (what peers published meanwhile may have left
  their histories, and the restored highest seqs are old), never for a publisher's own word,
  which would let it launder its skips by rejoining.
- `missing` reports seqs in [max(floor, highest - window + 1), highest] not yet seen and not given
  up, oldest first, at most `max_missing` of them. A given-up seq that arrives later is `NEW`.
- At most `max_publishers` are tracked; observing one more evicts the least recently observed.
  An evicted publisher that comes back starts over (its next seq is a new floor).

Memory is O(max_publishers * window / 8) bytes: about 10 MB at the defaults.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.limits import MAX_MISSING_PER_PEER, MAX_SEQ, MAX_TRACKED_PUBLISHERS, SEQ_WINDOW

__all__ = ["Observation", "SequenceTracker"]


class Observation(enum.StrEnum):
    NEW = "new"
    DUPLICATE = "duplicate"
    TOO_OLD = "too_old"


@dataclass(slots=True)
class _Publisher:
    floor: int
    highest: int
    # Bit i describes seq (highest - i), for 0 <= i < window.
    seen: int
    given_up: int
    delivered: int = 1
    skipped: int = 0
    excused: bool = False
    disowned: int = 0


class SequenceTracker:
    """Tracks seen seqs per publisher peer id. Not thread-safe; one per consumer."""

    __slots__ = ("_max_missing", "_max_publishers", "_mask", "_publishers", "_window")

    def __init__(
        self,
        *,
        window: int = SEQ_WINDOW,
        max_missing: int = MAX_MISSING_PER_PEER,
        max_publishers: int = MAX_TRACKED_PUBLISHERS,
    ) -> None:
        if window < 1 or max_missing < 0 or max_publishers < 1:
            raise ValueError("window and max_publishers must be >= 1, max_missing >= 0")
        self._window = window
        self._mask = (1 << window) - 1
        self._max_missing = max_missing
        self._max_publishers = max_publishers
        self._publishers: OrderedDict[str, _Publisher] = OrderedDict()

    def __len__(self) -> int:
        return len(self._publishers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._publishers

    @property
    def capacity(self) -> int:
        """Publishers tracked at most; observing a new one beyond this forgets the least recent."""
        return self._max_publishers

    def observe(self, peer_id: str, seq: int) -> Observation:
        """Record that `seq` from `peer_id` arrived; say whether it is new."""
        if not 0 <= seq <= MAX_SEQ:
            raise ValueError(f"seq must be in [0, {MAX_SEQ}], got {seq}")
        pub = self._publishers.get(peer_id)
        if pub is None:
            self._admit(peer_id, seq)
            return Observation.NEW
        self._publishers.move_to_end(peer_id)
        if seq > pub.highest:
            shift = seq - pub.highest
            excused, pub.excused = pub.excused, False
            pub.delivered += 1
            if not excused:  # seqs still owed that this move pushes out of the window, unasked
                pub.skipped += (self._owed(pub) >> max(0, self._window - shift)).bit_count()
            if shift >= self._window:
                # Beyond the window nothing in between can be tracked or repaired: start over,
                # counting what it passed over unless the gap was excused.
                if not excused:
                    pub.skipped += shift - 1
                pub.floor, pub.highest, pub.seen, pub.given_up = seq, seq, 1, 0
                return Observation.NEW
            pub.highest = seq
            pub.seen = ((pub.seen << shift) | 1) & self._mask
            pub.given_up = (pub.given_up << shift) & self._mask
            if excused:  # nothing between is owed
                pub.floor = seq
            return Observation.NEW
        offset = pub.highest - seq
        if offset >= self._window:
            return Observation.TOO_OLD
        bit = 1 << offset
        if pub.seen & bit:
            return Observation.DUPLICATE
        pub.seen |= bit
        if pub.given_up & bit:
            pub.skipped -= 1
            pub.given_up &= ~bit
        pub.delivered += 1
        return Observation.NEW

    def missing(self, peer_id: str) -> list[int]:
        """Seqs of `peer_id` worth asking for, oldest first, at most `max_missing`."""
        pub = self._publishers.get(peer_id)
        if pub is None:
            return []
        wanted = self._owed(pub)
        out: list[int] = []
        while wanted and len(out) < self._max_missing:
            offset = wanted.bit_length() - 1  # the highest offset is the oldest seq
            out.append(pub.highest - offset)
            wanted ^= 1 << offset
        return out

    def mark_given_up(self, peer_id: str, seqs: Iterable[int], *, disowned: bool = False) -> None:
        """Stop reporting these seqs as missing (repair failed or unavailable); `disowned`: the
        publisher said it never published them."""
        pub = self._publishers.get(peer_id)
        if pub is None:
            return
        for seq in seqs:
            offset = pub.highest - seq
            if 0 <= offset < self._window and seq >= pub.floor:
                bit = (1 << offset) & ~pub.seen & ~pub.given_up
                pub.given_up |= bit
                pub.skipped += bit != 0
                pub.disowned += disowned and bit != 0

    def owed(self, peer_id: str) -> int:
        """How many seqs `peer_id` owes now (missing, not given up; `missing` lists the oldest)."""
        pub = self._publishers.get(peer_id)
        return 0 if pub is None else self._owed(pub).bit_count()

    def disowned(self, peer_id: str) -> int:
        """Seqs `peer_id` said it never published while tracked (module rules); 0 if not tracked."""
        pub = self._publishers.get(peer_id)
        return 0 if pub is None else pub.disowned

    def skips(self, peer_id: str) -> tuple[int, int]:
        """(seqs skipped, seqs delivered) by `peer_id` while tracked (module rules); (0, 0) if
        not tracked."""
        pub = self._publishers.get(peer_id)
        return (0, 0) if pub is None else (pub.skipped, pub.delivered)

    def excuse_next_gap(self, peer_id: str | None = None) -> None:
        """The next forward move of `peer_id` (of every tracked publisher if None) sets a new
        floor and counts no skips."""
        for pid, pub in self._publishers.items():
            if peer_id is None or pid == peer_id:
                pub.excused = True

    def forgive_owed(self) -> None:
        """Give up every seq owed now, counting no skips (module rules: this side's restart)."""
        for pub in self._publishers.values():
            pub.given_up |= self._owed(pub)

    def resume_at(self, peer_id: str) -> int:
        """Where `peer_id`'s seqs go on after it joins again: the one after the highest seen
        from it (0 if not tracked: it numbers from its own base). Named by this side, so a
        rejoin chooses no seq: one chosen by the publisher is judged like any other jump."""
        pub = self._publishers.get(peer_id)
        return 0 if pub is None else min(pub.highest + 1, MAX_SEQ)

    def highest(self, peer_id: str) -> int | None:
        """The highest seq seen from `peer_id`, or None if not tracked."""
        pub = self._publishers.get(peer_id)
        return None if pub is None else pub.highest

    def forget(self, peer_id: str) -> None:
        """Drop all state for `peer_id` (e.g. it was banned)."""
        self._publishers.pop(peer_id, None)

    def snapshot(self) -> list[list[object]]:
        """Every tracked publisher's state, least recently observed first, as JSON-able rows
        [peer_id, floor, highest, seen, given_up, delivered, skipped, disowned] (bitmaps as hex
        strings)."""
        return [[p, s.floor, s.highest, f"{s.seen:x}", f"{s.given_up:x}", s.delivered, s.skipped, s.disowned]
                for p, s in self._publishers.items()]

    def restore(self, rows: Iterable[object]) -> None:
        """Take the state `snapshot` gave (e.g. from a checkpoint); ValueError if a row is not one
        this tracker could have produced. Replaces what was tracked."""
        restored: OrderedDict[str, _Publisher] = OrderedDict()
        for row in rows:
            # Rows of 5 fields come from checkpoints written before skips were counted, of 7
            # from before disowned seqs were.
            if not isinstance(row, (list, tuple)) or len(row) not in (5, 7, 8):
                raise ValueError(f"not a tracker row: {row!r:.80}")
            peer_id, floor, highest, seen, given_up = row[:5]
            delivered, skipped, disowned = (*row[5:], 0)[:3] if len(row) > 5 else (1, 0, 0)
            if not (isinstance(peer_id, str) and isinstance(floor, int) and isinstance(highest, int)
                    and isinstance(seen, str) and isinstance(given_up, str)
                    and isinstance(delivered, int) and isinstance(skipped, int) and isinstance(disowned, int)):
                raise ValueError(f"not a tracker row: {row!r:.80}")
            if (not 0 <= floor <= highest <= MAX_SEQ or not 0 <= skipped <= MAX_SEQ or not 0 <= disowned <= MAX_SEQ
                    or not 0 <= delivered <= MAX_SEQ):
                raise ValueError(f"tracker row for {peer_id}: floor {floor}, highest {highest}, {delivered} delivered, "
                                 f"{skipped} skipped, {disowned} disowned")
            restored[peer_id] = _Publisher(floor, highest, int(seen, 16) & self._mask, int(given_up, 16) & self._mask,
                                           delivered, skipped, disowned=disowned)
            restored.move_to_end(peer_id)
            while len(restored) > self._max_publishers:
                restored.popitem(last=False)
        self._publishers = restored

    def _owed(self, pub: _Publisher) -> int:
        """Bits (offset from the highest) of the seqs at or above the floor neither seen nor given up."""
        span = min(pub.highest - pub.floor + 1, self._window)
        return ~(pub.seen | pub.given_up) & ((1 << span) - 1)

    def _admit(self, peer_id: str, seq: int) -> None:
        if len(self._publishers) >= self._max_publishers:
            self._publishers.popitem(last=False)  # least recently observed
        self._publishers[peer_id] = _Publisher(floor=seq, highest=seq, seen=1, given_up=0)
