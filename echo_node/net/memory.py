"""An in-memory network: a learner and N peers in one `trio.run`, on trio's clock.

`MemorySwarm` implements the transport seam (echo_node/net/transport.py) without sockets:
`MemoryHost` is a node's control plane (request streams, gossip, provider records) and
`MemoryDataNet` its data channel (listeners and dials at (host, port)). Nothing here reads the
wall clock or waits on the operating system, so under `trio.testing.MockClock(autojump_threshold=0)`
a swarm's timeouts, backoffs and rate limits run in virtual time, as fast as the CPU allows and
the same way on a loaded machine as on an idle one.

What it models, and what it does not:
- Streams are bounded byte pipes (`PIPE_BYTES` in flight per direction): a writer whose reader
  does not read blocks, as over TCP; a closed end reads as EOF and breaks the other's writes.
  Bytes move in zero virtual time (links have no rate).
- Gossip is a full mesh: a message reaches every running subscriber of its topic once, checked by
  that subscriber's validator with the publisher as forwarder and origin (what strict signing
  proves over libp2p). No scoring, no heartbeat.
- Provider records are one table every host reads (a DHT that always answers).
- A host that stops is gone: dials and streams to it fail with the errors real links raise.

It is a test fixture for node code, not a transport a user runs: it authenticates nothing.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable

import trio

from echo_node.net.discovery import DialError
from echo_node.net.transport import (
    GossipMessage,
    GossipValidator,
    Listeners,
    PeerAddr,
    StreamHandler,
    StreamUnavailable,
)
from protocol.identity import Identity

log = logging.getLogger(__name__)

# Bytes one direction of a stream holds before its writer waits (a socket's buffers, roughly).
PIPE_BYTES = 1 << 18
# Connections a listener holds before accepting them; more are refused (a full backlog).
BACKLOG = 128
# Validated gossip messages a subscription holds before its reader takes them.
SUBSCRIPTION_QUEUE = 4096
# The control plane's port in every host's published address (the data channel picks its own).
HOST_PORT = 4001


class _Pipe:
    """One direction of a stream: bytes in flight, bounded; `eof` when the writer closed,
    `broken` when the reader did."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False
        self.broken = False
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection, with what node code reads of a connection: the
    remote's address (`remote_host`) and, for request streams, its peer id."""

    def __init__(self, outgoing: _Pipe, incoming: _Pipe, *, remote_host: str, remote_peer_id: str = "") -> None:
        self._out = outgoing
        self._in = incoming
        self.remote_host: str | None = remote_host
        self.remote_peer_id = remote_peer_id
        self._closed = False

    @staticmethod
    def pair(
        a_host: str, b_host: str, *, a_peer: str = "", b_peer: str = ""
    ) -> tuple[MemoryStream, MemoryStream]:
        """Two connected ends: the first is `a`'s (it sees `b` as its remote), the second `b`'s."""
        a_to_b, b_to_a = _Pipe(), _Pipe()
        a = MemoryStream(a_to_b, b_to_a, remote_host=b_host, remote_peer_id=b_peer)
        b = MemoryStream(b_to_a, a_to_b, remote_host=a_host, remote_peer_id=a_peer)
        return a, b

    def unsent(self) -> int:
        """Bytes written that the other end has not read (a socket's send queue)."""
        return len(self._out.buffer)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        view = memoryview(data).cast("B")
        while True:
            if self._closed:
                raise trio.ClosedResourceError("this end was closed")
            if self._out.broken:
                raise trio.BrokenResourceError("the other end was closed")
            if self._out.eof:
                raise trio.ClosedResourceError("sent EOF already")
            if not view:
                return
            room = PIPE_BYTES - len(self._out.buffer)
            if room <= 0:
                await self._out.wait()
                continue
            self._out.buffer += view[:room]
            view = view[room:]
            self._out.changed()

    async def wait_send_all_might_not_block(self) -> None:
        while not self._closed and not self._out.broken and len(self._out.buffer) >= PIPE_BYTES:
            await self._out.wait()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        while True:
            if self._closed:
                raise trio.ClosedResourceError("this end was closed")
            if self._in.buffer:
                n = len(self._in.buffer) if max_bytes is None else max_bytes
                data = bytes(self._in.buffer[:n])
                del self._in.buffer[:n]
                self._in.changed()
                return data
            if self._in.eof:
                return b""
            if self._in.broken:
                raise trio.BrokenResourceError("the other end reset the connection")
            await self._in.wait()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self._out.eof = True
        self._out.changed()

    def close(self) -> None:
        """Close at once (like a socket's `close()`): the other end reads EOF after what was
        sent, and its writes fail."""
        if self._closed:
            return
        self._closed = True
        self._out.eof = True
        self._in.broken = True
        self._in.buffer.clear()
        self._out.changed()
        self._in.changed()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


