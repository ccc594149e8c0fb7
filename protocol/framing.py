"""Byte framing: zstd frames for gossip, length prefixes for streams. No I/O.

Job:
- `encode_frame` / `decode_frame`: one message <-> one zstd frame (what a gossip payload is).
- `encode_length_prefixed` / `LengthPrefixedReader`: messages on a byte stream, as pure code the
  I/O layer feeds (h11 style: `feed(bytes)`, then `next_message()` until it returns None).

Invariants:
- `decode_frame` never allocates more than `max_size` bytes of output, whatever the input: it
  reads the declared content size from the frame header before decompressing and, for frames
  without one, lets zstd write into a buffer of exactly `max_size` bytes.
- A frame is exactly one zstd frame: trailing bytes, skippable frames and concatenated frames
  are rejected, so one message has one encoding.
- `LengthPrefixedReader` rejects an oversize declared length as soon as the 4 prefix bytes are
  in, before buffering the body, and its error state is sticky.
- A stream that ends mid-message is an error (`feed_eof`): a sender killed mid-stream looks like a
  normal end of stream to the reader (docs/platform.md).
"""

from __future__ import annotations

import threading

import zstandard

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import (
    MAX_DECOMPRESSED_BYTES,
    MAX_FRAME_BYTES,
    MAX_LENGTH_PREFIXED,
    MAX_ZSTD_WINDOW,
)

__all__ = [
    "LengthPrefixedReader",
    "decode_frame",
    "encode_frame",
    "encode_length_prefixed",
]

# zstd level 3 is zstd's default: ~2-4x on rollout payloads at well under a millisecond each.
_ZSTD_LEVEL = 3
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # RFC 8878 §3.1.1; skippable frames use other magics
_PREFIX_BYTES = 4

# A ZstdCompressor holds ~1 MiB of context; building one per message costs more than compressing
# a small rollout. Contexts are not thread-safe, hence one per thread.
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    cctx: zstandard.ZstdCompressor | None = getattr(_local, "cctx", None)
    if cctx is None:
        # Content size in the header lets the receiver refuse a bomb before decompressing.
        cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True)
        _local.cctx = cctx
    return cctx


def encode_frame(payload: bytes, *, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """Compress `payload` into one zstd frame; LocalProtocolError if a receiver would refuse it."""
    if len(payload) > MAX_DECOMPRESSED_BYTES:
        raise LocalProtocolError(
            f"payload of {len(payload)} B exceeds MAX_DECOMPRESSED_BYTES={MAX_DECOMPRESSED_BYTES}"
        )
    frame = _compressor().compress(payload)
    if len(frame) > max_frame:
        raise LocalProtocolError(
            f"compressed frame of {len(frame)} B exceeds {max_frame} B; split the message"
        )
    return frame


def decode_frame(data: bytes, *, max_size: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """Decompress one zstd frame of at most MAX_FRAME_BYTES into at most `max_size` bytes.

    Raises RemoteProtocolError for oversize input, garbage, truncation, trailing bytes, or output
    that would exceed `max_size`.
    """
    if len(data) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(data)} B exceeds MAX_FRAME_BYTES={MAX_FRAME_BYTES}")
    data = bytes(data)
    if not data.startswith(_ZSTD_MAGIC):
        raise RemoteProtocolError("not a zstd frame (bad magic number)")
    try:
        params = zstandard.get_frame_parameters(data)
        end = _frame_end(data, has_checksum=params.has_checksum)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"corrupt zstd frame header: {exc}") from None
    if end != len(data):
        raise RemoteProtocolError(f"{len(data) - end} trailing bytes after the zstd frame")
    known = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
    if known and params.content_size > max_size:
        # python-zstandard allocates the declared content size and ignores max_output_size when
        # the header declares one, so this check is what stops a declared-size bomb.
        raise RemoteProtocolError(
            f"frame declares {params.content_size} B of content, more than the {max_size} B cap"
        )
    if params.window_size > MAX_ZSTD_WINDOW:
        raise RemoteProtocolError(f"zstd window of {params.window_size} B is above {MAX_ZSTD_WINDOW}")
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW)
    try:
        # Without a declared size zstd decompresses into a max_size buffer and fails on overflow,
        # so a bomb costs at most max_size bytes; with one, the buffer is the (checked) size.
        out = dctx.decompress(data) if known else dctx.decompress(data, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"zstd frame does not decompress within {max_size} B: {exc}") from None
    if len(out) > max_size:  # defensive: the buffer sizes above already guarantee this
        raise RemoteProtocolError(f"frame decompressed to {len(out)} B, above {max_size} B")
    return out


