"""Piece exchange on a bounded-degree overlay: a receiver's requests to its neighbours
(`Exchange`) and the learner's sends to the peers it serves (`SeedPlan`). Pure: no I/O, no
clock; randomness from the caller's seeded `random.Random`. Each peer links to the k neighbours
the learner chose (protocol/weights/overlay.py), announces every piece it verified to them
(`have`), and asks them for what it lacks; the learner pushes pieces to its own bounded set.

Receiver rules (`Exchange`; tests in tests/unit/test_protocol_exchange.py):
1. Announcements: `has(peer, index)` records that a neighbour holds a piece we lack;
   `availability` of a piece we lack is the number of neighbours that announced it. An
   announcement of a piece we hold is not recorded: no rule reads who else holds it, and most
   announcements a peer hears are of pieces it already holds (each piece is announced to all k
   neighbours), so this is most of the cost of a version at scale. Our own announcements leave
   when `have_due` says: a piece from the learner at once (at most one frame per
   HAVE_SEED_GAP_S), any other within HAVE_BATCH_S, with whatever else arrived meanwhile.
2. Order: the first `random_first` pieces are asked at random among what a neighbour offers
   (so neighbours that start together hold different pieces to trade); after that, rarest
   first, approximated cheaply: of `sample` random candidates the neighbour offers, the one the
   fewest neighbours announced. (An exact rarest-first over M pieces costs O(M) per request,
   O(M²) per version and peer; sampling costs O(sample).)
3. Pipelining: one request per piece, except in the endgame. Without a `horizon`, `pipeline`
   requests outstanding per neighbour. With one, a neighbour's depth is sized by its measured
   rate: 1 + floor(horizon / t), t the time its answers take (an average over its last pieces,
   each timed from its request or the previous answer, whichever is later), at most
   `pipeline`. One request keeps a link busy when pieces take longer than a round trip; more
   than that only wait in the neighbour's queue, and every piece waiting there is one nobody
   else may send us, the learner included (measured: benchmarks/results/mesh-live-issue27).
   A neighbour starts at depth 1, or at the depth its answers' time in an earlier version gives
   (`neighbour_up(took=)`: the caller keeps it across versions), so a version does not start
   with a one-piece probe of every link.
4. Endgame: once every piece we lack is requested and at most `endgame_pieces` are missing, a
   neighbour with a free slot is asked for a piece already in flight elsewhere that it holds, at
   most `ENDGAME_COPIES` requests per piece; the first copy wins. (From the moment all are
   requested, with k neighbours x `pipeline` requests out, a tenth of all uploads were copies.)
5. A neighbour that leaves takes its announcements; its outstanding requests are free to ask
   elsewhere at once. A request outstanding for `request_timeout` is given up (`expire`) and the
   piece asked elsewhere: a neighbour that trickles or never answers stops holding pieces back.
   A piece that fails its hash check (`received(ok=False)`) counts against its sender; at
   `max_bad_pieces` it is dropped as a neighbour (`banned`) and its announcements forgotten, so
   advertising pieces it lacks costs it the link.

Learner rules (`SeedPlan`):
6. One piece in flight per served peer (download headroom: a link that still carries our last
   piece is not sent another), sent as soon as the previous one left, so the learner's uplink
   carries as many copies as it can.
7. Whom: among the idle served peers, the one holding the fewest pieces as far as the learner
   knows (the larger of what it announced and what the learner sent it); a peer that already
   took more than its fair share of what the learner sent (`fair_slack` pieces above the mean
   over served peers) goes after every other. A peer claiming to hold nothing therefore draws
   no more than its share of the learner's uplink.
8. What: the piece the learner sent fewest times among those that peer lacks (rarest first
   from the source's point of view); on symmetric links that is one copy of every piece first.
   Each piece at most once per peer, whatever it claims.
9. The served set: at most `width` peers at a time, the overlay's `source_links` first; one
   that holds every piece is replaced at once by a random linked peer that still lacks some,
   so the learner's uplink never idles while someone still needs a piece.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Final

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import MAX_PIECES
from protocol.weights.datachannel import mask_indices

__all__ = ["ENDGAME_COPIES", "HAVE_BATCH_S", "HAVE_SEED_GAP_S", "Exchange", "SeedPlan", "bits_of", "have_due"]

ENDGAME_COPIES: Final = 2
# A receiver announces the pieces it verified in one `have` per this many seconds, to every
# neighbour and the learner (one frame per batch instead of one per piece and neighbour); the
# live receiver and the simulator both use it (`have_due`).
HAVE_BATCH_S: Final = 0.05
# ... except a piece from the learner, announced at once but at most one `have` per this long.
HAVE_SEED_GAP_S: Final = 0.02
# Rule 3: the weight of a neighbour's newest answer in the average of what its answers take.
TIMING_WEIGHT: Final = 0.25


def have_due(verified_at: float, last_have_at: float, *, from_learner: bool) -> float:
    """When the `have` naming a piece verified at `verified_at` leaves (receiver rule 1), the
    previous one having left at `last_have_at`. A piece from the learner is, at that moment, held
    by nobody else in the swarm: while the learner's uplink is the bottleneck these are the
    scarce pieces, and every hop of the version's last ones waits for its announcement, so it
    leaves at once, no sooner than HAVE_SEED_GAP_S after the last (a peer fed at its downlink's
    rate still sends at most 1 / HAVE_SEED_GAP_S frames a second to each neighbour). Any other
    piece waits up to HAVE_BATCH_S for others to share its frame."""
    if from_learner:
        return max(verified_at, last_have_at + HAVE_SEED_GAP_S)
    return verified_at + HAVE_BATCH_S


def _check_pieces(num_pieces: int) -> None:
    if type(num_pieces) is not int or not 1 <= num_pieces <= MAX_PIECES:
        raise LocalProtocolError(f"num_pieces must be an int in [1, {MAX_PIECES}], got {num_pieces!r}")


def bits_of(indices: Iterable[int], num_pieces: int) -> int:
    """Piece indices as a bit mask (bit i: piece i); one outside [0, num_pieces) is a protocol
    violation (RemoteProtocolError), checked before any shift (1 << 2**40 is a MemoryError)."""
    bits = 0
    for index in indices:
        _check_index(index, num_pieces)
        bits |= 1 << index
    return bits


def _check_index(index: int, num_pieces: int) -> None:
    """A piece index a peer named: an int in [0, num_pieces), or a protocol violation."""
    if type(index) is not int or not 0 <= index < num_pieces:
        raise RemoteProtocolError(f"piece index must be an int in [0, {num_pieces}), got {index!r}")


class _Neighbour:
    __slots__ = ("bits", "depth", "inflight", "last", "took")

    def __init__(self, depth: int) -> None:
        self.bits = 0  # pieces it announced that we lacked when it did (bit i: piece i)
        self.inflight: dict[int, float] = {}  # index -> when asked
        self.depth = depth  # requests it may have outstanding (rule 3)
        self.last = -math.inf  # when its last answer arrived
        self.took: float | None = None  # what an answer takes, averaged (rule 3)


class Exchange:
    """One receiver's requests for one version (rules 1-5).

    Sets of pieces are bit masks (Python ints, bit i for piece i): an announcement of a batch
    costs a few word operations over M bits whatever it holds, and the candidates a neighbour
    offers are `its bits & ~(held | requested)` at the moment of asking, never a list to keep
    in step."""

    def __init__(
        self,
        num_pieces: int,
        rng: random.Random,
        *,
        pipeline: int = 2,
        horizon: float | None = None,
        random_first: int = 4,
        sample: int = 4,
        request_timeout: float = 5.0,
        max_bad_pieces: int = 3,
        endgame_pieces: int = 4,
    ) -> None:
        _check_pieces(num_pieces)
        if type(pipeline) is not int or pipeline < 1 or type(sample) is not int or sample < 1:
            raise LocalProtocolError(f"pipeline and sample must be ints >= 1, got {pipeline!r}, {sample!r}")
        if horizon is not None and not horizon > 0:
            raise LocalProtocolError(f"horizon must be > 0 or None, got {horizon!r}")
        if not request_timeout > 0:
            raise LocalProtocolError(f"request_timeout must be > 0, got {request_timeout!r}")
        self.num_pieces: Final = num_pieces
        self.rng = rng
        self.pipeline: Final = pipeline
        self.horizon: Final = horizon
        self.random_first: Final = random_first
        self.sample: Final = sample
        self.request_timeout: Final = float(request_timeout)
        self.max_bad_pieces: Final = max_bad_pieces
        self.endgame_pieces: Final = endgame_pieces
        self._bits_limit = 1 << num_pieces
        self.have = bytearray(num_pieces)
        self.have_bits = 0
        self.count = 0
        self.availability = [0] * num_pieces
        self.requested = [0] * num_pieces  # outstanding requests per piece
        self.requested_bits = 0  # pieces with at least one request out
        self.outstanding = 0  # pieces we lack with at least one request out
        self.penalties: dict[str, int] = {}
        self.stalls: dict[str, int] = {}
        self.banned: set[str] = set()
        self.wasted = 0  # copies that arrived after another had won (endgame, late answers)
        self._n: dict[str, _Neighbour] = {}
        self._asked: dict[int, list[str]] = {}  # piece -> neighbours asked for it, not answered
        self._cancels: list[tuple[str, int]] = []

    # --- events -----------------------------------------------------------------------------

    def neighbour_up(self, peer: str, *, took: float | None = None) -> None:
        """A link to `peer` is up; `took`: what its answers took in an earlier version (rule 3:
        its first depth follows from it instead of a one-piece probe)."""
        if peer not in self.banned and peer not in self._n:
            nb = self._n[peer] = _Neighbour(1 if self.horizon is not None else self.pipeline)
            if took is not None and self.horizon is not None and math.isfinite(took):
                self._timed(nb, took)

    def timing(self, peer: str) -> float | None:
        """What `peer`'s answers take, averaged (rule 3); None before its first one."""
        nb = self._n.get(peer)
        return None if nb is None else nb.took

    def neighbour_gone(self, peer: str) -> None:
        nb = self._n.pop(peer, None)
        if nb is None:
            return
        avail, bits = self.availability, nb.bits
        while bits:
            i = bits.bit_length() - 1
            avail[i] -= 1
            bits ^= 1 << i
        for i in nb.inflight:
            self._unrequest(peer, i)

    def has(self, peer: str, index: int) -> bool:
        """`peer` announced `index`; True if it is worth asking it now (we lack the piece)."""
        _check_index(index, self.num_pieces)
        return self.has_bits(peer, 1 << index)

    def has_many(self, peer: str, indices: Iterable[int]) -> bool:
        """`peer` announced several pieces at once (one `have` frame); True if it is worth
        asking it now."""
        return self.has_bits(peer, bits_of(indices, self.num_pieces))

    def has_bits(self, peer: str, bits: int) -> bool:
        """`peer` announced the pieces of the mask `bits`; True if it is worth asking it now.
        A piece beyond the version is a protocol violation (RemoteProtocolError)."""
        if type(bits) is not int or not 0 <= bits < self._bits_limit:
            raise RemoteProtocolError(f"an announcement names a piece outside [0, {self.num_pieces})")
        nb = self._n.get(peer)
        if nb is None:
            return False
        new = bits & ~(self.have_bits | nb.bits)
        if not new:
            return False
        nb.bits |= new
        avail = self.availability
        # Highest bit first: each step clears the top bit, so the mask shortens as it goes.
        while new:
            i = new.bit_length() - 1
            avail[i] += 1
            new ^= 1 << i
        return len(nb.inflight) < nb.depth

    def depth(self, peer: str) -> int:
        """The requests `peer` may have outstanding now (rule 3); 0 if it is no neighbour."""
        nb = self._n.get(peer)
        return nb.depth if nb is not None else 0

    def received(self, peer: str, index: int, *, ok: bool = True, now: float | None = None) -> bool:
        """A piece from `peer` arrived and was checked; True if it is new to us. The other
        requests for it still out become cancels (`take_cancels`). `now` times the answer for
        rule 3's depth (only a good answer to a request still outstanding is timed: a bad piece
        must not buy its sender a deeper pipeline)."""
        if type(index) is not int or not 0 <= index < self.num_pieces:
            _check_index(index, self.num_pieces)  # raises
        nb = self._n.get(peer)
        if nb is not None and (asked_at := nb.inflight.pop(index, None)) is not None:
            if ok and now is not None and self.horizon is not None:
                self._timed(nb, now - max(asked_at, nb.last))
                nb.last = now
            asked = self._asked[index]  # `peer` is among them (asked with it, dropped with it)
            if ok and len(asked) == 1 and not self.have[index]:
                # The common case, the one request out for a piece we lack: what `_unrequest`
                # and the rest of this method would do, in one pass.
                del self._asked[index]
                self.requested[index] = 0
                bit = 1 << index
                self.requested_bits &= ~bit
                self.outstanding -= 1
                self.have[index] = 1
                self.have_bits |= bit
                self.count += 1
                return True
            self._unrequest(peer, index)
        if not ok:
            self.penalties[peer] = self.penalties.get(peer, 0) + 1
            if self.penalties[peer] >= self.max_bad_pieces:
                self.banned.add(peer)
                self.neighbour_gone(peer)
            return False
        if self.have[index]:
            self.wasted += 1
            return False
        self.have[index] = 1
        self.have_bits |= 1 << index
        self.count += 1
        for other in self._asked.pop(index, ()):
            self._n[other].inflight.pop(index, None)
            self._cancels.append((other, index))
        if self.requested[index]:
            self.requested[index] = 0
            self.requested_bits &= ~(1 << index)
            self.outstanding -= 1
        return True

    def take_cancels(self) -> list[tuple[str, int]]:
        """(neighbour, piece) requests to call off: the piece came from elsewhere first."""
        out, self._cancels = self._cancels, []
        return out

    def expire(self, now: float) -> list[tuple[str, int]]:
        """Give up requests outstanding for `request_timeout` (rule 5); what was given up."""
        cut = now - self.request_timeout
        out: list[tuple[str, int]] = []
        for peer, nb in self._n.items():
            for i, sent in list(nb.inflight.items()):
                if sent <= cut:
                    del nb.inflight[i]
                    self._unrequest(peer, i)
                    self.stalls[peer] = self.stalls.get(peer, 0) + 1
                    out.append((peer, i))
        return out

    # --- decisions --------------------------------------------------------------------------

    def requests(self, peer: str, now: float) -> list[int]:
        """The pieces to ask `peer` for now (fill its pipeline: rules 2-4)."""
        nb = self._n.get(peer)
        if nb is None:
            return []
        out: list[int] = []
        inflight, requested, asked = nb.inflight, self.requested, self._asked
        while len(inflight) < nb.depth:
            index = self._pick(nb.bits & ~(self.have_bits | self.requested_bits))
            if index is None:
                index = self._endgame(nb)
                if index is None:
                    break
            inflight[index] = now
            if requested[index]:
                asked[index].append(peer)
            else:
                self.outstanding += 1
                self.requested_bits |= 1 << index
                asked[index] = [peer]
            requested[index] += 1
            out.append(index)
        return out

    def next_deadline(self) -> float | None:
        sent = [t for nb in self._n.values() for t in nb.inflight.values()]
        return min(sent) + self.request_timeout if sent else None

    @property
    def complete(self) -> bool:
        return self.count == self.num_pieces

    def neighbours(self) -> list[str]:
        return list(self._n)

    def unoffered(self) -> int:
        """The pieces we lack that no neighbour announced and nobody is asked for (a mask): what
        only the source can still give (a holder left before it announced, a piece was lost)."""
        offered = self.have_bits | self.requested_bits
        for nb in self._n.values():
            offered |= nb.bits
        return (self._bits_limit - 1) & ~offered

    # --- internals --------------------------------------------------------------------------

    def _timed(self, nb: _Neighbour, took: float) -> None:
        took = max(took, 0.0)
        nb.took = took if nb.took is None else nb.took + TIMING_WEIGHT * (took - nb.took)
        assert self.horizon is not None
        depth = self.pipeline if nb.took <= 0 else 1 + int(self.horizon / nb.took)
        nb.depth = max(1, min(self.pipeline, depth))

    def _unrequest(self, peer: str, index: int) -> None:
        asked = self._asked.get(index)
        if asked is not None:
            asked.remove(peer)
            if not asked:
                del self._asked[index]
        self.requested[index] -= 1
        if not self.requested[index]:
            # Asked no more: the neighbours that hold it offer it again (their bits), unless it
            # just arrived (`have_bits`).
            self.requested_bits &= ~(1 << index)
            if not self.have[index]:
                self.outstanding -= 1

    def _pick(self, cand: int) -> int | None:
        """Rule 2 over the candidates `cand` (a neighbour's bits & ~(held | requested)): each
        draw takes the first candidate at or after a uniform position (wrapping), so a candidate
        after a long run of non-candidates is the likelier; the k-th set bit of a mask has no
        cheap exact draw."""
        if not cand:
            return None
        if not cand & (cand - 1):
            return cand.bit_length() - 1  # one candidate
        m, draw, avail = self.num_pieces, self.rng.random, self.availability
        tries = 1 if self.count < self.random_first else self.sample
        best = -1
        best_avail = 1 << 30
        for _ in range(tries):
            at = int(draw() * m)
            above = cand >> at
            if above:
                index = at + (above & -above).bit_length() - 1
            else:
                index = (cand & -cand).bit_length() - 1
            a = avail[index]
            if a < best_avail:
                best, best_avail = index, a
        return best

    def _endgame(self, nb: _Neighbour) -> int | None:
        if self.count + self.outstanding < self.num_pieces or self.num_pieces - self.count > self.endgame_pieces:
            return None  # some piece we lack is not asked yet, or many are missing: not the endgame (rule 4)
        requested = self.requested
        for index in mask_indices(self.requested_bits & nb.bits & ~self.have_bits):
            if requested[index] < ENDGAME_COPIES and index not in nb.inflight:
                return index
        return None


