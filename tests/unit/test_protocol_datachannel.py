"""The data channel's frames: every valid frame round-trips, everything else is refused."""

from __future__ import annotations

import msgpack
import pytest

from protocol import Identity
from protocol.errors import RemoteProtocolError
from protocol.weights.datachannel import (
    MAX_SWARM_ENTRIES,
    Cancel,
    Direct,
    Get,
    Have,
    ManifestFrame,
    More,
    Next,
    Neighbours,
    NoMore,
    NotServed,
    PeerEntry,
    Peers,
    Piece,
    decode_frame,
    encode,
    have_bytes,
)

P = Identity.from_seed(b"\x05" * 32).peer_id
FRAMES = [
    Piece(3, b"abc"), Direct(3, b"abc"), Get(0), Cancel(3), Next(), More(), NoMore(), Peers((PeerEntry(P, "10.0.0.2", 4000), PeerEntry(P, "", 0))),
    ManifestFrame(b"sealed", b"s" * 64), NotServed(b"s" * 64), Have(0b1011), Have(0),
    Neighbours((PeerEntry(P, "10.0.0.2", 4000), PeerEntry(P, "", 0))),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: object) -> None:
    assert decode_frame(encode(frame), num_pieces=4, from_source=True) == frame  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        ["piece", 4, b"x"], ["piece", -1, b"x"], ["piece", True, b"x"], ["piece", 1, "x"], ["piece", 1],
        ["direct", 4, b"x"], ["direct", 1, "x"], ["direct", 1, b"x" * (4 * 1024 * 1024 + 1)], ["more", 1],
        ["get", 4], ["get", 2**63], ["cancel", 4], ["cancel", -1], ["cancel", True], ["cancel"], ["cancel", 1, 2], ["next", 1], ["none", 0], ["peers", "x"],
        ["peers", [[P, "10.0.0.1", 0]]], ["peers", [["not-a-peer", "", 0]]], ["peers", [[P, "0.0.0.0", 1]]],
        ["peers", [[P, "", 0]] * (MAX_SWARM_ENTRIES + 1)], ["manifest", b"x"], ["unavailable"], [], [1], {"piece": 1},
        # `have`: a mask of exactly ceil(4 / 8) bytes without bits at or beyond 4, or a list of
        # at most 4 indices in [0, 4).
        ["have", b"\x10"], ["have", b"\x80"], ["have", b""], ["have", b"\x01\x00"], ["have", [4]], ["have", [-1]],
        ["have", [True]], ["have", [1.0]], ["have", [2**40]], ["have", [0, 1, 2, 3, 0]], ["have", "x"], ["have"],
        ["neighbours", [[P, "10.0.0.1", 0]]], ["neighbours", [[P, "", 0]] * (MAX_SWARM_ENTRIES + 1)],
    ],
)
def test_malformed_frames_are_refused(fields: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frame(msgpack.packb(fields), num_pieces=4, from_source=True)


@pytest.mark.parametrize("frame", [f for f in FRAMES if not isinstance(f, (Piece, Get, Cancel, Next, More, Have))], ids=lambda f: type(f).__name__)
def test_control_frames_only_from_the_source(frame: object) -> None:
    with pytest.raises(RemoteProtocolError, match="not the source"):
        decode_frame(encode(frame), num_pieces=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [0, 1, 1 << 4095, (1 << 4096) - 1, 0b1010 << 2000, sum(1 << i for i in range(0, 4096, 3))],
                         ids=["none", "first", "last", "all", "two", "every-third"])
def test_a_have_takes_the_shorter_form_and_round_trips(bits: int) -> None:
    """A few pieces go as their indices, many as the mask; either decodes to the same set."""
    data = encode(Have(bits), num_pieces=4096)
    assert decode_frame(data, num_pieces=4096) == Have(bits)
    assert len(data) <= have_bytes(4096) + 16  # (the kind and msgpack's headers)