def _frame_end(data: bytes, *, has_checksum: bool) -> int:
    """Offset just past the first zstd frame in `data` (RFC 8878 §3.1.1.2 block headers).

    zstd's one-shot decoder stops after the first frame and ignores what follows, so we walk the
    block headers ourselves to see where the frame ends.
    """
    pos = zstandard.frame_header_size(data)
    while True:
        if pos + 3 > len(data):
            raise RemoteProtocolError("truncated zstd frame (block header)")
        header = int.from_bytes(data[pos : pos + 3], "little")
        pos += 3
        last, block_type, block_size = header & 1, (header >> 1) & 3, header >> 3
        if block_type == 3:
            raise RemoteProtocolError("corrupt zstd frame (reserved block type)")
        pos += 1 if block_type == 1 else block_size  # an RLE block stores one byte
        if pos > len(data):
            raise RemoteProtocolError("truncated zstd frame (block body)")
        if last:
            break
    if has_checksum:
        pos += 4
        if pos > len(data):
            raise RemoteProtocolError("truncated zstd frame (checksum)")
    return pos


def encode_length_prefixed(payload: bytes, *, max_len: int = MAX_LENGTH_PREFIXED) -> bytes:
    """`payload` preceded by its length as 4 bytes big-endian."""
    if len(payload) > min(max_len, MAX_LENGTH_PREFIXED):
        raise LocalProtocolError(f"message of {len(payload)} B exceeds the {max_len} B limit")
    return len(payload).to_bytes(_PREFIX_BYTES, "big") + payload


class LengthPrefixedReader:
    """Splits a byte stream into length-prefixed messages. Sans-I/O: the caller moves the bytes.

    Usage: after each `feed(chunk)`, call `next_message()` until it returns None; at end of stream
    call `feed_eof()`, which raises if the stream stopped mid-message. After any
    RemoteProtocolError the reader is dead: every later call raises again (the stream is out of
    sync and nothing after the bad prefix can be trusted).
    """

    __slots__ = ("_buf", "_eof", "_error", "_max_len")

    def __init__(self, *, max_len: int) -> None:
        if not 0 <= max_len <= MAX_LENGTH_PREFIXED:
            raise ValueError(f"max_len must be in [0, {MAX_LENGTH_PREFIXED}], got {max_len}")
        self._max_len = max_len
        self._buf = bytearray()
        self._eof = False
        self._error: str | None = None

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf)

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def missing(self) -> int:
        """Bytes still to come before `next_message()` has a message: 0 when one is ready; only
        the prefix's own bytes while it is incomplete. Lets the caller size its next read."""
        if len(self._buf) < _PREFIX_BYTES:
            return _PREFIX_BYTES - len(self._buf)
        end = _PREFIX_BYTES + int.from_bytes(self._buf[:_PREFIX_BYTES], "big")
        return max(0, end - len(self._buf))

    def feed(self, data: bytes | bytearray) -> None:
        """Append received bytes; raises at once if the next message declares an oversize length."""
        self._raise_if_failed()
        if self._eof:
            raise LocalProtocolError("feed() after feed_eof()")
        self._buf += data
        self._check_prefix()

    def feed_eof(self) -> None:
        """The stream ended. Raises RemoteProtocolError if a message was cut short."""
        self._raise_if_failed()
        self._eof = True
        if self._buf:
            self._fail(f"stream ended inside a message ({len(self._buf)} B of it received)")

    def next_message(self) -> bytes | None:
        """The next complete message, or None if more bytes are needed."""
        self._raise_if_failed()
        if len(self._buf) < _PREFIX_BYTES:
            return None
        length = int.from_bytes(self._buf[:_PREFIX_BYTES], "big")
        end = _PREFIX_BYTES + length
        if len(self._buf) < end:
            return None
        message = bytes(self._buf[_PREFIX_BYTES:end])
        del self._buf[:end]  # bytearray drops a prefix in O(1) amortized
        self._check_prefix()
        return message

    def _check_prefix(self) -> None:
        if len(self._buf) >= _PREFIX_BYTES:
            length = int.from_bytes(self._buf[:_PREFIX_BYTES], "big")
            if length > self._max_len:
                self._fail(f"declared message length {length} B exceeds the {self._max_len} B limit")

    def _fail(self, message: str) -> None:
        self._error = message
        self._buf.clear()
        raise RemoteProtocolError(message)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RemoteProtocolError(f"stream already failed: {self._error}")
