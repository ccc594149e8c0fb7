"""The learner's decisions for one version: which piece leaves its uplink, towards whom. Pure:
no I/O, no clock; the I/O layer (echo_node/weights/broadcast.py `Source`, and the simulator's
`SimSource`) reports events and sends what it is told.

Rules (each is a test in tests/unit/test_protocol_source.py):
1. Relayed pieces: a `next` takes the head of the shared queue. The peer that asked is the
   piece's first receiver and pushes it to every other peer, so one upload of the learner feeds
   the whole swarm: a relayed piece is worth N-1 direct ones.
2. Spare uplink (Mutualcast): a peer whose own pull is held back by its uplink (it relays all
   it can: protocol/weights/relay.py rule 5) asks `more`; each `more` is a credit for one direct
   piece, at most `max_credits` held. A linked peer is sent one direct piece when its link has
   nothing queued (download headroom: the I/O layer keeps the kernel's unsent bytes small, so a
   link's queue empties only as fast as that peer takes bytes in) and it holds a credit or
   lacks a piece of the direct set; among the peers served at once, those holding the fewest
   pieces from the source go first. The piece is the oldest piece of the direct set that peer
   lacks; only a peer with a credit that lacks none of the direct set opens a new piece, from
   the tail of the shared queue (the relays take from the head). A direct piece is not relayed:
   the source sends it to every peer itself, whether it asked or not (when only one peer asked
   `more` and only it was sent the pieces opened for it, the other 7 of 8 peers fetched 150 of
   them from the source at the very end: 1.70x the bound). So relays carry what
   the peers' uplinks can, the source's spare uplink carries the rest, and the two meet in the
   queue. On symmetric links the relays keep up and nobody asks `more`: the source uploads
   about one copy. When the peers' uplinks are the bottleneck it uploads as many copies as its
   uplink allows. Every direct piece costs the source N uploads whatever the order, so within
   the direct set the order only has to be cheap (a cursor per peer) and finish pieces rather
   than start them. (Opening a new piece for every send instead, rarest of all, empties the
   queue at the source's full rate, starves the relays, and leaves the source alone with N-1
   copies of most pieces.) The peer decides when it is uplink-bound because only it knows:
   judged by the source from the time since a peer last asked `next`, queueing delay on a
   loaded uplink made relaying peers look idle, and the source uploaded 1.9 copies on symmetric
   links (benchmarks/results/measurements.md).
3. Fair share: the source sends a linked peer each piece at most once (answers to `next` and
   `get` and direct pieces together), whatever it asks or claims; a `get` for a piece already
   sent on that link is not answered. Direct pieces go one at a time per link, only to a link
   with nothing queued: a peer that claims to lack everything draws at most one copy of the
   version, and no more than its share of the source's uplink (its one TCP flow among those of
   the peers that take direct pieces).
4. Work-conserving: when the source's uplink has had nothing to send for a while (the I/O
   layer's SOURCE_IDLE_S: no link with bytes queued, ours or unsent in the kernel) and its queue
   still holds untouched pieces, every linked peer without a credit is given one (`idle`), as if
   it had asked `more`; the direct pieces then go out under rule 2. The peers' own `more` comes
   only once their relay queue is long in time (0.3 s), and on home uplinks (100/20 Mbit/s,
   a 1 Gbit/s source, a version of 0.3 s) a relay queue never gets that long while each piece
   still waits on a 20 Mbit/s relay: the source idled and the peers waited (in the simulator
   3.2x the bound with 64 KiB pieces, 1.7x with this rule; 1.47x and 1.17x with 256 KiB). A
   queued piece was handed to nobody by `next`, so while the queue holds one every peer lacks
   it unless it took it by `get`; such a peer is answered "none" (rule 5). On symmetric links
   the source's uplink is the bottleneck and never idles: no credit comes from this rule.
5. A `more` the source cannot serve (the queue is empty and that peer holds the whole direct
   set) is answered `None` ("none" on the wire), like a `next` on an empty queue. A peer that
   leaves takes its record with it (a new link starts afresh).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Final

from protocol.errors import LocalProtocolError
from protocol.limits import MAX_PIECES

__all__ = ["MAX_CREDITS", "SourcePlan"]

# `more` credits a peer may hold; the asks beyond are dropped (a receiver keeps 2 outstanding).
MAX_CREDITS: Final = 4


class SourcePlan:
    """The learner's bookkeeping for one version of `num_pieces` pieces (rules: module doc)."""

    def __init__(self, num_pieces: int, *, max_credits: int = MAX_CREDITS) -> None:
        if type(num_pieces) is not int or not 1 <= num_pieces <= MAX_PIECES:
            raise LocalProtocolError(f"num_pieces must be an int in [1, {MAX_PIECES}], got {num_pieces!r}")
        self.num_pieces: Final = num_pieces
        self.max_credits: Final = max_credits
        self.queue: deque[int] = deque(range(num_pieces))  # untouched pieces: relays from the head
        self.direct_set: list[int] = []  # pieces the source delivers itself, in the order opened
        self._sent: dict[str, bytearray] = {}  # linked peer -> which pieces it was sent
        self._count: dict[str, int] = {}  # linked peer -> how many
        self._cursor: dict[str, int] = {}  # linked peer -> direct_set[:cursor] all sent to it
        self._credits: dict[str, int] = {}  # linked peer -> `more` not yet answered
        self.direct_sent = 0  # direct pieces handed out (statistics)

    # --- events -----------------------------------------------------------------------------

    def join(self, peer: str) -> None:
        if peer not in self._sent:
            self._sent[peer] = bytearray(self.num_pieces)
            self._count[peer] = 0
            self._cursor[peer] = 0
            self._credits[peer] = 0

    def leave(self, peer: str) -> None:
        """`peer`'s link closed."""
        for table in (self._sent, self._count, self._cursor, self._credits):
            table.pop(peer, None)

    def next(self, peer: str) -> int | None:
        """The piece answering `peer`'s `next` (rule 1), or None: the queue is empty."""
        sent = self._sent.get(peer)
        while self.queue and sent is not None:
            index = self.queue.popleft()
            if not sent[index]:
                self._mark(peer, index)
                return index
            # It holds it already (a `get`): as it would not relay it, the source delivers it.
            self.direct_set.append(index)
        return None

    def more(self, peer: str) -> None:
        """`peer` asks for a direct piece (rule 2): a credit, up to `max_credits`."""
        if peer in self._credits:
            self._credits[peer] = min(self.max_credits, self._credits[peer] + 1)

    def idle(self) -> list[str]:
        """The source's uplink idles (rule 4): one credit to each linked peer without one, while
        the queue holds untouched pieces; returns the peers credited."""
        if not self.queue:
            return []
        credited = [peer for peer, credits in self._credits.items() if not credits]
        for peer in credited:
            self._credits[peer] = 1
        return credited

    def get(self, peer: str, index: int) -> bool:
        """Whether to answer `peer`'s `get` for `index` (rule 3); if so it counts as sent."""
        sent = self._sent.get(peer)
        if sent is None or not 0 <= index < self.num_pieces or sent[index]:
            return False
        self._mark(peer, index)
        return True

    # --- decisions --------------------------------------------------------------------------

    def direct(self, idle: Iterable[str], budget: int | None = None) -> list[tuple[str, int | None]]:
        """What to send the `idle` peers (linked, nothing queued towards them) now, as (peer,
        index): one direct piece to each that holds a credit, fewest pieces first, at most
        `budget` in all (rule 2); index None: answer "none", the source has nothing more for
        that peer (rule 5; its credits are spent)."""
        order = sorted((p for p in set(idle) if self.wants(p)), key=lambda p: (self._count[p], p))
        out: list[tuple[str, int | None]] = []
        for peer in order:
            if budget is not None and len(out) >= budget:
                break
            credit = self._credits[peer] > 0
            index = self._pick(peer, may_open=credit)
            if index is not None:
                self._credits[peer] -= credit
                self._mark(peer, index)
                self.direct_sent += 1
            elif not credit:
                continue
            else:
                self._credits[peer] = 0
            out.append((peer, index))
        return out

    def wants(self, peer: str) -> bool:
        """Whether `peer` holds a credit or lacks a piece of the direct set (rule 2)."""
        if peer not in self._sent:
            return False
        return self._credits[peer] > 0 or self._advance(peer) < len(self.direct_set)

    def held(self, peer: str) -> int:
        """Pieces the source sent `peer` on its link (0 for a peer not linked)."""
        return self._count.get(peer, 0)

    # --- internals --------------------------------------------------------------------------

    def _advance(self, peer: str) -> int:
        """The position of the oldest direct piece `peer` lacks (len(direct_set): none)."""
        sent, opened = self._sent[peer], self.direct_set
        c = self._cursor[peer]
        while c < len(opened) and sent[opened[c]]:
            c += 1
        self._cursor[peer] = c
        return c

    def _pick(self, peer: str, *, may_open: bool) -> int | None:
        opened = self.direct_set
        c = self._advance(peer)
        if c < len(opened):
            return opened[c]
        sent = self._sent[peer]
        while may_open and self.queue:
            index = self.queue.pop()
            opened.append(index)
            if not sent[index]:  # (it may hold it already: a `get`)
                return index
        return None

    def _mark(self, peer: str, index: int) -> None:
        self._sent[peer][index] = 1
        self._count[peer] += 1
