"""The data channel: weight snapshots over plain TCP, off the libp2p loop.

Noise+Yamux in py-libp2p costs ~4.4 CPU-s per GiB per side on the trio thread and starves
gossip and the DHT (DESIGN.md), so bulk bytes never travel over libp2p streams. The learner
hands each joined peer a random session token over its Noise-authenticated libp2p stream; the
peer presents the token here. Integrity does not rest on this channel: the expected size and
SHA-256 of every version reach the peer over libp2p (status response or signed announcement),
and `fetch_weights` rejects any byte string that does not match them.

Wire: one length-prefixed `WeightsRequest` frame (run id, version, token); the answer is one
length-prefixed `WeightsHeader` frame, then exactly `size` raw bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import trio

from echo_node.net.framing import read_frame, receive_exactly, write_frame
from protocol.errors import RemoteProtocolError
from protocol.messages import WeightsHeader, WeightsRequest, decode_message, encode_message

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
# Both control frames on this channel are a few hundred bytes; anything larger is hostile.
_CONTROL_MAX = 4096
_CHUNK = 1 << 20
# Peers download at most a few versions back; older snapshots are freed.
KEEP_VERSIONS = 4


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    data: bytes
    sha256: bytes


class WeightServer:
    """Serves the learner's recent weight snapshots to token holders."""

    def __init__(
        self, run_id: str, *, bind_host: str = "127.0.0.1", advertise_host: str | None = None, max_clients: int = 32
    ) -> None:
        self.run_id = run_id
        self.bind_host = bind_host
        self.advertise_host = advertise_host or bind_host
        self.port = 0
        self.bytes_sent = 0
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()
        self._tokens: dict[bytes, str] = {}
        self._limiter = trio.CapacityLimiter(max_clients)

    def publish(self, version: int, data: bytes) -> Snapshot:
        snap = Snapshot(version, data, hashlib.sha256(data).digest())
        self._snapshots[version] = snap
        while len(self._snapshots) > KEEP_VERSIONS:
            self._snapshots.popitem(last=False)
        return snap

    def latest(self) -> Snapshot | None:
        return next(reversed(self._snapshots.values()), None)

    def issue_token(self, peer_id: str) -> bytes:
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[token] = peer_id
        return token

    def revoke_peer(self, peer_id: str) -> None:
        self._tokens = {t: p for t, p in self._tokens.items() if p != peer_id}

    def _holder(self, token: bytes) -> str | None:
        for known, peer in self._tokens.items():
            if hmac.compare_digest(known, token):
                return peer
        return None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.bind_host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream, self._limiter:
            try:
                await self._serve_one(stream)
            except (RemoteProtocolError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                log.info("data channel: dropped a client: %s", exc)

    async def _serve_one(self, stream: trio.SocketStream) -> None:
        with trio.fail_after(10):
            request = decode_message(await read_frame(stream, max_len=_CONTROL_MAX), expected=WeightsRequest)
        peer = self._holder(request.token)
        if peer is None or request.run_id != self.run_id:
            raise RemoteProtocolError("unknown data-channel token or run")
        version = request.version
        snap = self._snapshots.get(version)
        if snap is None:
            raise RemoteProtocolError(f"{peer} asked for version {version}, which is not served")
        header = WeightsHeader(run_id=self.run_id, version=version, size=len(snap.data), sha256=snap.sha256)
        await write_frame(stream, encode_message(header))
        view = memoryview(snap.data)
        for start in range(0, len(view), _CHUNK):
            await stream.send_all(view[start : start + _CHUNK])
        self.bytes_sent += len(snap.data)


async def fetch_weights(
    host: str,
    port: int,
    token: bytes,
    *,
    run_id: str,
    version: int,
    size: int,
    sha256: bytes,
) -> bytes:
    """Download one snapshot and return it only if it matches the expected size and hash."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await write_frame(stream, encode_message(WeightsRequest(run_id=run_id, version=version, token=token)))
        header = decode_message(await read_frame(stream, max_len=_CONTROL_MAX), expected=WeightsHeader)
        if (header.run_id, header.version, header.size, header.sha256) != (run_id, version, size, sha256):
            raise RemoteProtocolError(
                f"data channel offered {header.run_id}@{header.version} ({header.size} B), "
                f"expected {run_id}@{version} ({size} B)"
            )
        data = await receive_exactly(stream, size, chunk=_CHUNK)
    if hashlib.sha256(data).digest() != sha256:
        raise RemoteProtocolError(f"weights for version {version} fail their SHA-256 check")
    return data
