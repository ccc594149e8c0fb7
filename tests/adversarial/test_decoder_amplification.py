"""A small hostile input cannot make a decoder build a large object graph.

One byte of msgpack (0x90) is a whole Python list, and zstd turns a few hundred bytes into
megabytes of such bytes: before the array budget, a 451-byte frame built ~266 MB of lists.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
import zstandard

from protocol import decode_message, open_envelope
from protocol._wire import unpack_strict
from protocol.errors import RemoteProtocolError
from protocol.limits import MAX_FRAME_BYTES
from protocol.weights.datachannel import decode_frame as decode_data_frame

# An array of 4096 arrays of 1000 empty arrays: 4 MB of msgpack, 4 million lists if decoded.
_INNER = b"\xdc" + (1000).to_bytes(2, "big") + b"\x90" * 1000
LISTS = b"\xdc" + (4096).to_bytes(2, "big") + _INNER * 4096
BOMB = zstandard.ZstdCompressor(level=19).compress(LISTS)
SMALL_LISTS = LISTS[: 4 * 1024 * 1024 + 1024]


def peak_mb(decode: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError):
            decode()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("name", "decode"),
    [
        ("gossip frame", lambda: open_envelope(BOMB)),
        ("stream message", lambda: decode_message(LISTS[: 4 * 1024 * 1024])),
        ("raw msgpack", lambda: unpack_strict(LISTS, what="x")),
        ("data-channel frame", lambda: decode_data_frame(SMALL_LISTS[: 4 * 1024 * 1024])),
    ],
)
def test_a_nested_array_bomb_is_refused_cheaply(name: str, decode: Callable[[], object]) -> None:
    assert len(BOMB) < 1024 < MAX_FRAME_BYTES
    # Dominated by the input itself (4 MB) plus at most MAX_WIRE_ARRAYS lists (~4 MB).
    assert peak_mb(decode) < 16, name