class MemoryListener(trio.abc.Listener[trio.abc.Stream]):
    def __init__(self, swarm: MemorySwarm, address: tuple[str, int]) -> None:
        self._swarm = swarm
        self.address = address
        self._send, self._receive = trio.open_memory_channel[MemoryStream](BACKLOG)

    def offer(self, stream: MemoryStream) -> None:
        try:
            self._send.send_nowait(stream)
        except (trio.WouldBlock, trio.ClosedResourceError):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused") from None

    async def accept(self) -> trio.abc.Stream:
        return await self._receive.receive()

    def close(self) -> None:
        self._swarm.unlisten(self)
        self._send.close()
        self._receive.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


class MemoryDataNet:
    """A host's data channel in a `MemorySwarm`: it listens at its own address whatever host it
    is asked to bind (there is one interface), and dials others from it."""

    def __init__(self, swarm: MemorySwarm, address: str) -> None:
        self._swarm = swarm
        self.address = address

    async def listen(self, host: str, port: int) -> tuple[int, Listeners]:
        await trio.lowlevel.checkpoint()
        listener = self._swarm.listen(self.address, port)
        return listener.address[1], [listener]

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        listener = self._swarm.listener(host, port)
        if listener is None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"nothing listens at {host}:{port}")
        ours, theirs = MemoryStream.pair(self.address, host)
        listener.offer(theirs)
        return ours


class _Subscription:
    def __init__(
        self, validator: GossipValidator, on_overflow: Callable[[GossipMessage], None],
        admit: Callable[[GossipMessage], bool] | None,
    ) -> None:
        self.validator = validator
        self.on_overflow = on_overflow
        self.admit = admit
        self.send, self.receive = trio.open_memory_channel[GossipMessage](SUBSCRIPTION_QUEUE)


class MemoryHost:
    """A node's control plane in a `MemorySwarm` (echo_node/net/transport.py's `Host`)."""

    def __init__(self, swarm: MemorySwarm, identity: Identity, address: str) -> None:
        self._swarm = swarm
        self.identity = identity
        self.address = address
        self.gossip_drops: dict[str, dict[str, int]] = {}
        # Invalid gossip counted against each forwarder (what GossipSub's score would pay).
        self.penalties: Counter[str] = Counter()
        self._handlers: dict[str, StreamHandler] = {}
        self._subscriptions: dict[str, _Subscription] = {}
        self._connected: set[str] = set()
        self._nursery: trio.Nursery | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def addrs(self) -> list[str]:
        return [f"/ip4/{self.address}/tcp/{HOST_PORT}/p2p/{self.peer_id}"]

    @property
    def advertise_host(self) -> str:
        return self.address

    @property
    def running(self) -> bool:
        return self._nursery is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for peer in list(self._connected):
                self._swarm.unlink(self.peer_id, peer)
            for sub in self._subscriptions.values():
                sub.send.close()

    # -- connections and discovery ---------------------------------------------------------

    def connected_peers(self) -> list[str]:
        return sorted(self._connected)

    def _running_peer(self, peer_id: str) -> MemoryHost | None:
        other = self._swarm.hosts.get(peer_id)
        return other if other is not None and other.running and other is not self else None

    async def connect(self, peer: PeerAddr) -> None:
        await trio.lowlevel.checkpoint()
        if self._running_peer(peer.peer_id) is None:
            raise DialError(peer.peer_id, [(a, "connection refused") for a in peer.addrs] or [("-", "no such host")])
        self._swarm.link(self.peer_id, peer.peer_id)

    async def connect_multiaddr(self, maddr: str) -> str:
        _, sep, peer_id = maddr.rpartition("/p2p/")
        if not sep or not peer_id:
            raise ValueError(f"not a multiaddr with /p2p/<peer id>: {maddr!r}")
        await self.connect(PeerAddr(peer_id, (maddr,)))
        return peer_id

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self._swarm.unlink(self.peer_id, peer_id)

    async def provide(self, key: str) -> bool:
        await trio.lowlevel.checkpoint()
        self._swarm.providers.setdefault(key, {})[self.peer_id] = None
        return True

    async def find_providers(self, key: str, count: int = 20) -> list[PeerAddr]:
        await trio.lowlevel.checkpoint()
        found = []
        for peer_id in self._swarm.providers.get(key, {}):
            other = self._running_peer(peer_id)
            if other is not None:
                found.append(PeerAddr(peer_id, tuple(other.addrs)))
        return found[:count]

    # -- streams -------------------------------------------------------------------------------

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        self._handlers[protocol_id] = handler

    async def open_stream(self, peer_id: str, protocol_id: str) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        other = self._running_peer(peer_id)
        handler = None if other is None else other._handlers.get(protocol_id)
        if other is None or other._nursery is None or handler is None:
            raise StreamUnavailable(f"no {protocol_id} stream to {peer_id}")
        self._swarm.link(self.peer_id, peer_id)
        ours, theirs = MemoryStream.pair(self.address, other.address, a_peer=self.peer_id, b_peer=peer_id)
        other._nursery.start_soon(_serve_stream, handler, theirs)
        return ours

    # -- gossip --------------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, validator: GossipValidator, *, on_overflow: Callable[[GossipMessage], None] | None = None,
        admit: Callable[[GossipMessage], bool] | None = None,
    ) -> None:
        await trio.lowlevel.checkpoint()
        self.gossip_drops[topic] = {}
        overflow = on_overflow or (lambda msg: self._count_drop(topic, "reader_behind"))
        self._subscriptions[topic] = _Subscription(validator, overflow, admit)

    def _count_drop(self, topic: str, reason: str) -> None:
        drops = self.gossip_drops.setdefault(topic, {})
        drops[reason] = drops.get(reason, 0) + 1

    def deliver(self, topic: str, origin: str, data: bytes) -> None:
        """A message `origin` published on `topic`, as this host's validator and queue see it."""
        sub = self._subscriptions.get(topic)
        if sub is None or not self.running:
            return
        try:
            valid = sub.validator(origin, origin, data)
        except Exception:  # a validator that raises refuses, as py-libp2p's does
            log.exception("gossip validator for %s raised", topic)
            valid = False
        if not valid:
            self._count_drop(topic, "invalid")
            self.penalties[origin] += 1
            return
        msg = GossipMessage(origin, data)
        if sub.admit is not None and not sub.admit(msg):
            sub.on_overflow(msg)
            return
        try:
            sub.send.send_nowait(msg)
        except trio.WouldBlock:
            sub.on_overflow(msg)
        except trio.ClosedResourceError:
            pass

    def messages(self, topic: str) -> AsyncIterator[GossipMessage]:
        """Validated messages of a subscribed topic, in arrival order (the subscription's channel:
        a reader that stops early leaves no generator to finalize)."""
        return self._subscriptions[topic].receive

    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        payload = bytes(data)  # one immutable copy, shared by every subscriber
        for other in list(self._swarm.hosts.values()):
            if other is not self:
                other.deliver(topic, self.peer_id, payload)

    def gossip_peers(self, topic: str) -> list[str]:
        return sorted(
            p for p in self._connected
            if (other := self._running_peer(p)) is not None and topic in other._subscriptions
        )

    def penalize(self, peer_id: str, topic: str) -> None:
        self.penalties[peer_id] += 1


