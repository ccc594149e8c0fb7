"""The weight data channel's wire protocol: typed, bounded frames and the signed hello. No I/O.

Job: everything a node reads from a data connection is decoded here, with the same strictness as
the gossip messages (messages.py): a frame is one msgpack array whose first element names its
kind; the kind fixes the arity and the type and range of every element. Anything else raises
`RemoteProtocolError`, and nothing else escapes a decoder.

Frames (each a length-prefixed msgpack array on plain TCP; `docs/wire.md` has the byte layout):
- dialer -> listener, first: `hello` (signed, see `make_hello`).
- source (the learner) -> peer: `["manifest", sealed manifest, session]` first, then
  `["peers", [[peer id, host, port], ...]]`, `["none"]` (its queue is empty) and
  `["direct", index, bytes]` (a piece for this peer alone, not to be relayed: the learner sends
  it to every peer itself, with its spare uplink);
  `["unavailable", session]` instead of a manifest when it does not serve what was asked.
  `session` is the learner's signature over the domain and the peer's whole hello: it binds the
  connection to the learner's key and to this hello's fresh nonce, so the control frames that
  follow on it (who to dial, "stop asking") come from the learner, not from whoever answered.
- either side: `["next"]` (to the source only: hand me the next piece), `["more"]` (to the
  source only: my uplink is busy relaying, send me a direct piece), `["get", index]`,
  `["piece", index, bytes]`.
- probe answer: `["reachable", signature over PROBE_DOMAIN + hello]`.
- the bounded-degree exchange (a version the source serves on the overlay): the source's second
  frame is `["neighbours", [[peer id, host, port], ...]]` instead of `peers`, the receiver's own
  entry first, then the neighbours it is to link with now; a later `neighbours` frame replaces
  the set. Between any two nodes of such a version: `["have", mask]`, the pieces the sender
  verified since its last `have` (the whole set on a new link), `mask` little-endian with bit i
  for piece i, exactly ceil(pieces / 8) bytes and no bit at or beyond the version's pieces, or
  (shorter for a few pieces) the list of their indices, each in [0, pieces), at most pieces
  entries; requests are `get`, answers `piece`, and `["cancel", index]` calls off an earlier
  `get` of the same link (the piece came from elsewhere first): the holder drops its answer if
  it has not begun sending it (one may cross the cancel); a cancel of a piece with no `get` on
  that link not yet called off is a protocol error (the caller's rule: echo_node/weights/mesh.py).

Rules: piece indices lie in [0, pieces of the version); a piece's bytes are at most
MAX_PIECE_SIZE (the manifest's hash check says whether they are the right ones); `peers` lists at
most MAX_SWARM_ENTRIES entries of valid peer ids with an IP-literal host and a port, or with
("", 0) for a peer nobody can dial; frames of the source
(`manifest`, `peers`, `neighbours`, `none`, `unavailable`, `direct`) are accepted only on the connection
to the source.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from protocol._wire import pack, unpack_strict
from protocol.addresses import AddressError, check_data_host, check_port
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity, is_valid_peer_id, peer_id_from_public_key, public_key_from_peer_id, verify
from protocol.limits import (
    ED25519_PUBLIC_KEY_BYTES,
    ED25519_SIGNATURE_BYTES,
    MAX_PIECE_SIZE,
    MAX_PIECES,
    MAX_RUN_ID_LEN,
    MAX_VERSION,
)

__all__ = [
    "FULL", "HELLO_MAX", "MAX_SWARM_ENTRIES", "MAX_WIRE_FRAME", "PROBE", "Cancel", "Frame", "Get", "Hello", "HelloChecker",
    "Direct", "Have", "ManifestFrame", "More", "Neighbours", "Next", "NoMore", "PeerEntry", "Peers", "Piece", "NotServed",
    "decode_frame", "decode_probe_answer", "have_bytes", "mask_indices",
    "encode", "make_hello", "probe_answer", "session_signature", "verify_session",
]

# A frame is one piece at most plus a small header.
MAX_WIRE_FRAME: Final = MAX_PIECE_SIZE + 1024
HELLO_MAX: Final = 1024
HELLO_TTL_S: Final = 60.0
# Hellos remembered against replay (each for its lifetime); the oldest is forgotten beyond this.
MAX_SEEN_NONCES: Final = 65536
MAX_SWARM_ENTRIES: Final = 1024
NONCE_BYTES: Final = 16
# v2: the source binds its answer to the hello (`session`); v1 peers are refused at the hello.
HELLO_DOMAIN: Final = b"echo-node/v2/data-hello\x00"
PROBE_DOMAIN: Final = b"echo-node/v2/data-probe\x00"
SESSION_DOMAIN: Final = b"echo-node/v2/data-session\x00"
UNAVAILABLE_DOMAIN: Final = b"echo-node/v2/data-unavailable\x00"
FULL: Final = -1  # the `base` of a full snapshot (a delta names the version it applies to)
# A hello whose version is PROBE asks the target to prove it listens there (see `probe_answer`).
PROBE: Final = -1


# --- the hello ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    sender: str
    target: str
    run_id: str
    version: int
    base: int
    host: str
    port: int
    raw: bytes  # the signed bytes as received: what a session or probe answer signs


def make_hello(
    identity: Identity, *, target: str, run_id: str, version: int, base: int = FULL, host: str = "", port: int = 0,
    now: float, nonce: bytes | None = None,
) -> bytes:
    """A signed hello: [body, signature], body = [public key, target, run, version, base, nonce,
    expiry (float64 seconds since the epoch), host, port]."""
    body = pack([identity.public_key, target, run_id, version, base, nonce or os.urandom(NONCE_BYTES), float(now + HELLO_TTL_S), host, port])
    return pack([body, identity.sign(HELLO_DOMAIN + body)])


def _hello_fields(data: bytes) -> tuple[bytes, bytes, list[Any]]:
    if len(data) > HELLO_MAX:
        raise RemoteProtocolError(f"data-channel hello of {len(data)} bytes exceeds {HELLO_MAX}")
    outer = unpack_strict(data, what="data-channel hello")
    if not (isinstance(outer, list) and len(outer) == 2 and isinstance(outer[0], bytes) and isinstance(outer[1], bytes)):
        raise RemoteProtocolError("malformed data-channel hello: not [body, signature]")
    body, signature = outer
    fields = unpack_strict(body, what="data-channel hello body")
    if not (isinstance(fields, list) and len(fields) == 9):
        raise RemoteProtocolError("malformed data-channel hello: the body has not 9 fields")
    public_key, target, run_id, version, base, nonce, expiry, host, port = fields
    typed = (
        isinstance(public_key, bytes) and len(public_key) == ED25519_PUBLIC_KEY_BYTES and len(signature) == ED25519_SIGNATURE_BYTES
        and isinstance(target, str) and is_valid_peer_id(target) and isinstance(run_id, str) and len(run_id) <= MAX_RUN_ID_LEN
        and _is_int(version, PROBE, MAX_VERSION) and _is_int(base, FULL, MAX_VERSION)
        and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES and type(expiry) is float
        and isinstance(host, str) and _is_int(port, 0, 65535)
    )
    if not typed:
        raise RemoteProtocolError("malformed data-channel hello: a field has the wrong type or range")
    return body, signature, fields


class HelloChecker:
    """Verifies hellos addressed to `me` for `run_id`; each nonce is accepted once."""

    def __init__(self, me: str, run_id: str) -> None:
        self.me = me
        self.run_id = run_id
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, data: bytes, now: float) -> Hello:
        body, signature, fields = _hello_fields(data)
        public_key, target, run_id, version, base, nonce, expiry, host, port = fields
        if (host, port) != ("", 0):  # a probe, or a peer nobody can dial, names no address
            try:
                host, port = check_data_host(host, where="hello host"), check_port(port, where="hello port")
            except AddressError as exc:
                raise RemoteProtocolError(f"malformed data-channel hello: {exc}") from None
        verify(public_key, signature, HELLO_DOMAIN + body)
        sender = peer_id_from_public_key(public_key)
        if target != self.me or run_id != self.run_id:
            raise RemoteProtocolError(f"hello from {sender} is for another target or run")
        while self._seen and (next(iter(self._seen.values())) <= now or len(self._seen) >= MAX_SEEN_NONCES):
            self._seen.popitem(last=False)
        if not now <= expiry <= now + 2 * HELLO_TTL_S or nonce in self._seen:
            raise RemoteProtocolError(f"hello from {sender} is expired or replayed")
        self._seen[nonce] = expiry
        return Hello(sender, target, run_id, version, base, host, port, data)


def _is_int(value: object, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _sign_hello(identity: Identity, domain: bytes, hello: bytes) -> bytes:
    return identity.sign(domain + hello)


def session_signature(identity: Identity, hello: bytes, *, available: bool = True) -> bytes:
    """The source's proof, on its first frame, that it is the learner answering this hello."""
    return _sign_hello(identity, SESSION_DOMAIN if available else UNAVAILABLE_DOMAIN, hello)


