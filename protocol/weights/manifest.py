"""Weight manifests: the learner's signed description of one weight version's payload. No I/O.

Job: say, for weight version `version` of run `run_id`, exactly which bytes a peer must assemble
(the payload, cut into fixed-size pieces, each with its digest) and what they decode to (the
weights blob, with its size and digest; see Digests below). Peers fetch pieces from the learner and from each other
and check every piece against the manifest before using or serving it, so the manifest's
signature is what makes bytes relayed by untrusted peers trustworthy.

Payload codecs:
- "full": the payload is the weights blob itself (`base_version` is None; the weights size and
  hash equal the payload's).
- "xor-zstd": the payload is `delta.encode_delta(weights, base_weights)`, against the weights of
  `base_version` (< `version`), which the receiver must already hold; decoded with
  `delta.decode_delta` and checked against `weights_sha256` (by `payload_digest`).

Digests: a payload is hashed as 16 KiB leaves (`LEAF_SIZE`, the smallest piece, so every
piece is a whole number of leaves). A piece's digest is the SHA-256 of its leaves' SHA-256s
(`piece_digest`), and a payload's or weights blob's digest is the SHA-256 of its size and all
its leaves' SHA-256s (`payload_digest`), so the learner reads a payload once for both, and the
weights digest does not depend on how a payload was cut into pieces. Inner nodes carry a domain
prefix; leaves need none, since the signed manifest fixes how many leaves each node covers.

Invariants (enforced by construction, so also on every decoded manifest):
- piece i covers payload[i * piece_size : min((i + 1) * piece_size, payload_size)]: offsets and
  sizes are derived, never sent, so they cannot disagree with each other or with the hashes;
- len(pieces) == ceil(payload_size / piece_size), between 1 and MAX_PIECES;
- `piece_size` is a power of two in [MIN_PIECE_SIZE, MAX_PIECE_SIZE];
- a manifest is accepted only if signed by the run's learner (`protocol.envelope.open_manifest`).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Final, Literal, TypeAlias

from protocol.drops import DropReason
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.fields import WireMessage, _fail, _int, _run_id, _seq, _set, _sha256, _short, _str
from protocol.limits import (
    MAX_PIECE_SIZE,
    MAX_PIECES,
    MAX_VERSION,
    MAX_WEIGHTS_BYTES,
    MIN_PIECE_SIZE,
    SHA256_BYTES,
)
from protocol.weights.delta import max_delta_size

__all__ = [
    "CODECS",
    "DEFAULT_PIECE_SIZE",
    "LEAF_SIZE",
    "Codec",
    "WeightManifest",
    "build_manifest",
    "choose_piece_size",
    "payload_digest",
    "piece_digest",
    "piece_range",
    "verify_piece",
]

Codec: TypeAlias = Literal["full", "xor-zstd"]
CODECS: Final = ("full", "xor-zstd")

# Relays fill their pipeline sooner with 64 KiB chunks than with 1 MiB ones (docs/platform.md).
DEFAULT_PIECE_SIZE: Final = 64 * 1024
LEAF_SIZE: Final = MIN_PIECE_SIZE
_PIECE_DOMAIN: Final = b"echo-node/v1/piece\x00"
_ROOT_DOMAIN: Final = b"echo-node/v1/payload\x00"


# Leaves per task when hashing with several threads: hashlib releases the GIL while it hashes a
# large buffer, so threads hash at the speed of the cores; 4 MiB per task keeps the pool's
# per-task cost negligible and the tasks many enough to balance.
_LEAVES_PER_TASK: Final = 256


def _leaf_hashes(view: memoryview, workers: int = 1) -> list[bytes]:
    if workers <= 1 or len(view) <= _LEAVES_PER_TASK * LEAF_SIZE:
        return _leaf_range(view, 0, len(view))
    step = _LEAVES_PER_TASK * LEAF_SIZE
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(lambda lo: _leaf_range(view, lo, min(lo + step, len(view))), range(0, len(view), step))
        return [leaf for part in parts for leaf in part]


def _leaf_range(view: memoryview, lo: int, hi: int) -> list[bytes]:
    return [hashlib.sha256(view[i : min(i + LEAF_SIZE, hi)]).digest() for i in range(lo, hi, LEAF_SIZE)]


def _piece(leaves: list[bytes]) -> bytes:
    return hashlib.sha256(_PIECE_DOMAIN + b"".join(leaves)).digest()


def _root(size: int, leaves: list[bytes]) -> bytes:
    return hashlib.sha256(_ROOT_DOMAIN + size.to_bytes(8, "big") + b"".join(leaves)).digest()


def payload_digest(data: bytes | bytearray | memoryview, *, workers: int = 1) -> bytes:
    """What a manifest states as `payload_sha256` / `weights_sha256` for `data` (see the module
    docstring): one pass over the bytes, by `workers` threads."""
    view = memoryview(data).cast("B")
    return _root(len(view), _leaf_hashes(view, workers))


def piece_digest(data: bytes | bytearray | memoryview) -> bytes:
    """What a manifest lists for a piece holding `data`."""
    return _piece(_leaf_hashes(memoryview(data).cast("B")))


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightManifest(WireMessage):
    """One weight version's payload, as pieces with hashes; sealed by the learner."""

    KIND: ClassVar[str | None] = "weight_manifest"

    run_id: str
    version: int
    base_version: int | None  # None: a full snapshot; else the version the delta is against
    codec: Codec
    payload_size: int
    payload_sha256: bytes
    piece_size: int
    pieces: tuple[bytes, ...]  # piece_digest of each piece, in payload order
    weights_size: int  # the weights blob after decoding the payload
    weights_sha256: bytes

    def __post_init__(self) -> None:
        w = "WeightManifest"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "version", _int(f"{w}.version", self.version, 0, MAX_VERSION))
        codec = _str(f"{w}.codec", self.codec, 16)
        if codec not in CODECS:
            _fail(f"{w}.codec", f"{_short(codec)} is not one of {CODECS}")
        _set(self, "weights_size", _int(f"{w}.weights_size", self.weights_size, 1, MAX_WEIGHTS_BYTES))
        _set(self, "weights_sha256", _sha256(f"{w}.weights_sha256", self.weights_sha256))
        _set(self, "payload_size", _int(f"{w}.payload_size", self.payload_size, 1, MAX_WEIGHTS_BYTES))
        _set(self, "payload_sha256", _sha256(f"{w}.payload_sha256", self.payload_sha256))
        if codec == "full":
            self._check_full(w)
        else:
            self._check_delta(w)
        self._check_pieces(w)

    def _check_full(self, w: str) -> None:
        if self.base_version is not None:
            _fail(f"{w}.base_version", "must be None for a full snapshot")
        if self.weights_size != self.payload_size or self.weights_sha256 != self.payload_sha256:
            _fail(w, "a full snapshot's weights size and hash must equal its payload's")

    def _check_delta(self, w: str) -> None:
        if self.base_version is None:
            _fail(f"{w}.base_version", "a delta needs the version it is against")
        _set(self, "base_version", _int(f"{w}.base_version", self.base_version, 0, self.version - 1))
        if self.payload_size > max_delta_size(self.weights_size):
            _fail(f"{w}.payload_size", f"{self.payload_size} B is more than any delta of {self.weights_size} B")

    def _check_pieces(self, w: str) -> None:
        size = _int(f"{w}.piece_size", self.piece_size, MIN_PIECE_SIZE, MAX_PIECE_SIZE)
        if size & (size - 1):
            _fail(f"{w}.piece_size", f"{size} is not a power of two")
        pieces = _seq(f"{w}.pieces", self.pieces, MAX_PIECES, min_len=1)
        if not all(type(p) is bytes and len(p) == SHA256_BYTES for p in pieces):
            for i, p in enumerate(pieces):  # locate the culprit only once one fails
                _sha256(f"{w}.pieces[{i}]", p)
            pieces = tuple(bytes(p) for p in pieces)
        expected = -(-self.payload_size // size)
        if len(pieces) != expected:
            _fail(f"{w}.pieces", f"{len(pieces)} digests for {self.payload_size} B in {size} B pieces (need {expected})")
        _set(self, "pieces", pieces)

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)

    @property
    def is_delta(self) -> bool:
        return self.codec == "xor-zstd"


