"""Pipelined peer-to-peer broadcast of one weight payload: the learner uploads each piece ~once.

Scheme (DESIGN.md measured it at 1.03–1.06x of the bound for hand-made relays): the source (the
learner) hands out pieces from one shared queue to whichever peer asks next; the first receiver
verifies the piece against the signed manifest and pushes it to every other peer at once
(store-and-forward, pipelined piece by piece). A peer asks the source for more only while its
own outbound backlog is short, so a peer with a slow uplink takes fewer pieces and the mesh
runs at the speed of the aggregate uplink, not of its slowest link (a chain would).

Whatever a peer still lacks once the source's queue is empty (a relay died mid-push, a piece was
corrupt) is fetched through `protocol.pieces.PieceSwarm`: from the peers that proved they hold it,
the source only as a last resort, with timeouts and re-requests elsewhere.

Every piece is hash-checked against the manifest before it is stored, used or relayed; a peer
that sends a bad piece is penalized and, after `max_bad_pieces`, never asked again. Connections
open with a signed hello (peer id, target, run, version, nonce, expiry) so only swarm members
are served. Bulk bytes travel on plain TCP, never on the libp2p loop (DESIGN.md).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from echo_node.net.framing import read_frame, write_frame
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key, verify
from protocol.manifest import WeightManifest, piece_range, verify_piece
from protocol.pieces import Cancel, PieceSwarm, Request

log = logging.getLogger(__name__)

# Frames are one piece at most plus a small header; pieces are at most 4 MiB (protocol.limits).
MAX_WIRE_FRAME = 4 * 1024 * 1024 + 1024
HELLO_DOMAIN = b"echo-node/v1/data-hello\x00"
HELLO_TTL_S = 60.0
# What a vanished peer looks like on a data connection: handled as "this link is gone".
LINK_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
# A peer asks the source for another piece only while fewer than this many piece-pushes wait in
# its outbound queues (per link); more would let a slow uplink hoard pieces the others need.
BACKLOG_PIECES = 4
SOURCE_PIPELINE = 2
SEND_BUFFER_BYTES = 256 * 1024
ENDGAME_QUIET_S = 0.5


class Membership:
    """Who may open a data connection: the swarm's peer ids (from the run's join records)."""

    def __init__(self, members: Iterable[str]) -> None:
        self.members = set(members)
        self._seen_nonces: dict[bytes, float] = {}

    def hello(self, identity: Identity, *, target: str, run_id: str, version: int) -> bytes:
        expiry = time.time() + HELLO_TTL_S
        nonce = os.urandom(16)
        body = msgpack.packb([identity.public_key, target, run_id, version, nonce, expiry])
        return msgpack.packb([body, identity.sign(HELLO_DOMAIN + body)])

    def check(self, data: bytes, *, me: str, run_id: str, version: int) -> str:
        """The peer id behind a hello, or RemoteProtocolError. Each nonce is accepted once."""
        try:
            body, signature = msgpack.unpackb(data)
            public_key, target, hello_run, hello_version, nonce, expiry = msgpack.unpackb(body)
        except Exception as exc:
            raise RemoteProtocolError(f"malformed data-channel hello: {exc}") from None
        verify(public_key, signature, HELLO_DOMAIN + body)
        sender = peer_id_from_public_key(public_key)
        now = time.time()
        self._seen_nonces = {n: t for n, t in self._seen_nonces.items() if t > now}
        if (target, hello_run, hello_version) != (me, run_id, version):
            raise RemoteProtocolError(f"hello from {sender} is for another target, run or version")
        if not now <= expiry <= now + 2 * HELLO_TTL_S or nonce in self._seen_nonces:
            raise RemoteProtocolError(f"hello from {sender} is expired or replayed")
        if sender not in self.members:
            raise RemoteProtocolError(f"{sender} is not a member of this swarm")
        self._seen_nonces[nonce] = expiry
        return sender


@dataclass
class Stats:
    bytes_up: int = 0
    bytes_down: int = 0
    bad_pieces: dict[str, int] = field(default_factory=dict)


class Link:
    """One data connection; frames are msgpack arrays, sent by one task so they never interleave."""

    def __init__(self, stream: trio.abc.Stream, remote: str, stats: Stats, on_sent: Callable[[], None] | None = None) -> None:
        self.stream = stream
        self.remote = remote
        self.stats = stats
        self.on_sent = on_sent
        # Unbounded in count, bounded in practice: pieces enter only via the backpressured
        # source pull (at most BACKLOG_PIECES waiting) or as answers to our own requests.
        self._send, self._queue = trio.open_memory_channel[tuple[bool, bytes]](math.inf)
        self.queued_pieces = 0
        if isinstance(stream, trio.SocketStream):
            # The backlog check only sees our own queue; a multi-MB kernel send buffer would
            # hide a slow uplink behind it and let that peer keep taking pieces from the source.
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    def send(self, *frame: Any) -> None:
        is_piece = frame[0] == "piece"
        self.queued_pieces += is_piece
        self._send.send_nowait((is_piece, msgpack.packb(list(frame))))

    async def sender(self) -> None:
        async for is_piece, data in self._queue:
            try:
                await write_frame(self.stream, data)
            except LINK_ERRORS:
                return  # the peer is gone; the reader side notices and cleans up
            if is_piece:
                self.queued_pieces -= 1
                self.stats.bytes_up += len(data)
                if self.on_sent is not None:
                    self.on_sent()

    async def frames(self) -> Any:
        while True:
            try:
                data = await read_frame(self.stream, max_len=MAX_WIRE_FRAME)
            except (RemoteProtocolError, *LINK_ERRORS):
                return
            try:
                frame = msgpack.unpackb(data)
            except Exception:
                raise RemoteProtocolError(f"{self.remote} sent an undecodable frame") from None
            if not isinstance(frame, list) or not frame or not isinstance(frame[0], str):
                raise RemoteProtocolError(f"{self.remote} sent a malformed frame")
            yield frame

    def close(self) -> None:
        self._send.close()


class PieceStore:
    def __init__(self, manifest: WeightManifest, payload: bytes | None = None) -> None:
        self.manifest = manifest
        n = manifest.num_pieces
        self.pieces: list[bytes | None] = [None] * n
        if payload is not None:
            for i in range(n):
                off, size = piece_range(manifest, i)
                self.pieces[i] = payload[off : off + size]
        self.count = sum(p is not None for p in self.pieces)

    def put(self, index: int, data: bytes) -> bool:
        """Verify and store; False if already held. RemoteProtocolError if it does not verify."""
        if not 0 <= index < len(self.pieces):
            raise RemoteProtocolError(f"piece index {index} out of range")
        verify_piece(self.manifest, index, data)
        if self.pieces[index] is not None:
            return False
        self.pieces[index] = data
        self.count += 1
        return True

    @property
    def complete(self) -> bool:
        return self.count == len(self.pieces)

    def payload(self) -> bytes:
        assert self.complete
        return b"".join(p for p in self.pieces if p is not None)


class Source:
    """The learner's side: serve the shared queue and, in the endgame, any piece asked for."""

    def __init__(self, identity: Identity, manifest: WeightManifest, payload: bytes, members: Membership) -> None:
        self.identity = identity
        self.store = PieceStore(manifest, payload)
        self.members = members
        self.queue = deque(range(manifest.num_pieces))
        self.stats = Stats()
        # Set by the owner to hold pieces back until the swarm has gathered (a benchmark starts
        # its clock then); open by default.
        self.gate = trio.Event()
        self.gate.set()
        self.connected: set[str] = set()

    async def serve(self, stream: trio.abc.Stream) -> None:
        try:
            await self._serve(stream)
        except LINK_ERRORS as exc:
            log.info("a data connection broke: %s", exc)

    async def _serve(self, stream: trio.abc.Stream) -> None:
        async with stream:
            try:
                remote = self.members.check(
                    await read_frame(stream, max_len=4096), me=self.identity.peer_id,
                    run_id=self.store.manifest.run_id, version=self.store.manifest.version,
                )
            except RemoteProtocolError as exc:
                log.warning("refused a data connection: %s", exc)
                return
            link = Link(stream, remote, self.stats)
            self.connected.add(remote)
            await self.gate.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.sender)
                try:
                    async for frame in link.frames():
                        if frame[0] == "next":
                            self._send_next(link)
                        elif frame[0] == "get" and len(frame) == 2 and isinstance(frame[1], int):
                            self._send_piece(link, frame[1])
                except RemoteProtocolError as exc:
                    log.warning("data connection from %s: %s", remote, exc)
                link.close()

    def _send_next(self, link: Link) -> None:
        if self.queue:
            self._send_piece(link, self.queue.popleft())
        else:
            link.send("none")

    def _send_piece(self, link: Link, index: int) -> None:
        if 0 <= index < len(self.store.pieces) and (data := self.store.pieces[index]) is not None:
            link.send("piece", index, data)