class SeedPlan:
    """The learner's sends for one version (rules 6-9).

    Sets of pieces are bit masks over the pieces' positions in one random order drawn at the
    start (`_order`): rarest first is then the lowest set bit of `bucket & ~known`, a few word
    operations, and ties go the same random way for every peer."""

    def __init__(self, num_pieces: int, rng: random.Random, *, width: int = 32, fair_slack: int = 8) -> None:
        _check_pieces(num_pieces)
        if type(width) is not int or width < 1:
            raise LocalProtocolError(f"width must be an int >= 1, got {width!r}")
        self.num_pieces: Final = num_pieces
        self.rng = rng
        self.width: Final = width
        self.fair_slack: Final = fair_slack
        order = list(range(num_pieces))
        rng.shuffle(order)
        self._order = order  # position -> piece
        self._pos = [0] * num_pieces  # piece -> position
        for pos, index in enumerate(order):
            self._pos[index] = pos
        # Pieces by how many times the learner sent them: bucket c has the positions of the
        # pieces sent c times.
        self._buckets: list[int] = [(1 << num_pieces) - 1]
        self._copies = [0] * num_pieces
        self._known: dict[str, int] = {}  # linked peer -> positions sent to it or announced
        self._known_count: dict[str, int] = {}
        self._sent_count: dict[str, int] = {}
        self._active: dict[str, None] = {}  # the peers served now (rule 9), in order
        self._waiting: list[str] = []  # linked, not served, not complete (lazily pruned)
        self._busy: set[str] = set()
        self.total_sent = 0

    # --- events -----------------------------------------------------------------------------

    def link(self, peer: str, *, preferred: bool = False) -> None:
        """`peer` linked to the learner for this version; `preferred` ones are served first
        (the overlay's rotating `source_links`)."""
        if peer in self._known:
            return
        self._known[peer] = 0
        self._known_count[peer] = 0
        self._sent_count[peer] = 0
        if preferred and len(self._active) < self.width:
            self._active[peer] = None
        else:
            self._waiting.append(peer)
            self._top_up()

    def drop(self, peer: str) -> None:
        for table in (self._known, self._known_count, self._sent_count):
            table.pop(peer, None)
        self._busy.discard(peer)
        if self._active.pop(peer, 0) is None:
            self._top_up()

    def has(self, peer: str, index: int) -> None:
        """`peer` holds `index` (it announced it, or the learner sent it); a piece beyond the
        version is a protocol violation (RemoteProtocolError)."""
        if type(index) is not int or not 0 <= index < self.num_pieces:
            _check_index(index, self.num_pieces)  # raises
        known = self._known.get(peer)
        bit = 1 << self._pos[index]
        if known is not None and not known & bit:
            self._known[peer] = known | bit
            self._known_count[peer] += 1
            if self._known_count[peer] == self.num_pieces and self._active.pop(peer, 0) is None:
                self._top_up()

    def done(self, peer: str) -> None:
        """The piece in flight to `peer` left the learner's uplink (rule 6)."""
        self._busy.discard(peer)

    # --- decisions --------------------------------------------------------------------------

    def served(self) -> list[str]:
        return list(self._active)

    def idle(self) -> list[str]:
        return [p for p in self._active if p not in self._busy]

    def pick(self, idle: Iterable[str]) -> tuple[str, int] | None:
        """The next send among the `idle` served peers (rules 7-8), or None: nothing useful."""
        served = [p for p in idle if p in self._active and p not in self._busy]
        if not served:
            return None
        fair = self.total_sent / max(1, len(self._known)) + self.fair_slack
        served.sort(key=lambda p: (self._sent_count[p] > fair, self._known_count[p], p))
        for peer in served:
            index = self._rarest_for(peer)
            if index is not None:
                self._mark(peer, index)
                return peer, index
        return None

    def copies(self, index: int) -> int:
        return self._copies[index]

    def sent_to(self, peer: str) -> int:
        return self._sent_count.get(peer, 0)

    # --- internals --------------------------------------------------------------------------

    def _top_up(self) -> None:
        """Serve random waiting peers that still lack pieces until `width` are served (rule 9)."""
        waiting, rng = self._waiting, self.rng
        while len(self._active) < self.width and waiting:
            j = rng.randrange(len(waiting))
            peer = waiting[j]
            waiting[j] = waiting[-1]
            waiting.pop()
            if peer in self._known and peer not in self._active and self._known_count[peer] < self.num_pieces:
                self._active[peer] = None

    def _rarest_for(self, peer: str) -> int | None:
        unknown = ~self._known[peer]
        for bucket in self._buckets:
            fresh = bucket & unknown
            if fresh:
                return self._order[(fresh & -fresh).bit_length() - 1]
        return None

    def _mark(self, peer: str, index: int) -> None:
        self.has(peer, index)
        self._sent_count[peer] += 1
        self._busy.add(peer)
        self.total_sent += 1
        c = self._copies[index]
        bit = 1 << self._pos[index]
        self._buckets[c] &= ~bit
        if c + 1 == len(self._buckets):
            self._buckets.append(0)
        self._buckets[c + 1] |= bit
        self._copies[index] = c + 1
