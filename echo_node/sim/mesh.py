"""Weight versions over a bounded-degree overlay, decided by the real protocol machines, at the
scale of thousands of peers.

What is real and what is modelled:
- Real: who links to whom is `protocol.weights.overlay.Overlay`'s (the learner's draws, healing
  on churn, slow rotation, its own bounded set); which piece a peer asks of which neighbour,
  pipelining, rarest first, the endgame are `protocol.weights.exchange.Exchange`'s; which piece
  the learner sends to whom is `protocol.weights.exchange.SeedPlan`'s.
- Modelled: bytes, hashes and sockets, by the link model of `echo_node.sim.net` (each uplink a
  FIFO at its rate, each downlink a serial queue; its module doc states the model), which each
  sender keeps here for its own uplink (`_Sender`): a transfer costs one event, its upload's end,
  whatever the swarm's size, so a version costs O(N·M) events for N peers and M pieces. Its
  arrival (upload end + downlink wait + both access latencies) is handled then, its effects timed
  from the arrival: the completion, the `have` it joins, the cancels and the next `get` it
  triggers leave at the arrival; only the receiver's own tables (`Exchange`, the learner's
  `SeedPlan`) see the piece up to those latencies early (tens of ms against a version's tens of
  seconds). Announcements (`have`) leave when the live receiver's would (`have_due`: a piece
  from the learner at once, others within `HAVE_BATCH_S`), one frame with every piece verified
  since, and reach the neighbours at once (a few bytes; per piece they would be N·M·k events); the
  requests of one decision travel together, one access latency each way, and join the holder's
  FIFO when they reach it (no event of their own unless they wake an idle uplink); a `cancel`
  likewise drops the transfer if it reaches the holder before the transfer starts.
  The learner counts a served peer as having download headroom when its downlink delivered all
  it was given (as `echo_node.sim.broadcast.SimSource` does).
- Each peer keeps what its neighbours' answers took across versions (the live
  `DataServer.link_timing`): a link's requests start at the depth the last version measured.
- Churn: a peer leaves at once (its links and what it was sending go with it); a newcomer is
  given its neighbours by the overlay and fetches the current version, announced pieces
  exchanged both ways on every new link.

Not modelled: hostile peers (tests/unit/test_protocol_exchange.py drives the machine's defences),
request timeouts (no honest peer stalls here), NAT, the TCP slow start, and ACKs: a live peer's
ACKs wait in its uplink's queue behind its uploads, so what it has queued there slows what it
downloads. That is why the live receiver sizes its requests by a neighbour's rate
(`horizon`, Exchange rule 3) and the simulator by default keeps a fixed `pipeline` of 2: here
the live rule changes little, live it changes much, and on home uplinks the live swarm stays
further from its bound than this model says (numbers: benchmarks/results/measurements.md,
"requests sized by a neighbour's rate").
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from echo_node.sim.events import EventLoop
from echo_node.sim.net import Node
from protocol.capacity import broadcast_bound
from protocol.weights.exchange import Exchange, SeedPlan, have_due
from protocol.weights.manifest import choose_piece_size
from protocol.weights.overlay import DEFAULT_DEGREE, Overlay

__all__ = ["MeshResult", "MeshSim", "VersionResult", "simulate_mesh"]

LEARNER_ID = "learner"
# A served peer has download headroom while its downlink holds at most this many pieces not yet
# delivered (a live link: its TCP window keeps a few pieces in flight).
HEADROOM_PIECES = 4


class _Sender:
    """One version's uplink on a host: `echo_node.sim.net`'s model (a FIFO at the uplink's rate;
    the receiver's downlink serves transfers in the order their uploads end), kept by the sender
    itself. A transfer enters the FIFO when it is asked for (`ready`: when the request reaches
    the sender), so a request costs no event of its own while the uplink is busy: the FIFO is a
    heap by (ready, order asked), and an idle uplink wakes at its head's `ready`. A transfer is
    skipped at its start when its receiver left, its link was cut, or the receiver called it off
    before then (`cancels`); one in progress still takes its time and is then discarded."""

    __slots__ = ("v", "loop", "node", "up", "lat", "id", "connected", "queue", "busy", "wake_at", "cancels")

    def __init__(self, v: _Version, node: Node, pid: str) -> None:
        self.v = v
        self.loop = v.loop
        self.node = node
        self.up = node.up
        self.lat = node.lat
        self.id = pid
        self.connected = False
        self.queue: list[tuple[float, int, _Receiver, int]] = []  # heap: (ready, order, receiver, piece)
        self.busy = False  # a transfer is on the uplink
        self.wake_at = math.inf  # when a pending wake-up runs (inf: none pending)
        self.cancels: dict[tuple[_Receiver, int], float] = {}  # (receiver, piece) -> when its cancel arrives

    def sent(self, dst: _Receiver, index: int) -> None:
        """A transfer left the uplink and reached a connected receiver's downlink."""

    def unsent(self, dst: _Receiver, index: int) -> None:
        """A transfer was skipped or discarded (its receiver or link is gone)."""

    def startable(self, dst: _Receiver, index: int) -> bool:
        return dst.connected

    def push(self, dst: _Receiver, indices: list[int], ready: float) -> None:
        """Queue transfers of `indices` to `dst` from time `ready` (>= now), in that order."""
        q, order = self.queue, self.v.order
        for index in indices:
            heapq.heappush(q, (ready, next(order), dst, index))
        if not self.busy and ready < self.wake_at:
            self.wake_at = ready
            self.loop.at(ready, self._wake, ready)

    def _wake(self, at: float) -> None:
        if at == self.wake_at:
            self.wake_at = math.inf
            if not self.busy:
                self._start()

    def _start(self) -> None:
        q, v = self.queue, self.v
        loop = self.loop
        now = loop.now
        while q:
            ready, _, dst, index = q[0]
            if ready > now:
                if ready < self.wake_at:
                    self.wake_at = ready
                    loop.at(ready, self._wake, ready)
                break
            heapq.heappop(q)
            if self.cancels:
                cancelled = self.cancels.pop((dst, index), None)
                if cancelled is not None and cancelled <= now:
                    self.unsent(dst, index)
                    continue
            if not self.startable(dst, index):
                self.unsent(dst, index)
                continue
            self.busy = True
            size = v.piece_size if index != v.last_index else v.last_size
            loop.at(now + size / self.up, self._done, dst, index)
            return
        self.busy = False

    def _done(self, dst: _Receiver, index: int) -> None:
        if not (self.connected and dst.connected):
            self.unsent(dst, index)
        else:
            v = self.v
            size = v.piece_size if index != v.last_index else v.last_size
            rx = dst.node
            self.node.bytes_up += size
            self.sent(dst, index)
            loop = self.loop
            now = loop.now
            arrive = max(now, max(rx.down_free, now - size / self.up) + size / rx.down)
            rx.down_free = arrive
            dst.arrived(self, index, arrive + self.lat + rx.lat)
        self._start()


class _Seed(_Sender):
    """The learner's side of one version (SeedPlan rules 6-8) over the simulated uplink."""

    __slots__ = ("plan", "timer_at")

    def __init__(self, v: _Version, node: Node) -> None:
        super().__init__(v, node, LEARNER_ID)
        self.connected = True
        self.plan = SeedPlan(v.num_pieces, random.Random(v.rng_seed), width=v.source_degree)
        self.timer_at = math.inf

    def sent(self, dst: _Receiver, index: int) -> None:
        self.plan.done(dst.id)
        self.fill()

    def unsent(self, dst: _Receiver, index: int) -> None:
        self.plan.done(dst.id)

    def send(self, dst: _Receiver, index: int) -> None:
        """Queue a push now; an idle uplink starts it at once."""
        heapq.heappush(self.queue, (self.v.loop.now, next(self.v.order), dst, index))
        if not self.busy:
            self._start()

    def fill(self) -> None:
        v = self.v
        now = v.loop.now
        idle, busy_until = [], math.inf
        for peer in self.plan.idle():
            r = v.receivers.get(peer)
            if r is None or not r.connected or r.done_at is not None:
                continue
            # Headroom: its downlink has at most HEADROOM_PIECES pieces still to deliver.
            free_at = r.node.down_free - HEADROOM_PIECES * v.piece_size / r.node.down
            if free_at > now:
                busy_until = min(busy_until, free_at)
            else:
                idle.append(peer)
        while idle:
            pick = self.plan.pick(idle)
            if pick is None:
                break
            peer, index = pick
            idle.remove(peer)
            self.send(v.receivers[peer], index)
        if now < busy_until < self.timer_at:
            self.timer_at = busy_until
            v.loop.at(busy_until, self._timer, busy_until)

    def _timer(self, at: float) -> None:
        if at == self.timer_at:
            self.timer_at = math.inf
            self.fill()


class _Receiver(_Sender):
    """A peer's side of one version: announces, asks its neighbours (Exchange), serves them."""

    __slots__ = ("ex", "links", "done_at", "joined_at", "unannounced", "announce_at", "last_have", "tell_learner", "timings")

    def __init__(self, v: _Version, node: Node, seed: int) -> None:
        super().__init__(v, node, node.id)
        self.ex = Exchange(v.num_pieces, random.Random(seed), pipeline=v.pipeline, horizon=v.horizon)
        self.links: dict[str, _Receiver] = {}
        self.done_at: float | None = None  # when it held every piece (None: not yet)
        self.joined_at = v.loop.now
        # (arrival, piece, from the learner) verified, not announced yet; the next `have` leaves
        # at announce_at, the last one left at last_have (`have_due`).
        self.unannounced: list[tuple[float, int, bool]] = []
        self.announce_at = math.inf
        self.last_have = -math.inf
        self.tell_learner = v.seed.plan.has  # the learner hears of every piece a peer verified
        # What each neighbour's answers took on our links, across versions (the live peer's
        # `DataServer.link_timing`).
        self.timings = v.timings.setdefault(node.id, {})

    def link(self, other: _Receiver) -> None:
        """A new link: both sides announce what they hold, then ask."""
        self.links[other.id] = other
        other.links[self.id] = self
        self.ex.neighbour_up(other.id, took=self.timings.get(other.id))
        other.ex.neighbour_up(self.id, took=other.timings.get(self.id))
        for a, b in ((self, other), (other, self)):
            if a.ex.count:
                b.ex.has_bits(a.id, a.ex.have_bits)
        self.ask(other)
        other.ask(self)

    def unlink(self, other: _Receiver) -> None:
        self.links.pop(other.id, None)
        other.links.pop(self.id, None)
        self.remember(other.id)
        other.remember(self.id)
        self.ex.neighbour_gone(other.id)
        other.ex.neighbour_gone(self.id)
        self.refill()
        other.refill()

    def refill(self) -> None:
        for other in list(self.links.values()):
            self.ask(other)

    def remember(self, peer: str) -> None:
        """Keep what `peer`'s answers took, for our next version's link to it."""
        took = self.ex.timing(peer)
        if took is not None:
            self.timings[peer] = took

    def announce(self, at: float) -> None:
        """One `have` frame to every neighbour with the pieces that arrived since the last; it
        leaves when the earliest of them is due (`have_due`: a piece from the learner at once,
        any other `HAVE_BATCH_S` after its arrival), with every piece that arrived meanwhile."""
        if at != self.announce_at:
            return  # an earlier arrival moved the frame forward: this one is stale
        fresh, later = 0, []
        for item in self.unannounced:
            if item[0] <= at:
                fresh |= 1 << item[1]
            else:
                later.append(item)
        self.unannounced = later
        self.announce_at = math.inf
        if fresh:
            self.last_have = at
        if later:
            self._announce_by(min(have_due(t, self.last_have, from_learner=seed) for t, _, seed in later))
        if not self.connected or not fresh:
            return
        me = self.id
        for other in self.links.values():
            if other.connected and other.done_at is None and other.ex.has_bits(me, fresh):
                other.ask(self)

    def _announce_by(self, at: float) -> None:
        if at < self.announce_at:
            self.announce_at = at
            self.loop.at(at, self.announce, at)

    def ask(self, holder: _Receiver) -> None:
        if not self.connected or self.done_at is not None:
            return
        now = self.loop.now
        wanted = self.ex.requests(holder.id, now)
        if wanted:
            # The `get` reaches the holder after both access latencies; its transfers join the
            # holder's FIFO then.
            holder.push(self, wanted, now + self.lat + holder.lat)

    def startable(self, dst: _Receiver, index: int) -> bool:
        """A `get` is served while both ends are up and linked (a cut link takes its queue)."""
        return self.connected and dst.connected and dst.id in self.links and bool(self.ex.have[index])

    def arrived(self, src: _Sender, index: int, at: float) -> None:
        """A piece from `src` left its uplink now and arrives at `at` (module doc: handled now,
        its effects timed from `at`)."""
        if not self.connected:
            return
        v, ex = self.v, self.ex
        sid = src.id
        v.deliveries += 1
        if ex.received(sid, index, now=at):
            cancels = ex.take_cancels()
            if cancels:
                # A `cancel` reaches the holder after both access latencies; the transfer is
                # dropped if it has not started by then.
                sent = at + self.lat
                for peer, i in cancels:
                    holder = self.links.get(peer)
                    if holder is not None:
                        holder.cancels[(self, i)] = sent + holder.lat
            seeded = sid == LEARNER_ID
            self.unannounced.append((at, index, seeded))
            self._announce_by(have_due(at, self.last_have, from_learner=seeded))
            self.tell_learner(self.id, index)
            if ex.count == ex.num_pieces:
                self.done_at = at
                v.done += 1
                v.finished()
                return
        else:
            v.duplicates += 1
            if sid == LEARNER_ID:
                v.learner_duplicates += 1
        # Its pipeline to the sender has a free slot: ask again (what `ask` does, inline), the
        # `get` leaving on arrival.
        if self.links.get(sid) is src and self.done_at is None:
            wanted = ex.requests(sid, at)
            if wanted:
                src.push(self, wanted, at + self.lat + src.lat)


@dataclass(slots=True)
class VersionResult:
    version: int
    bound_s: float
    seconds: float | None  # publication until every member present at publication that stayed holds it
    last_s: float | None  # until the last member (newcomers included) held it
    members: int
    learner_copies: float  # pieces the learner sent ÷ pieces of the version
    deliveries: int  # pieces that reached a connected receiver
    duplicates: int  # of which it held already
    wall_s: float
    cpu_s: float  # this process's CPU time for the version (the wall time counts a loaded machine's other work)

    @property
    def ratio(self) -> float | None:
        return None if self.seconds is None else self.seconds / self.bound_s


class _Version:
    def __init__(self, sim: MeshSim, version: int, size_bytes: int) -> None:
        self.loop = sim.loop
        self.order = itertools.count()  # ties between transfers ready at the same time: order asked
        self.rng_seed = sim.seed * 1_000_003 + version
        self.version = version
        self.pipeline = sim.pipeline
        self.horizon = sim.horizon
        self.source_degree = sim.overlay.source_degree
        self.piece_size = sim.piece_size or choose_piece_size(size_bytes)
        self.num_pieces = -(-size_bytes // self.piece_size)
        self.last_index = self.num_pieces - 1
        self.last_size = size_bytes - (self.num_pieces - 1) * self.piece_size
        self.receivers: dict[str, _Receiver] = {}
        self.timings = sim.timings
        self.deliveries = 0
        self.duplicates = 0
        self.learner_duplicates = 0
        self.done = 0
        self.pending = 0  # connected receivers that lack pieces
        self.published_at = sim.loop.now
        self.seed = _Seed(self, sim.learner)

    def finished(self) -> None:
        """A connected receiver that lacked pieces holds them all now: the version is over once
        none lacks any (a leave only counts down: its churn event may bring a newcomer)."""
        self.pending -= 1
        if not self.pending:
            self.loop.halt()

    def piece_bytes(self, index: int) -> int:
        return self.last_size if index == self.last_index else self.piece_size


@dataclass(slots=True)
class MeshResult:
    versions: list[VersionResult] = field(default_factory=list)
    links_per_peer_max: int = 0
    links_per_peer_mean: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    events: int = 0


class MeshSim:
    """A learner and a churning swarm of peers on the overlay, one version after another."""

    def __init__(
        self,
        learner_up: float,
        peers: list[tuple[str, float, float, float]],
        *,
        size_bytes: int,
        degree: int = DEFAULT_DEGREE,
        source_degree: int = 32,
        pipeline: int = 2,
        horizon: float | None = None,
        piece_size: int | None = None,
        churn_per_hour: float = 0.0,
        rotate_share: float = 0.02,
        source_rotate: int = 2,
        seed: int = 0,
        spare: list[tuple[str, float, float, float]] | None = None,
    ) -> None:
        self.loop = EventLoop()
        self.rng = random.Random(seed)
        self.seed = seed
        self.size_bytes = size_bytes
        self.pipeline = pipeline
        self.horizon = horizon
        self.piece_size = piece_size
        self.churn_per_hour = churn_per_hour
        self.rotate_share = rotate_share
        self.source_rotate = source_rotate
        self.learner = Node(LEARNER_ID, up=learner_up, down=math.inf)
        self.nodes: dict[str, Node] = {}
        self.overlay = Overlay(random.Random(seed + 1), degree=degree, source_degree=source_degree, settle_s=0.0)
        for pid, down, up, lat in peers:
            self._add(pid, down, up, lat)
        # Newcomers under churn are drawn from these (and from those who left), one per leave.
        self.spare = list(spare or [])
        self.gone: list[tuple[str, float, float, float]] = []
        self.current: _Version | None = None
        # Per peer, what each neighbour's answers took (Exchange rule 3), kept across versions.
        self.timings: dict[str, dict[str, float]] = {}

    def _add(self, pid: str, down: float, up: float, lat: float) -> None:
        self.nodes[pid] = Node(pid, up=up, down=down, lat=lat)
        self.overlay.join(pid, reachable=True, now=self.loop.now)

    # --- one version --------------------------------------------------------------------------

    def publish(self, version: int) -> tuple[_Version, set[str]]:
        v = _Version(self, version, self.size_bytes)
        self.current = v
        for pid, node in self.nodes.items():
            v.receivers[pid] = _Receiver(v, node, self.rng.getrandbits(32))
        for r in v.receivers.values():
            r.connected = True
        v.pending = len(v.receivers)
        for a, b in self._shuffled(self.overlay.links()):
            v.receivers[a].link(v.receivers[b])
        preferred = self.overlay.source_links()
        for pid in v.receivers:
            v.seed.plan.link(pid, preferred=pid in preferred)
        v.seed.fill()
        return v, set(self.nodes)

    def leave(self, pid: str) -> None:
        node = self.nodes.pop(pid, None)
        if node is None:
            return
        self.gone.append((pid, node.down, node.up, node.lat))
        change = self.overlay.leave(pid, now=self.loop.now)
        v = self.current
        if v is None:
            return
        r = v.receivers.get(pid)
        if r is not None:
            if r.connected and not r.ex.complete:
                v.pending -= 1
            r.connected = False
            for other in list(r.links.values()):
                r.unlink(other)
            v.seed.plan.drop(pid)
        self._apply(v, change.added, set())
        v.seed.fill()

    def join(self, pid: str, down: float, up: float, lat: float) -> None:
        self.nodes[pid] = node = Node(pid, up=up, down=down, lat=lat)
        change = self.overlay.join(pid, reachable=True, now=self.loop.now)
        v = self.current
        if v is None:
            return
        r = v.receivers[pid] = _Receiver(v, node, self.rng.getrandbits(32))
        r.connected = True
        v.pending += 1
        self._apply(v, change.added, change.removed)
        v.seed.plan.link(pid)
        v.seed.fill()

    def _shuffled(self, links: set[tuple[str, str]]) -> list[tuple[str, str]]:
        """`links` in a seeded random order: reproducible (a set's order varies with the
        process's string hashing) and unbiased (in sorted order every peer's neighbours would be
        linked, announced to and asked lowest id first, which loads the low ids and costs the
        learner copies: benchmarks/results/measurements.md)."""
        out = sorted(links)
        self.rng.shuffle(out)
        return out

    def _apply(self, v: _Version, added: set[tuple[str, str]], removed: set[tuple[str, str]]) -> None:
        for a, b in self._shuffled(removed):
            ra, rb = v.receivers.get(a), v.receivers.get(b)
            if ra is not None and rb is not None:
                ra.unlink(rb)
        for a, b in self._shuffled(added):
            ra, rb = v.receivers.get(a), v.receivers.get(b)
            if ra is not None and rb is not None and ra.connected and rb.connected:
                ra.link(rb)

    # --- the run ------------------------------------------------------------------------------

    def run(
        self,
        versions: int,
        *,
        max_wall_s: float = math.inf,
        timeout_factor: float = 10.0,
        on_version: Callable[[VersionResult], None] | None = None,
    ) -> MeshResult:
        """Publish `versions` versions one after another; `on_version` hears each as it ends
        (a 10,000-peer version takes minutes: a caller shows progress with it)."""
        result = MeshResult()
        started, cpu = time.perf_counter(), time.process_time()
        for version in range(versions):
            if time.perf_counter() - started > max_wall_s:
                break
            result.versions.append(self._one(version, timeout_factor))
            if on_version is not None:
                on_version(result.versions[-1])
            # Between versions the learner rewires a few links and rotates its own set.
            self.overlay.rotate(int(self.rotate_share * len(self.overlay.links())), now=self.loop.now)
            self.overlay.rotate_source(self.source_rotate)
        degrees = [len(self.overlay.neighbours(p)) for p in self.nodes]
        result.links_per_peer_max = max(degrees, default=0)
        result.links_per_peer_mean = sum(degrees) / max(1, len(degrees))
        result.wall_s = time.perf_counter() - started
        result.cpu_s = time.process_time() - cpu
        result.events = self.loop.events_run
        return result

    def _one(self, version: int, timeout_factor: float) -> VersionResult:
        wall, cpu = time.perf_counter(), time.process_time()
        nodes = list(self.nodes.values())
        bound = broadcast_bound(self.size_bytes, self.learner.up, [n.down for n in nodes], [n.up for n in nodes])
        v, members = self.publish(version)
        start = self.loop.now
        deadline = start + timeout_factor * bound
        if self.churn_per_hour > 0:
            self._schedule_churn(v, deadline)
        if v.pending:
            self.loop.run(until=deadline)
        seconds = _until_all([r.done_at for pid, r in v.receivers.items() if pid in members and r.connected], start)
        last = _until_all([r.done_at for r in v.receivers.values() if r.connected], start)
        # What is still queued for this version goes: the next starts on idle links.
        for r in v.receivers.values():
            for peer in r.links:
                r.remember(peer)
            r.connected = False
        v.seed.connected = False
        self._drain()
        return VersionResult(
            version=version, bound_s=bound, seconds=seconds, last_s=last, members=len(members),
            learner_copies=v.seed.plan.total_sent / v.num_pieces, deliveries=v.deliveries, duplicates=v.duplicates,
            wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu,
        )

    def _drain(self) -> None:
        """Start the next version on a clean slate: drop the timers of the last one (its queues
        went with its senders)."""
        self.loop.clear()
        for node in [*self.nodes.values(), self.learner]:
            node.down_free = min(node.down_free, self.loop.now)

    def _schedule_churn(self, v: _Version, until: float) -> None:
        rate = self.churn_per_hour / 3600.0 * len(self.nodes)  # leaves per second, each replaced
        t = self.loop.now
        while True:
            t += self.rng.expovariate(rate)
            if t >= until:
                return
            self.loop.at(t, self._churn_one)

    def _churn_one(self) -> None:
        if not self.nodes:
            return
        pid = self.rng.choice(sorted(self.nodes)) if len(self.nodes) < 64 else self._draw_node()
        self.leave(pid)
        pool = self.spare or self.gone
        if pool:
            new = pool.pop(self.rng.randrange(len(pool)))
            if new[0] not in self.nodes:
                self.join(*new)
        if self.current is not None and not self.current.pending:
            self.loop.halt()

    def _draw_node(self) -> str:
        keys = list(self.nodes)
        return keys[self.rng.randrange(len(keys))]


def _until_all(done_at: list[float | None], start: float) -> float | None:
    """Seconds from `start` until the last of them completed; None if one did not (or none)."""
    times = [t for t in done_at if t is not None]
    return max(times) - start if times and len(times) == len(done_at) else None


def simulate_mesh(
    size_bytes: int,
    learner_up: float,
    peers: list[tuple[float, float]],
    *,
    versions: int = 1,
    latency_s: float = 0.0,
    seed: int = 0,
    **kwargs: object,
) -> MeshResult:
    """Versions of `size_bytes` over the overlay, for peers given as (down, up) in bytes/s."""
    specs = [(f"p{i:05d}", down, up, latency_s) for i, (down, up) in enumerate(peers)]
    sim = MeshSim(learner_up, specs, size_bytes=size_bytes, seed=seed, **kwargs)  # type: ignore[arg-type]
    return sim.run(versions)
