"""A rollout peer's weight refresh: a delta when it holds the base, the full snapshot otherwise."""

from __future__ import annotations

import os
from types import SimpleNamespace

import trio

from echo_node.config import RunConfig
from echo_node.net.discovery import PeerAddr
from echo_node.weights.broadcast import DataServer, Source
from echo_node.weights.follower import DELTA_BACKOFF_VERSIONS, Target, WeightFollower
from protocol import Identity, seal
from protocol.weights.delta import encode_delta
from protocol.weights.manifest import build_manifest, payload_digest

PIECE = 16 * 1024
LEARNER = Identity.from_seed(b"\x01" * 32)
PEER = Identity.from_seed(b"\x10" * 32)


def test_delta_when_the_peer_holds_the_base_then_full_when_none_is_offered() -> None:
    v7 = os.urandom(16 * PIECE)
    v8 = bytearray(v7)
    v8[::97] = bytes((b + 1) % 256 for b in v8[::97])
    v8_b = bytes(v8)
    full8 = build_manifest(run_id="run-1", version=8, payload=v8_b, piece_size=PIECE)
    delta = encode_delta(v8_b, v7)
    delta8 = build_manifest(run_id="run-1", version=8, payload=delta, codec="xor-zstd", base_version=7,
                            weights_size=len(v8_b), weights_sha256=full8.weights_sha256, piece_size=PIECE)
    v9 = os.urandom(len(v7))
    full9 = build_manifest(run_id="run-1", version=9, payload=v9, piece_size=PIECE)
    peer_data = DataServer(PEER, "run-1")
    members = {PEER.peer_id}
    results: list[bytes | None] = []
    peers: list[WeightFollower] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(8, Source(LEARNER, full8, seal(full8, LEARNER), v8_b, members))
            learner.register(8, Source(LEARNER, delta8, seal(delta8, LEARNER), delta, members), base=7)
            learner.register(9, Source(LEARNER, full9, seal(full9, LEARNER), v9, members))
            await nursery.start(learner.run)
            await nursery.start(peer_data.run)
            session = SimpleNamespace(
                learner=PeerAddr(LEARNER.peer_id, ()), data_host="127.0.0.1", data_port=learner.port, engine=SimpleNamespace(version=7),
                spec=SimpleNamespace(epoch=0),
            )
            peer = WeightFollower(RunConfig(run_id="run-1"), None, peer_data, session)  # type: ignore[arg-type]
            peers.append(peer)
            peer._nursery = nursery
            peer._blob, peer._blob_version, peer._blob_epoch = v7, 7, 0
            with trio.fail_after(10):
                results.append(await peer._fetch_delta(Target(8, len(v8_b), full8.weights_sha256, 4, 0)))
                peer._blob, peer._blob_version = v8_b, 8
                results.append(await peer._fetch_delta(Target(9, len(v9), full9.weights_sha256, 4, 0)))
            nursery.cancel_scope.cancel()

    trio.run(main)
    peer = peers[0]
    assert results[0] == v8_b and payload_digest(results[0]) == full8.weights_sha256
    assert peer.deltas_used == 1
    # No delta for version 9: the peer falls back to the full snapshot and stops asking a while.
    assert results[1] is None and peer._delta_from == 9 + DELTA_BACKOFF_VERSIONS
