"""Field validation and the message base class, shared by messages.py and manifest.py. No I/O.

Job: the one place that says how a field is checked (type, bound, canonical form) and how a
message maps to and from its wire array, so every message module builds on it and none imports
another (messages.py lists the registry, manifest.py defines the manifest, envelope.py signs
them; the import graph is a tree).

Invariant: every helper raises LocalProtocolError("<Class>.<field>: <what>") on a bad value;
`WireMessage.from_wire` turns that into RemoteProtocolError for bytes that came from a peer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, fields
from typing import Any, ClassVar, NoReturn, Self, TypeAlias, TypeVar

from protocol.addresses import AddressError, check_data_host
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.identity import is_valid_peer_id
from protocol.limits import (
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_ITEMS,
    MAX_CONFIG_KEYS,
    MAX_CONFIG_LIST,
    MAX_INT64,
    MAX_NAME_LEN,
    MAX_STR,
    MIN_INT64,
    RUN_ID_PATTERN,
    SHA256_BYTES,
)

ConfigScalar: TypeAlias = None | bool | int | float | str
ConfigDict: TypeAlias = dict[str, Any]  # values: scalar | list[scalar] | dict[str, scalar | list]


# --- validation helpers: all raise LocalProtocolError("<Class>.<field>: <what>") ---------------


def _fail(where: str, what: str) -> NoReturn:
    raise LocalProtocolError(f"{where}: {what}")


def _short(value: object) -> str:
    """repr for error messages, truncated: peers control these values."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalize fields in __post_init__


def _int(where: str, value: object, lo: int, hi: int) -> int:
    # bool is an int subclass; True as a version or token id is a type confusion, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(where, f"expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        _fail(where, f"{_short(value)} out of range [{lo}, {hi}]")
    return int(value)


def _float(where: str, value: object, lo: float, hi: float) -> float:
    if not isinstance(value, float):  # an int on the wire would not re-encode canonically
        _fail(where, f"expected float, got {type(value).__name__}")
    if not math.isfinite(value):
        _fail(where, f"must be finite, got {value!r}")
    if not lo <= value <= hi:
        _fail(where, f"{value!r} out of range [{lo}, {hi}]")
    return float(value)


