"""The data channel's frames: every valid frame round-trips, everything else is refused."""

from __future__ import annotations

import msgpack
import pytest

from protocol import Identity
from protocol.errors import RemoteProtocolError
from protocol.weights.datachannel import (
    MAX_SWARM_ENTRIES,
    Direct,
    Get,
    ManifestFrame,
    More,
    Next,
    NoMore,
    NotServed,
    PeerEntry,
    Peers,
    Piece,
    decode_frame,
    encode,
)

P = Identity.from_seed(b"\x05" * 32).peer_id
FRAMES = [
    Piece(3, b"abc"), Direct(3, b"abc"), Get(0), Next(), More(), NoMore(), Peers((PeerEntry(P, "10.0.0.2", 4000), PeerEntry(P, "", 0))),
    ManifestFrame(b"sealed", b"s" * 64), NotServed(b"s" * 64),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_round_trip(frame: object) -> None:
    assert decode_frame(encode(frame), num_pieces=4, from_source=True) == frame  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        ["piece", 4, b"x"], ["piece", -1, b"x"], ["piece", True, b"x"], ["piece", 1, "x"], ["piece", 1],
        ["direct", 4, b"x"], ["direct", 1, "x"], ["direct", 1, b"x" * (4 * 1024 * 1024 + 1)], ["more", 1],
        ["get", 4], ["get", 2**63], ["next", 1], ["none", 0], ["peers", "x"],
        ["peers", [[P, "10.0.0.1", 0]]], ["peers", [["not-a-peer", "", 0]]], ["peers", [[P, "0.0.0.0", 1]]],
        ["peers", [[P, "", 0]] * (MAX_SWARM_ENTRIES + 1)], ["manifest", b"x"], ["unavailable"], [], [1], {"piece": 1},
    ],
)
def test_malformed_frames_are_refused(fields: object) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frame(msgpack.packb(fields), num_pieces=4, from_source=True)


@pytest.mark.parametrize("frame", [f for f in FRAMES if not isinstance(f, (Piece, Get, Next, More))], ids=lambda f: type(f).__name__)
def test_control_frames_only_from_the_source(frame: object) -> None:
    with pytest.raises(RemoteProtocolError, match="not the source"):
        decode_frame(encode(frame), num_pieces=4)  # type: ignore[arg-type]
