"""Pipelined peer-to-peer broadcast of weight versions: relays first, the learner's spare uplink
for the rest.

Scheme (the shared-queue mesh, a few % off the bound in hand-made relays: docs/platform.md): the
source (the learner) hands out pieces from one shared queue to whichever peer asks next; the
first receiver verifies the piece against the signed manifest and pushes it to every other peer
at once (store-and-forward, pipelined piece by piece). A peer asks the source for more only
while its own outbound backlog is short and drains within `DRAIN_S` at its measured uplink rate
(one piece until its first relay measured it), so a peer with a slow uplink takes fewer pieces
and the mesh runs at the speed of the aggregate uplink, not of its slowest link (a chain would).

When the peers' uplinks are the bottleneck (home links: 10-20 Mbit/s up, 100 down), one copy
from the learner leaves most of its uplink idle. A peer whose uplink is busy relaying
(`SourcePull` rule 5) asks `more`, and the learner sends pieces from the tail of its queue directly
to every peer, not relayed (Mutualcast): `protocol.weights.source.SourcePlan` says which piece
goes to whom. On symmetric links nobody asks and the learner still uploads about one copy.

Whatever a peer still lacks once the source's queue is empty (a relay died mid-push, a piece was
corrupt, a push raced the link's set-up) is fetched through `protocol.weights.pieces.PieceSwarm`: from
the peers that proved they hold it, the source only as a last resort, with timeouts and
re-requests elsewhere.

Wire, per version and link: length-prefixed frames on plain TCP, never on the libp2p loop,
where bulk bytes starve gossip and the DHT (docs/platform.md). Every frame, the signed hello and
the learner's session signature are defined and decoded in `protocol.weights.datachannel` (byte layout:
docs/wire.md); this module only drives them.

Reachability is learned, not assumed: a peer's data address is handed to others only after the
learner dialed it back and the peer proved its identity there (`probe`, answered by any
`DataServer`). So a peer behind a NAT is listed without an address: it dials the reachable
peers itself (links are two-way, so it still relays over them), nobody waits on a dial to it,
and a joiner cannot make the swarm dial an address of its choosing. The source's first `peers`
frame to a newcomer starts with the newcomer's own entry, which tells it which side it is on.

Every piece is hash-checked against the manifest before it is stored, used or relayed; a peer
that sends a bad piece or a bad frame, or asks without reading, is cut and banned from this
node's data channel for every version. A link whose peer stops reading is cut after
`LINK_STALL_S` without progress, so its queue no longer holds back our pull; one that reads, but
too slowly to keep up while most of our links do, is a laggard (`LAGGARD_HOLD_S`): it holds the
pull for a bounded time and is pushed at most LAGGARD_PIECES. A receiver's decisions about the source (when to ask it,
what to relay, when to repair) are `protocol.weights.relay.SourcePull`'s; which piece to ask of whom is
`PieceSwarm`'s.
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import socket
import struct
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Container, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

import trio

from echo_node.net.budget import DATA_CHANNEL, Caps, Inbound, Ticket, listener_caps, serve_admitted
from echo_node.net.framing import read_frame, write_frame
from echo_node.net.transport import TCP, DataNet
from protocol.errors import RemoteProtocolError
from protocol.framing import LengthPrefixedReader, encode_length_prefixed
from protocol.identity import Identity
from protocol.limits import MAX_PIECES
from protocol.weights.datachannel import (
    FULL,
    HELLO_MAX,
    MAX_SWARM_ENTRIES,
    MAX_WIRE_FRAME,
    PROBE,
    Frame,
    Get,
    Hello,
    HelloChecker,
    Direct,
    ManifestFrame,
    More,
    Next,
    NoMore,
    NotServed,
    PeerEntry,
    Peers,
    Piece,
    decode_frame,
    decode_probe_answer,
    encode,
    make_hello,
    probe_answer,
    session_signature,
)
from protocol.weights.manifest import WeightManifest, piece_range, verify_piece
from protocol.weights.pieces import Cancel, PieceSwarm, Request
from protocol.weights.relay import SourcePull
from protocol.weights.source import SourcePlan

log = logging.getLogger(__name__)

# What a vanished peer looks like on a data connection: handled as "this link is gone".
LINK_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
# A peer asks the source for another piece only while fewer than this many piece-pushes wait in
# its outbound queues (per link); more would let a slow uplink hoard pieces the others need.
BACKLOG_PIECES = 4
SOURCE_PIPELINE = 2
# ... and only while its relay queue drains within this many seconds at its measured uplink rate
# (SourcePull rule 1: a slow uplink with many links takes fewer pieces).
DRAIN_S = 2.0
# Laggards. The pull waits for the longest relay queue, so one neighbour that reads slowly (a
# peer trickling on purpose just above LINK_STALL_S's rate, or a saturated downlink) would hold
# every peer linked to it, and through them the swarm, to its pace. A link whose queue has not
# emptied for LAGGARD_HOLD_S while it holds BACKLOG_PIECES or more, and fewer than half of our
# links hold that much, is left out of the pull's backlog and drain time until its queue
# empties. A slow uplink of our own fills all links alike, so it never makes laggards; each
# laggard still holds the pull for LAGGARD_HOLD_S per time it empties (a bounded delay). Not
# shorter: on symmetric links a few honest links fall behind for a second or so (their peers'
# downlinks are full), and pulling past them lengthened the broadcast's tail. The loop looks
# again every LAGGARD_CHECK_S while a link holds BACKLOG_PIECES: a trickler may let no frame
# leave for seconds, and a frame leaving is what wakes the pull. A link holding more than
# LAGGARD_PIECES is pushed no new first copies until it drains below that (its peer repairs
# what it misses), so a laggard's queue does not grow with every piece this peer relays; honest
# links behind for a while stay under it. A link that comes up late is sent what this peer
# relayed before it under the same bound: up to LAGGARD_PIECES at once, the rest one piece per
# piece that leaves (`Receiver._catch_up`), so a member that dials late and reads slowly on
# purpose holds at most that much of our memory, not our whole relay share of the version.
LAGGARD_HOLD_S = 2.0
LAGGARD_CHECK_S = 0.05
LAGGARD_PIECES = 64
SEND_BUFFER_BYTES = 256 * 1024
# Reads on a data link: at least MIN_READ_BYTES (as cheap as a tiny read), more when the frame
# in progress needs it (a 256 KiB piece in one go on loopback), never above MAX_READ_BYTES. Not
# always MAX_READ_BYTES: CPython allocates the whole read buffer each time, so a small request
# read into a huge buffer costs several times more.
MIN_READ_BYTES = 64 * 1024
MAX_READ_BYTES = 512 * 1024
ENDGAME_QUIET_S = 0.01  # (SourcePull rule 4: the endgame's repair waits only this long)
# No new piece for this long, whatever the source says: repair from whoever has what we lack.
STALL_S = 3.0
# An inbound data connection must deliver its signed hello within this (a dialer sends it right
# after connecting): until then it holds a descriptor and a pending slot (echo_node/net/budget.py).
HELLO_DEADLINE_S = 3.0
# A connection for a version this node has not started yet waits this long for it (the dialer
# may have seen the announcement first).
ROUTE_WAIT_S = 5.0
# A data link on which nothing was sent or received for this long is closed.
LINK_IDLE_S = 60.0
# A link that holds data to send and could not hand one SEND_CHUNK of it to the kernel for this
# long is cut: its peer does not read. (Waiting for LINK_IDLE_S, its queue held back the pull of
# every peer pushing to it for a minute.) A SEND_CHUNK in LINK_STALL_S is 210 kbit/s, below
# any link's share that could still carry a version.
LINK_STALL_S = 5.0
SEND_CHUNK = 128 * 1024
# The learner's links hold at most this many unsent bytes in the kernel (TCP_NOTSENT_LOWAT), so
# a link's own queue empties only as fast as its peer takes bytes in: an empty queue then means
# download headroom (SourcePlan rule 2). Their send buffer is left to the kernel's autotuning:
# the ACKs of a peer whose uplink is busy relaying wait behind its relays (0.2-1 s measured on
# 10 Mbit/s uplinks), and a capped buffer would cap what the learner can send it.
SOURCE_NOTSENT_LOWAT = 64 * 1024
# The learner's uplink counts as idle (SourcePlan rule 4) when no link held bytes to send, in
# its queue or unsent in the kernel, at two looks this far apart. It looks only while untouched
# pieces remain, and a look stops at the first busy link. 5 ms: past a hiccup between two
# sends, short against a version on home links (0.3 s for the embedded model's).
SOURCE_IDLE_S = 0.005
# Linux's ioctl for the bytes a TCP socket holds that were not sent yet (SIOCOUTQNSD).
_SIOCOUTQNSD = 0x894B
# What a peer may make us queue towards it by asking (`get`, `next`, `more`) without reading:
# beyond this many bytes, it is disconnected rather than buffered. An honest peer has at most
# SOURCE_PIPELINE `next` + 4 repair `get`s (PieceSwarm's max_inflight_per_peer) + 2 `more`
# (SourcePull.direct_pipeline) outstanding, and the learner may have queued one direct piece it
# owes it: 9 piece frames, each a few bytes over a piece. (At 8 pieces the learner cut honest
# peers whose loop paused while the learner's kernel buffer held only TCP_NOTSENT_LOWAT.)
LINK_QUEUE_PIECES = 12
LINK_QUEUE_MIN_BYTES = 1 << 20
# A peer that sent a bad piece or a bad frame is refused on the data channel this long; at most
# this many bans are kept (the one ending first is forgotten first).
DATA_BAN_S = 600.0
MAX_DATA_BANS = 4096
MAX_LINK_TIMINGS = 1024


def base_of(manifest: WeightManifest) -> int:
    """The routing base of a manifest: FULL, or the version its delta applies to."""
    return FULL if manifest.base_version is None else manifest.base_version


@dataclass
class Stats:
    bytes_up: int = 0
    bytes_down: int = 0
    bad_pieces: dict[str, int] = field(default_factory=dict)
    # A receiver's verified pieces by how they came: "next" (the source's answer, ours to
    # relay), "direct" (its spare uplink), "repair" (its answer to our `get`), "peers"; and
    # "duplicate" for copies already held. For the `installed` record: where a download's time went.
    pieces: Counter[str] = field(default_factory=Counter)
    asked_more: int = 0  # `more` requests sent
    withdrawn: int = 0  # answers called off by the asker (a `cancel`) before they left


def encode_frame(frame: Frame, *, num_pieces: int = MAX_PIECES) -> bytes:
    """A length-prefixed frame, ready for the wire (`num_pieces`: the version's, for a `have`)."""
    return encode_length_prefixed(encode(frame, num_pieces=num_pieces), max_len=MAX_WIRE_FRAME)


class LinkOverflow(RemoteProtocolError):
    """The peer keeps asking but does not read: it is disconnected rather than buffered."""


class Link:
    """One data connection; frames are typed (protocol.weights.datachannel), sent by one task so they
    never interleave.

    Bounds: what the remote makes us queue by asking (`answer`) is capped at `queue_cap` bytes
    (LinkOverflow past it), counted apart from what we push on our own (relays: at most one copy
    of each piece of the version per link, and never more than LAGGARD_PIECES and one queued at
    once, `Receiver`). A link idle both ways for LINK_IDLE_S ends; one whose queued bytes make
    no progress for LINK_STALL_S is cut (`stalled`). `on_sent` hears the tag of every frame
    that left that is a piece or was queued with a tag."""

    def __init__(
        self, stream: trio.abc.Stream, remote: str, stats: Stats, on_sent: Callable[[object], None] | None = None, *,
        num_pieces: int, piece_size: int, from_source: bool = False, notsent_lowat: int | None = None,
    ) -> None:
        self.stream = stream
        self.remote = remote
        self.stats = stats
        self.on_sent = on_sent
        self.num_pieces = num_pieces
        self.from_source = from_source
        self.queue_cap = max(LINK_QUEUE_MIN_BYTES, LINK_QUEUE_PIECES * piece_size)
        self._send, self._queue = trio.open_memory_channel[tuple[bool, bytes, object, bool, int | None]](math.inf)
        # Answers queued under a key (`answer(key=)`) and not begun, and those of them called
        # off (`withdraw`): the sender skips a withdrawn one. Counts, for a key asked twice.
        self._keyed: Counter[int] = Counter()
        self._withdrawn: Counter[int] = Counter()
        self.queued_pieces = 0
        self.queued_bytes = 0
        self.asked_bytes = 0  # of queued_bytes, those the remote asked for (`answer`)
        self.stalled = False
        self.behind_since: float | None = None  # since when pieces have been queued without a break
        self.last_active = trio.current_time()
        if isinstance(stream, trio.SocketStream):
            if notsent_lowat is not None:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, notsent_lowat)
            else:
                # The backlog check only sees our own queue; a multi-MB kernel send buffer would
                # hide a slow uplink behind it and let that peer keep taking pieces from the source.
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    def send(self, frame: Frame, tag: object = None) -> None:
        self.send_packed(isinstance(frame, (Piece, Direct)), encode_frame(frame, num_pieces=self.num_pieces), tag)

    def answer(self, frame: Frame, tag: object = None, *, key: int | None = None) -> None:
        """Queue a frame the remote asked for; LinkOverflow if it does not read what it asks.
        Only answers count: our own pushes queued ahead of them are no fault of a slow reader.
        An answer queued under `key` can be called off until it begins to leave (`withdraw`)."""
        if self.asked_bytes > self.queue_cap:
            raise LinkOverflow(f"{self.remote} asks without reading ({self.asked_bytes} bytes queued)")
        if key is not None:
            self._keyed[key] += 1
        self.send_packed(isinstance(frame, (Piece, Direct)), encode_frame(frame, num_pieces=self.num_pieces), tag,
                         asked=True, key=key)

    def withdraw(self, key: int) -> bool:
        """Call off one answer queued under `key` that has not begun to leave; False if none is
        (it left already, or was never queued)."""
        if self._keyed[key] <= self._withdrawn[key]:
            return False
        self._withdrawn[key] += 1
        return True

    def send_packed(self, is_piece: bool, data: bytes, tag: object = None, *, asked: bool = False, key: int | None = None) -> None:
        """Queue an `encode_frame` result (a relayed piece is encoded once for all its links)."""
        if is_piece and not self.queued_pieces:
            self.behind_since = trio.current_time()
        self.queued_pieces += is_piece
        self.queued_bytes += len(data)
        self.asked_bytes += asked * len(data)
        self._send.send_nowait((is_piece, data, tag, asked, key))

    def _dequeued(self, is_piece: bool, size: int, asked: bool) -> None:
        self.queued_bytes -= size
        self.asked_bytes -= asked * size
        if is_piece:
            self.queued_pieces -= 1
            if not self.queued_pieces:
                self.behind_since = None

    def _skip(self, key: int | None) -> bool:
        """Whether a keyed answer about to leave was withdrawn (then it is dropped unsent)."""
        if key is None:
            return False
        self._keyed[key] -= 1
        withdrawn = self._withdrawn[key] > 0
        if withdrawn:
            self._withdrawn[key] -= 1
        if not self._keyed[key]:
            del self._keyed[key]
            self._withdrawn.pop(key, None)
        return withdrawn

    async def sender(self) -> None:
        async for is_piece, data, tag, asked, key in self._queue:
            if self._skip(key):
                self._dequeued(is_piece, len(data), asked)
                self.stats.withdrawn += 1
                continue
            view = memoryview(data)
            try:
                for start in range(0, len(view), SEND_CHUNK):
                    with trio.move_on_after(LINK_STALL_S) as stall:
                        await self.stream.send_all(view[start : start + SEND_CHUNK])
                    if stall.cancelled_caught:
                        # Not reading: cut, so that the reader ends and the owner drops the link
                        # (and with it what it holds back).
                        self.stalled = True
                        await trio.aclose_forcefully(self.stream)
                        return
                    self.last_active = trio.current_time()
            except LINK_ERRORS:
                return  # the peer is gone; the reader side notices and cleans up
            self._dequeued(is_piece, len(data), asked)
            if is_piece:
                self.stats.bytes_up += len(data)
            if (is_piece or tag is not None) and self.on_sent is not None:
                self.on_sent(tag)

    async def frames(self) -> AsyncGenerator[Frame, None]:
        """Decoded frames until the link ends (closed, idle, or cut mid-frame); a frame that does
        not decode raises RemoteProtocolError."""
        # Buffered: one read brings many small frames (requests, haves) or most of a piece; a
        # read per length prefix and per 64 KiB costs a rollout peer a real share of its core.
        reader = LengthPrefixedReader(max_len=MAX_WIRE_FRAME)
        while True:
            try:
                while (data := reader.next_message()) is None:
                    with trio.move_on_at(self.last_active + LINK_IDLE_S) as idle:
                        chunk = await self.stream.receive_some(min(MAX_READ_BYTES, max(MIN_READ_BYTES, reader.missing)))
                    if idle.cancelled_caught:
                        if trio.current_time() >= self.last_active + LINK_IDLE_S:
                            return
                        continue  # we sent meanwhile: not idle
                    if not chunk:
                        return  # closed, maybe inside a frame: a vanished peer looks the same
                    self.last_active = trio.current_time()
                    reader.feed(chunk)  # RemoteProtocolError for a length beyond any frame
            except LINK_ERRORS:
                return
            yield decode_frame(data, num_pieces=self.num_pieces, from_source=self.from_source)

    def close(self) -> None:
        self._send.close()