Connector = Callable[[str], Awaitable[trio.abc.Stream]]


class Receiver:
    """A rollout peer's side: pull from the source, push to peers, repair what is missing."""

    def __init__(
        self,
        identity: Identity,
        manifest: WeightManifest,
        members: Membership,
        *,
        source_id: str,
        request_timeout: float = 5.0,
    ) -> None:
        self.identity = identity
        self.manifest = manifest
        self.members = members
        self.source_id = source_id
        self.store = PieceStore(manifest)
        self.stats = Stats()
        self.links: dict[str, Link] = {}
        self.swarm = PieceSwarm(manifest.num_pieces, request_timeout=request_timeout)
        self.swarm.peer_has_all(source_id)
        self.done = trio.Event()
        self._source_empty = False
        self._source_outstanding = 0
        self._last_progress = 0.0
        self._wake = trio.Event()

    # -- connections -------------------------------------------------------------------------

    async def dial(self, nursery: trio.Nursery, peer_id: str, connect: Connector) -> None:
        stream = await connect(peer_id)
        m = self.manifest
        await write_frame(stream, self.members.hello(self.identity, target=peer_id, run_id=m.run_id, version=m.version))
        nursery.start_soon(self._run_link, stream, peer_id)

    async def accept(self, stream: trio.abc.Stream) -> None:
        m = self.manifest
        try:
            remote = self.members.check(await read_frame(stream, max_len=4096), me=self.identity.peer_id, run_id=m.run_id, version=m.version)
        except (RemoteProtocolError, *LINK_ERRORS) as exc:
            log.warning("refused a data connection: %s", exc)
            await stream.aclose()
            return
        await self._run_link(stream, remote)

    async def _run_link(self, stream: trio.abc.Stream, remote: str) -> None:
        try:
            link = Link(stream, remote, self.stats, on_sent=self._refill_source)
        except LINK_ERRORS:
            return  # gone before the first byte
        self.links[remote] = link
        try:
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(link.sender)
                if remote == self.source_id:
                    self._refill_source()
                try:
                    async for frame in link.frames():
                        self._on_frame(link, frame)
                except RemoteProtocolError as exc:
                    log.warning("data connection with %s: %s", remote, exc)
                nursery.cancel_scope.cancel()
        finally:
            link.close()
            self.links.pop(remote, None)
            self.swarm.peer_gone(remote, trio.current_time())
            self._wake.set()

    # -- frames ------------------------------------------------------------------------------

    def _on_frame(self, link: Link, frame: list[Any]) -> None:
        kind = frame[0]
        if kind == "piece" and len(frame) == 3 and isinstance(frame[1], int) and isinstance(frame[2], bytes):
            self._on_piece(link, frame[1], frame[2])
        elif kind == "get" and len(frame) == 2 and isinstance(frame[1], int):
            i = frame[1]
            if 0 <= i < len(self.store.pieces) and (data := self.store.pieces[i]) is not None:
                link.send("piece", i, data)
        elif kind == "none" and link.remote == self.source_id:
            self._source_empty = True
            self._source_outstanding = 0
        self._wake.set()

    def _on_piece(self, link: Link, index: int, data: bytes) -> None:
        now = trio.current_time()
        self.stats.bytes_down += len(data)
        try:
            new = self.store.put(index, data)
        except RemoteProtocolError as exc:
            log.warning("bad piece %d from %s: %s", index, link.remote, exc)
            self.stats.bad_pieces[link.remote] = self.stats.bad_pieces.get(link.remote, 0) + 1
            self.swarm.received(link.remote, index, False, now)
            return
        self.swarm.received(link.remote, index, True, now)
        if link.remote != self.source_id:
            self.swarm.peer_has(link.remote, [index])
        from_source = link.remote == self.source_id
        if from_source and self._source_outstanding > 0:
            self._source_outstanding -= 1
        if new:
            self._last_progress = now
            if from_source:
                # First receiver of a piece the source handed out: relay it to everyone now.
                for other in list(self.links.values()):
                    if other.remote != self.source_id:
                        other.send("piece", index, data)
            if self.store.complete:
                self.done.set()
        if from_source:
            self._refill_source()

    def _refill_source(self) -> None:
        """Keep SOURCE_PIPELINE asks outstanding while our relay backlog is short."""
        source = self.links.get(self.source_id)
        if source is None or self._source_empty:
            return
        backlog = max((l.queued_pieces for l in self.links.values() if l is not source), default=0)
        while self._source_outstanding < SOURCE_PIPELINE and backlog < BACKLOG_PIECES:
            source.send("next")
            self._source_outstanding += 1

    # -- the download loop --------------------------------------------------------------------

    async def run(self) -> bytes:
        """Until every piece is held and verified; returns the payload."""
        self._last_progress = trio.current_time()
        while not self.store.complete:
            if self._source_empty and trio.current_time() - self._last_progress >= ENDGAME_QUIET_S:
                self._repair(trio.current_time())
            self._wake = trio.Event()
            with trio.move_on_after(0.1):
                await self._wake.wait()
        return self.store.payload()

    def _repair(self, now: float) -> None:
        for action in self.swarm.poll(now):
            link = self.links.get(action.peer)
            if link is None:
                continue
            if isinstance(action, Request):
                link.send("get", action.index)
            elif isinstance(action, Cancel):
                pass  # a late copy is still verified and counted; nothing to tell the sender


def split_list(items: list[str], me: str) -> tuple[list[str], list[str]]:
    """Which peers I dial (those after me) and which dial me, so each pair has one link."""
    ordered = sorted(items)
    return [p for p in ordered if p > me], [p for p in ordered if p < me]