def verify_session(learner_id: str, hello: bytes, signature: bytes, *, available: bool = True) -> None:
    """RemoteProtocolError unless `signature` is the learner's session signature over `hello`."""
    verify(public_key_from_peer_id(learner_id), signature, (SESSION_DOMAIN if available else UNAVAILABLE_DOMAIN) + hello)


def probe_answer(identity: Identity, hello: bytes) -> bytes:
    return encode(Reachable(_sign_hello(identity, PROBE_DOMAIN, hello)))


def decode_probe_answer(data: bytes, peer_id: str, hello: bytes) -> None:
    """RemoteProtocolError unless `data` is `peer_id`'s answer to our probe `hello`."""
    frame = unpack_strict(data, what="probe answer")
    if not (isinstance(frame, list) and len(frame) == 2 and frame[0] == "reachable" and isinstance(frame[1], bytes)):
        raise RemoteProtocolError("not a probe answer")
    verify(public_key_from_peer_id(peer_id), frame[1], PROBE_DOMAIN + hello)


# --- frames -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Piece:
    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Direct:
    """A piece the source sends this peer alone, from its spare uplink: verified and kept like
    any piece, never relayed (the source delivers it to every peer itself)."""

    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Get:
    index: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Call off an earlier `get` of `index` on this link: the piece came from elsewhere first."""

    index: int


@dataclass(frozen=True, slots=True)
class Next:
    pass


@dataclass(frozen=True, slots=True)
class More:
    """Peer -> source: my uplink relays all it can; send me a piece of your own (`Direct`)."""


@dataclass(frozen=True, slots=True)
class NoMore:
    pass


@dataclass(frozen=True, slots=True)
class PeerEntry:
    peer_id: str
    host: str  # "" with port 0: listed, but nobody can dial it
    port: int


@dataclass(frozen=True, slots=True)
class Peers:
    entries: tuple[PeerEntry, ...]


@dataclass(frozen=True, slots=True)
class Neighbours:
    """Source -> peer, on the overlay: the receiver's own entry first (which says whether others
    can dial it), then every neighbour it is to hold a link with now (the set replaces the last)."""

    entries: tuple[PeerEntry, ...]


@dataclass(frozen=True, slots=True)
class Have:
    """Pieces the sender holds verified, as a mask (bit i: piece i), below 1 << pieces."""

    bits: int


def have_bytes(num_pieces: int) -> int:
    """The exact length of a `have` mask on the wire for a version of `num_pieces` pieces."""
    return (num_pieces + 7) // 8


@dataclass(frozen=True, slots=True)
class ManifestFrame:
    sealed: bytes
    session: bytes


@dataclass(frozen=True, slots=True)
class NotServed:
    session: bytes


@dataclass(frozen=True, slots=True)
class Reachable:
    signature: bytes


Frame: TypeAlias = Piece | Direct | Get | Cancel | Next | More | NoMore | Peers | Neighbours | Have | ManifestFrame | NotServed | Reachable
_KINDS: Final[dict[type, str]] = {
    Piece: "piece", Direct: "direct", Get: "get", Cancel: "cancel", Next: "next", More: "more", NoMore: "none", Peers: "peers",
    Neighbours: "neighbours", Have: "have", ManifestFrame: "manifest", NotServed: "unavailable", Reachable: "reachable",
}
_FROM_SOURCE_ONLY: Final = frozenset({"manifest", "peers", "neighbours", "none", "unavailable", "direct"})


def encode(frame: Frame, *, num_pieces: int = MAX_PIECES) -> bytes:
    """The msgpack array of `frame` (the caller length-prefixes it); a `have` mask is written in
    the length of a version of `num_pieces` pieces."""
    kind = _KINDS[type(frame)]
    if isinstance(frame, Have):
        size = have_bytes(num_pieces)
        if frame.bits.bit_count() * 3 < size:  # a few pieces: their indices are the shorter form
            return pack([kind, mask_indices(frame.bits)])
        return pack([kind, frame.bits.to_bytes(size, "little")])
    if isinstance(frame, (Piece, Direct)):
        return pack([kind, frame.index, frame.data])
    if isinstance(frame, (Get, Cancel)):
        return pack([kind, frame.index])
    if isinstance(frame, (Peers, Neighbours)):
        return pack([kind, [[e.peer_id, e.host, e.port] for e in frame.entries]])
    if isinstance(frame, ManifestFrame):
        return pack([kind, frame.sealed, frame.session])
    if isinstance(frame, (NotServed,)):
        return pack([kind, frame.session])
    if isinstance(frame, Reachable):
        return pack([kind, frame.signature])
    return pack([kind])


def decode_frame(data: bytes, *, num_pieces: int = MAX_PIECES, from_source: bool = False) -> Frame:
    """One frame read from a data connection (see the module rules)."""
    if len(data) > MAX_WIRE_FRAME:
        raise RemoteProtocolError(f"data frame of {len(data)} bytes exceeds {MAX_WIRE_FRAME}")
    frame = unpack_strict(data, what="data frame")
    if not (isinstance(frame, list) and frame and isinstance(frame[0], str)):
        raise RemoteProtocolError("malformed data frame: not an array starting with its kind")
    kind, args = frame[0], frame[1:]
    if kind in _FROM_SOURCE_ONLY and not from_source:
        raise RemoteProtocolError(f"a {kind!r} frame from a peer that is not the source")
    if kind in ("piece", "direct") and len(args) == 2 and _is_int(args[0], 0, num_pieces - 1) and isinstance(args[1], bytes):
        if len(args[1]) > MAX_PIECE_SIZE:
            raise RemoteProtocolError(f"piece of {len(args[1])} bytes exceeds {MAX_PIECE_SIZE}")
        return (Piece if kind == "piece" else Direct)(args[0], args[1])
    if kind in ("get", "cancel") and len(args) == 1 and _is_int(args[0], 0, num_pieces - 1):
        return (Get if kind == "get" else Cancel)(args[0])
    if kind == "next" and not args:
        return Next()
    if kind == "more" and not args:
        return More()
    if kind == "none" and not args:
        return NoMore()
    if kind in ("peers", "neighbours") and len(args) == 1 and isinstance(args[0], list) and len(args[0]) <= MAX_SWARM_ENTRIES:
        return (Peers if kind == "peers" else Neighbours)(tuple(_peer_entry(e) for e in args[0]))
    if kind == "have" and len(args) == 1 and isinstance(args[0], bytes) and len(args[0]) == have_bytes(num_pieces):
        bits = int.from_bytes(args[0], "little")
        if bits >> num_pieces:
            raise RemoteProtocolError(f"a have mask names a piece at or beyond {num_pieces}")
        return Have(bits)
    if kind == "have" and len(args) == 1 and isinstance(args[0], list) and len(args[0]) <= num_pieces:
        bits = 0
        for index in args[0]:
            if not _is_int(index, 0, num_pieces - 1):  # checked before the shift: 1 << 2**40 is a MemoryError
                raise RemoteProtocolError(f"a have list names a piece outside [0, {num_pieces})")
            bits |= 1 << index
        return Have(bits)
    if kind == "manifest" and len(args) == 2 and isinstance(args[0], bytes) and isinstance(args[1], bytes):
        return ManifestFrame(args[0], args[1])
    if kind == "unavailable" and len(args) == 1 and isinstance(args[0], bytes):
        return NotServed(args[0])
    raise RemoteProtocolError(f"malformed data frame of kind {kind[:32]!r}")


def mask_indices(bits: int) -> list[int]:
    """The indices of the set bits of a piece mask (>= 0), in increasing order."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def _peer_entry(entry: object) -> PeerEntry:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and is_valid_peer_id(entry[0])
            and isinstance(entry[1], str) and _is_int(entry[2], 0, 65535)):
        raise RemoteProtocolError("malformed peers entry")
    peer_id, host, port = entry
    if (host, port) == ("", 0):
        return PeerEntry(peer_id, host, port)
    try:
        return PeerEntry(peer_id, check_data_host(host, where="peers entry"), check_port(port, where="peers entry"))
    except AddressError as exc:
        raise RemoteProtocolError(str(exc)) from None