class PieceStore:
    """A version's pieces, assembled in place: each verified piece is copied into its slot as it
    arrives, so completing costs nothing. (Joining 64 MiB at the end cost 30-40 ms per peer, and
    eight peers finishing at once on one core serialised that into 0.3 s of the broadcast.)

    `payload`: the whole version, held already (a source). `into`: a writable buffer of exactly
    the manifest's payload size to assemble into (a peer's mapped version file); by default a
    new bytearray. Either way the size is the signed manifest's, never a remote's say."""

    def __init__(
        self, manifest: WeightManifest, payload: bytes | memoryview | None = None, *, into: bytearray | memoryview | mmap.mmap | None = None
    ) -> None:
        self.manifest = manifest
        n = manifest.num_pieces
        if payload is not None and into is not None:
            raise ValueError("a piece store either holds its payload or assembles it, not both")
        if into is not None:
            buffer = memoryview(into).cast("B")
            if buffer.readonly or len(buffer) != manifest.payload_size:
                raise ValueError(f"cannot assemble {manifest.payload_size} B into a buffer of {len(buffer)} B")
        else:
            buffer = memoryview(bytearray(manifest.payload_size) if payload is None else payload)
        self._buffer = buffer
        self._held = [payload is not None] * n
        self.count = n if payload is not None else 0

    def put(self, index: int, data: bytes) -> bool:
        """Verify and store; False if already held. RemoteProtocolError if it does not verify."""
        verify_piece(self.manifest, index, data)
        if self._held[index]:
            return False
        off, size = piece_range(self.manifest, index)
        self._buffer[off : off + size] = data
        self._held[index] = True
        self.count += 1
        return True

    def get(self, index: int) -> memoryview | None:
        """A read-only view of a held piece (msgpack packs views without a copy)."""
        if not (0 <= index < len(self._held) and self._held[index]):
            return None
        off, size = piece_range(self.manifest, index)
        return self._buffer[off : off + size].toreadonly()

    @property
    def complete(self) -> bool:
        return self.count == len(self._held)

    def payload(self) -> memoryview:
        """The whole version, read-only, without a copy."""
        assert self.complete
        return self._buffer.toreadonly()


