"""One weight version's broadcast over simulated links, decided by the real protocol state machines.

What is real and what is modelled:
- Real: every decision a receiver makes is taken by the protocol objects the live receiver uses
  (`protocol.weights.relay.SourcePull`: how many `next` and `more` to send, whether to relay a
  piece, when to repair; `protocol.weights.pieces.PieceSwarm`: which piece to ask of whom in the
  repair, timeouts, endgame), and every decision of the learner by the live one's
  (`protocol.weights.source.SourcePlan`: which piece answers a `next`, whether to answer a
  `get`, which direct piece goes to whom), built with the same parameters (`echo_node.weights.broadcast`'s constants
  and `Receiver`'s default request timeout, imported, not copied), and called at the same
  moments as `echo_node.weights.broadcast.Receiver` calls them (below). The piece size is
  `protocol.weights.manifest.choose_piece_size` unless a caller fixes it.
- Modelled: bytes, hashes and sockets. Pieces always verify (no hostile peer here); links are
  `echo_node.sim.net`'s model.

How `Receiver` and `Source` are mirrored, event by event:
- The learner (`SimSource`, like `Source`) answers each `next` with the head of the shared queue
  or with "none", a `get` with the piece unless it sent it to that peer before, and after every
  piece that leaves its uplink (`Link.on_sent`) and every `more`, sends the direct pieces (or
  "none") `SourcePlan.direct` names for the members with nothing queued towards them. The live
  link's queue empties only as fast as its peer takes bytes in; here a member counts as idle
  when nothing is queued for it on the learner's uplink and its downlink has delivered all it
  was given (else the learner looks again when it has). While untouched pieces remain it looks
  every SOURCE_IDLE_S whether its uplink holds anything for anyone, and after two empty looks
  in a row credits every peer (`SourcePlan.idle`), as `Source._watch_idle` does; a piece counts
  as queued until it has left the uplink (the live one also asks the kernel for unsent bytes).
- A receiver connects one round trip after it joins (hello, then manifest and peer list). Its
  links: one to the learner and one to every other connected member of this version (the
  learner's `peers` frames make a full mesh), except pairs where one side bans the other.
  A member that connects late is pushed, by each member, what that member relayed so far
  (`Receiver._run_link`'s replay of `relaying`).
- On a piece: the swarm hears `received` (and `peer_has` when it came from a peer); `SourcePull
  .piece` says whether to relay it (told whether a piece from the learner answers our `get` or
  is a direct piece); a first copy from the learner is pushed to every other link at once; a
  piece from the learner refills the pull (`next` and `more`; a complete member asks no
  `more`). On every piece a link finishes sending,
  the pull is refilled too (`Link.on_sent`). The backlog the pull sees is the longest relay
  queue among this receiver's links (counted per link, kept in a histogram so the maximum is
  O(1)). A link holding more than LAGGARD_PIECES is pushed no new first copies, as live. The
  live rule that leaves laggards out of the backlog (a minority of links behind for
  LAGGARD_HOLD_S) is not mirrored: a member's uplink here sends its pushes in order, so its
  links keep pace with each other, and nobody reads slowly.
- After every frame, and at `SourcePull.wake_at`, the run loop's body runs while the version
  is incomplete: refill the pull; if `repair_due`, poll the swarm and send its `get`s (a
  `Cancel` sends nothing, as in `Receiver._repair`).
- A holder answers a `get` if it holds the piece; a link on which the asker already made it
  queue more than `Link.queue_cap` bytes is cut instead (`LinkOverflow`), and the asker is banned
  from the holder's data channel for `DATA_BAN_S` (every version); the learner cuts the same
  way. Cuts are counted (`SimBroadcast.overflows`).
- A completed receiver keeps serving (relay pushes still queued go out, `get`s are answered)
  and keeps refilling its pull, as the live one does while its links live.
- A member that leaves takes its links with it: every other receiver's swarm hears `peer_gone`.
Not modelled: link idle and stall timeouts, the follower's fetch timeouts (`FETCH_TIMEOUT_S`,
`STALL_ABANDON_S`: a download here never gives up), dial failures, NAT.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Sequence

from echo_node.sim.events import EventLoop
from echo_node.sim.net import CONTROL, Endpoint, Node, Uplinks
from echo_node.weights.broadcast import (
    BACKLOG_PIECES,
    DATA_BAN_S,
    DRAIN_S,
    ENDGAME_QUIET_S,
    LAGGARD_PIECES,
    LINK_QUEUE_MIN_BYTES,
    LINK_QUEUE_PIECES,
    SOURCE_IDLE_S,
    SOURCE_PIPELINE,
    STALL_S,
    Receiver,
)
from protocol.weights.manifest import choose_piece_size
from protocol.weights.pieces import PieceSwarm, Request
from protocol.weights.relay import SourcePull
from protocol.weights.source import SourcePlan

__all__ = ["LEARNER_ID", "REQUEST_TIMEOUT_S", "SimBroadcast", "SimReceiver", "SimSource", "simulate_broadcast"]

LEARNER_ID = "learner"
# The live receiver's piece request timeout: `Receiver`'s default, read from its signature so
# the two cannot drift apart.
REQUEST_TIMEOUT_S: float = inspect.signature(Receiver.__init__).parameters["request_timeout"].default


class _LinkQueues:
    """Pieces queued per outbound link, and the longest such queue in O(1) (the pull's backlog)."""

    __slots__ = ("count", "hist", "longest")

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.hist = [0]  # hist[c]: links with c pieces queued (c >= 1)
        self.longest = 0

    def add(self, peer: str) -> None:
        self.add_each([peer], 1)

    def add_each(self, peers: list[str], n: int) -> None:
        """`add` n times for each of `peers` (the hot path: one relay pushed to every link)."""
        count, hist = self.count, self.hist
        get = count.get
        top = self.longest
        for peer in peers:
            c = get(peer, 0)
            count[peer] = c + n
            if c + n >= len(hist):
                hist.extend([0] * (c + n + 1 - len(hist)))
            if c:
                hist[c] -= 1
            hist[c + n] += 1
            if c + n > top:
                top = c + n
        self.longest = top

    def sub(self, peer: str) -> None:
        c = self.count.get(peer, 0)
        if not c:
            return  # the link was dropped meanwhile
        self._move(peer, c, c - 1)

    def drop(self, peer: str) -> None:
        c = self.count.get(peer, 0)
        if c:
            self._move(peer, c, 0)

    def _move(self, peer: str, c: int, to: int) -> None:
        hist = self.hist
        hist[c] -= 1
        if to:
            self.count[peer] = to
            hist[to] += 1
        else:
            del self.count[peer]
        while self.longest and not hist[self.longest]:
            self.longest -= 1


class SimSource:
    """The learner's side of one version (`broadcast.Source`), decided by the real
    `protocol.weights.source.SourcePlan`: answers to `next`, `more` and `get`."""

    def __init__(self, bc: SimBroadcast, node: Node) -> None:
        self.connected = True
        self.bc = bc
        self.node = node
        self.id = LEARNER_ID
        self.plan = SourcePlan(bc.num_pieces)
        self.links = _LinkQueues()
        # (peer, index) of the direct pieces on the uplink: each piece goes to each peer at most
        # once (SourcePlan rule 3), so the pair names the send.
        self.directs: set[tuple[str, int]] = set()
        self.timer_at = math.inf
        self.watching = False
        self.idle_credits = 0

    def on_next(self, r: SimReceiver) -> None:
        if not (self.connected and r.connected) or not self.bc.answer_allowed(self, r):
            return
        index = self.plan.next(r.id)
        if index is None:
            self.bc.uplinks.send(self, r, CONTROL, 0)
        else:
            self._send(r, index)

    def on_more(self, r: SimReceiver) -> None:
        if self.connected and r.connected:
            self.plan.more(r.id)
            self.fill()

    def on_get(self, r: SimReceiver, index: int) -> None:
        if self.connected and r.connected and self.bc.answer_allowed(self, r) and self.plan.get(r.id, index):
            self._send(r, index)

    def _send(self, r: SimReceiver, index: int) -> None:
        self.links.add(r.id)
        self.bc.uplinks.send(self, r, index, self.bc.piece_bytes(index))

    def sent(self, dst: Endpoint, index: int) -> None:
        if index != CONTROL:
            self.links.sub(dst.id)  # type: ignore[attr-defined]
        self.fill()  # `Link.on_sent` -> `Source._sent`

    def unsent(self, dst: Endpoint, index: int) -> None:
        """The link went with its queue (`links.drop` already forgot it; `plan.leave` too)."""
        self.directs.discard((dst.id, index))  # type: ignore[attr-defined]

    def fill(self) -> None:
        """`Source._fill`: direct pieces (or "none") to the members that asked `more` and have
        nothing queued towards them. The live link's queue empties only as fast as the peer
        takes bytes in; here that is a downlink with nothing left to deliver (else a wake-up
        when it has)."""
        if not self.connected:
            return
        now = self.bc.loop.now
        idle, busy_until = [], math.inf
        for r in self.bc.linked:
            if r.source_cut or self.links.count.get(r.id, 0) or not self.plan.wants(r.id):
                continue
            if r.node.down_free > now:
                busy_until = min(busy_until, r.node.down_free)
            else:
                idle.append(r.id)
        for peer, index in self.plan.direct(idle):
            r = self.bc.receivers[peer]
            if index is None:
                self.bc.uplinks.send(self, r, CONTROL, 0)
            else:
                self.directs.add((peer, index))
                self._send(r, index)
        if now < busy_until < self.timer_at:
            self.timer_at = busy_until
            self.bc.loop.at(busy_until, self._timer, busy_until)

    def _timer(self, at: float) -> None:
        if at == self.timer_at:
            self.timer_at = math.inf
            self.fill()

    def start_watch(self) -> None:
        """`Source._start_watch`: the idle watch (SourcePlan rule 4) runs while untouched pieces remain."""
        if not self.watching and self.connected and self.plan.queue:
            self.watching = True
            self.bc.loop.at(self.bc.loop.now + SOURCE_IDLE_S, self._watch, False)

    def _watch(self, idle_before: bool) -> None:
        """`Source._watch_idle`: credit every peer when no link had anything queued on the
        uplink at two looks SOURCE_IDLE_S apart. (The uplink here has no kernel buffer: a piece
        counts as queued until it has left.)"""
        if not (self.connected and self.plan.queue and self.bc.linked):
            self.watching = False
            return
        idle = not any(self.links.count.get(r.id, 0) for r in self.bc.linked)
        if idle and idle_before:
            self.idle_credits += len(self.plan.idle())
            self.fill()
            idle = False
        self.bc.loop.at(self.bc.loop.now + SOURCE_IDLE_S, self._watch, idle)

    def on_piece(self, src: Endpoint, index: int) -> None:
        """A piece pushed to the source is of no use to it (as in `Source.serve`)."""

    def on_no_more(self) -> None:
        raise AssertionError("the source is never told 'none'")


class SimReceiver:
    """A peer's side of one version (`broadcast.Receiver`), driven by the real state machines."""

    def __init__(self, bc: SimBroadcast, node: Node) -> None:
        self.bc = bc
        self.node = node
        self.id = node.id
        self.connected = False
        self.left = False
        self.slot = len(bc.receivers)  # fixed position, for the rotating push order
        self.done_at: float | None = None
        self.have = bytearray(bc.num_pieces)
        self.count = 0
        self.swarm = PieceSwarm(bc.num_pieces, request_timeout=REQUEST_TIMEOUT_S)
        self.swarm.peer_has_all(LEARNER_ID)
        self.pull = SourcePull(pipeline=SOURCE_PIPELINE, backlog_pieces=BACKLOG_PIECES, drain_s=DRAIN_S,
                               endgame_quiet_s=ENDGAME_QUIET_S, stall_s=STALL_S)
        self.relaying: list[int] = []
        self.asked_source: set[int] = set()  # pieces asked of the learner with `get` (repairs)
        self.relay_bytes = 0  # relay pushes queued on our uplink
        self.answers: set[tuple[str, int]] = set()  # `get` answers queued on our uplink
        self.links = _LinkQueues()
        self.cut: set[str] = set()  # members this receiver has no link with (bans)
        self.source_cut = False
        self.timer_at = math.inf

    # --- links ------------------------------------------------------------------------------

    def push(self, indices: Sequence[int], dests: Sequence[SimReceiver]) -> None:
        """Queue pieces on the links to `dests` (relay pushes, in the given order)."""
        bc = self.bc
        entries: list[tuple[Endpoint, Endpoint, int, int]] = []
        for index in indices:
            size = bc.piece_bytes(index)
            entries.extend([(self, d, index, size) for d in dests])
        if entries:
            self.links.add_each([d.id for d in dests], len(indices))
            self.relay_bytes += sum(e[3] for e in entries)
            bc.uplinks.send_many(self, entries)

    def sent(self, dst: Endpoint, index: int) -> None:
        self.links.sub(dst.id)  # type: ignore[attr-defined]
        self._dequeued(dst, index)
        self._refill()  # `Link.on_sent`

    def unsent(self, dst: Endpoint, index: int) -> None:
        self._dequeued(dst, index)  # the link is gone, and `links.drop` forgot its queue

    def _dequeued(self, dst: Endpoint, index: int) -> None:
        key = (dst.id, index)  # type: ignore[attr-defined]
        if key in self.answers:  # an answer to a `get`, not a relay push
            self.answers.discard(key)
        else:
            self.relay_bytes -= self.bc.piece_bytes(index)
            if not self.relay_bytes:
                self.pull.relay_drained()

    # --- frames -----------------------------------------------------------------------------

    def on_piece(self, src: Endpoint, index: int) -> None:
        bc = self.bc
        sid = src.id  # type: ignore[attr-defined]
        if not (self.connected and src.connected) or (self.source_cut if src is bc.source else sid in self.cut):
            return  # the link closed while the piece was in flight
        now = bc.loop.now
        new = not self.have[index]
        bc.deliveries += 1
        if new:
            self.have[index] = 1
            self.count += 1
        else:
            bc.duplicates += 1
        self.swarm.received(sid, index, True, now)
        from_source = src is bc.source
        if not from_source:
            self.swarm.peer_has(sid, (index,))
        direct = from_source and (self.id, index) in bc.source.directs
        if direct:  # the learner's spare uplink: ours alone, not relayed
            bc.source.directs.discard((self.id, index))
        asked = from_source and index in self.asked_source
        if not direct:
            self.asked_source.discard(index)  # one answer per `get`: a later copy is a `next`'s
        if self.pull.piece(from_source=from_source, new=new, now=now, asked=asked, direct=direct):
            if not self.relaying:
                bc.relayers.append(self)
            self.relaying.append(index)
            dests = bc.relay_order(self)
            if self.links.longest > LAGGARD_PIECES:  # (`Receiver._on_piece`: laggards are pushed no more)
                dests = [d for d in dests if self.links.count.get(d.id, 0) <= LAGGARD_PIECES]
            self.push((index,), dests)
        if new and self.count == bc.num_pieces:
            self.done_at = now
            bc.member_done(self)
        if from_source:
            self._refill()
        self._loop(now)

    def on_no_more(self) -> None:
        if self.connected:
            self.pull.source_empty()
            self._loop(self.bc.loop.now)

    def on_get(self, asker: SimReceiver, index: int) -> None:
        if not (self.connected and asker.connected) or not self.have[index]:
            return
        if self.bc.answer_allowed(self, asker):
            self.answers.add((asker.id, index))
            self.links.add(asker.id)
            self.bc.uplinks.send(self, asker, index, self.bc.piece_bytes(index))

    # --- the download loop (`Receiver.run`) ---------------------------------------------------

    def _refill(self) -> None:
        if self.source_cut:
            return
        # The live receiver measures its uplink while relaying; here links run at `node.up`
        # whenever they have work, so that is the measurement.
        backlog, drain_s = self.links.longest, self.relay_bytes / self.node.up
        n = self.pull.asks(backlog, drain_s)
        m = 0 if self.count == self.bc.num_pieces else self.pull.mores(backlog, drain_s, self.bc.loop.now)
        if n or m:
            bc = self.bc
            at = bc.loop.now + self.node.lat + bc.learner.lat
            for _ in range(n):
                bc.loop.at(at, bc.source.on_next, self)
            for _ in range(m):
                bc.loop.at(at, bc.source.on_more, self)

    def _loop(self, now: float) -> None:
        if self.count == self.bc.num_pieces:
            return
        self._refill()
        if self.pull.repair_due(now):
            self._repair(now)
            wake = self.pull.wake_at(now, self.swarm.next_deadline())
        else:  # before the repair, the swarm's deadlines do not count (SourcePull rule 4)
            wake = self.pull.wake_at(now, None)
        if wake < self.timer_at:
            self.timer_at = wake
            self.bc.loop.at(wake, self._timer, wake)

    def _timer(self, at: float) -> None:
        if at != self.timer_at or not self.connected:
            return  # superseded by an earlier wake-up, or gone
        self.timer_at = math.inf
        self._loop(self.bc.loop.now)

    def _repair(self, now: float) -> None:
        bc = self.bc
        for action in self.swarm.poll(now):
            if not isinstance(action, Request):
                continue  # a late copy is still counted; nothing to tell the sender
            holder = bc.endpoint(action.peer)
            if holder is None or not holder.connected:
                continue
            if holder is bc.source:
                if self.source_cut:
                    continue
                self.asked_source.add(action.index)
            elif holder.id in self.cut:
                continue
            bc.loop.at(now + self.node.lat + holder.node.lat, holder.on_get, self, action.index)


class SimBroadcast:
    """One version: the learner's source and the receivers of the members that joined it."""

    def __init__(
        self,
        loop: EventLoop,
        uplinks: Uplinks,
        learner: Node,
        version: int,
        size_bytes: int,
        *,
        piece_size: int | None = None,
        on_member_done: Callable[[SimBroadcast, SimReceiver], None] | None = None,
    ) -> None:
        self.loop = loop
        self.uplinks = uplinks
        self.learner = learner
        self.version = version
        self.size_bytes = size_bytes
        self.piece_size = piece_size or choose_piece_size(size_bytes)
        self.num_pieces = -(-size_bytes // self.piece_size)
        self._last_piece = size_bytes - (self.num_pieces - 1) * self.piece_size
        # `Link.queue_cap`: what an asker may make a link queue before it is cut.
        self.queue_cap = max(LINK_QUEUE_MIN_BYTES, LINK_QUEUE_PIECES * self.piece_size)
        self.published_at = loop.now
        self.on_member_done = on_member_done
        self.source = SimSource(self, learner)
        self.receivers: dict[str, SimReceiver] = {}  # every member that joined, gone or not
        self.linked: list[SimReceiver] = []  # connected members, in connection order
        self.relayers: list[SimReceiver] = []  # members that relayed a first copy
        self.overflows = 0
        self.deliveries = 0  # pieces that reached a connected receiver
        self.duplicates = 0  # of which it held already
        self.done_count = 0  # members that completed (gone since or not)

    def piece_bytes(self, index: int) -> int:
        return self._last_piece if index == self.num_pieces - 1 else self.piece_size

    def endpoint(self, peer_id: str) -> SimSource | SimReceiver | None:
        return self.source if peer_id == LEARNER_ID else self.receivers.get(peer_id)

    # --- membership -------------------------------------------------------------------------

    def join(self, node: Node) -> SimReceiver | None:
        """`node` fetches this version (None: the learner's data channel refuses it, banned)."""
        if self.uplinks.banned(LEARNER_ID, node.id) or node.id in self.receivers:
            return None
        r = SimReceiver(self, node)
        self.receivers[node.id] = r
        self.loop.at(self.loop.now + 2 * (node.lat + self.learner.lat), self._connect, r)
        return r

    def _connect(self, r: SimReceiver) -> None:
        if r.left:
            return  # left before the manifest came back
        now = self.loop.now
        r.connected = True
        r.pull.last_progress = now
        uplinks = self.uplinks
        if uplinks.bans:
            for m in self.linked:
                if uplinks.banned(m.id, r.id) or uplinks.banned(r.id, m.id):
                    m.cut.add(r.id)
                    r.cut.add(m.id)
        for m in self.relayers:
            if m.connected and m.id not in r.cut:
                m.push(m.relaying, (r,))  # what r missed before its link existed
        self.linked.append(r)
        self.source.plan.join(r.id)
        self.source.start_watch()
        r._refill()
        r._loop(now)

    def leave(self, peer_id: str) -> None:
        """The member left (churn, or it stopped following): its links close."""
        r = self.receivers.get(peer_id)
        if r is None or r.left:
            return
        r.left = True
        if not r.connected:
            return
        r.connected = False
        self.linked.remove(r)
        now = self.loop.now
        self.source.links.drop(peer_id)
        self.source.plan.leave(peer_id)
        for m in self.linked:
            m.links.drop(peer_id)
            m.swarm.peer_gone(peer_id, now)
            m._loop(now)  # a dead link may free the backlog or the piece requests

    def close_source(self) -> None:
        """The learner stops serving this version (it is `keep_versions` old): its links close."""
        source = self.source
        if not source.connected:
            return
        source.connected = False
        now = self.loop.now
        for m in self.linked:
            m.source_cut = True
            m.swarm.peer_gone(LEARNER_ID, now)
            m._loop(now)

    def member_done(self, r: SimReceiver) -> None:
        self.done_count += 1
        if self.on_member_done is not None:
            self.on_member_done(self, r)

    def relay_order(self, r: SimReceiver) -> list[SimReceiver]:
        """The links a first copy is pushed on, starting at a point that rotates with each piece
        relayed, so that no member is always served last by a FIFO uplink."""
        linked = self.linked
        start = (len(r.relaying) * 7919 + r.slot * 104729) % len(linked)
        order = linked[start:] + linked[:start]
        if r.cut:
            return [m for m in order if m is not r and m.id not in r.cut]
        return [m for m in order if m is not r]

    # --- overflow (`Link.answer`) -----------------------------------------------------------

    def answer_allowed(self, holder: SimSource | SimReceiver, asker: SimReceiver) -> bool:
        """Whether `holder` answers: not if `asker` made their link queue more than the cap."""
        queued = holder.links.count.get(asker.id, 0) * self.piece_size
        if queued <= self.queue_cap:
            return True
        self.overflows += 1
        now = self.loop.now
        self.uplinks.ban(holder.id, asker.id, now + DATA_BAN_S)
        if holder is self.source:
            asker.source_cut = True
            asker.swarm.peer_gone(LEARNER_ID, now)
            self.source.links.drop(asker.id)
            self.source.plan.leave(asker.id)
        else:
            assert isinstance(holder, SimReceiver)
            holder.cut.add(asker.id)
            asker.cut.add(holder.id)
            holder.links.drop(asker.id)
            asker.links.drop(holder.id)
            holder.swarm.peer_gone(asker.id, now)
            asker.swarm.peer_gone(holder.id, now)
            holder._loop(now)
        asker._loop(now)
        return False


def simulate_broadcast(
    size_bytes: int,
    learner_up: float,
    peers: list[tuple[float, float]],
    *,
    piece_size: int | None = None,
    seed: int = 0,
    latency_s: float = 0.0,
) -> float:
    """Seconds from publication until every peer holds the version, for peers given as
    (down, up) in bytes/s, each with one-way access latency `latency_s` (the learner's too).
    `seed` orders the peers' joins (the order their hellos reach the learner)."""
    loop = EventLoop()
    uplinks = Uplinks(loop)
    learner = Node(LEARNER_ID, up=learner_up, down=math.inf, lat=latency_s)
    nodes = [Node(f"p{i:05d}", up=up, down=down, lat=latency_s) for i, (down, up) in enumerate(peers)]
    random.Random(seed).shuffle(nodes)
    bc = SimBroadcast(loop, uplinks, learner, 0, size_bytes, piece_size=piece_size)
    for node in nodes:
        bc.join(node)
    loop.run(stop=lambda: bc.done_count == len(nodes))
    return max(r.done_at for r in bc.receivers.values() if r.done_at is not None) - bc.published_at
