"""A receiver's dealings with the source of a version: when to ask it, what to relay, when to
repair. Pure: handed `now`, never reads a clock; the I/O layer (echo_node/weights/broadcast.py) sends.

Rules (each is a test in tests/unit/test_protocol_relay.py):
1. Pull: one `next` at a time until this peer's first relay has drained (until then it does
   not know what its uplink can do); then up to `pipeline` outstanding, and only while every
   relay link has fewer than `backlog_pieces` pieces queued and the relay queue drains within
   `drain_s` at the uplink's measured rate. A peer with a slow uplink (and many links: a piece
   relayed to 99 peers is 99 copies) then takes fewer pieces from the shared queue, and the
   swarm runs at the speed of its aggregate uplink, not of its slowest link. Counting pieces per
   link alone let every peer take two pieces at the start, which a 3 Mbit/s uplink needs a
   minute to push to 99 others (2-3x the bound in simulated home swarms of 100 peers and 256
   pieces; 1.06-1.37x with this rule).
2. Relay: a piece that came from the source in answer to `next` and is new here is pushed to
   every other link at once (this peer is its first receiver); pieces from peers are not pushed
   on, nor are the source's answers to our own `get` (a repair: the piece was handed out
   before, and its first receiver is still pushing it; relayed again, the slowest downlinks
   took it twice, which cost 1.4-2.9x the broadcast bound in simulated home swarms).
3. The source said "none": its queue is empty, nothing is outstanding there, and it is never
   asked again.
4. Repair: once the source is empty and no new piece arrived for `endgame_quiet_s`, or when no
   new piece arrived for `stall_s` whatever the source says, missing pieces are fetched from
   whoever has them (`PieceSwarm`); from then on the receiver wakes at the swarm's deadlines,
   and at least every quiet period. At the end the last pieces trickle in from the relays'
   queues at their uplinks' pace while the source has spare uplink, so the quiet period is
   short: 10 ms (the broadcast's I/O layer sets it). Each relayed piece that arrives resets it,
   and on home uplinks relayed pieces trickle in for the whole tail: at 0.1 s, 3 peers at 20/100
   Mbit/s with a 1 Gbit/s source and 14 pieces took 2.1x the bound in the simulator, 1.5x at
   10 ms (10 such peers 2.7x -> 1.8x; 30 peers and 64 MiB 1.14x -> 1.05x; symmetric links
   unchanged). The source's queue is empty by then and its uplink idle; a repair it answers
   costs a duplicate where the relay's copy lands too (1.00 -> 1.06 copies from the learner on
   symmetric links, live). Repairs could once pile up unanswered at the learner and get honest
   peers cut as asking without reading (tests/integration/test_swarm.py); the learner now
   counts only answers against that bound, and a peer keeps few `get`s outstanding.
5. More: while this peer's uplink is busy relaying (its first relay still going
   `first_relay_s` after it started, or, once the uplink is measured, a relay queue that drains
   in `direct_drain_s` or more) and the source is not empty, keep up to `direct_pipeline`
   `more` requests outstanding: the source may then spend its spare uplink on pieces for this
   peer alone (direct pieces, never relayed; protocol/weights/source.py rule 2). A `more` is
   answered by a direct piece or by "none". Not only when rule 1 holds the pull back
   (`drain_s`): the queue then hovers just below the limit, and the peer asked `more` half the
   time (8 peers, 10/100 Mbit/s: direct pieces came in bursts, 1.47x the bound). Not for a
   queue that is long in pieces but short in time: on symmetric links peers asked then (a relay
   queue of 4 pieces at 100 Mbit/s drains in 0.15 s), and each direct piece costs the source a
   copy per peer (1.15 copies, 1.16x the bound). 0.3 s rather than 0.5 s: one 64 KiB piece to 7
   peers at 10 Mbit/s takes 0.37 s, and at 0.5 s the learner's uplink idled whenever the relays
   held less than two (1.32x the bound, 1.22x at 0.3 s). The first relay counts on its own: it takes 37 ms on symmetric 100 Mbit/s
   links (64 KiB to 7 peers) but 0.2-0.4 s on home uplinks, and a small version (14 pieces of
   256 KiB to 3 peers, 0.29 s bound) was handed out to the relays before any was measured. The
   loop wakes when the first relay turns `first_relay_s` old (`wake_at`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SourcePull"]


@dataclass(slots=True)
class SourcePull:
    pipeline: int = 2
    backlog_pieces: int = 4
    drain_s: float = 2.0
    endgame_quiet_s: float = 0.5
    stall_s: float = 3.0
    outstanding: int = 0
    empty: bool = False
    last_progress: float = 0.0
    relayed: int = 0  # first copies this peer relayed
    drained: bool = False  # its relay queue emptied since it relayed one: the uplink is measured
    direct_pipeline: int = 2
    direct_drain_s: float = 0.3
    first_relay_s: float = 0.1
    relay_started: float | None = None  # when this peer first relayed a piece
    direct_outstanding: int = 0  # `more` requests not answered yet

    def asks(self, backlog: int, drain_s: float = 0.0) -> int:
        """How many `next` requests to send now (rule 1), given the longest relay queue in pieces
        and the seconds the relay queue takes to drain at the uplink's measured rate."""
        if self.empty or backlog >= self.backlog_pieces:
            return 0
        if not self.drained:
            if self.relayed or self.outstanding:
                return 0  # one piece first: its relay measures the uplink
            self.outstanding = 1
            return 1
        if drain_s >= self.drain_s:
            return 0
        n = max(0, self.pipeline - self.outstanding)
        self.outstanding += n
        return n

    def mores(self, backlog: int, drain_s: float = 0.0, now: float = 0.0) -> int:
        """How many `more` requests to send now (rule 5), given what `asks` was given."""
        del backlog  # the same arguments as `asks`; only time counts here
        if self.empty or not self._uplink_busy(drain_s, now):
            return 0
        n = max(0, self.direct_pipeline - self.direct_outstanding)
        self.direct_outstanding += n
        return n

    def relay_drained(self) -> None:
        """The relay queue is empty (its last push left); the uplink has been measured once a
        relay was pushed."""
        if self.relayed:
            self.drained = True

    def piece(self, *, from_source: bool, new: bool, now: float, asked: bool = False, direct: bool = False) -> bool:
        """A verified piece arrived (`asked`: the source's answer to our `get`; `direct`: its
        answer to `more`); True if this peer must relay it to its other links (rule 2)."""
        if direct:
            self.direct_outstanding = max(0, self.direct_outstanding - 1)
            asked = True  # not ours to relay
        elif from_source and not asked and self.outstanding > 0:
            self.outstanding -= 1
        if new:
            self.last_progress = now
        relay = from_source and new and not asked
        self.relayed += relay
        if relay and self.relay_started is None:
            self.relay_started = now
        return relay

    def source_empty(self) -> None:
        """The source answered "none" (rule 3)."""
        self.empty = True
        self.outstanding = 0
        self.direct_outstanding = 0

    def quiet(self) -> float:
        return self.endgame_quiet_s if self.empty else self.stall_s

    def repair_due(self, now: float) -> bool:
        """Whether to ask the piece swarm for what is missing now (rule 4)."""
        return now >= self.last_progress + self.quiet()

    def wake_at(self, now: float, swarm_deadline: float | None) -> float:
        """When the receiver's loop must look again if no event comes first (rules 4 and 5)."""
        if not self.repair_due(now):
            at = self.last_progress + self.quiet()
        else:
            at = now + self.quiet()
            if swarm_deadline is not None:
                at = min(swarm_deadline, at)
        if not (self.drained or self.empty) and self.relay_started is not None:
            first = self.relay_started + self.first_relay_s
            if first > now:
                at = min(at, first)
        return at

    def _uplink_busy(self, drain_s: float, now: float) -> bool:
        if self.drained:
            return drain_s >= self.direct_drain_s
        return self.relay_started is not None and now >= self.relay_started + self.first_relay_s
