"""Weight manifests: derived piece ranges, piece verification, signed open, bounds."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

import msgpack
import pytest

from protocol import Identity, decode_message, encode_message, seal
from protocol.drops import DropReason
from protocol.envelope import open_manifest
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.framing import decode_frame, encode_frame
from protocol.limits import MAX_FRAME_BYTES, MAX_PIECE_SIZE, MAX_PIECES, MIN_PIECE_SIZE
from protocol.weights.delta import decode_delta, encode_delta
from protocol.weights.manifest import (
    LEAF_SIZE,
    WeightManifest,
    build_manifest,
    choose_piece_size,
    payload_digest,
    piece_digest,
    piece_range,
    verify_piece,
)

LEARNER = Identity.from_seed(b"\x0c" * 32)
MALLORY = Identity.from_seed(b"\x0b" * 32)
PIECE = MIN_PIECE_SIZE
PAYLOAD = random.Random(0).randbytes(3 * PIECE + 1000)  # three full pieces and a short one


def manifest(**overrides: Any) -> WeightManifest:
    m = build_manifest(run_id="run-1", version=7, payload=PAYLOAD, piece_size=PIECE)
    kw = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    kw.update(overrides)
    return WeightManifest(**kw)


def test_pieces_cover_the_payload_exactly() -> None:
    m = manifest()
    assert m.num_pieces == 4 and m.codec == "full" and m.base_version is None
    assert m.weights_size == m.payload_size == len(PAYLOAD)
    assert m.weights_sha256 == m.payload_sha256 == payload_digest(PAYLOAD)
    ranges = [piece_range(m, i) for i in range(m.num_pieces)]
    assert ranges == [(0, PIECE), (PIECE, PIECE), (2 * PIECE, PIECE), (3 * PIECE, 1000)]
    assert b"".join(PAYLOAD[o : o + s] for o, s in ranges) == PAYLOAD
    for i, (o, s) in enumerate(ranges):
        verify_piece(m, i, PAYLOAD[o : o + s])
        verify_piece(m, i, memoryview(PAYLOAD)[o : o + s])
    exact = build_manifest(run_id="r", version=0, payload=bytes(2 * PIECE), piece_size=PIECE)
    assert exact.num_pieces == 2 and piece_range(exact, 1) == (PIECE, PIECE)
    with pytest.raises(LocalProtocolError):
        piece_range(m, 4)


def test_digests_are_a_hash_tree_over_16_kib_leaves() -> None:
    # The wire contract spelled out: SHA-256 of each 16 KiB leaf; a piece is the SHA-256 of
    # its leaves' digests; the payload is the SHA-256 of its size and all leaves' digests.
    def sha(b: bytes) -> bytes:
        return hashlib.sha256(b).digest()

    assert LEAF_SIZE == 16 * 1024
    leaves = [sha(PAYLOAD[o : o + LEAF_SIZE]) for o in range(0, len(PAYLOAD), LEAF_SIZE)]
    root = sha(b"echo-node/v1/payload\x00" + len(PAYLOAD).to_bytes(8, "big") + b"".join(leaves))
    assert payload_digest(PAYLOAD) == root
    two_leaf = build_manifest(run_id="r", version=0, payload=PAYLOAD, piece_size=2 * LEAF_SIZE)
    assert two_leaf.pieces == (
        sha(b"echo-node/v1/piece\x00" + leaves[0] + leaves[1]),
        sha(b"echo-node/v1/piece\x00" + leaves[2] + leaves[3]),
    )
    assert piece_digest(PAYLOAD[2 * LEAF_SIZE :]) == two_leaf.pieces[1]
    # One digest of the bytes however they are cut into pieces, so a delta's manifest can name
    # the weights a full manifest with other pieces describes.
    assert two_leaf.payload_sha256 == manifest().payload_sha256 == root
    assert payload_digest(PAYLOAD[:-1]) != root and payload_digest(PAYLOAD + b"\x00") != root


def test_verify_piece_rejects_wrong_bytes() -> None:
    m = manifest()
    good = PAYLOAD[:PIECE]
    with pytest.raises(RemoteProtocolError, match="expected 16384 B"):
        verify_piece(m, 0, good[:-1])
    with pytest.raises(RemoteProtocolError, match="digest does not match"):
        verify_piece(m, 0, b"\x00" + good[1:])
    with pytest.raises(RemoteProtocolError, match="digest does not match"):
        verify_piece(m, 1, good)  # a genuine piece offered under another index
    for index in (-1, 4, True):
        with pytest.raises(RemoteProtocolError, match="outside"):
            verify_piece(m, index, good)


def test_seal_and_open() -> None:
    m = manifest()
    frame = seal(m, LEARNER)
    assert open_manifest(frame, learner_peer_id=LEARNER.peer_id, run_id="run-1") == m
    assert decode_message(encode_message(m), WeightManifest) == m  # unsigned stream encoding too


def test_open_rejects_forged_foreign_and_tampered() -> None:
    m = manifest()
    with pytest.raises(RemoteProtocolError) as exc:
        open_manifest(seal(m, MALLORY), learner_peer_id=LEARNER.peer_id, run_id="run-1")
    assert exc.value.reason == DropReason.WRONG_SENDER
    with pytest.raises(RemoteProtocolError) as exc:
        open_manifest(seal(manifest(run_id="run-2"), LEARNER), learner_peer_id=LEARNER.peer_id, run_id="run-1")
    assert exc.value.reason == DropReason.WRONG_RUN
    # Tamper: swap one piece hash inside the signed payload, keep the learner's signature.
    fields = msgpack.unpackb(decode_frame(seal(m, LEARNER)))
    body = msgpack.unpackb(fields[2])
    body[7][0] = b"\x00" * 32
    fields[2] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(RemoteProtocolError) as exc:
        open_manifest(encode_frame(msgpack.packb(fields, use_bin_type=True)), learner_peer_id=LEARNER.peer_id, run_id="run-1")
    assert exc.value.reason == DropReason.BAD_SIGNATURE
    with pytest.raises(RemoteProtocolError) as exc:
        open_manifest(b"\x28\xb5\x2f\xfd garbage", learner_peer_id=LEARNER.peer_id, run_id="run-1")
    assert exc.value.reason == DropReason.MALFORMED


def test_largest_manifest_fits_one_sealed_frame() -> None:
    rng = random.Random(1)
    digest = rng.randbytes(32)
    m = WeightManifest(
        run_id="r" * 64, version=2**63 - 1, base_version=None, codec="full",
        payload_size=MAX_PIECES * MAX_PIECE_SIZE, payload_sha256=digest, piece_size=MAX_PIECE_SIZE,
        pieces=tuple(rng.randbytes(32) for _ in range(MAX_PIECES)),
        weights_size=MAX_PIECES * MAX_PIECE_SIZE, weights_sha256=digest,
    )
    frame = seal(m, LEARNER)
    assert len(frame) <= MAX_FRAME_BYTES
    assert open_manifest(frame, learner_peer_id=LEARNER.peer_id, run_id="r" * 64) == m


def test_delta_manifest_end_to_end() -> None:
    rng = random.Random(2)
    base = rng.randbytes(5 * PIECE)
    new = bytearray(base)
    for i in rng.sample(range(len(new)), 500):
        new[i] ^= 1
    new_weights = bytes(new)
    delta = encode_delta(new_weights, base)
    m = build_manifest(
        run_id="run-1", version=8, payload=delta, codec="xor-zstd", base_version=7,
        weights_size=len(new_weights), weights_sha256=payload_digest(new_weights),
    )
    assert m.is_delta and m.piece_size == choose_piece_size(len(delta))
    got = open_manifest(seal(m, LEARNER), learner_peer_id=LEARNER.peer_id, run_id="run-1")
    pieces = []
    for i in range(got.num_pieces):
        off, size = piece_range(got, i)
        verify_piece(got, i, delta[off : off + size])
        pieces.append(delta[off : off + size])
    out = decode_delta(b"".join(pieces), base, max_size=got.weights_size)
    assert payload_digest(out) == got.weights_sha256 and out == new_weights


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"piece_size": 3 * PIECE}, "power of two"),
        ({"piece_size": PIECE // 2}, "out of range"),
        ({"piece_size": 2 * MAX_PIECE_SIZE}, "out of range"),
        ({"pieces": ()}, "length 0"),
        ({"pieces": (b"\x00" * 32,) * 3}, "need 4"),
        ({"pieces": (b"\x00" * 32,) * 5}, "need 4"),
        ({"pieces": (b"\x00" * 31,) * 4}, r"pieces\[0\]"),
        ({"pieces": (b"\x00" * 32,) * (MAX_PIECES + 1)}, "outside"),
        ({"base_version": 3}, "must be None"),
        ({"weights_size": 1}, "must equal"),
        ({"weights_sha256": b"\x01" * 32}, "must equal"),
        ({"codec": "gzip"}, "not one of"),
        ({"payload_size": 0}, "out of range"),
        ({"version": -1}, "out of range"),
        ({"version": True}, "expected int"),
        ({"run_id": "bad run"}, "does not match"),
        ({"codec": "xor-zstd"}, "needs the version"),
        ({"codec": "xor-zstd", "base_version": 7}, r"out of range \[0, 6\]"),
        ({"codec": "xor-zstd", "base_version": 6, "weights_size": 10}, "more than any delta"),
    ],
)
def test_invalid_manifests_are_refused(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        manifest(**overrides)


def test_invalid_wire_manifest_is_a_remote_error() -> None:
    wire = manifest().to_wire()
    wire[6] = 3 * PIECE  # piece_size: not a power of two
    with pytest.raises(RemoteProtocolError, match="power of two"):
        WeightManifest.from_wire(wire)
    with pytest.raises(RemoteProtocolError, match="fields"):
        WeightManifest.from_wire(wire[:-1])
    assert WeightManifest.from_wire(manifest().to_wire()) == manifest()


def test_delta_base_version_round_trips() -> None:
    m = manifest(codec="xor-zstd", base_version=6, weights_size=len(PAYLOAD) - 10, weights_sha256=b"\x02" * 32)
    assert WeightManifest.from_wire(msgpack.unpackb(msgpack.packb(m.to_wire(), use_bin_type=True))) == m


def test_choose_piece_size_and_builder_bounds() -> None:
    assert choose_piece_size(1) == 64 * 1024
    assert choose_piece_size(1, preferred=1) == MIN_PIECE_SIZE
    assert choose_piece_size(270_000_000) == 128 * 1024  # SmolLM2-135M in bf16
    assert choose_piece_size(MAX_PIECES * MAX_PIECE_SIZE) == MAX_PIECE_SIZE
    with pytest.raises(LocalProtocolError, match="does not fit"):
        choose_piece_size(MAX_PIECES * MAX_PIECE_SIZE + 1)
    with pytest.raises(LocalProtocolError, match=r"use piece_size >= 32768"):
        build_manifest(run_id="r", version=0, payload=bytes(MAX_PIECES * PIECE + 1), piece_size=PIECE)
    with pytest.raises(LocalProtocolError, match="needs weights_size"):
        build_manifest(run_id="r", version=1, payload=b"x", codec="xor-zstd", base_version=0)
    with pytest.raises(LocalProtocolError, match="not one of"):
        build_manifest(run_id="r", version=1, payload=b"x", codec="raw")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="piece_size"):
        build_manifest(run_id="r", version=1, payload=b"x", piece_size=0)
