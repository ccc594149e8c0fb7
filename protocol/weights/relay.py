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
   and at least every quiet period.
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

    def relay_drained(self) -> None:
        """The relay queue is empty (its last push left); the uplink has been measured once a
        relay was pushed."""
        if self.relayed:
            self.drained = True

    def piece(self, *, from_source: bool, new: bool, now: float, asked: bool = False) -> bool:
        """A verified piece arrived (`asked`: the source's answer to our `get`); True if this peer
        must relay it to its other links (rule 2)."""
        if from_source and not asked and self.outstanding > 0:
            self.outstanding -= 1
        if new:
            self.last_progress = now
        relay = from_source and new and not asked
        self.relayed += relay
        return relay

    def source_empty(self) -> None:
        """The source answered "none" (rule 3)."""
        self.empty = True
        self.outstanding = 0

    def quiet(self) -> float:
        return self.endgame_quiet_s if self.empty else self.stall_s

    def repair_due(self, now: float) -> bool:
        """Whether to ask the piece swarm for what is missing now (rule 4)."""
        return now >= self.last_progress + self.quiet()

    def wake_at(self, now: float, swarm_deadline: float | None) -> float:
        """When the receiver's loop must look again if no event comes first (rule 4)."""
        if not self.repair_due(now):
            return self.last_progress + self.quiet()
        later = now + self.quiet()
        return later if swarm_deadline is None else min(swarm_deadline, later)
