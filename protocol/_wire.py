"""msgpack packing and strict unpacking shared by messages and envelopes (internal).

Invariants: `pack` is deterministic for our wire values (arrays in field order, maps with sorted
keys, float64 floats, smallest int encodings); `unpack_strict` bounds every container, refuses
ext types and non-str map keys, and turns every failure into RemoteProtocolError.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.errors import RemoteProtocolError
from protocol.limits import MAX_CONFIG_KEYS, MAX_STR, MAX_WIRE_ARRAY


def pack(obj: Any) -> bytes:
    # use_bin_type keeps bytes and str distinct on the wire; floats always pack as float64.
    return msgpack.packb(obj, use_bin_type=True)


def unpack_strict(data: bytes, *, what: str) -> Any:
    """Decode one msgpack object that must span all of `data`."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,  # str must be valid UTF-8
            strict_map_key=True,  # map keys only str/bytes; our maps then require str
            use_list=True,
            max_str_len=MAX_STR,
            max_array_len=MAX_WIRE_ARRAY,
            max_map_len=MAX_CONFIG_KEYS,
            max_ext_len=0,  # no ext types (timestamps included) anywhere in the protocol
        )
    # msgpack reports hostile input as ValueError subclasses (FormatError, ExtraData, StackError,
    # UnicodeDecodeError, "incomplete input") and occasionally TypeError/OverflowError.
    except (ValueError, TypeError, OverflowError) as exc:
        raise RemoteProtocolError(f"{what}: invalid msgpack: {exc}") from None