class VersionHandler(Protocol):
    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None: ...


class DataServer:
    """One TCP listener per node; routes each verified hello to the handler of its version.

    Inbound connections are admitted through an `Inbound` budget (`caps`, default: this
    process's share of its open-file limit): pending until their hello verified, within
    `HELLO_DEADLINE_S`, then open (echo_node/net/budget.py says which are cut when full)."""

    def __init__(
        self, identity: Identity, run_id: str, *, bind_host: str = "127.0.0.1", advertise_host: str | None = None, port: int = 0,
        caps: Caps | None = None, ban_s: float = DATA_BAN_S, on_ban: Callable[[str, str], None] | None = None,
        resolve: Callable[[int, int], Awaitable[VersionHandler | None]] | None = None, net: DataNet = TCP,
    ) -> None:
        """`net`: where connections come from and go to (TCP; a test's in-memory swarm)."""
        self.identity = identity
        self.net = net
        self.inbound = Inbound(caps or listener_caps(DATA_CHANNEL), name="data channel")
        # Inbound connections that ended on an error, by its type (what used to be log lines).
        self.closed: Counter[str] = Counter()
        self.run_id = run_id
        self.bind_host = bind_host
        self.host = advertise_host or bind_host
        self.port = port
        self.checker = HelloChecker(identity.peer_id, run_id)
        # Peers caught sending a bad piece or frame -> end of their ban on trio's clock (a
        # deadline of this process: it is not kept across restarts, the learner's own ban is),
        # for every version this node serves or fetches; `on_ban` tells the owner (the learner bans).
        self.bans: dict[str, float] = {}
        self.ban_s = ban_s
        self.on_ban = on_ban
        # What each neighbour's answers took on our mesh links (Exchange rule 3), kept across
        # versions so that a version's requests start at the depth the last one measured; the
        # MAX_LINK_TIMINGS peers heard from last (a peer's own say never enters it).
        self._link_timings: OrderedDict[str, float] = OrderedDict()
        self._handlers: dict[tuple[int, int], VersionHandler] = {}
        self._registered = trio.Event()
        # Asked for a (version, base) that is not registered while the version is: the owner may
        # make it now (the learner cuts a delta against an older base) or answer None.
        self.resolve = resolve

    def register(self, version: int, handler: VersionHandler, *, base: int = FULL) -> None:
        self._handlers[(version, base)] = handler
        self._registered.set()
        self._registered = trio.Event()

    def unregister(self, version: int) -> None:
        for key in [k for k in self._handlers if k[0] == version]:
            del self._handlers[key]

    def hello(self, *, target: str, version: int, base: int = FULL) -> bytes:
        return make_hello(
            self.identity, target=target, run_id=self.run_id, version=version, base=base, host=self.host, port=self.port,
            now=time.time(),
        )

    def ban(self, peer_id: str, why: str) -> None:
        """Refuse `peer_id` on the data channel for `ban_s`, across versions."""
        if self.is_banned(peer_id):
            return
        while len(self.bans) >= MAX_DATA_BANS:
            del self.bans[min(self.bans, key=self.bans.__getitem__)]
        self.bans[peer_id] = trio.current_time() + self.ban_s
        log.warning("banned %s from the data channel for %.0fs: %s", peer_id, self.ban_s, why)
        if self.on_ban is not None:
            self.on_ban(peer_id, why)

    def link_timing(self, peer_id: str) -> float | None:
        """What `peer_id`'s answers took on our last mesh link to it (None: never timed)."""
        return self._link_timings.get(peer_id)

    def remember_link_timing(self, peer_id: str, took: float) -> None:
        """Keep what `peer_id`'s answers took, for the next version's link to it; the
        MAX_LINK_TIMINGS peers timed last are kept."""
        timings = self._link_timings
        timings[peer_id] = took
        timings.move_to_end(peer_id)
        while len(timings) > MAX_LINK_TIMINGS:
            timings.popitem(last=False)

    def is_banned(self, peer_id: str) -> bool:
        until = self.bans.get(peer_id)
        if until is not None and until <= trio.current_time():
            del self.bans[peer_id]
            return False
        return until is not None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        self.port, listeners = await self.net.listen(self.bind_host, self.port)
        task_status.started(self.port)
        await serve_admitted(listeners, self._handle, self.inbound)

    async def _handle(self, stream: trio.abc.Stream, ticket: Ticket) -> None:
        try:
            with trio.fail_after(HELLO_DEADLINE_S):
                raw = await read_frame(stream, max_len=HELLO_MAX)
                hello = self.checker.check(raw, time.time())
                if hello.version == PROBE:
                    await write_frame(stream, probe_answer(self.identity, raw))
                    await stream.aclose()
                    return
            if self.is_banned(hello.sender):
                raise RemoteProtocolError(f"{hello.sender} is banned from this node's data channel")
            if not self.inbound.promote(ticket):
                raise RemoteProtocolError(f"{hello.sender}: this node holds as many data connections as it takes")
            handler = await self._route(hello.version, hello.base)
            if handler is None:
                # "unavailable" lets a peer asking for a delta fall back to the full snapshot at
                # once instead of waiting out a timeout; signed, so nobody else can say it.
                await write_frame(stream, encode(NotServed(session_signature(self.identity, raw, available=False))))
                # A normal answer (a peer asking for a delta that was not cut, a version gone):
                # no log line at INFO, which an operator would see every few versions.
                log.debug("%s asked for %d/%d, which is not served here", hello.sender, hello.version, hello.base)
                await stream.aclose()
                return
            await handler.serve(stream, hello)
        except Misbehaved as exc:
            self.ban(hello.sender, str(exc))
            await stream.aclose()
        except (RemoteProtocolError, trio.TooSlowError, *LINK_ERRORS) as exc:
            # Counted, at DEBUG: a stranger can make these as fast as it can connect, and a log
            # line each would be a lever on the event loop.
            self.closed[type(exc).__name__] += 1
            log.debug("data connection closed: %s", exc)
            await stream.aclose()

    async def _route(self, version: int, base: int) -> VersionHandler | None:
        """The handler for (version, base); waits a little for a version not started yet."""
        with trio.move_on_after(ROUTE_WAIT_S):
            while not any(k[0] == version for k in self._handlers):
                await self._registered.wait()
        handler = self._handlers.get((version, base))
        if handler is None and base != FULL and self.resolve is not None and any(k[0] == version for k in self._handlers):
            handler = await self.resolve(version, base)
        return handler


