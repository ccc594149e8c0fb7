"""Piece bookkeeping for one manifest download: which piece to ask of whom, and when to give up.

Job: the "what to send to whom" half of weight dissemination (rust-libp2p style). A `PieceSwarm`
is told about events (a peer has pieces, a peer left, a piece arrived and did or did not verify)
and polled for actions (`Request`, `Cancel`); it never does I/O and never reads a clock: `now` is
passed in. The I/O layer calls `poll(now)` after every event and again at `next_deadline()`.

Rules (each is a test in tests/unit/test_protocol_pieces.py):
1. Order: "rarest" (default) asks first for the pieces the fewest connected peers have (BitTorrent's
   rarest first), ties broken by a fixed permutation of piece indices: lowest index first, or a
   shuffle when an `rng` is given. Give each peer its own seeded rng so peers that all start from
   the learner ask it for different pieces. "sequential" asks in index order.
2. Source: among peers that have the piece, have a free pipeline slot (< `max_inflight_per_peer`
   requests outstanding to them), are not banned and never sent a bad copy of it, the least loaded
   non-seeder is asked. With `avoid_seeders` (default), a seeder (`peer_has_all`, e.g. the learner)
   is asked for a piece only if no non-seeder that has it is eligible, even a busy one: the
   download then waits for that peer's slot. So the seeder uploads the pieces the swarm does not
   hold yet, and each of those about once; the rest flows between peers (the learner's uplink is
   the bottleneck of a star: docs/platform.md).
3. At most one request per piece is in flight, except in the endgame (`endgame`, default): once
   every missing piece that someone has is in flight, free slots duplicate in-flight pieces, at
   most `ENDGAME_COPIES` requests per piece, never onto a seeder when `avoid_seeders` nor onto a
   peer that stalled on that piece. The first
   copy to arrive wins and the others are cancelled.
4. Timeouts: a request outstanding for `request_timeout` seconds (now >= sent + timeout) is
   cancelled and counted as a stall of its peer (`stalls`); the piece is asked of another holder.
   A peer that stalled on a piece is asked for it again only when no other peer that has it is
   eligible, busy or not.
5. Bad data: `received(..., ok=False)` (the piece failed `manifest.verify_piece`) counts a penalty
   (`penalties`); that peer is never asked for that piece again. At `max_bad_pieces` penalties the
   peer is banned (`banned`): its requests are cancelled and its pieces stop counting.
6. A peer that leaves (`peer_gone`) takes its pieces with it; its in-flight pieces become
   requestable at once (no cancel is emitted: there is no one to send it to).

Serving: the node also relays pieces it has verified (`can_serve`), as soon as it has them.

Cost: `poll` is O(M log M + M * F) for M missing pieces and F peers with free slots; `received`
and the `peer_*` events are O(pieces they touch). Piece counts are bounded by MAX_PIECES.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import MAX_PIECES

__all__ = ["ENDGAME_COPIES", "Action", "Cancel", "PieceSwarm", "Request", "Strategy"]

Strategy: TypeAlias = Literal["rarest", "sequential"]

# Requests per piece in the endgame. Two already hides one slow peer; more multiplies the waste.
ENDGAME_COPIES: Final = 2

_NONE: Final[frozenset[str]] = frozenset()


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """Ask `peer` for piece `index`."""

    peer: str
    index: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel:
    """Abandon the outstanding request for piece `index` to `peer` (timed out, or won elsewhere)."""

    peer: str
    index: int


Action: TypeAlias = Request | Cancel


@dataclass(slots=True)
class _Peer:
    pieces: set[int] | None = field(default_factory=set)  # None: a seeder, has every piece
    inflight: dict[int, float] = field(default_factory=dict)  # index -> time requested

    def holds(self, index: int) -> bool:
        return self.pieces is None or index in self.pieces


class PieceSwarm:
    """Bookkeeping of one download of `num_pieces` pieces from a set of peers (rules: module doc)."""

    def __init__(
        self,
        num_pieces: int,
        *,
        request_timeout: float,
        max_inflight_per_peer: int = 4,
        strategy: Strategy = "rarest",
        avoid_seeders: bool = True,
        max_bad_pieces: int = 3,
        endgame: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        if type(num_pieces) is not int or not 1 <= num_pieces <= MAX_PIECES:
            raise LocalProtocolError(f"num_pieces must be an int in [1, {MAX_PIECES}], got {num_pieces!r}")
        if not request_timeout > 0:
            raise LocalProtocolError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
        if type(max_inflight_per_peer) is not int or max_inflight_per_peer < 1:
            raise LocalProtocolError(f"max_inflight_per_peer must be an int >= 1, got {max_inflight_per_peer!r}")
        if strategy not in ("rarest", "sequential"):
            raise LocalProtocolError(f"strategy must be 'rarest' or 'sequential', got {strategy!r}")
        if type(max_bad_pieces) is not int or max_bad_pieces < 1:
            raise LocalProtocolError(f"max_bad_pieces must be an int >= 1, got {max_bad_pieces!r}")
        self.num_pieces: Final = num_pieces
        self.request_timeout: Final = float(request_timeout)
        self.max_inflight_per_peer: Final = max_inflight_per_peer
        self.strategy: Final = strategy
        self.avoid_seeders: Final = avoid_seeders
        self.max_bad_pieces: Final = max_bad_pieces
        self.endgame: Final = endgame
        self.penalties: dict[str, int] = {}  # bad pieces received, per peer
        self.stalls: dict[str, int] = {}  # requests that timed out, per peer
        self.banned: set[str] = set()
        self._have = bytearray(num_pieces)
        self._missing = num_pieces
        self._peers: dict[str, _Peer] = {}
        self._seeders: set[str] = set()  # connected peers with pieces None
        self._avail = [0] * num_pieces  # connected non-seeders holding each piece (seeders add to all)
        self._inflight: dict[int, dict[str, float]] = {}  # index -> {peer: time requested}
        self._bad_from: dict[int, set[str]] = {}  # index -> peers that sent a bad copy
        self._stalled_from: dict[int, set[str]] = {}  # index -> peers that timed out on it
        self._pending: list[Action] = []  # cancels decided by events, handed out by the next poll
        self._tiebreak = list(range(num_pieces))
        if rng is not None:
            rng.shuffle(self._tiebreak)

    # --- events -------------------------------------------------------------------------------

    def peer_has(self, peer: str, indices: Iterable[int]) -> None:
        """`peer` announced it holds `indices` (RemoteProtocolError for an index out of range)."""
        items = list(indices)
        for i in items:  # validate all before changing anything
            if type(i) is not int or not 0 <= i < self.num_pieces:
                raise RemoteProtocolError(f"{peer} announced piece {i!r} outside [0, {self.num_pieces})")
        if peer in self.banned:
            return
        p = self._peers.setdefault(peer, _Peer())
        if p.pieces is None:
            return  # a seeder already counts as holding everything
        for i in items:
            if i not in p.pieces:
                p.pieces.add(i)
                self._avail[i] += 1

    def peer_has_all(self, peer: str) -> None:
        """`peer` holds every piece (a seeder, such as the learner)."""
        if peer in self.banned:
            return
        p = self._peers.setdefault(peer, _Peer())
        if p.pieces is not None:
            for i in p.pieces:
                self._avail[i] -= 1
            p.pieces = None
            self._seeders.add(peer)

    def peer_gone(self, peer: str, now: float) -> None:
        """`peer` disconnected: forget its pieces; its in-flight pieces are requestable again."""
        del now  # nothing here depends on time; kept so every event has the same shape
        p = self._peers.pop(peer, None)
        if p is not None:
            self._drop_peer(peer, p, cancel=False)

    def received(self, peer: str, index: int, ok: bool, now: float) -> None:
        """`peer` delivered piece `index`; `ok` says whether it passed `verify_piece`.

        A late piece (its request timed out or was cancelled) still counts if it verifies.
        """
        del now
        self._check_index(index)
        self._forget_request(peer, index)
        if not ok:
            self._penalize(peer, index)
        elif not self._have[index]:
            self._got(index)

    def have(self, index: int) -> None:
        """We obtained piece `index` some other way (from disk, another download)."""
        self._check_index(index)
        if not self._have[index]:
            self._got(index)

    # --- actions ------------------------------------------------------------------------------

    def poll(self, now: float) -> list[Action]:
        """What to send now: cancels first (timeouts, endgame losers, bans), then new requests."""
        actions, self._pending = self._pending, []
        self._expire(now, actions)
        if self._missing:
            self._assign(now, actions)
        return actions

    def next_deadline(self) -> float | None:
        """When the earliest in-flight request times out (call `poll` then); None if none is."""
        sent = [t for reqs in self._inflight.values() for t in reqs.values()]
        return min(sent) + self.request_timeout if sent else None

    # --- queries ------------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._missing == 0

    @property
    def missing(self) -> int:
        return self._missing

    @property
    def progress(self) -> float:
        """Fraction of pieces held, in [0, 1]."""
        return 1.0 - self._missing / self.num_pieces

    def can_serve(self, index: object) -> bool:
        """Whether we hold (verified) piece `index` and may relay it; False for any bad index."""
        return type(index) is int and 0 <= index < self.num_pieces and bool(self._have[index])

    def held(self) -> list[int]:
        """Indices of the pieces we hold (what to announce to a newly connected peer)."""
        return [i for i in range(self.num_pieces) if self._have[i]]

    def useful_peers(self) -> list[str]:
        """Connected, unbanned peers holding at least one piece we lack."""
        if not self._missing:
            return []
        return [
            pid for pid, p in self._peers.items() if p.pieces is None or any(not self._have[i] for i in p.pieces)
        ]

    def in_flight(self) -> set[Request]:
        """Every outstanding request."""
        return {Request(peer=pid, index=i) for i, reqs in self._inflight.items() for pid in reqs}

    # --- internals ----------------------------------------------------------------------------

    def _check_index(self, index: int) -> None:
        if type(index) is not int or not 0 <= index < self.num_pieces:
            raise LocalProtocolError(f"piece index {index!r} outside [0, {self.num_pieces})")

    def _forget_request(self, peer: str, index: int) -> None:
        p = self._peers.get(peer)
        if p is not None:
            p.inflight.pop(index, None)
        reqs = self._inflight.get(index)
        if reqs is not None:
            reqs.pop(peer, None)
            if not reqs:
                del self._inflight[index]

    def _got(self, index: int) -> None:
        self._have[index] = 1
        self._missing -= 1
        for pid in self._inflight.pop(index, {}):  # endgame duplicates still out: call them off
            self._peers[pid].inflight.pop(index, None)
            self._pending.append(Cancel(peer=pid, index=index))
        self._bad_from.pop(index, None)
        self._stalled_from.pop(index, None)

    def _penalize(self, peer: str, index: int) -> None:
        self.penalties[peer] = self.penalties.get(peer, 0) + 1
        self._bad_from.setdefault(index, set()).add(peer)
        if self.penalties[peer] >= self.max_bad_pieces and peer not in self.banned:
            self.banned.add(peer)
            p = self._peers.pop(peer, None)
            if p is not None:
                self._drop_peer(peer, p, cancel=True)

    def _drop_peer(self, peer: str, p: _Peer, *, cancel: bool) -> None:
        if p.pieces is not None:
            for i in p.pieces:
                self._avail[i] -= 1
        self._seeders.discard(peer)
        for i in p.inflight:
            reqs = self._inflight[i]
            del reqs[peer]
            if not reqs:
                del self._inflight[i]
            if cancel:
                self._pending.append(Cancel(peer=peer, index=i))

    def _expire(self, now: float, actions: list[Action]) -> None:
        deadline = now - self.request_timeout
        for i, reqs in list(self._inflight.items()):
            for pid, sent in list(reqs.items()):
                if sent <= deadline:
                    del reqs[pid]
                    del self._peers[pid].inflight[i]
                    self.stalls[pid] = self.stalls.get(pid, 0) + 1
                    self._stalled_from.setdefault(i, set()).add(pid)
                    actions.append(Cancel(peer=pid, index=i))
            if not reqs:
                del self._inflight[i]

    def _assign(self, now: float, actions: list[Action]) -> None:
        free = {
            pid: self.max_inflight_per_peer - len(p.inflight)
            for pid, p in self._peers.items()
            if len(p.inflight) < self.max_inflight_per_peer
        }
        if not free:
            return
        wanted = [
            i for i in range(self.num_pieces)
            if not self._have[i] and i not in self._inflight and (self._seeders or self._avail[i])
        ]
        if self.strategy == "rarest":
            wanted.sort(key=lambda i: (self._avail[i], self._tiebreak[i]))
        unassigned = False
        for i in wanted:
            if not free:
                return
            pid = self._source(i, free, _NONE, allow_seeders=True)
            if pid is None:
                unassigned = True
            else:
                self._request(pid, i, now, free, actions)
        if self.endgame and free and not unassigned:
            self._endgame(now, free, actions)

    def _endgame(self, now: float, free: dict[str, int], actions: list[Action]) -> None:
        racing = [i for i, reqs in self._inflight.items() if len(reqs) < ENDGAME_COPIES]
        racing.sort(key=lambda i: (len(self._inflight[i]), self._tiebreak[i]))
        for i in racing:
            if not free:
                return
            # Not onto a peer already fetching it, nor one that stalled on it (it would race itself).
            exclude = self._inflight[i].keys() | self._stalled_from.get(i, _NONE)
            pid = self._source(i, free, exclude, allow_seeders=not self.avoid_seeders)
            if pid is not None:
                self._request(pid, i, now, free, actions)

    def _request(self, pid: str, i: int, now: float, free: dict[str, int], actions: list[Action]) -> None:
        self._peers[pid].inflight[i] = now
        self._inflight.setdefault(i, {})[pid] = now
        actions.append(Request(peer=pid, index=i))
        free[pid] -= 1
        if not free[pid]:
            del free[pid]

    def _tier(self, pid: str, p: _Peer, stalled: set[str] | frozenset[str]) -> int:
        """0: a preferred source; 1: a seeder we would rather spare; 2: stalled on this piece."""
        if pid in stalled:
            return 2
        return 1 if p.pieces is None and self.avoid_seeders else 0

    def _source(self, i: int, free: dict[str, int], exclude: Iterable[str], *, allow_seeders: bool) -> str | None:
        """The free peer to ask for piece i, or None to wait (rule 2 of the module doc)."""
        bad = self._bad_from.get(i, _NONE)
        stalled = self._stalled_from.get(i, _NONE)
        skip = bad | set(exclude) if exclude else bad
        best: str | None = None
        best_key: tuple[int, int, int] | None = None
        for pid in free:
            p = self._peers[pid]
            if pid in skip or not p.holds(i) or (p.pieces is None and not allow_seeders):
                continue
            key = (self._tier(pid, p, stalled), len(p.inflight), self.stalls.get(pid, 0))
            if best_key is None or key < best_key:
                best, best_key = pid, key
        if best_key is None or best_key[0] == 0:
            return best
        # Is a better-tier source merely busy? Then wait for its slot instead.
        return None if self._count_tier_below(i, best_key[0], skip, stalled, allow_seeders) else best

    def _count_tier_below(
        self, i: int, tier: int, skip: set[str] | frozenset[str], stalled: set[str] | frozenset[str], allow_seeders: bool
    ) -> int:
        """How many connected peers, busy or free, could serve piece i at a tier below `tier`.

        Counted from `_avail` minus the few excluded peers, so it costs O(|skip| + |stalled| +
        seeders), not O(peers).
        """
        count = self._avail[i]
        for pid in skip | stalled:
            p = self._peers.get(pid)
            if p is not None and p.pieces is not None and i in p.pieces:
                count -= 1
        usable_seeders = (
            sum(1 for pid in self._seeders if pid not in skip and pid not in stalled) if allow_seeders else 0
        )
        if tier == 1:  # tier 0 only: non-seeders (and seeders, when we do not spare them)
            return count + (0 if self.avoid_seeders else usable_seeders)
        return count + usable_seeders
