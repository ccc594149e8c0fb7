"""Request/response over libp2p streams: one framed request, one framed response, then close.

Streams are Noise-authenticated, so plain (unsigned) protocol messages suffice here; the remote
peer id comes from the connection, not from the message. Every read is bounded by the frame
limit and every exchange by a deadline at the call site.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from echo_node.net.framing import StreamEnded, read_frame, write_frame
from echo_node.net.transport import Stream, Streams
from protocol.errors import RemoteProtocolError
from protocol.limits import MAX_DECOMPRESSED_BYTES
from protocol.messages import ErrorResponse, decode_message, encode_message

log = logging.getLogger(__name__)

JOIN = "/echo-node/join/1"
STATUS = "/echo-node/status/1"
REPAIR = "/echo-node/repair/1"

T = TypeVar("T")


class RequestFailed(Exception):
    """The remote answered with an ErrorResponse."""


async def call(node: Streams, peer_id: str, protocol_id: str, request: Any, expected: type[T]) -> T:
    """Send one request and return the typed response; the caller bounds it with a deadline."""
    stream = await node.open_stream(peer_id, protocol_id)
    try:
        await write_frame(stream, encode_message(request))
        payload = await read_frame(stream, max_len=MAX_DECOMPRESSED_BYTES)
    finally:
        await stream.aclose()
    reply = decode_message(payload)
    if isinstance(reply, ErrorResponse):
        raise RequestFailed(f"{reply.code}: {reply.message}")
    if not isinstance(reply, expected):
        raise RemoteProtocolError(f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply


Handler = Callable[[Any, str], Awaitable[Any]]


async def serve_one(stream: Stream, handler: Handler, *, on_bad: Callable[[str, Exception], None]) -> None:
    """Read one request, answer it; bad input becomes an ErrorResponse and a penalty, never a crash."""
    try:
        request = decode_message(await read_frame(stream, max_len=MAX_DECOMPRESSED_BYTES))
        response = await handler(request, stream.remote_peer_id)
    except StreamEnded as exc:
        # A hang-up before the whole request came: what a cancelled call leaves. Answered (the
        # answer may not arrive), not penalized: strikes are for bytes that break the protocol,
        # and an empty stream costs its sender as much as it costs us.
        log.debug("request stream from %s ended early: %s", stream.remote_peer_id, exc)
        response = ErrorResponse(code="bad_request", message=str(exc)[:200])
    except RemoteProtocolError as exc:
        on_bad(stream.remote_peer_id, exc)
        response = ErrorResponse(code="bad_request", message=str(exc)[:200])
    except RequestRefused as exc:
        response = ErrorResponse(code=exc.code, message=str(exc)[:200])
    try:
        await write_frame(stream, encode_message(response))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.debug("%s hung up before its answer: %s", stream.remote_peer_id, exc)


class RequestRefused(Exception):
    """A well-formed request this node will not serve (wrong run id, unknown version, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
