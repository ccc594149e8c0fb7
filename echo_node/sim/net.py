"""Simulated hosts and links: who may send a weight piece when, and when it arrives.

Link model (simple, stated, and the same for every host):
- Each host has an uplink of `up` bytes/s, a downlink of `down` bytes/s and a one-way access
  latency `lat` s; a message from a to b takes `a.lat + b.lat` in flight (no shared core: the
  bottlenecks of a home swarm are its access links).
- Uplink: served one transfer at a time at `up`: a piece of s bytes occupies the uplink for
  s/up. Each version a host serves has one FIFO for all its links; the versions take turns,
  one piece each (round robin), as the TCP connections of different versions share a link
  fairly, so what an old version still has queued does not hold a new one back entirely.
  Within a version, a FIFO rather than TCP's fair share between its links: with equal piece
  sizes both give every link the same rate over a round of pushes, and a FIFO costs one event
  per piece (an answer to a `get` waits behind the pushes queued before it in both).
- Downlink: a transfer also occupies the receiver's downlink for s/down; the downlink serves
  transfers in the order their uploads finish, and cannot finish one before its last byte left
  the sender. So a piece arrives at max(upload end, max(downlink free, upload start) + s/down)
  + latency. A slow downlink delays what it receives without holding back the sender's uplink
  (TCP would slow that one flow and give its share of the uplink to the sender's other links).
- Control frames (`next`, `get`, `peers`) are tiny and go on their own, after the latency only;
  an answer of the learner to `next` (a piece or "none") leaves its uplink in the order asked,
  so "none" never overtakes a piece sent on the same link before it.
- A transfer whose sender or receiver left the link (churn, a cut) before it starts is skipped;
  one in progress still takes its time and is then discarded. Either way the sender hears
  `unsent` (its queue accounting), as a live link's queue goes with the link.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from echo_node.sim.events import EventLoop

__all__ = ["CONTROL", "Endpoint", "Node", "Uplinks"]

# The index of a zero-size control answer in an uplink queue (the learner's "none").
CONTROL = -1


class Endpoint(Protocol):
    """One side of a version's data links on a host (the learner's source or a receiver)."""

    node: Node
    connected: bool

    def sent(self, dst: Endpoint, index: int) -> None: ...
    def unsent(self, dst: Endpoint, index: int) -> None: ...
    def on_piece(self, src: Endpoint, index: int) -> None: ...
    def on_no_more(self) -> None: ...


@dataclass(eq=False, slots=True)
class Node:
    """A host: access links and its upload queues (one per version it serves, by sender)."""

    id: str
    up: float  # bytes/s
    down: float  # bytes/s
    lat: float = 0.0  # one-way access latency, s
    queues: dict[Endpoint, deque[tuple[Endpoint, Endpoint, int, int]]] = field(default_factory=dict)
    turns: deque[Endpoint] = field(default_factory=deque)  # senders with something queued
    current: tuple[Endpoint, Endpoint, int, int] | None = None  # the transfer on the uplink
    busy: bool = False
    down_free: float = 0.0  # when the downlink finishes what it was given
    bytes_up: int = 0


class Uplinks:
    """Moves queued pieces over the hosts' links (model: module doc)."""

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        # (host, peer) -> until when host's data channel refuses peer (a link that overflowed,
        # broadcast.py); shared by every version, as a live node's DataServer bans are.
        self.bans: dict[tuple[str, str], float] = {}

    def ban(self, host: str, peer: str, until: float) -> None:
        self.bans[(host, peer)] = until

    def banned(self, host: str, peer: str) -> bool:
        return bool(self.bans) and self.bans.get((host, peer), -1.0) > self.loop.now

    def send(self, src: Endpoint, dst: Endpoint, index: int, size: int) -> None:
        self.send_many(src, [(src, dst, index, size)])

    def send_many(self, src: Endpoint, entries: list[tuple[Endpoint, Endpoint, int, int]]) -> None:
        """Queue transfers from `src` (each entry: src, dst, piece index, bytes)."""
        node = src.node
        q = node.queues.get(src)
        if q is None:
            q = node.queues[src] = deque()
            node.turns.append(src)
        q.extend(entries)
        if not node.busy:
            self._start(node)

    def cancel(self, src: Endpoint, dst: Endpoint, index: int) -> bool:
        """Drop a transfer of `index` from `src` to `dst` that has not started (the receiver
        called its request off); False when there is none (it started, or left already)."""
        q = src.node.queues.get(src)
        if q:
            for entry in q:
                if entry[1] is dst and entry[2] == index:
                    q.remove(entry)
                    src.unsent(dst, index)
                    return True
        return False

    def queued(self, node: Node) -> int:
        """Transfers waiting on `node`'s uplink (the one in progress not counted)."""
        return sum(len(q) for q in node.queues.values())

    def _start(self, node: Node) -> None:
        turns, queues = node.turns, node.queues
        while turns:
            src = turns.popleft()
            q = queues[src]
            while q and not (q[0][0].connected and q[0][1].connected):
                gone = q.popleft()  # the link is gone: nothing to send
                gone[0].unsent(gone[1], gone[2])
            if not q:
                del queues[src]
                continue
            node.current = entry = q.popleft()
            if q:
                turns.append(src)  # its next piece after the other versions' turns
            else:
                del queues[src]
            node.busy = True
            self.loop.at(self.loop.now + entry[3] / node.up, self._done, node)
            return
        node.busy = False

    def _done(self, node: Node) -> None:
        assert node.current is not None
        src, dst, index, size = node.current
        node.current = None
        now = self.loop.now
        if not (src.connected and dst.connected):
            src.unsent(dst, index)
        else:
            node.bytes_up += size
            src.sent(dst, index)
            if index == CONTROL:
                self.loop.at(now + node.lat + dst.node.lat, dst.on_no_more)
            else:
                rx = dst.node
                arrive = max(now, max(rx.down_free, now - size / node.up) + size / rx.down)
                rx.down_free = arrive
                self.loop.at(arrive + node.lat + rx.lat, dst.on_piece, src, index)
        self._start(node)
