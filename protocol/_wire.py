"""msgpack packing and strict unpacking shared by messages and envelopes (internal).

Invariants: `pack` is deterministic for our wire values (arrays in field order, maps with sorted
keys, float64 floats, smallest int encodings); `unpack_strict` bounds every container, refuses
ext types and non-str map keys, and turns every failure into RemoteProtocolError.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.errors import RemoteProtocolError
from protocol.limits import MAX_CONFIG_KEYS, MAX_STR, MAX_WIRE_ARRAY, MAX_WIRE_ARRAYS


def pack(obj: Any) -> bytes:
    # use_bin_type keeps bytes and str distinct on the wire; floats always pack as float64.
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


class _ArrayBudget:
    """Counts arrays as the unpacker builds them and stops it past `MAX_WIRE_ARRAYS`: one byte
    of msgpack (0x90) is a whole Python list (~64 B), so without this a 451-byte zstd frame of
    4 MB of nested empty arrays built ~266 MB of lists before anything could refuse it."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_WIRE_ARRAYS

    def __call__(self, items: list[Any]) -> list[Any]:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_WIRE_ARRAYS} arrays in one message")
        return items


def unpack_strict(data: bytes, *, what: str) -> Any:
    """Decode one msgpack object that must span all of `data`."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,  # str must be valid UTF-8
            strict_map_key=True,  # map keys only str/bytes; our maps then require str
            use_list=True,
            list_hook=_ArrayBudget(),
            max_str_len=MAX_STR,
            max_array_len=MAX_WIRE_ARRAY,
            max_map_len=MAX_CONFIG_KEYS,
            max_ext_len=0,  # no ext types (timestamps included) anywhere in the protocol
        )
    # msgpack reports hostile input as ValueError subclasses (FormatError, ExtraData, StackError,
    # UnicodeDecodeError, "incomplete input") and occasionally TypeError/OverflowError.
    except (ValueError, TypeError, OverflowError) as exc:
        raise RemoteProtocolError(f"{what}: invalid msgpack: {exc}") from None
