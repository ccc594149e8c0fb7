"""Weight versions over the bounded-degree overlay, live: the learner's sends (`SeedSource`) and a
peer's piece exchange with its neighbours (`MeshReceiver`).

Every decision is a pure machine's, the same ones the simulator drives (echo_node/sim/mesh.py):
who links to whom is `protocol.weights.overlay.Overlay`'s (kept by `PeerOverlay`, one per run),
which piece a peer asks of which neighbour (pipelining, rarest first, endgame, timeouts) is
`protocol.weights.exchange.Exchange`'s, which piece the learner sends to whom is `SeedPlan`'s.
This module moves their frames over `broadcast.Link`s and holds the bounds a live link needs.

Why a second scheme beside the push mesh of broadcast.py: there every peer links to every other
(N²/2 links) and relays each piece it got from the source to all of them, one hop. That is at
its bound on small swarms and hopeless at thousands of peers. Here each peer holds at most the
overlay's degree of links (k, 12-24), and pieces travel many hops by `have` and `get`. The
learner serves every version this way unless the config forces the push mesh
(`PeerOverlay.use_mesh`); the peer learns which from the source's second frame (`neighbours`
instead of `peers`: echo_node/weights/fetch.py).

Rules (tests: tests/node/test_mesh_broadcast.py, tests/adversarial/test_mesh_attacks.py):
1. Links: a peer links only with the neighbours the learner listed for it in this version, and
   accepts a dial only from one of them; a later `neighbours` frame replaces the set and cuts the
   links it no longer names. At most MAX_NEIGHBOURS are taken from a list. Who dials is the push
   mesh's rule: between two dialable peers the one with the larger id, and a peer nobody can
   dial dials every dialable neighbour. So a Sybil cannot place itself beside a victim: the
   learner draws neighbours (overlay rule 2).
2. Announcements: a new link starts with a `have` of everything held; pieces verified since are
   announced in one `have` per HAVE_BATCH_S (exchange.py) to every neighbour and to the learner (its SeedPlan
   picks peers by what they hold), a piece from the learner at once (`have_due`: nobody else
   holds it yet). The learner's `have` also names the pieces asked of a
   neighbour: it then sends none of them, so a neighbour's answer is not wasted on a piece the
   learner sent meanwhile. Nobody asks pieces of the learner's link by its haves, so the claim
   cannot mislead anyone else.
3. Requests: `Exchange.requests` fills each neighbour's pipeline after every event that may
   open one; its depth covers MESH_HORIZON_S at the rate that neighbour's answers arrive, one
   to MESH_PIPELINE requests (Exchange rule 3), starting from the rate measured on our last
   version's link to it (`DataServer.link_timing`). A request unanswered for REQUEST_TIMEOUT_S is asked elsewhere; a
   neighbour whose requests time out MAX_STALLS times is cut (a trickler, or one that announces
   pieces it never sends), not banned (a congested honest link looks the same).
4. Answers: a neighbour is answered only for pieces we hold (asking for one we never announced
   is a protocol violation), at most ANSWER_COPIES copies of the version in all, and never more
   queued than `Link.answer`'s cap: asking without reading, or asking for the same pieces over
   and over to spend our uplink, is a ban.
5. Pieces: every piece is hash-checked against the signed manifest before it is stored,
   announced or served; a bad one bans its sender. A neighbour sends only what we asked of it
   (an unasked piece is a ban: it would spend our downlink at its choosing); late answers to
   requests that timed out are fine. A request whose piece came from elsewhere first (the
   learner, or the endgame's other copy), or that timed out, is called off with a `cancel`: its
   holder drops the answer if it has not begun to leave (`Link.withdraw`; what its kernel and
   the network hold already is sent anyway). A cancel of a piece it has no request for (never
   asked, or called off already) is a ban.
6. The learner (`SeedSource`): one piece in flight per served peer, sent when the link's queue is
   empty (its kernel buffer holds at most SOURCE_NOTSENT_LOWAT unsent, so an empty queue means
   download headroom); whom and what are SeedPlan rules 7-9 (the peer holding fewest pieces,
   the piece sent fewest times, nobody above its fair share). A peer may also `get` pieces nobody
   offers it (its holder left before announcing): at most `repair_allowance` per version, then
   `none`. So claiming to hold nothing draws at most a fair share plus that allowance. The
   frames a peer sends the learner do work the version's size bounds: a `have` costs a pass
   over its pieces new on that link only, more `have`s naming none new than the version has
   pieces, or more than SOURCE_PIPELINE + 1 `get`s answered `none`, is a ban (a flood of
   repeated full haves cost the learner a pass over every piece each).
7. A peer asks the learner only for pieces no neighbour offers, after SOURCE_REPAIR_S without a
   new piece, SOURCE_PIPELINE at a time, until it says `none`.

Not done here (yet): a measured round trip for the pipeline's horizon (a fixed
MESH_HORIZON_S), and an uplink estimate kept across versions.
"""