async def _serve_stream(handler: StreamHandler, stream: MemoryStream) -> None:
    try:
        await handler(stream)
    except Exception:  # a handler's failure ends its stream, never the host (as over libp2p)
        log.exception("stream handler failed")
    finally:
        stream.close()


class MemorySwarm:
    """The network a set of `MemoryHost`s and `MemoryDataNet`s share: addresses 127.0.0.2,
    127.0.0.3, ... (loopback: a swarm on one machine, as the dial-back rules see it)."""

    def __init__(self) -> None:
        self.hosts: dict[str, MemoryHost] = {}
        self.providers: dict[str, dict[str, None]] = {}
        self._listeners: dict[tuple[str, int], MemoryListener] = {}
        self._addresses = 1
        self._ports = 40000

    def node(self, identity: Identity) -> tuple[MemoryHost, MemoryDataNet]:
        """A new host's control plane and data channel, at an address of its own."""
        if identity.peer_id in self.hosts:
            raise ValueError(f"{identity.peer_id} is in this swarm already")
        self._addresses += 1
        address = f"127.0.0.{self._addresses}"
        host = MemoryHost(self, identity, address)
        self.hosts[identity.peer_id] = host
        return host, MemoryDataNet(self, address)

    def link(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            if x in self.hosts:
                self.hosts[x]._connected.add(y)

    def unlink(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            if x in self.hosts:
                self.hosts[x]._connected.discard(y)

    def listen(self, address: str, port: int) -> MemoryListener:
        if port == 0:
            while (address, self._ports) in self._listeners:
                self._ports += 1
            port = self._ports
        if (address, port) in self._listeners:
            raise OSError(errno.EADDRINUSE, f"{address}:{port} is in use")
        listener = MemoryListener(self, (address, port))
        self._listeners[(address, port)] = listener
        return listener

    def listener(self, address: str, port: int) -> MemoryListener | None:
        return self._listeners.get((address, port))

    def unlisten(self, listener: MemoryListener) -> None:
        if self._listeners.get(listener.address) is listener:
            del self._listeners[listener.address]
