"""The transport seam: what node code needs of the network, as small Protocols.

Two implementations stand behind them: `echo_node/net/p2p.py` (py-libp2p: Noise, yamux,
GossipSub, Kademlia; what a user runs) and `echo_node/net/memory.py` (one process, trio memory
streams, trio's clock; what a test runs a learner and N peers in, on virtual time). Node code
names only these types, so neither implementation leaks into it.

The control plane is the host (`Host`: gossip, request streams, discovery). The data channel
(weights, dial-back probes) is plain byte streams to (host, port) pairs, so it has its own seam
(`DataNet`): TCP in a user's node, memory streams in a test's swarm.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from echo_node.net.framing import ByteStream


class Stream(ByteStream, Protocol):
    """A request stream: authenticated to `remote_peer_id` by the transport, not the payload.
    Both transports' streams also say where the connection comes from as this end sees it
    (`remote_host`, None when unknown); a handler that wants it reads it with getattr."""

    remote_peer_id: str

    async def aclose(self) -> None: ...


class StreamUnavailable(ConnectionError):
    """A stream to a peer could not be opened (it is gone, unreachable, or refused the protocol)."""


StreamHandler = Callable[[Stream], Awaitable[None]]
# (forwarder peer id, originator peer id, payload) -> accept?
GossipValidator = Callable[[str, str, bytes], bool]


@dataclass(frozen=True, slots=True)
class PeerAddr:
    """A peer and the multiaddrs it can be dialed at."""

    peer_id: str
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GossipMessage:
    sender: str
    data: bytes


class Streams(Protocol):
    """Request streams to peers by id (join, status, repair)."""

    async def open_stream(self, peer_id: str, protocol_id: str) -> Stream: ...

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None: ...


class Gossip(Protocol):
    """Topic gossip: validated on arrival, scored per forwarder."""

    async def subscribe(
        self, topic: str, validator: GossipValidator, *, on_overflow: Callable[[GossipMessage], None] | None = None,
        admit: Callable[[GossipMessage], bool] | None = None,
    ) -> None: ...

    def messages(self, topic: str) -> AsyncIterator[GossipMessage]: ...

    async def publish(self, topic: str, data: bytes) -> None: ...

    def gossip_peers(self, topic: str) -> list[str]: ...

    def penalize(self, peer_id: str, topic: str) -> None: ...


class Discovery(Protocol):
    """Connections and the provider records peers find each other by."""

    async def connect(self, peer: PeerAddr) -> None: ...

    async def connect_multiaddr(self, maddr: str) -> str: ...

    async def disconnect(self, peer_id: str) -> None: ...

    def connected_peers(self) -> list[str]: ...

    async def provide(self, key: str) -> bool: ...

    async def find_providers(self, key: str, count: int = ...) -> Sequence[PeerAddr]: ...


class Host(Streams, Gossip, Discovery, Protocol):
    """A node's whole control plane: the seam `Learner` and `RolloutPeer` are built on."""

    @property
    def peer_id(self) -> str: ...

    @property
    def addrs(self) -> list[str]: ...

    @property
    def advertise_host(self) -> str: ...

    # Gossip messages dropped before the owner saw them, per topic and reason.
    gossip_drops: dict[str, dict[str, int]]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


Listeners = Sequence[trio.abc.Listener[trio.abc.Stream]]


class DataNet(Protocol):
    """Byte streams to (host, port) pairs: the data channel's listeners and dials. A listener's
    and a stream's resources close synchronously (`socket.close()`, or `close()` for the memory
    ones): echo_node/net/budget.py drops a refused connection on the spot."""

    async def listen(self, host: str, port: int) -> tuple[int, Listeners]:
        """Listen at host:port (0: any free port); the port bound and the listeners."""
        ...

    async def connect(self, host: str, port: int) -> trio.abc.Stream: ...


class TcpNet:
    """`DataNet` over TCP: what every node a user runs uses."""

    async def listen(self, host: str, port: int) -> tuple[int, Listeners]:
        listeners = await trio.open_tcp_listeners(port, host=host)
        return int(listeners[0].socket.getsockname()[1]), listeners

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, port)


TCP = TcpNet()