from __future__ import annotations

import logging
import math
import mmap
import random
import secrets
from collections import Counter
from collections.abc import Collection, Mapping
from contextlib import aclosing
from dataclasses import dataclass

import trio

from echo_node.weights.broadcast import (
    LINK_ERRORS,
    SOURCE_NOTSENT_LOWAT,
    SOURCE_PIPELINE,
    Changes,
    Connector,
    DataServer,
    Link,
    Misbehaved,
    PieceStore,
    ROUTE_WAIT_S,
    Stats,
    base_of,
    encode_frame,
)
from echo_node.net.framing import write_frame
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.weights.datachannel import (
    MAX_SWARM_ENTRIES,
    Cancel,
    Frame,
    Get,
    Have,
    Hello,
    ManifestFrame,
    Neighbours,
    NoMore,
    PeerEntry,
    Piece,
    mask_indices,
    session_signature,
)
from protocol.weights.exchange import HAVE_BATCH_S, Exchange, SeedPlan, have_due
from protocol.weights.manifest import WeightManifest
from protocol.weights.overlay import DEFAULT_DEGREE, DEGREE_RANGE, Change, Overlay

__all__ = ["MeshReceiver", "PeerOverlay", "SeedSource"]

log = logging.getLogger(__name__)

# Requests outstanding per neighbour (Exchange rule 3): enough to cover MESH_HORIZON_S at the
# rate the neighbour's answers arrive, at most MESH_PIPELINE. A home uplink shared by its
# neighbours answers a 64 KiB piece in a few hundred ms: one request. MESH_HORIZON_S stands for
# a round trip; links measure no RTT yet.
MESH_PIPELINE = 4
MESH_HORIZON_S = 0.1
REQUEST_TIMEOUT_S = 5.0
# Requests of one neighbour that may time out before it is cut (rule 3).
MAX_STALLS = 3
# The most links a `neighbours` frame may set: the overlay's largest degree plus its headroom.
MAX_NEIGHBOURS = DEGREE_RANGE[1] + DEGREE_RANGE[1] // 2
# A neighbour may be answered this many copies of the version (an honest one asks each piece of
# us at most once, again only after its request to us timed out), plus a few pieces.
ANSWER_COPIES = 2
ANSWER_SLACK = 16
# Rule 7: no new piece for this long, and pieces nobody offers: ask the learner for them.
SOURCE_REPAIR_S = 1.0
# Rule 6: pieces a peer may `get` from the learner per version: this share of the version, at
# least REPAIR_MIN.
REPAIR_SHARE = 16
REPAIR_MIN = 8
# The tags of the frames the learner queues: every one tells it when it left (`Link.on_sent`).
_PUSH = "push"
_SENT = "sent"


