"""A receiver's dealings with the source of a version: when to ask it, what to relay, when to
repair. Pure: handed `now`, never reads a clock; the I/O layer (echo_node/weights/broadcast.py) sends.

Rules (each is a test in tests/unit/test_protocol_relay.py):
1. Pull: keep up to `pipeline` `next` requests outstanding with the source, and ask only while
   every relay link has fewer than `backlog_pieces` pieces queued: a peer with a slow uplink
   then takes fewer pieces from the shared queue, and the swarm runs at the speed of its
   aggregate uplink, not of its slowest link.
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
    endgame_quiet_s: float = 0.5
    stall_s: float = 3.0
    outstanding: int = 0
    empty: bool = False
    last_progress: float = 0.0

    def asks(self, backlog: int) -> int:
        """How many `next` requests to send now, given the longest relay queue (rule 1)."""
        if self.empty or backlog >= self.backlog_pieces:
            return 0
        n = max(0, self.pipeline - self.outstanding)
        self.outstanding += n
        return n

    def piece(self, *, from_source: bool, new: bool, now: float, asked: bool = False) -> bool:
        """A verified piece arrived (`asked`: the source's answer to our `get`); True if this peer
        must relay it to its other links (rule 2)."""
        if from_source and not asked and self.outstanding > 0:
            self.outstanding -= 1
        if new:
            self.last_progress = now
        return from_source and new and not asked

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
