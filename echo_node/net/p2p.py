"""The one module that imports py-libp2p.

It turns a libp2p host (Noise, Yamux, Kademlia, GossipSub v1.1) into a small trio-facing
surface: `P2PNode.run` starts everything inside the caller's nursery; streams come out as
`PeerStream` objects with plain `receive_some`/`send_all`; gossip comes out as
`(sender, data)` pairs that already passed the caller's validator. No libp2p type leaves this
module: `P2PNode` is one implementation of echo_node/net/transport.py's `Host`, and the in-memory
swarm of echo_node/net/memory.py is the other.

Choices below follow what py-libp2p 0.8.1 does, measured (docs/platform.md):
- Noise-only security and Yamux-only muxing: the default host also accepts plaintext and
  mplex; QUIC delivered short streams.
- `max_connections_per_peer=1` removes a fixed 250 ms wait on every dial.
- GossipSub's defaults drop bursts (10 msg/s spam limit, also on our own publishes; 120 s
  heartbeat), so we run v1.1 with a 1 s heartbeat, spam protection and adaptive gossip off,
  a topic validator, and peer scoring with real thresholds.
- Subscriptions buffer only 32 messages: a reader task drains each into our own bounded queue.
- The DHT does not seed its routing table from connected peers; we do it.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import logging
import math
import re
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub import pubsub as _pubsub_module
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from echo_node.config import NetConfig
from echo_node.net.budget import LIBP2P, Caps, Inbound, listener_caps
from echo_node.net.discovery import DialError
from echo_node.net.transport import GossipMessage, GossipValidator, PeerAddr, StreamHandler, StreamUnavailable
from protocol.addresses import (
    AddressError,
    TcpAddr,
    check_announce,
    check_data_host,
    dial_plan,
    ip_of,
    is_loopback,
    parse_tcp_multiaddr,
    publish_addrs,
    unroutable_reason,
)
from protocol.identity import Identity

log = logging.getLogger(__name__)

# py-libp2p gives each peer a 32-RPC outbound queue that rejects when full, so a burst of
# publishes loses all but the first 32 without a word (docs/platform.md).
# Pubsub builds the queue by this module-level name; a deeper queue keeps bursts whole and the
# gap repair covers whatever is still lost.
OUTBOUND_QUEUE_RPCS = 4096
setattr(_pubsub_module, "RpcQueue", functools.partial(RpcQueue, max_size=OUTBOUND_QUEUE_RPCS))
# py-libp2p logs ordinary events (stream resets, refused dials we retry, copies of a publish
# for the unsubscribed bootstrap) at WARNING and ERROR, and resets its logger's level when it is
# imported. echo-node reports what matters in its own words, so libp2p speaks only at DEBUG.
logging.getLogger("libp2p").setLevel(
    logging.DEBUG if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else logging.CRITICAL
)

# An inbound libp2p connection must finish its Noise and Yamux handshakes within this (a few round
# trips); until then it holds a descriptor and a pending slot of the inbound budget.
HANDSHAKE_DEADLINE_S = 5.0
# Connections this node dials itself (bootstrap, DHT lookups, peers), beyond the inbound budget.
OUTBOUND_CONNECTIONS = 256

# How long the host's own addresses are reused before they are computed again (see
# `_memoize_addrs`).
ADDRS_TTL_S = 1.0

GOSSIPSUB_PROTOCOL = TProtocol("/meshsub/1.1.0")
# Namespaced so that our provider records cannot collide with another application's keys.
PROVIDER_NAMESPACE = b"/echo-node/v1/run/"


# What the DialError hint says when every address a remote published is one nobody can dial.
UNROUTABLE_HINT = (
    "hint: every address it published is unroutable from here; it must be started with "
    "--advertise-host ADDRESS or --announce MULTIADDR (the address others dial)"
)
_REACHED_PEER = re.compile(r"remote_peer_id_from_pubkey=(\w+)")


def describe_dial_failure(exc: BaseException) -> str:
    """What happened on one dial, in a volunteer's words (refused, timed out, wrong peer, ...).

    py-libp2p wraps the cause several layers deep (swarm, transport, exception groups), so the
    whole chain is searched, the most telling cause first.
    """
    chain: list[BaseException] = []
    stack: list[BaseException | None] = [exc]
    while stack and len(chain) < 64:
        e = stack.pop()
        if e is None or any(e is c for c in chain):
            continue
        chain.append(e)
        # trio's and Python's exception groups say `exceptions`, py-libp2p's MultiError `errors`.
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ()), *getattr(e, "errors", ())]
    for e in chain:
        if isinstance(e, PeerIDMismatchesPubkey):
            found = _REACHED_PEER.search(str(e))
            return f"wrong peer: the handshake reached {found.group(1) if found else 'another peer id'}"
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, (TimeoutError, trio.TooSlowError)):
            return "timed out"
        if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "no route to host" if e.errno == errno.EHOSTUNREACH else "network unreachable"
    return f"{type(chain[-1]).__name__}: {str(chain[-1])[:160]}".rstrip(": ")


def interface_hosts() -> list[str]:
    """This machine's IPv4 addresses, one per interface that has one, loopback last."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    return sorted(set(found), key=lambda h: (h.startswith("127."), found.index(h)))