class PeerOverlay:
    """The learner's overlay of one run, kept in step with its tables: members join it at their
    first fetch of a version on the overlay (dialable when a dial-back proved their address),
    leave it once they are no longer members, and are rewired slowly between versions."""

    def __init__(
        self,
        members: Collection[str],
        relays: Mapping[str, tuple[str, int]],
        *,
        mode: str = "auto",
        degree: int = DEFAULT_DEGREE,
        source_degree: int = 32,
        source_rotate: int = 2,
        settle_s: float = 60.0,
        rotate_share: float = 0.02,
        rng: random.Random | None = None,
    ) -> None:
        if mode not in ("auto", "push", "mesh"):
            raise ValueError(f"exchange mode must be auto, push or mesh, got {mode!r}")
        self.members = members
        self.relays = relays
        self.mode = mode
        self.rotate_share = rotate_share
        self.source_rotate = source_rotate
        self.overlay = Overlay(rng or random.Random(secrets.randbits(64)), degree=degree,
                               source_degree=source_degree, settle_s=settle_s)

    def use_mesh(self) -> bool:
        """Whether the next version goes out on the overlay: unless the mode forces the push mesh.
        (`auto` took the push mesh up to degree + 1 members until the overlay measured better on
        home links at 3 and 8 peers and level on symmetric ones: benchmarks/results/mesh-live-issue27.)"""
        return self.mode != "push"

    def place(self, peer: str, now: float) -> Change:
        """`peer` fetches a version: make it a member of the overlay, dialable or not as its
        proven address says (a peer proven since it joined is placed again)."""
        change = Change()
        reachable = peer in self.relays
        known = self.overlay.is_reachable(peer)
        if known is not None and known != reachable:
            change.merge(self.overlay.leave(peer, now=now))
        if peer not in self.overlay:
            change.merge(self.overlay.join(peer, reachable=reachable, now=now))
        return change

    def between_versions(self, now: float) -> None:
        """Before a new version: members gone leave; a few links and learner links rotate."""
        for peer in self.overlay.members():
            if peer not in self.members:
                self.overlay.leave(peer, now=now)
        self.overlay.rotate(int(self.rotate_share * len(self.overlay.links())), now=now)
        self.overlay.rotate_source(self.source_rotate)


@dataclass(slots=True)
class _Heard:
    """What a peer has sent on its current link to the learner (`SeedSource`'s bounds)."""

    pieces: int = 0  # the pieces it announced (a mask)
    stale_haves: int = 0  # its `have`s that named no new piece
    refused: int = 0  # its `get`s answered `none`


