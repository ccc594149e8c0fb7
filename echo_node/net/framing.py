"""Length-prefixed frames over any trio-style byte stream.

A sender killed mid-stream looks like a clean end of stream to a libp2p reader
(docs/platform.md), so every transfer carries its length up front and a short read is an error,
never a short message.
Works over `PeerStream` (libp2p), trio TCP streams and trio's memory streams alike.
"""

from __future__ import annotations

import struct
from typing import Protocol

from protocol.errors import RemoteProtocolError
from protocol.framing import encode_length_prefixed

_LEN = struct.Struct(">I")


class ByteStream(Protocol):
    async def receive_some(self, max_bytes: int, /) -> bytes | bytearray: ...

    async def send_all(self, data: bytes, /) -> None: ...


class StreamEnded(RemoteProtocolError):
    """The stream ended before a whole frame arrived: the sender hung up (or was cancelled)
    mid-message. A protocol error for the reader, but no proof of malice: a peer whose call was
    cancelled between opening a stream and writing to it ends it just so."""


async def receive_exactly(stream: ByteStream, n: int, *, chunk: int = 1 << 16) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.receive_some(min(chunk, n - len(buf)))
        if not data:
            raise StreamEnded(f"stream ended after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


async def read_frame(stream: ByteStream, *, max_len: int) -> bytes:
    (length,) = _LEN.unpack(await receive_exactly(stream, _LEN.size))
    if length > max_len:
        raise RemoteProtocolError(f"frame of {length} bytes exceeds the {max_len}-byte bound")
    return await receive_exactly(stream, length)


async def write_frame(stream: ByteStream, payload: bytes) -> None:
    await stream.send_all(encode_length_prefixed(payload))