def piece_range(manifest: WeightManifest, index: int) -> tuple[int, int]:
    """(offset, size) of piece `index` in the payload; LocalProtocolError if out of range."""
    if type(index) is not int or not 0 <= index < manifest.num_pieces:
        raise LocalProtocolError(f"piece index {index!r} outside [0, {manifest.num_pieces})")
    offset = index * manifest.piece_size
    return offset, min(manifest.piece_size, manifest.payload_size - offset)


def verify_piece(manifest: WeightManifest, index: int, data: bytes | bytearray | memoryview) -> None:
    """RemoteProtocolError unless `data` is exactly piece `index` of the manifest's payload.

    Call before storing, using or serving a piece: the sender of bad bytes is the one to penalize.
    """
    if type(index) is not int or not 0 <= index < manifest.num_pieces:
        raise RemoteProtocolError(f"piece index {index!r} outside [0, {manifest.num_pieces})")
    _, size = piece_range(manifest, index)
    if len(data) != size:
        raise RemoteProtocolError(f"piece {index}: {len(data)} B, expected {size} B")
    if piece_digest(data) != manifest.pieces[index]:
        raise RemoteProtocolError(f"piece {index}: digest does not match the manifest")


def choose_piece_size(payload_size: int, preferred: int = DEFAULT_PIECE_SIZE) -> int:
    """The smallest power of two >= `preferred` (clamped to the bounds) that needs <= MAX_PIECES."""
    if type(payload_size) is not int or not 1 <= payload_size <= MAX_PIECES * MAX_PIECE_SIZE:
        raise LocalProtocolError(
            f"payload of {payload_size!r} B does not fit {MAX_PIECES} pieces of {MAX_PIECE_SIZE} B"
        )
    size = MIN_PIECE_SIZE
    while size < preferred and size < MAX_PIECE_SIZE:
        size *= 2
    while -(-payload_size // size) > MAX_PIECES:
        size *= 2
    return size


def build_manifest(
    *,
    run_id: str,
    version: int,
    payload: bytes | bytearray | memoryview,
    codec: Codec = "full",
    piece_size: int | None = None,
    base_version: int | None = None,
    weights_size: int | None = None,
    weights_sha256: bytes | None = None,
    workers: int = 1,
) -> WeightManifest:
    """Hash `payload` into a manifest (the learner's side; seal it with `envelope.seal`).

    For "full", `weights_size` / `weights_sha256` default to the payload's. For "xor-zstd" they
    and `base_version` are required: they describe the weights the delta decodes to.
    `piece_size` defaults to `choose_piece_size(len(payload))`; `workers` threads hash the
    leaves (the digests do not depend on it). LocalProtocolError on anything
    the manifest's invariants refuse.
    """
    if codec not in CODECS:
        raise LocalProtocolError(f"codec {codec!r} is not one of {CODECS}")
    view = memoryview(payload).cast("B")
    n = len(view)
    if piece_size is None:
        piece_size = choose_piece_size(n)
    if type(piece_size) is not int or piece_size < MIN_PIECE_SIZE:  # also guards the slicing below
        raise LocalProtocolError(f"piece_size {piece_size!r} below {MIN_PIECE_SIZE}")
    if n > MAX_PIECES * piece_size:
        raise LocalProtocolError(
            f"payload of {n} B needs more than {MAX_PIECES} pieces of {piece_size} B; "
            f"use piece_size >= {choose_piece_size(n, piece_size)}"
        )
    leaves = _leaf_hashes(view, workers)
    payload_sha256 = _root(n, leaves)
    if codec == "full":
        weights_size = n if weights_size is None else weights_size
        weights_sha256 = payload_sha256 if weights_sha256 is None else weights_sha256
    elif weights_size is None or weights_sha256 is None:
        raise LocalProtocolError("a delta manifest needs weights_size and weights_sha256 of the decoded weights")
    per_piece = piece_size // LEAF_SIZE
    pieces = tuple(_piece(leaves[i : i + per_piece]) for i in range(0, len(leaves), per_piece))
    return WeightManifest(
        run_id=run_id,
        version=version,
        base_version=base_version,
        codec=codec,
        payload_size=n,
        payload_sha256=payload_sha256,
        piece_size=piece_size,
        pieces=pieces,
        weights_size=weights_size,
        weights_sha256=weights_sha256,
    )