# The tag of every frame the learner queues: `Link.on_sent` then tells it each that left.
_SENT = "sent"


class Source:
    """The learner's side for one version: manifest, swarm view, and what to send whom, as
    `protocol.weights.source.SourcePlan` decides (relayed pieces first, its spare uplink in
    direct pieces, at most one copy of each piece per link)."""

    def __init__(
        self,
        identity: Identity,
        manifest: WeightManifest,
        sealed_manifest: bytes,
        payload: bytes,
        members: Container[str],
        relays: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        self.identity = identity
        self.sealed_manifest = sealed_manifest
        self.store = PieceStore(manifest, payload)
        # The learner's live table of joined peers, kept by reference: a peer that joins after
        # the version was published can still fetch it, and one banned since cannot.
        self.members = members
        # Data addresses proven by a dial-back (`probe`), also kept by reference; a member not
        # in it is listed without an address and dials the others itself.
        self.relays: Mapping[str, tuple[str, int]] = {} if relays is None else relays
        self.plan = SourcePlan(manifest.num_pieces)
        self.stats = Stats()
        # Set by the owner to hold pieces back until the swarm has gathered (relay links exist);
        # open by default.
        self.gate = trio.Event()
        self.gate.set()
        self.swarm: dict[str, tuple[str, int]] = {}
        self._links: dict[str, Link] = {}
        # Each link's nursery: the idle watch (SourcePlan rule 4) runs in one of them, and moves
        # to another when that link ends.
        self._nurseries: dict[str, trio.Nursery] = {}
        self._watch_in: str | None = None
        self.idle_credits = 0  # credits the idle rule gave (statistics)

    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None:
        if hello.sender not in self.members:
            raise RemoteProtocolError(f"{hello.sender} is not a member of this run")
        manifest = self.store.manifest
        link = Link(stream, hello.sender, self.stats, self._sent, num_pieces=manifest.num_pieces,
                    piece_size=manifest.piece_size, notsent_lowat=SOURCE_NOTSENT_LOWAT)
        misbehaved: RemoteProtocolError | None = None
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(link.sender)
            link.send(ManifestFrame(self.sealed_manifest, session_signature(self.identity, hello.raw)), _SENT)
            # Frozen for this version, so every member hears the same about each other.
            host, port = self.relays.get(hello.sender, ("", 0))
            entry = PeerEntry(hello.sender, host, port)
            others = [PeerEntry(p, h, pt) for p, (h, pt) in self.swarm.items() if p != hello.sender]
            link.send(Peers(tuple([entry, *others][:MAX_SWARM_ENTRIES])), _SENT)
            for other in self._links.values():
                other.send(Peers((entry,)))
            self.swarm[hello.sender] = (host, port)
            self._links[hello.sender] = link
            self._nurseries[hello.sender] = nursery
            self.plan.join(hello.sender)
            self._start_watch()
            try:
                await self.gate.wait()
                async with aclosing(link.frames()) as frames:
                    async for frame in frames:
                        if isinstance(frame, Next):
                            self._send_next(link)
                        elif isinstance(frame, More):
                            self.plan.more(link.remote)
                            self._fill()
                        elif isinstance(frame, Get):
                            if self.plan.get(link.remote, frame.index):
                                self._send_piece(link, frame.index)
                        # A piece pushed to the source is of no use to it; harmless, ignored.
            except RemoteProtocolError as exc:
                misbehaved = exc
            finally:
                self._links.pop(hello.sender, None)
                self._nurseries.pop(hello.sender, None)
                self.swarm.pop(hello.sender, None)
                self.plan.leave(hello.sender)
                link.close()
                nursery.cancel_scope.cancel()
                if self._watch_in == hello.sender:
                    self._watch_in = None
                    self._start_watch()
            if link.stalled:
                misbehaved = RemoteProtocolError(f"{hello.sender} does not read what it asked for")
        if misbehaved is not None:
            raise Misbehaved(f"{hello.sender}: {misbehaved}")

    def _start_watch(self) -> None:
        """Run the idle watch in some link's nursery, unless it runs or has nothing to do."""
        if self._watch_in is None and self.plan.queue and self._nurseries:
            peer, nursery = next(iter(self._nurseries.items()))
            self._watch_in = peer
            nursery.start_soon(self._watch_idle, peer)

    async def _watch_idle(self, peer: str) -> None:
        """SourcePlan rule 4: while untouched pieces remain, credit every peer when the uplink
        had nothing to send at two looks SOURCE_IDLE_S apart."""
        idle_before = False
        try:
            while self.plan.queue and self._watch_in == peer:
                await trio.sleep(SOURCE_IDLE_S)
                idle = self.gate.is_set() and self._uplink_idle()
                if idle and idle_before:
                    self.idle_credits += len(self.plan.idle())
                    self._fill()
                    idle = False
                idle_before = idle
        finally:
            if self._watch_in == peer:
                self._watch_in = None

    def _uplink_idle(self) -> bool:
        """Whether no link holds bytes to send, ours or the kernel's. Every link: counting only a
        majority let the rule fire on symmetric links, where the uplink is the bottleneck but
        a link's queue empties now and then (1.17x the bound and 1.17 copies live, against
        1.08x and 1.05). A link whose peer reads slowly so turns the rule off while it lasts;
        the broadcast then runs as without it (peers ask `more`), and a link that makes no
        progress at all is cut after LINK_STALL_S."""
        return not any(link.queued_bytes or _unsent(link.stream) for link in self._links.values())

    def _send_next(self, link: Link) -> None:
        index = self.plan.next(link.remote)
        if index is None:
            link.answer(NoMore(), _SENT)
        else:
            self._send_piece(link, index)

    def _send_piece(self, link: Link, index: int) -> None:
        data = self.store.get(index)
        if data is not None:
            link.answer(Piece(index, data), _SENT)  # type: ignore[arg-type]  # a read-only view packs as bin

    def _sent(self, _tag: object) -> None:
        """A frame left a link, which may now have nothing queued: room for a direct piece."""
        self._fill()

    def _fill(self) -> None:
        """Direct pieces for the peers that asked `more` and whose links have nothing queued
        (SourcePlan rule 2), or "none" when there is nothing more for them (rule 5)."""
        if not self.gate.is_set():
            return
        idle = [peer for peer, link in self._links.items() if not link.queued_bytes and self.plan.wants(peer)]
        for peer, index in self.plan.direct(idle):
            link = self._links[peer]
            data = None if index is None else self.store.get(index)
            link.send(NoMore() if data is None else Direct(index, data), _SENT)  # type: ignore[arg-type]


def _unsent(stream: trio.abc.Stream) -> int:
    """Bytes a TCP stream's kernel buffer holds that were not sent yet (an in-memory stream says
    itself; 0 for other streams)."""
    if not isinstance(stream, trio.SocketStream):
        unsent = getattr(stream, "unsent", None)
        return int(unsent()) if callable(unsent) else 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(stream.socket.fileno(), _SIOCOUTQNSD, b"\0" * 4))[0])
    except OSError:
        return 0