def _str(where: str, value: object, max_len: int, *, min_len: int = 1) -> str:
    """Lengths count characters; a string is also at most MAX_STR bytes of UTF-8, what every
    decoder accepts (so a message that can be built can be received)."""
    if not isinstance(value, str):
        _fail(where, f"expected str, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        _fail(where, f"length {len(value)} outside [{min_len}, {max_len}]")
    if len(value) > MAX_STR // 4 and len(value.encode("utf-8", "surrogatepass")) > MAX_STR:
        _fail(where, f"{len(value.encode('utf-8', 'surrogatepass'))} bytes of UTF-8, above {MAX_STR}")
    return str(value)


def _bytes(where: str, value: object, *, exact: int | None = None, max_len: int = MAX_STR) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        _fail(where, f"expected bytes, got {type(value).__name__}")
    value = bytes(value)
    if exact is not None and len(value) != exact:
        _fail(where, f"expected exactly {exact} bytes, got {len(value)}")
    if len(value) > max_len:
        _fail(where, f"{len(value)} bytes exceeds {max_len}")
    return value


def _run_id(where: str, value: object) -> str:
    value = _str(where, value, 64)
    if not RUN_ID_PATTERN.fullmatch(value):
        _fail(where, f"{_short(value)} does not match {RUN_ID_PATTERN.pattern}")
    return value


def _peer_id(where: str, value: object) -> str:
    if not is_valid_peer_id(value):
        _fail(where, f"{_short(value)} is not an Ed25519 libp2p peer id")
    return str(value)


def _seq(where: str, value: object, max_len: int, *, min_len: int = 0) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)):
        _fail(where, f"expected a list, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        _fail(where, f"length {len(value)} outside [{min_len}, {max_len}]")
    return tuple(value)


_T = TypeVar("_T")


def _nested_seq(where: str, value: object, sub: type[_T], max_len: int, *, min_len: int = 0) -> tuple[_T, ...]:
    """A bounded list of already-built `sub` messages (from_wire builds them from wire arrays)."""
    items = _seq(where, value, max_len, min_len=min_len)
    for i, x in enumerate(items):
        if not isinstance(x, sub):
            _fail(f"{where}[{i}]", f"expected {sub.__name__}, got {type(x).__name__}")
    return items


def _ints(where: str, value: object, max_len: int, lo: int, hi: int, *, min_len: int = 0) -> tuple[int, ...]:
    items = _seq(where, value, max_len, min_len=min_len)
    # Fast path over up to 4096 elements per field; only locate the culprit once one fails.
    if not all(type(x) is int for x in items) or (items and (min(items) < lo or max(items) > hi)):
        for i, x in enumerate(items):
            _int(f"{where}[{i}]", x, lo, hi)
    return items


def _logprobs(where: str, value: object, max_len: int) -> tuple[float, ...]:
    """Per-token log-probabilities: finite floats <= 0."""
    lps = _seq(where, value, max_len)
    # x <= 0.0 is False for NaN and +inf, so one pass rejects both; -inf is checked next.
    if not all(isinstance(x, float) and x <= 0.0 for x in lps) or (lps and min(lps) == -math.inf):
        for i, x in enumerate(lps):
            _float(f"{where}[{i}]", x, -math.inf, 0.0)
    return lps


def _token_versions(where: str, value: object, max_len: int, max_version: int) -> tuple[int, ...]:
    """The weight version of each token, non-decreasing: weights only move forward."""
    vs = _ints(where, value, max_len, 0, max_version)
    if any(a > b for a, b in zip(vs, vs[1:])):
        _fail(where, "must be non-decreasing (weights only move forward)")
    return vs


def _data_host(where: str, value: object) -> str:
    try:
        return check_data_host(value, where=where)
    except AddressError as exc:
        _fail(where, str(exc).removeprefix(f"{where}: "))


def _sha256(where: str, value: object) -> bytes:
    return _bytes(where, value, exact=SHA256_BYTES)


# --- config dicts (RunSpec.model / RunSpec.tokenizer) -----------------------------------------


def _config(where: str, value: object) -> ConfigDict:
    budget = [MAX_CONFIG_ITEMS]
    return _config_map(where, value, depth=1, budget=budget)


def _config_map(where: str, value: object, *, depth: int, budget: list[int]) -> ConfigDict:
    if not isinstance(value, Mapping):
        _fail(where, f"expected a dict, got {type(value).__name__}")
    if len(value) > MAX_CONFIG_KEYS:
        _fail(where, f"{len(value)} keys exceeds {MAX_CONFIG_KEYS}")
    out: ConfigDict = {}
    for key in sorted(value, key=lambda k: (not isinstance(k, str), str(k))):
        if not isinstance(key, str) or not 0 < len(key) <= MAX_NAME_LEN:
            _fail(where, f"key {_short(key)} is not a str of 1..{MAX_NAME_LEN} characters")
        out[key] = _config_value(f"{where}[{key!r}]", value[key], depth=depth, budget=budget)
    return out


def _config_value(where: str, value: object, *, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        _fail(where, f"config has more than {MAX_CONFIG_ITEMS} values")
    if isinstance(value, (list, tuple)):
        items = _seq(where, value, MAX_CONFIG_LIST)
        return [_config_scalar(f"{where}[{i}]", x, budget=budget) for i, x in enumerate(items)]
    if isinstance(value, Mapping):
        if depth >= MAX_CONFIG_DEPTH:
            _fail(where, f"config dicts nest at most {MAX_CONFIG_DEPTH} deep")
        return _config_map(where, value, depth=depth + 1, budget=budget)
    return _config_scalar(where, value, budget=None)


def _config_scalar(where: str, value: object, *, budget: list[int] | None) -> ConfigScalar:
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            _fail(where, f"config has more than {MAX_CONFIG_ITEMS} values")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _int(where, value, MIN_INT64, MAX_INT64)
    if isinstance(value, float):
        return _float(where, value, -math.inf, math.inf)
    if isinstance(value, str):
        return _str(where, value, MAX_STR, min_len=0)
    _fail(where, f"config values must be None, bool, int, float, str or lists of those, got "
          f"{type(value).__name__}")


# --- base class -------------------------------------------------------------------------------


class WireMessage:
    """Base of all messages: array-of-fields wire form, strict `from_wire`.

    Subclasses declare `KIND` (the registry key; None for messages only nested inside others),
    `SIGNER_FIELD` (a field that must equal the envelope signer's peer id), and `_NESTED` (fields
    holding one nested message, or a tuple of them).
    """

    __slots__ = ()

    # Every concrete message is a dataclass (declared here so `fields(cls)` type-checks).
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    KIND: ClassVar[str | None] = None
    SIGNER_FIELD: ClassVar[str | None] = None
    _NESTED: ClassVar[Mapping[str, type[WireMessage]]] = {}
    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {}

    def to_wire(self) -> list[Any]:
        return [_to_wire_value(getattr(self, name)) for name in _field_names(type(self))]

    @classmethod
    def from_wire(cls, obj: object) -> Self:
        names = _field_names(cls)
        name = cls.__name__
        if not isinstance(obj, (list, tuple)):
            raise RemoteProtocolError(f"{name}: expected an array of {len(names)} fields, got {type(obj).__name__}")
        if len(obj) != len(names):
            raise RemoteProtocolError(
                f"{name}: expected {len(names)} fields ({', '.join(names)}), got {len(obj)}"
            )
        kwargs: dict[str, Any] = {}
        for field, value in zip(names, obj):
            if field in cls._NESTED:
                value = _nested(cls._NESTED[field], f"{name}.{field}", value)
            elif field in cls._NESTED_TUPLE:
                sub, max_len = cls._NESTED_TUPLE[field]
                if not isinstance(value, (list, tuple)) or len(value) > max_len:
                    raise RemoteProtocolError(f"{name}.{field}: expected a list of at most {max_len}")
                value = tuple(_nested(sub, f"{name}.{field}[{i}]", v) for i, v in enumerate(value))
            kwargs[field] = value
        try:
            return cls(**kwargs)
        except LocalProtocolError as exc:  # the peer's bytes built an invalid message
            raise RemoteProtocolError(str(exc)) from None


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type[WireMessage]) -> tuple[str, ...]:
    # dataclasses.fields() builds a new tuple per call: a noticeable share of opening a batch.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _nested(sub: type[WireMessage], where: str, value: object) -> WireMessage:
    try:
        return sub.from_wire(value)
    except ProtocolError as exc:
        raise RemoteProtocolError(f"{where}: {exc}") from None


def _to_wire_value(value: object) -> object:
    if isinstance(value, WireMessage):
        return value.to_wire()
    if isinstance(value, tuple) and value and isinstance(value[0], WireMessage):
        return [v.to_wire() for v in value]
    if isinstance(value, dict):
        return {k: _to_wire_value(value[k]) for k in sorted(value)}  # canonical key order
    return value  # scalars, bytes, tuples of scalars (msgpack packs tuples as arrays)