class SeedSource:
    """The learner's side of one version on the overlay (rule 6)."""

    def __init__(
        self,
        identity: Identity,
        manifest: WeightManifest,
        sealed_manifest: bytes,
        payload: bytes,
        overlay: PeerOverlay,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.identity = identity
        self.sealed_manifest = sealed_manifest
        self.store = PieceStore(manifest, payload)
        self.overlay = overlay
        self.members = overlay.members
        self.relays = overlay.relays
        n = manifest.num_pieces
        self.plan = SeedPlan(n, rng or random.Random(secrets.randbits(64)), width=overlay.overlay.source_degree)
        self.repair_allowance = max(REPAIR_MIN, n // REPAIR_SHARE)
        self.stats = Stats()
        # Set by the owner to hold pieces back until the swarm has gathered; open by default.
        self.gate = trio.Event()
        self.gate.set()
        # Peers that fetched this version (their entry as first told), kept after their link to
        # us ends: they still serve their neighbours.
        self.present: dict[str, PeerEntry] = {}
        self.repairs: Counter[str] = Counter()
        self._links: dict[str, Link] = {}
        self._told: dict[str, frozenset[str]] = {}
        # Per link: the pieces its peer announced on it, its `have`s that named none new, and
        # its `get`s answered `none`. Only new pieces cost us a pass; a peer may name a piece
        # twice (asked of a neighbour, then verified: ours does not, another may), so at most
        # as many haves without a new piece as the version has pieces; and it stops asking at
        # `none` (its SOURCE_PIPELINE requests in flight then still come). So the frames a
        # peer sends us do work that the version's size bounds; past that, a ban.
        self._heard: dict[str, _Heard] = {}

    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None:
        peer = hello.sender
        if peer not in self.members:
            raise RemoteProtocolError(f"{peer} is not a member of this run")
        if peer in self._links:
            raise RemoteProtocolError(f"{peer} holds a link for this version already")
        manifest = self.store.manifest
        change = self.overlay.place(peer, trio.current_time())
        link = Link(stream, peer, self.stats, lambda tag: self._sent(peer, tag), num_pieces=manifest.num_pieces,
                    piece_size=manifest.piece_size, notsent_lowat=SOURCE_NOTSENT_LOWAT)
        misbehaved: RemoteProtocolError | None = None
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(link.sender)
            link.send(ManifestFrame(self.sealed_manifest, session_signature(self.identity, hello.raw)), _SENT)
            host, port = self.relays.get(peer, ("", 0))
            self.present[peer] = PeerEntry(peer, host, port)
            self._links[peer] = link
            self._heard[peer] = _Heard()
            self._tell(peer)
            touched = {p for edge in (*change.added, *change.removed) for p in edge} | self.overlay.overlay.neighbours(peer)
            for other in sorted(touched - {peer}):
                self._tell(other)
            self.plan.link(peer, preferred=peer in self.overlay.overlay.source_links())
            try:
                await self.gate.wait()
                self._fill()
                async with aclosing(link.frames()) as frames:
                    async for frame in frames:
                        self._on_frame(link, frame)
            except RemoteProtocolError as exc:
                misbehaved = exc
            finally:
                self._links.pop(peer, None)
                self._told.pop(peer, None)
                self._heard.pop(peer, None)
                self.plan.drop(peer)
                link.close()
                nursery.cancel_scope.cancel()
            if link.stalled:
                misbehaved = RemoteProtocolError(f"{peer} does not read what it asked for")
        if misbehaved is not None:
            raise Misbehaved(f"{peer}: {misbehaved}")

    def _on_frame(self, link: Link, frame: Frame) -> None:
        peer = link.remote
        heard = self._heard[peer]
        if isinstance(frame, Have):
            new = frame.bits & ~heard.pieces
            if not new:
                heard.stale_haves += 1
                if heard.stale_haves > self.store.manifest.num_pieces:
                    raise RemoteProtocolError("more haves naming no new piece than the version has pieces")
                return
            heard.pieces |= new
            for index in mask_indices(new):
                self.plan.has(peer, index)
            self._fill()
        elif isinstance(frame, Get):
            data = self.store.get(frame.index)
            if self.repairs[peer] >= self.repair_allowance or data is None:
                heard.refused += 1
                if heard.refused > SOURCE_PIPELINE + 1:
                    raise RemoteProtocolError("keeps asking for repairs after `none`")
                link.answer(NoMore(), _SENT)
                return
            self.repairs[peer] += 1
            self.plan.has(peer, frame.index)
            link.answer(Piece(frame.index, data), _SENT)  # type: ignore[arg-type]  # a read-only view packs as bin
        else:
            raise RemoteProtocolError(f"unexpected {type(frame).__name__} frame from a peer on the overlay")

    def _tell(self, peer: str) -> None:
        """Send `peer` its neighbours of this version, if they changed since we last did."""
        link = self._links.get(peer)
        if link is None:
            return
        wanted = sorted(p for p in self.overlay.overlay.neighbours(peer) if p in self.present and p in self.members)
        key = frozenset(wanted[:MAX_NEIGHBOURS])
        if self._told.get(peer) == key:
            return
        self._told[peer] = key
        entries = [self.present[peer], *(self.present[p] for p in sorted(key))]
        link.send(Neighbours(tuple(entries[:MAX_SWARM_ENTRIES])), _SENT)

    def _sent(self, peer: str, tag: object) -> None:
        if tag == _PUSH:
            self.plan.done(peer)
        self._fill()

    def _fill(self) -> None:
        """Rule 6: a piece to every served peer with nothing in flight and an empty queue."""
        if not self.gate.is_set():
            return
        idle = [p for p in self.plan.idle() if (link := self._links.get(p)) is not None and not link.queued_bytes]
        while idle:
            pick = self.plan.pick(idle)
            if pick is None:
                return
            peer, index = pick
            idle.remove(peer)
            self._links[peer].send(Piece(index, self.store.get(index)), _PUSH)  # type: ignore[arg-type]


class MeshReceiver:
    """A rollout peer's side of one version on the overlay (rules 1-5, 7)."""

    def __init__(
        self, server: DataServer, manifest: WeightManifest, *, source_id: str,
        into: bytearray | memoryview | mmap.mmap | None = None, connect: Connector | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.server = server
        self.identity = server.identity
        self.manifest = manifest
        self.source_id = source_id
        self.store = PieceStore(manifest, into=into)
        self.stats = Stats()
        self.links: dict[str, Link] = {}
        self.members: set[str] = set()  # the neighbours the source lists now
        self.reachable = True
        self.ex = Exchange(manifest.num_pieces, rng or random.Random(secrets.randbits(64)), pipeline=MESH_PIPELINE,
                           horizon=MESH_HORIZON_S, request_timeout=REQUEST_TIMEOUT_S)
        self.done = trio.Event()
        self.cut: Counter[str] = Counter()  # neighbours cut, by why
        self._source: Link | None = None
        self._fresh = 0  # pieces verified since the last `have` (a mask)
        self._claimed = 0  # pieces asked of neighbours, not yet told the learner (rule 2)
        self._told_source = 0  # pieces told the learner: held or asked of a neighbour
        self._flush_at: float | None = None
        self._last_have = -math.inf  # when our last `have` to the neighbours left
        self._asked_of: dict[str, int] = {}  # neighbour -> pieces ever asked of it (a mask)
        self._answers: Counter[str] = Counter()  # neighbour -> pieces it asked of us
        # neighbour -> the pieces it asked of us and has not called off (a mask): a `get` sets
        # its bit, a `cancel` needs it and clears it, so each request is called off at most once.
        self._cancellable: dict[str, int] = {}
        self._answer_cap = ANSWER_COPIES * manifest.num_pieces + ANSWER_SLACK
        self._asked_source: set[int] = set()
        self._source_empty = False
        self._last_piece = 0.0
        self._scopes: dict[str, trio.CancelScope] = {}
        self._wake = trio.Event()
        self._members_changed = Changes()
        self._nursery: trio.Nursery | None = None
        self.connect = connect or server.net.connect

    @property
    def missing(self) -> int:
        return self.manifest.num_pieces - self.store.count

    # -- connections -------------------------------------------------------------------------

    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None:
        """An incoming link from another peer (routed here by the DataServer)."""
        # The source names a newcomer to us and the newcomer's dial may outrun that.
        if not await self._members_changed.until(lambda: hello.sender in self.members, ROUTE_WAIT_S):
            raise RemoteProtocolError(f"{hello.sender} is not one of our neighbours for this version")
        if hello.sender in self.links:
            raise RemoteProtocolError(f"{hello.sender} holds a link with us for this version already")
        await self._run_link(stream, hello.sender)

    async def _dial(self, entry: PeerEntry) -> None:
        if self.server.is_banned(entry.peer_id):
            return
        try:
            stream = await self.connect(entry.host, entry.port)
            hello = self.server.hello(target=entry.peer_id, version=self.manifest.version, base=base_of(self.manifest))
            await write_frame(stream, hello)
        except LINK_ERRORS as exc:
            log.info("could not reach %s at %s:%d: %s", entry.peer_id, entry.host, entry.port, exc)
            return
        if entry.peer_id not in self.members or entry.peer_id in self.links:
            await stream.aclose()  # dropped from our neighbours meanwhile, or it dialed us first
            return
        await self._run_link(stream, entry.peer_id)

    def _set_neighbours(self, entries: tuple[PeerEntry, ...]) -> None:
        me = self.identity.peer_id
        if not entries or entries[0].peer_id != me:
            raise RemoteProtocolError("a neighbours frame must start with our own entry")
        self.reachable = entries[0].port != 0
        wanted: dict[str, PeerEntry] = {}
        for e in entries[1:]:
            if e.peer_id not in (me, self.source_id) and len(wanted) < MAX_NEIGHBOURS:
                wanted[e.peer_id] = e
        for gone in self.members - wanted.keys():
            scope = self._scopes.get(gone)
            if scope is not None:
                scope.cancel()
        added = [e for pid, e in wanted.items() if pid not in self.members]
        self.members = set(wanted)
        for e in added:
            if e.port and (e.peer_id < me or not self.reachable) and self._nursery is not None:
                self._nursery.start_soon(self._dial, e)
        self._members_changed.fire()

    async def _run_link(self, stream: trio.abc.Stream, remote: str) -> None:
        m = self.manifest
        from_source = remote == self.source_id
        try:
            link = Link(stream, remote, self.stats, num_pieces=m.num_pieces, piece_size=m.piece_size, from_source=from_source)
        except LINK_ERRORS:
            return  # gone before the first byte
        if from_source:
            self._source = link
        else:
            self.links[remote] = link
        try:
            with trio.CancelScope() as scope:
                self._scopes[remote] = scope
                async with stream, trio.open_nursery() as nursery:
                    nursery.start_soon(link.sender)
                    held = self.ex.have_bits | (self._told_source if from_source else 0)
                    if held:
                        link.send(Have(held))
                    if from_source:
                        self._told_source = held
                    if not from_source:
                        self.ex.neighbour_up(remote, took=self.server.link_timing(remote))
                        self._ask(link)
                    try:
                        async with aclosing(link.frames()) as frames:
                            async for frame in frames:
                                self._on_frame(link, frame)
                    except RemoteProtocolError as exc:
                        if from_source:  # bound to the learner's key: only logged
                            log.warning("data connection with the learner: %s", exc)
                        else:
                            self.server.ban(remote, str(exc))
                    nursery.cancel_scope.cancel()
        finally:
            link.close()
            if from_source:
                self._source = None
            else:
                self.links.pop(remote, None)
                self._scopes.pop(remote, None)
                self._remember_timing(remote)
                self.ex.neighbour_gone(remote)
            self._wake.set()

    def _remember_timing(self, peer: str) -> None:
        """Keep what `peer`'s answers took for the next version's link to it (rule 3)."""
        took = self.ex.timing(peer)
        if took is not None:
            self.server.remember_link_timing(peer, took)

    # -- frames ------------------------------------------------------------------------------

    def _on_frame(self, link: Link, frame: Frame) -> None:
        """One decoded frame (frames only the source may send: `Link` checks)."""
        if isinstance(frame, Piece):
            self._on_piece(link, frame.index, frame.data)
        elif isinstance(frame, Have):
            if link is not self._source and self.ex.has_bits(link.remote, frame.bits):
                self._ask(link)
        elif isinstance(frame, Get):
            self._answer(link, frame.index)
        elif isinstance(frame, Cancel):
            self._withdraw(link, frame.index)
        elif isinstance(frame, Neighbours):
            self._set_neighbours(frame.entries)
        elif isinstance(frame, NoMore):
            self._source_empty = True
        else:
            raise RemoteProtocolError(f"unexpected {type(frame).__name__} frame on the overlay")
        self._wake.set()

    def _answer(self, link: Link, index: int) -> None:
        data = self.store.get(index)
        if data is None:
            raise RemoteProtocolError(f"asked for piece {index}, which we never announced")
        remote = link.remote
        self._answers[remote] += 1
        if self._answers[remote] > self._answer_cap:
            raise RemoteProtocolError(f"asked for more than {ANSWER_COPIES} copies of the version")
        self._cancellable[remote] = self._cancellable.get(remote, 0) | 1 << index
        link.answer(Piece(index, data), key=index)  # type: ignore[arg-type]  # a read-only view packs as bin

    def _withdraw(self, link: Link, index: int) -> None:
        """A neighbour calls off its `get` of `index`: the answer is dropped if it has not begun
        to leave. Only a request not yet called off may be (an honest peer asks a neighbour for
        a piece again only after calling off the request that timed out)."""
        remote = link.remote
        asked = self._cancellable.get(remote, 0)
        if not asked >> index & 1:
            raise RemoteProtocolError(f"cancelled piece {index}, which it has no request for")
        self._cancellable[remote] = asked & ~(1 << index)
        link.withdraw(index)

    def _cancel(self, requests: list[tuple[str, int]]) -> None:
        """Call off requests whose piece came from elsewhere first (or that timed out and are
        asked elsewhere): the neighbour's uplink, the scarce one, then skips the copy if it has
        not begun sending it."""
        for peer, index in requests:
            link = self.links.get(peer)
            if link is not None:
                link.send(Cancel(index))

    def _on_piece(self, link: Link, index: int, data: bytes) -> None:
        remote = link.remote
        from_source = link is self._source
        if not from_source and not self._asked_of.get(remote, 0) >> index & 1:
            raise RemoteProtocolError(f"sent piece {index}, which we never asked of it")
        self.stats.bytes_down += len(data)
        try:
            new = self.store.put(index, data)
        except RemoteProtocolError as exc:
            self.stats.bad_pieces[remote] = self.stats.bad_pieces.get(remote, 0) + 1
            self.ex.received(remote, index, ok=False)
            raise RemoteProtocolError(f"bad piece {index}: {exc}") from None
        self.ex.received(remote, index, now=trio.current_time())
        self._cancel(self.ex.take_cancels())
        kind = "peers" if not from_source else "repair" if index in self._asked_source else "seed"
        self.stats.pieces[kind if new else "duplicate"] += 1
        if from_source:
            self._asked_source.discard(index)
        if new:
            now = trio.current_time()
            self._last_piece = now
            self._fresh |= 1 << index
            due = have_due(now, self._last_have, from_learner=kind == "seed")
            if self.store.complete or due <= now:
                self._flush()
                if self.store.complete:
                    self.done.set()
            elif self._flush_at is None or due < self._flush_at:
                self._flush_at = due
        if not from_source:
            self._ask(link)

    def _ask(self, link: Link) -> None:
        if self.store.complete:
            return
        asked = self.ex.requests(link.remote, trio.current_time())
        for index in asked:
            self._asked_of[link.remote] = self._asked_of.get(link.remote, 0) | 1 << index
            link.send(Get(index))
        if asked:
            self._claimed |= sum(1 << i for i in asked) & ~self._told_source
            if self._flush_at is None:
                self._flush_at = trio.current_time() + HAVE_BATCH_S

    def _flush(self) -> None:
        """Rule 2: one `have` with the pieces verified since the last, to every neighbour; the
        learner's also names the pieces asked of a neighbour since (it sends neither)."""
        fresh, claimed, self._fresh, self._claimed, self._flush_at = self._fresh, self._claimed, 0, 0, None
        num_pieces = self.manifest.num_pieces
        if fresh:
            self._last_have = trio.current_time()
            frame = encode_frame(Have(fresh), num_pieces=num_pieces)
            for link in self.links.values():
                link.send_packed(False, frame)
        told = (fresh | claimed) & ~self._told_source
        if told and self._source is not None:
            self._told_source |= told
            self._source.send_packed(False, encode_frame(Have(told), num_pieces=num_pieces))

    # -- the download loop --------------------------------------------------------------------

    async def run(self, nursery: trio.Nursery, source_stream: trio.abc.Stream, first: Neighbours) -> memoryview:
        """Until every piece is held and verified; returns the payload. Links live in `nursery`,
        so the peer keeps serving this version after it completes, until the nursery ends."""
        self._nursery = nursery
        self._set_neighbours(first.entries)
        nursery.start_soon(self._run_link, source_stream, self.source_id)
        self._last_piece = trio.current_time()
        while not self.store.complete:
            now = trio.current_time()
            if self._flush_at is not None and now >= self._flush_at:
                self._flush()
            expired = self.ex.expire(now)
            self._cancel(expired)
            for peer in {peer for peer, _ in expired}:
                if self.ex.stalls.get(peer, 0) >= MAX_STALLS and peer in self._scopes:
                    self.cut["stalled"] += 1
                    log.info("cut %s: %d requests timed out", peer, self.ex.stalls[peer])
                    self._scopes[peer].cancel()
            for link in list(self.links.values()):
                self._ask(link)
            if now >= self._last_piece + SOURCE_REPAIR_S:
                self._repair()
            self._wake = trio.Event()
            deadline = self.ex.next_deadline()
            at = min(math.inf if self._flush_at is None else self._flush_at,
                     math.inf if deadline is None else deadline, self._last_piece + SOURCE_REPAIR_S)
            with trio.move_on_at(max(at, now + 1e-3)):
                await self._wake.wait()
        for peer in self.links:  # complete: no more answers to time on these links
            self._remember_timing(peer)
        return self.store.payload()

    def _repair(self) -> None:
        """Rule 7: ask the learner for pieces no neighbour offers, SOURCE_PIPELINE at a time."""
        self._last_piece = trio.current_time()  # (asks again after another quiet SOURCE_REPAIR_S)
        source = self._source
        if source is None or self._source_empty:
            return
        for index in mask_indices(self.ex.unoffered()):
            if len(self._asked_source) >= SOURCE_PIPELINE:
                return
            if index not in self._asked_source:
                self._asked_source.add(index)
                source.send(Get(index))