class Changes:
    """Something that changes now and then (a receiver's listed peers), and a wait until a
    condition on it holds: each `fire` wakes every waiter to look again."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait up to `timeout` for `done()`; whether it holds at the end."""
        with trio.move_on_after(timeout):
            while not done():
                await self._event.wait()
        return done()


class Misbehaved(RemoteProtocolError):
    """A peer sent a frame that breaks the protocol on an established data link: banned."""


Connector = Callable[[str, int], Awaitable[trio.abc.Stream]]


tcp_connect: Connector = TCP.connect


class Receiver:
    """A rollout peer's side for one version: pull from the source, push to peers, repair."""

    def __init__(
        self, server: DataServer, manifest: WeightManifest, *, source_id: str, request_timeout: float = 5.0,
        into: bytearray | memoryview | mmap.mmap | None = None, connect: Connector | None = None,
    ) -> None:
        self.server = server
        self.identity = server.identity
        self.manifest = manifest
        self.source_id = source_id
        self.store = PieceStore(manifest, into=into)  # `into`: where to assemble (PieceStore)
        self.stats = Stats()
        self.links: dict[str, Link] = {}
        self.members: set[str] = {source_id}
        # Whether the source lists us with an address others can dial (its first peers entry).
        self.reachable = True
        self._members_changed = Changes()
        self.swarm = PieceSwarm(manifest.num_pieces, request_timeout=request_timeout)
        self.swarm.peer_has_all(source_id)
        self.pull = SourcePull(pipeline=SOURCE_PIPELINE, backlog_pieces=BACKLOG_PIECES, drain_s=DRAIN_S,
                               endgame_quiet_s=ENDGAME_QUIET_S, stall_s=STALL_S)
        self.done = trio.Event()
        # Pieces the source handed to us first: ours to relay, also to links that come up late.
        self.relaying: list[int] = []
        self._asked_source: set[int] = set()  # pieces asked of the source with `get` (repairs)
        # The uplink's rate, measured while relaying: bytes sent over the time the relay links
        # had something queued.
        self._relay_busy_s = 0.0
        self._relay_busy_since: float | None = None
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        # How links to other peers are opened: the server's network unless a test says otherwise.
        self.connect = connect or server.net.connect

    # -- connections -------------------------------------------------------------------------

    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None:
        """An incoming link from another peer (routed here by the DataServer)."""
        # The source announces each newcomer; its hello may outrun that announcement.
        if not await self._members_changed.until(lambda: hello.sender in self.members, ROUTE_WAIT_S):
            raise RemoteProtocolError(f"{hello.sender} is not in this version's swarm")
        await self._run_link(stream, hello.sender)

    async def _dial(self, peer_id: str, host: str, port: int) -> None:
        if self.server.is_banned(peer_id):
            return
        try:
            stream = await self.connect(host, port)
            hello = self.server.hello(target=peer_id, version=self.manifest.version, base=base_of(self.manifest))
            await write_frame(stream, hello)
        except LINK_ERRORS as exc:
            log.info("could not reach %s at %s:%d: %s", peer_id, host, port, exc)
            return
        await self._run_link(stream, peer_id)

    def _add_peers(self, entries: tuple[PeerEntry, ...]) -> None:
        for peer_id, host, port in ((e.peer_id, e.host, e.port) for e in entries):
            if peer_id == self.identity.peer_id:
                self.reachable = port != 0
        for peer_id, host, port in ((e.peer_id, e.host, e.port) for e in entries):
            if peer_id == self.identity.peer_id or peer_id in self.members:
                continue
            self.members.add(peer_id)
            # One link per pair: between two reachable peers the one with the larger id dials;
            # a peer nobody can dial dials every reachable one; two unreachable peers have none.
            if port and (peer_id < self.identity.peer_id or not self.reachable) and self._nursery is not None:
                self._nursery.start_soon(self._dial, peer_id, host, port)
        self._members_changed.fire()

    async def _run_link(self, stream: trio.abc.Stream, remote: str) -> None:
        m = self.manifest
        from_source = remote == self.source_id
        # What this peer relayed before the link existed: the remote missed those pushes.
        missed = deque(() if from_source else self.relaying)

        def sent(tag: object) -> None:
            self._catch_up(link, missed)
            self._refill_source(tag)

        try:
            link = Link(stream, remote, self.stats, on_sent=sent, num_pieces=m.num_pieces,
                        piece_size=m.piece_size, from_source=from_source)
        except LINK_ERRORS:
            return  # gone before the first byte
        self.links[remote] = link
        try:
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(link.sender)
                if from_source:
                    self._refill_source()
                else:
                    self._catch_up(link, missed)
                try:
                    async with aclosing(link.frames()) as frames:
                        async for frame in frames:
                            self._on_frame(link, frame)
                except RemoteProtocolError as exc:
                    # A bad frame or piece, or asking without reading: cut and refused for a
                    # while, for every version (the learner's link is bound to its key: only
                    # logged).
                    if remote == self.source_id:
                        log.warning("data connection with the learner: %s", exc)
                    else:
                        self.server.ban(remote, str(exc))
                nursery.cancel_scope.cancel()
        finally:
            link.close()
            self.links.pop(remote, None)
            self.swarm.peer_gone(remote, trio.current_time())
            self._wake.set()

    def _catch_up(self, link: Link, missed: deque[int]) -> None:
        """Queue pieces the link missed while its queue holds fewer than LAGGARD_PIECES; called
        again as each frame leaves, so a late link is sent them all at the pace it reads. (New
        first copies may still take the last place, `_on_piece`: they come first.)"""
        while missed and link.queued_pieces < LAGGARD_PIECES:
            index = missed.popleft()
            link.send(Piece(index, self.store.get(index)))  # type: ignore[arg-type]

    # -- frames ------------------------------------------------------------------------------

    def _on_frame(self, link: Link, frame: Frame) -> None:
        """One decoded frame (control frames only ever come from the source: `Link` checks)."""
        if isinstance(frame, Piece):
            self._on_piece(link, frame.index, frame.data)
        elif isinstance(frame, Direct):  # the source's spare uplink: ours alone, not relayed
            self._on_piece(link, frame.index, frame.data, direct=True)  # (only the source's: Link)
        elif isinstance(frame, Get):
            data = self.store.get(frame.index)
            if data is not None:
                link.answer(Piece(frame.index, data))  # type: ignore[arg-type]
        elif isinstance(frame, NoMore):
            self.pull.source_empty()
        elif isinstance(frame, Peers):
            self._add_peers(frame.entries)
        elif not isinstance(frame, Next):
            raise RemoteProtocolError(f"unexpected {type(frame).__name__} frame on an established link")
        self._wake.set()

    def _on_piece(self, link: Link, index: int, data: bytes, *, direct: bool = False) -> None:
        now = trio.current_time()

        self.stats.bytes_down += len(data)
        try:
            new = self.store.put(index, data)
        except RemoteProtocolError as exc:
            self.stats.bad_pieces[link.remote] = self.stats.bad_pieces.get(link.remote, 0) + 1
            self.swarm.received(link.remote, index, False, now)
            raise RemoteProtocolError(f"bad piece {index}: {exc}") from None
        self.swarm.received(link.remote, index, True, now)
        from_source = link.remote == self.source_id
        if not from_source:
            self.swarm.peer_has(link.remote, [index])
        asked = from_source and index in self._asked_source
        kind = "peers" if not from_source else "direct" if direct else "repair" if asked else "next"
        self.stats.pieces[kind if new else "duplicate"] += 1
        if not direct:
            self._asked_source.discard(index)  # one answer per `get`: a later copy is a `next`'s
        if self.pull.piece(from_source=from_source, new=new, now=now, asked=asked, direct=direct):
            if self._relay_busy_since is None:
                self._relay_busy_since = now
            self.relaying.append(index)
            frame = encode_frame(Piece(index, data))
            for other in list(self.links.values()):
                if other.remote != self.source_id and other.queued_pieces <= LAGGARD_PIECES:
                    other.send_packed(True, frame)
        if new and self.store.complete:
            self.done.set()
        if from_source:
            self._refill_source()

    def _refill_source(self, _sent: object = None) -> None:
        """Ask the source for as many pieces as `SourcePull` says our relay backlog allows."""
        source = self.links.get(self.source_id)
        if source is None:
            return
        relays = self._pacing([link for link in self.links.values() if link is not source])
        backlog = max((link.queued_pieces for link in relays), default=0)
        queued = sum(link.queued_bytes for link in relays)
        if self._relay_busy_since is not None:  # the uplink is measured over busy time only
            now = trio.current_time()
            self._relay_busy_s += now - self._relay_busy_since
            self._relay_busy_since = now if queued else None
            if not queued:
                self.pull.relay_drained()
        if not queued or self._relay_busy_s <= 0:
            drain_s = 0.0  # nothing queued, or nothing measured yet (rule 1 waits for that)
        else:
            sent = self.stats.bytes_up
            drain_s = queued * self._relay_busy_s / sent if sent else math.inf
        for _ in range(self.pull.asks(backlog, drain_s)):
            source.send(Next())
        started = self.pull.relay_started is not None  # (only then does rule 5 need the time)
        now = trio.current_time() if started else 0.0
        for _ in range(0 if self.store.complete else self.pull.mores(backlog, drain_s, now)):
            source.send(More())
            self.stats.asked_more += 1

    @staticmethod
    def _pacing(relays: list[Link]) -> list[Link]:
        """The relay links the pull waits for: all but the laggards (LAGGARD_HOLD_S)."""
        holding = sum(link.queued_pieces >= BACKLOG_PIECES for link in relays)
        if not holding or 2 * holding >= len(relays):
            return relays
        since = trio.current_time() - LAGGARD_HOLD_S
        return [link for link in relays if link.queued_pieces < BACKLOG_PIECES
                or link.behind_since is None or link.behind_since > since]

    # -- the download loop --------------------------------------------------------------------

    @property
    def missing(self) -> int:
        return self.swarm.missing

    async def run(self, nursery: trio.Nursery, source_stream: trio.abc.Stream | None = None, first: Peers | None = None) -> memoryview:
        """Until every piece is held and verified; returns the payload. Links live in `nursery`,
        so the peer keeps serving this version after it completes, until the nursery ends.
        `first`: the source's `peers` frame, when the caller read it (echo_node/weights/fetch.py)."""
        self._nursery = nursery
        if first is not None:
            self._add_peers(first.entries)
        if source_stream is not None:
            nursery.start_soon(self._run_link, source_stream, self.source_id)
        self.pull.last_progress = trio.current_time()
        while not self.store.complete:
            # Events that free our relay backlog (a dead link removed) must also reopen the
            # pull from the source, or a peer waits on pushes that will never come.
            self._refill_source()
            now = trio.current_time()
            if self.pull.repair_due(now):
                self._repair(now)
            self._wake = trio.Event()
            at = self.pull.wake_at(now, self.swarm.next_deadline())
            if any(link.queued_pieces >= BACKLOG_PIECES for link in self.links.values()):
                at = min(at, now + LAGGARD_CHECK_S)  # a link holding the pull may turn laggard
            with trio.move_on_at(at):
                await self._wake.wait()
        return self.store.payload()

    def _repair(self, now: float) -> None:
        for action in self.swarm.poll(now):
            link = self.links.get(action.peer)
            if link is None:
                continue
            if isinstance(action, Request):
                if action.peer == self.source_id:
                    self._asked_source.add(action.index)
                link.send(Get(action.index))
            elif isinstance(action, Cancel):
                pass  # a late copy is still verified and counted; nothing to tell the sender