_SIOCGIFADDR = 0x8915  # linux/sockios.h


def _tcp_addrs(addrs: Sequence[multiaddr.Multiaddr]) -> list[TcpAddr]:
    """The TCP addresses among libp2p's multiaddrs (other transports are neither published nor
    counted as ours)."""
    out = []
    for addr in addrs:
        try:
            out.append(parse_tcp_multiaddr(str(addr)))
        except AddressError:
            continue
    return out


class PeerStream:
    """A libp2p stream seen as a trio-style byte stream (what tests replace with memory streams)."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.remote_peer_id = stream.muxed_conn.peer_id.to_base58()
        # The IP address the connection comes from, as this node sees it (behind a NAT: the
        # router's public address, not the one the peer knows itself by).
        remote = stream.get_remote_address()
        self.remote_host: str | None = remote[0] if remote else None

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self._stream.read(max_bytes)

    async def send_all(self, data: bytes) -> None:
        await self._stream.write(data)

    async def aclose(self) -> None:
        try:
            await self._stream.close()
        except Exception:  # the peer may have reset it already; closing is best effort
            log.debug("closing stream to %s failed", self.remote_peer_id, exc_info=True)


class _Delivery:
    """Stands in for the subscription channel py-libp2p delivers validated messages into. It
    calls `send_nowait` and, when the channel is full, drops the message with a log line; this
    tells the owner first (`on_overflow`), so the drop can be counted where it belongs. `admit`
    may refuse a message before it is queued (the owner's bound on what waits): the same drop."""

    def __init__(
        self, send: trio.MemorySendChannel[rpc_pb2.Message], on_overflow: Callable[[GossipMessage], None],
        admit: Callable[[GossipMessage], bool] | None = None,
    ) -> None:
        self._send = send
        self._on_overflow = on_overflow
        self._admit = admit

    def send_nowait(self, msg: rpc_pb2.Message) -> None:
        gossip = GossipMessage(ID(msg.from_id).to_base58(), msg.data)
        if self._admit is not None and not self._admit(gossip):
            self._on_overflow(gossip)
            raise trio.WouldBlock
        try:
            self._send.send_nowait(msg)
        except trio.WouldBlock:
            self._on_overflow(gossip)
            raise

    async def aclose(self) -> None:
        await self._send.aclose()


@dataclass(kw_only=True, slots=True)
class P2PSettings:
    listen: str = "/ip4/127.0.0.1/tcp/0"
    dht_server: bool = True
    heartbeat_s: float = 1.0
    subscription_queue: int = 4096
    # Seeds the penalty a peer takes for each invalid message it forwards or publishes.
    # py-libp2p's invalid-message weight is *positive* (the scorer subtracts it), opposite
    # of go/rust; see docs/platform.md.
    invalid_message_weight: float = 10.0
    graylist_threshold: float = -80.0
    gossip_threshold: float = -10.0
    publish_threshold: float = -50.0
    app_score: Callable[[str], float] | None = None
    # The IP address others reach this machine at (a router's public address, a VM's floating
    # IP): published with the listener's port instead of the address it binds.
    advertise_host: str | None = None
    # Full multiaddrs to publish instead of anything derived from the listener (port forwards,
    # DNS names); they win over `advertise_host`.
    announce: tuple[str, ...] = ()
    # How long one address may take to answer a dial before the next one is tried.
    dial_timeout_s: float = 5.0
    # Inbound connections (echo_node/net/budget.py); None: this process's share of its
    # open-file limit.
    inbound_caps: Caps | None = None

    def __post_init__(self) -> None:
        if self.advertise_host is not None:
            self.advertise_host = check_data_host(self.advertise_host, where="--advertise-host")
        for text in self.announce:
            check_announce(text)


def p2p_settings(net: NetConfig, **extra: Any) -> P2PSettings:
    """The libp2p host's settings from the config tree's [net] table."""
    return P2PSettings(listen=net.listen, advertise_host=net.advertise_host, announce=tuple(net.announce), **extra)


def listen_host(listen: str) -> str:
    """The host of a listen multiaddr like /ip4/H/tcp/P (where the data channel binds too)."""
    try:
        return parse_tcp_multiaddr(listen).host
    except AddressError as exc:
        raise ValueError(f"--listen {listen}: {exc}") from None


def provider_key(run_id: str) -> str:
    """The DHT key under which a run's learner is announced (hex multihash, sha2-256)."""
    digest = hashlib.sha256(PROVIDER_NAMESPACE + run_id.encode()).digest()
    return (bytes([0x12, 0x20]) + digest).hex()


def _score_params(settings: P2PSettings) -> ScoreParams:
    app = settings.app_score
    return ScoreParams(
        p4_invalid_messages=TopicScoreParams(
            weight=settings.invalid_message_weight, cap=1000.0, decay=0.99
        ),
        p6_appl_slack_weight=1.0 if app is not None else 0.0,
        p6_appl_slack_decay=1.0,
        publish_threshold=settings.publish_threshold,
        gossip_threshold=settings.gossip_threshold,
        graylist_threshold=settings.graylist_threshold,
        accept_px_threshold=0.0,
        app_specific_score_fn=(lambda pid: app(pid.to_base58())) if app is not None else None,
    )


def _memoize_addrs(host: IHost, ttl_s: float) -> None:
    """Reuse the host's address list for `ttl_s` seconds.

    py-libp2p attaches our signed peer record to every gossip RPC it sends or forwards, and to
    see whether the record is still current it rebuilds the address list each time (a
    getsockname per listener and several multiaddr parses): py-spy put ~30 % of a learner's
    handling of each incoming rollout message there. Addresses change only when listeners or
    observed addresses do, which a second's delay does not hurt.
    """
    compute = host.get_addrs
    cached: list[multiaddr.Multiaddr] = []
    expires = -math.inf

    def get_addrs() -> list[multiaddr.Multiaddr]:
        nonlocal cached, expires
        now = time.monotonic()
        if now >= expires:
            cached = compute()
            # Nothing listens yet: the next call may already see the listeners.
            expires = now + ttl_s if cached else -math.inf
        return list(cached)

    setattr(host, "get_addrs", get_addrs)


async def _close_quietly(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:  # already reset or closed by the other side
        log.debug("closing a connection failed", exc_info=True)



class P2PNode:
    """A running libp2p host with DHT and GossipSub; start it with `nursery.start(node.run)`."""

    def __init__(self, identity: Identity, settings: P2PSettings | None = None) -> None:
        self.settings = settings or P2PSettings()
        self._announce = tuple(check_announce(a) for a in self.settings.announce)
        self._interfaces = interface_hosts()
        key_pair = create_new_key_pair(identity.seed)
        self.inbound = Inbound(self.settings.inbound_caps or listener_caps(LIBP2P), name="libp2p")
        most = self.inbound.caps.open + OUTBOUND_CONNECTIONS
        self._host: IHost = new_host(
            key_pair=key_pair,
            sec_opt={
                NOISE_PROTOCOL_ID: NoiseTransport(
                    key_pair, noise_privkey=create_new_x25519_key_pair().private_key
                )
            },
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            connection_config=ConnectionConfig(
                max_connections_per_peer=1, max_connections=most, high_watermark=most,
                inbound_upgrade_timeout=HANDSHAKE_DEADLINE_S,
            ),
            # Identify, the DHT's provider and peer records and signed peer records all publish
            # what this factory returns. Observed addresses stay out: behind a NAT they name the
            # router's port of one outbound connection, which nobody can dial back.
            addrs_factory=self._publishable,
            disable_identify_address_discovery=True,
        )
        _memoize_addrs(self._host, ADDRS_TTL_S)
        self._guard_inbound()
        self.peer_id = self._host.get_id().to_base58()
        if self.peer_id != identity.peer_id:
            raise AssertionError("libp2p and protocol/ disagree on the peer id")
        self._gossipsub = GossipSub(
            protocols=[GOSSIPSUB_PROTOCOL],
            degree=6,
            degree_low=4,
            degree_high=12,
            heartbeat_interval=math.ceil(self.settings.heartbeat_s),
            heartbeat_initial_delay=0.1,
            score_params=_score_params(self.settings),
            adaptive_gossip_enabled=False,
            spam_protection_enabled=False,
            eclipse_protection_enabled=False,
        )
        self._pubsub = Pubsub(self._host, self._gossipsub)
        # Message ids are (author, seqno), and py-libp2p starts the seqno at the Unix time in
        # seconds, +1 per message: a node publishing more than one message a second and restarted
        # (a learner resumed after a crash, a peer started again) reuses seqnos its subscribers
        # saw within their seen-cache TTL, and they drop its new messages as duplicates: after a
        # learner restart its version announcements stopped reaching its peers. Nanoseconds, as
        # go-libp2p does: a restart starts above anything the previous process could count to.
        self._pubsub.counter = time.time_ns()
        # Messages of our validated topics that py-libp2p dropped before our validator saw them,
        # by reason (see `_push_msg`); and how many reached the validator.
        self.gossip_drops: dict[str, dict[str, int]] = {}
        self._reached_validator: set[int] = set()  # id() of messages in flight that did
        self._library_push_msg = self._pubsub.push_msg
        self._pubsub.push_msg = self._push_msg  # type: ignore[method-assign]
        self._dht: KadDHT | None = None
        self._subscriptions: dict[str, trio.MemoryReceiveChannel[rpc_pb2.Message]] = {}
        self._nursery: trio.Nursery | None = None

    def _guard_inbound(self) -> None:
        """Admit inbound connections through `self.inbound` instead of py-libp2p's own handler.

        py-libp2p's handler takes a slot of a fixed 250-slot limiter per inbound connection and
        gives it back only when the whole host stops, even after the connection closed (it
        waits for the swarm's end to "keep the connection alive"): after 250 inbound
        connections in a process's life, every later one was refused, and a stranger can make
        250 handshakes in seconds. Here a slot is held while the connection is open, pending
        ones are capped per source and in total, and the handshake has its deadline
        (`HANDSHAKE_DEADLINE_S`, the host's inbound upgrade timeout).
        """
        swarm: Any = self._host.get_network()

        async def handle(read_write_closer: Any, maddr: multiaddr.Multiaddr) -> None:
            remote = read_write_closer.get_remote_address()
            with trio.CancelScope() as scope:
                ticket = self.inbound.arrive(remote[0] if remote else "", scope, trio.current_time())
                if ticket is None:  # refused before any handshake state exists: the cheapest answer
                    await _close_quietly(read_write_closer)
                    return
                raw = RawConnection(read_write_closer, False)
                try:
                    try:
                        muxed = await swarm.upgrade_inbound_raw_conn(raw, maddr)
                    except Exception as exc:  # a failed or refused handshake: the stranger's problem
                        log.debug("inbound connection from %s failed its handshake: %s", remote, exc)
                        return
                    if not self.inbound.promote(ticket):
                        log.debug("inbound connection from %s refused: %d open", remote, self.inbound.opened)
                        await muxed.close()
                        return
                    await muxed.event_closed.wait()
                finally:
                    self.inbound.leave(ticket)
                    with trio.CancelScope(shield=True):  # cut, refused or ended: the socket goes too
                        await _close_quietly(raw)

        swarm._handle_inbound_connection = handle

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listen = [multiaddr.Multiaddr(self.settings.listen)]
        async with self._host.run(listen_addrs=listen), trio.open_nursery() as nursery:
            self._nursery = nursery
            mode = DHTMode.SERVER if self.settings.dht_server else DHTMode.CLIENT
            self._dht = KadDHT(self._host, mode, strict_validation=True)
            try:
                async with background_trio_service(self._dht), background_trio_service(self._pubsub):
                    await self._pubsub.wait_until_ready()
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                # py-libp2p's host leaves the sockets of connections it dialed open when it stops
                # (the process's exit closed them): a node started and stopped in one process
                # would keep them, and its peers would see it connected.
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    for peer in list(self._host.get_connected_peers()):
                        try:
                            await self._host.disconnect(peer)
                        except Exception:  # already going; closing is best effort
                            log.debug("closing the connection to %s failed", peer, exc_info=True)

    # -- addresses -----------------------------------------------------------------------------

    def _publishable(self, candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        published = publish_addrs(
            _tcp_addrs(candidates), announce=self._announce, advertise_host=self.settings.advertise_host,
            interface_hosts=self._interfaces,
        )
        return [multiaddr.Multiaddr(a.text(with_peer=False)) for a in published]

    @property
    def addrs(self) -> list[str]:
        """What this node publishes, each ending in /p2p/<peer id>: never a wildcard, and
        loopback only when loopback is all this node has."""
        return [str(a) for a in self._host.get_addrs()]

    @property
    def advertise_host(self) -> str:
        """The IP address this node's data channel is published at (same rules as `addrs`)."""
        try:
            bound = parse_tcp_multiaddr(self.settings.listen)
        except AddressError as exc:
            raise ValueError(f"--listen {self.settings.listen}: {exc}") from None
        published = publish_addrs(
            [TcpAddr(bound.proto, bound.host, bound.port or 1)], announce=self._announce,
            advertise_host=self.settings.advertise_host, interface_hosts=self._interfaces,
        )
        for addr in published:
            if ip_of(addr.host) is not None:
                return addr.host
        for addr in published:  # only names were announced: the data channel needs an address
            return check_data_host(socket.gethostbyname(addr.host), where=f"--announce {addr.text()}")
        raise ValueError(f"no routable address to publish for --listen {self.settings.listen}")

    def _own_endpoints(self) -> tuple[set[tuple[str, int]], bool]:
        """(host, port) pairs this node listens or publishes at, and whether all it publishes
        is loopback (a swarm on one machine, where loopback addresses are worth dialing)."""
        listening = _tcp_addrs(self._host.get_transport_addrs())
        published = _tcp_addrs(self._host.get_addrs())
        own = {(a.host, a.port) for a in listening + published}
        # A wildcard listener is reachable at every interface address on its port.
        own |= {(h, a.port) for a in listening if unroutable_reason(a.host) for h in self._interfaces}
        return own, all(is_loopback(a.host) for a in published)

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self._host.get_connected_peers()]

    # -- dialing and discovery ---------------------------------------------------------------

    async def connect(self, peer: PeerAddr) -> None:
        """Connect to `peer` through the first of its addresses that answers as that peer.

        Addresses that cannot work from here (unroutable, our own, another machine's loopback)
        are skipped, the rest dialed one at a time so that the DialError can say what happened
        on each: refused, timed out, or a handshake with another peer id.
        """
        pid = ID.from_base58(peer.peer_id)
        if self._host.get_network().get_connections(pid):
            await self._seed_routing_table(pid)
            return
        own, local_only = self._own_endpoints()
        to_dial, outcomes = dial_plan(peer.addrs, own=own, local_only=local_only)
        store = self._host.get_peerstore()
        for text in to_dial:
            # Only this address in the peerstore: the swarm dials every address it knows.
            store.clear_addrs(pid)
            self._forget_dial_failures(pid)
            try:
                with trio.fail_after(self.settings.dial_timeout_s):
                    await self._host.connect(PeerInfo(pid, [multiaddr.Multiaddr(text)]))
            except Exception as exc:
                outcomes.append((text, describe_dial_failure(exc)))
                continue
            await self._seed_routing_table(pid)
            return
        hint = UNROUTABLE_HINT if not to_dial and peer.addrs else ""
        raise DialError(peer.peer_id, outcomes, hint=hint)

    def _forget_dial_failures(self, peer_id: ID) -> None:
        # The swarm refuses to redial a peer whose addresses all failed recently (a negative
        # cache). Our callers already pace retries with their own backoff, and a bootstrap that
        # was down a second ago may be up now.
        unblock = getattr(self._host.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(peer_id)

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to `peer_id` (none: nothing happens)."""
        await self._host.disconnect(ID.from_base58(peer_id))

    async def connect_multiaddr(self, maddr: str) -> str:
        """Dial a full multiaddr ending in /p2p/<id>; returns the peer id. Raises DialError."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
        except Exception as exc:
            raise ValueError(f"not a multiaddr with /p2p/<peer id>: {maddr!r} ({exc})") from exc
        peer_id = info.peer_id.to_base58()
        await self.connect(PeerAddr(peer_id, (maddr,)))
        return peer_id

    async def _seed_routing_table(self, peer_id: ID) -> None:
        if self._dht is not None and peer_id != self._host.get_id():
            await self._dht.routing_table.add_peer(peer_id)

    async def provide(self, key: str) -> bool:
        assert self._dht is not None, "provide() before run() started"
        return await self._dht.provide(key)

    async def find_providers(self, key: str, count: int = 20) -> list[PeerAddr]:
        assert self._dht is not None, "find_providers() before run() started"
        found: dict[str, PeerAddr] = {}
        # find_providers returns duplicates (docs/platform.md); keep one entry per peer.
        for info in await self._dht.find_providers(key, count):
            pid = info.peer_id.to_base58()
            if pid != self.peer_id and pid not in found:
                found[pid] = PeerAddr(pid, tuple(str(a) for a in info.addrs))
        return list(found.values())

    # -- streams -----------------------------------------------------------------------------

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler) -> None:
        async def on_stream(stream: INetStream) -> None:
            wrapped = PeerStream(stream)
            try:
                await handler(wrapped)
            finally:
                await wrapped.aclose()

        self._host.set_stream_handler(TProtocol(protocol_id), on_stream)

    async def open_stream(self, peer_id: str, protocol_id: str) -> PeerStream:
        """A stream to a connected (or dialable) peer; `StreamUnavailable` (an OSError, like any
        other link failure) when there is none: py-libp2p's own error types stop here."""
        try:
            stream = await self._host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol_id)])
        except Exception as exc:
            raise StreamUnavailable(f"no {protocol_id} stream to {peer_id}: {type(exc).__name__}: {exc}") from exc
        return PeerStream(stream)

    # -- gossip ------------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, validator: GossipValidator, *, on_overflow: Callable[[GossipMessage], None] | None = None,
        admit: Callable[[GossipMessage], bool] | None = None,
    ) -> None:
        """Subscribe; messages that pass `validator` become readable with `messages(topic)`.
        `on_overflow` hears of each validated message dropped because the reader fell behind,
        or because `admit` refused to queue it. Refusing there, not in the validator, keeps
        the message valid to GossipSub: its forwarder's score does not pay for our backlog."""
        self.gossip_drops[topic] = {}

        def check(forwarder: ID, msg: rpc_pb2.Message) -> bool:
            self._reached_validator.add(id(msg))
            try:
                origin = ID(msg.from_id).to_base58()
            except Exception:
                return False
            return validator(forwarder.to_base58(), origin, msg.data)

        self._pubsub.set_topic_validator(topic, check, False)
        await self._pubsub.subscribe(topic)
        # py-libp2p delivers into a 32-slot channel with send_nowait and handles a whole RPC
        # batch without a checkpoint, so no reader task can keep up with a burst: 168 of 200
        # messages vanished in a loopback test. Swap in a channel sized by our own bound.
        send, receive = trio.open_memory_channel[rpc_pb2.Message](self.settings.subscription_queue)
        overflow = on_overflow or (lambda msg: self._count_drop(topic, "reader_behind"))
        self._pubsub.subscribed_topics_send[topic] = _Delivery(send, overflow, admit)  # type: ignore[assignment]
        self._subscriptions[topic] = receive

    async def _push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        """py-libp2p's `push_msg`, counting what it drops before our validator for the topics we
        validate: blacklisted senders, messages already seen (normal gossip redundancy), the
        score gate (a graylisted, e.g. banned, peer) and, inferred afterwards, signatures that
        fail strict signing. The same cheap checks, in the library's order, then the library."""
        topics = [t for t in msg.topicIDs if t in self.gossip_drops]
        reason = None
        if topics:
            ps = self._pubsub
            try:
                blacklisted = ps.is_peer_blacklisted(msg_forwarder) or ps.is_peer_blacklisted(ID(msg.from_id))
            except Exception:
                blacklisted = False
            scorer = getattr(self._gossipsub, "scorer", None)
            if blacklisted:
                reason = "blacklisted"
            elif ps._is_msg_seen(msg):
                reason = "duplicate"
            elif scorer is not None and not scorer.allow_publish(msg_forwarder, list(msg.topicIDs)):
                reason = "score_gate"
        try:
            await self._library_push_msg(msg_forwarder, msg)
            validated = id(msg) in self._reached_validator
        finally:
            self._reached_validator.discard(id(msg))
        for t in topics:
            if reason is not None:
                self._count_drop(t, reason)
            elif not validated:
                self._count_drop(t, "signature")  # passed the cheap gates, never validated

    def _count_drop(self, topic: str, reason: str) -> None:
        drops = self.gossip_drops.setdefault(topic, {})
        drops[reason] = drops.get(reason, 0) + 1

    async def messages(self, topic: str) -> AsyncIterator[GossipMessage]:
        """Validated messages of a subscribed topic, in arrival order."""
        async for msg in self._subscriptions[topic]:
            yield GossipMessage(ID(msg.from_id).to_base58(), msg.data)

    async def publish(self, topic: str, data: bytes) -> None:
        await self._pubsub.publish(topic, data)

    def gossip_peers(self, topic: str) -> list[str]:
        return [p.to_base58() for p in self._pubsub.peer_topics.get(topic, ())]

    def penalize(self, peer_id: str, topic: str) -> None:
        """Count an invalid message against a peer in GossipSub's score (P4)."""
        scorer = getattr(self._gossipsub, "scorer", None)
        if scorer is not None:
            scorer.on_invalid_message(ID.from_base58(peer_id), topic)