async def probe(
    identity: Identity, run_id: str, peer_id: str, host: str, port: int, *, connect: Connector = tcp_connect
) -> None:
    """Dial `peer_id`'s data channel at host:port and make it prove it is there (AutoNAT-style).

    Returns when it did; raises ProbeFailed saying why not (the caller bounds it with a
    deadline: behind a NAT that drops inbound connections, the dial simply never answers).
    """
    hello = make_hello(identity, target=peer_id, run_id=run_id, version=PROBE, now=time.time())
    try:
        stream = await connect(host, port)
    except OSError as exc:
        raise ProbeFailed(f"{host}:{port}: {exc.strerror or exc}") from None
    async with stream:
        try:
            await write_frame(stream, hello)
            answer = await read_frame(stream, max_len=HELLO_MAX)
        except (RemoteProtocolError, *LINK_ERRORS) as exc:
            raise ProbeFailed(f"{host}:{port} did not answer the probe ({exc})") from None
    try:
        decode_probe_answer(answer, peer_id, hello)
    except (RemoteProtocolError, ValueError) as exc:
        raise ProbeFailed(f"{host}:{port} is not {peer_id} ({exc})") from None


class ProbeFailed(Exception):
    """A dial-back found nobody, or somebody else, at a peer's data address."""


class Served:
    """The last `keep` versions a node serves (peers relay them; late joiners catch up)."""

    def __init__(self, server: DataServer, keep: int) -> None:
        self.server = server
        self.keep = keep
        self._scopes: OrderedDict[int, trio.CancelScope | None] = OrderedDict()

    def add(self, version: int, scope: trio.CancelScope | None = None) -> None:
        replaced = self._scopes.pop(version, None)
        if replaced is not None and replaced is not scope:
            replaced.cancel()  # the same number fetched again (a new epoch's, or full after a delta)
        self._scopes[version] = scope
        while len(self._scopes) > self.keep:
            old, old_scope = self._scopes.popitem(last=False)
            self.server.unregister(old)
            if old_scope is not None:
                old_scope.cancel()

    def __contains__(self, version: object) -> bool:
        return version in self._scopes
