"""A rollout peer's weight refresh: a delta when it holds the base, the full snapshot otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from echo_node.config import RunConfig
from echo_node.net.transport import PeerAddr
from echo_node.peer import weight_follower as follower_module
from echo_node.peer.weight_follower import DELTA_BACKOFF_VERSIONS, Target, WeightFollower
from echo_node.weights.broadcast import DataServer, Source, encode_frame
from protocol import Identity, seal
from protocol.errors import RemoteProtocolError
from protocol.weights.datachannel import FULL, Hello, ManifestFrame, session_signature
from protocol.weights.delta import encode_delta
from protocol.weights.manifest import build_manifest, payload_digest

PIECE = 16 * 1024
LEARNER = Identity.from_seed(b"\x01" * 32)
PEER = Identity.from_seed(b"\x10" * 32)


def follower(learner: DataServer, peer_data: DataServer, engine: object, nursery: trio.Nursery,
             cfg: RunConfig | None = None, **kwargs: object) -> WeightFollower:
    """A peer's WeightFollower of run-1 whose learner serves data at `learner`'s port."""
    session = SimpleNamespace(learner=PeerAddr(LEARNER.peer_id, ()), data_host="127.0.0.1", data_port=learner.port,
                              engine=engine, spec=SimpleNamespace(epoch=0))
    peer = WeightFollower(cfg or RunConfig(run_id="run-1"), None, peer_data, session, **kwargs)  # type: ignore[arg-type]
    peer._nursery = nursery
    return peer


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
            peer = follower(learner, peer_data, SimpleNamespace(version=7), nursery)
            peers.append(peer)
            peer._blob, peer._blob_version, peer._blob_epoch = v7, 7, 0
            with trio.fail_after(10):
                got = await peer._fetch_delta(Target(8, len(v8_b), full8.weights_sha256, 4, 0))
                results.append(None if got is None else bytes(got[0]))
                peer._blob, peer._blob_version = v8_b, 8
                got = await peer._fetch_delta(Target(9, len(v9), full9.weights_sha256, 4, 0))
                results.append(None if got is None else bytes(got[0]))
            nursery.cancel_scope.cancel()

    trio.run(main)
    peer = peers[0]
    assert results[0] == v8_b and payload_digest(results[0]) == full8.weights_sha256
    assert peer.deltas_used == 1
    # No delta for version 9: the peer falls back to the full snapshot and stops asking a while.
    assert results[1] is None and peer._delta_from == 9 + DELTA_BACKOFF_VERSIONS


def test_a_delta_slower_than_a_full_snapshot_is_given_up_for_the_full_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner is still cutting the delta (its resolver has not answered): the peer waits
    no longer than its last full snapshot took, then fetches the full one and asks only for
    full snapshots a while (the cut is slower than its link)."""
    monkeypatch.setattr(follower_module, "DELTA_WAIT_MIN_S", 0.3)
    v7 = os.urandom(16 * PIECE)
    v8 = bytes(reversed(v7))
    full8 = build_manifest(run_id="run-1", version=8, payload=v8, piece_size=PIECE)
    asked: list[tuple[int, int]] = []

    async def cutting(version: int, base: int) -> None:
        asked.append((version, base))
        await trio.sleep_forever()

    peers: list[WeightFollower] = []
    waited: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1", resolve=cutting)
            learner.register(8, Source(LEARNER, full8, seal(full8, LEARNER), v8, {PEER.peer_id}))
            await nursery.start(learner.run)
            peer_data = DataServer(PEER, "run-1")
            await nursery.start(peer_data.run)
            peer = follower(learner, peer_data, SimpleNamespace(version=7), nursery)
            peers.append(peer)
            peer._blob, peer._blob_version, peer._blob_epoch = v7, 7, 0
            peer._full_fetch_s = 0.1  # a fast link
            t0 = trio.current_time()
            with trio.fail_after(10):
                await peer._fetch(Target(8, len(v8), full8.weights_sha256, 4, 0))
            waited.append(trio.current_time() - t0)
            nursery.cancel_scope.cancel()

    trio.run(main)
    peer = peers[0]
    assert asked == [(8, 7)] and peer.deltas_used == 0
    assert peer._blob_version == 8 and bytes(peer._blob) == v8  # type: ignore[arg-type]
    assert peer._delta_from == 8 + DELTA_BACKOFF_VERSIONS
    assert 0.3 <= waited[0] < 5


def test_a_peer_keeps_its_versions_as_files_and_unlinks_what_it_no_longer_serves(tmp_path: Path) -> None:
    """Full, then deltas, into mapped files under the peer's folder: a received payload is
    kept while it is relayed (keep_versions), decoded weights only while they are the delta
    base; a delta that decodes to the wrong weights leaves the base as it was and no file; a
    newer number for the same weights moves over without a transfer or a file."""
    step = [bytearray(os.urandom(16 * PIECE))]
    for v in range(1, 5):
        nxt = bytearray(step[-1])
        nxt[v::89] = bytes((b + v) % 256 for b in nxt[v::89])
        step.append(nxt)
    blobs = [bytes(b) for b in step]  # versions 1..5 are blobs[0..4]
    full = {v: build_manifest(run_id="run-1", version=v, payload=blobs[v - 1], piece_size=PIECE) for v in range(1, 6)}
    members = {PEER.peer_id}
    learner = DataServer(LEARNER, "run-1")
    learner.register(1, Source(LEARNER, full[1], seal(full[1], LEARNER), blobs[0], members))
    for v in (2, 3, 4):
        delta = encode_delta(blobs[v - 1], blobs[v - 2])
        m = build_manifest(run_id="run-1", version=v, payload=delta, codec="xor-zstd", base_version=v - 1,
                           weights_size=len(blobs[v - 1]), weights_sha256=full[v].weights_sha256, piece_size=PIECE)
        learner.register(v, Source(LEARNER, m, seal(m, LEARNER), delta, members), base=v - 1)
    # Version 5 as a delta cut against the wrong base (it decodes, to other weights).
    bad = encode_delta(blobs[4], blobs[0])
    m5 = build_manifest(run_id="run-1", version=5, payload=bad, codec="xor-zstd", base_version=4,
                        weights_size=len(blobs[4]), weights_sha256=full[5].weights_sha256, piece_size=PIECE)
    learner.register(5, Source(LEARNER, m5, seal(m5, LEARNER), bad, members), base=4)
    folder = tmp_path / "peers" / f"{PEER.peer_id}.versions"
    folder.mkdir(parents=True)
    (folder / "7.payload").write_bytes(b"left by an earlier process")
    loaded: list[tuple[bytes, int]] = []

    def load_weights(blob: memoryview, version: int) -> None:
        loaded.append((bytes(blob), version))
        engine.version = version

    engine = SimpleNamespace(version=-1, load_weights=load_weights)
    files: list[set[str]] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.run)
            peer_data = DataServer(PEER, "run-1")
            await nursery.start(peer_data.run)
            cfg = RunConfig(run_id="run-1")
            cfg.net.keep_versions = 2
            peer = follower(learner, peer_data, engine, nursery, cfg, versions_dir=folder)
            assert not (folder / "7.payload").exists(), "files of an earlier process are removed"
            with trio.fail_after(20):
                for v in (1, 2, 3, 4):
                    await peer._fetch(Target(v, len(blobs[v - 1]), full[v].weights_sha256, 4, 0))
                    peer.load_pending()
                    files.append({p.name for p in folder.iterdir()})
                with pytest.raises(RemoteProtocolError, match="wrong weights"):
                    await peer._fetch(Target(5, len(blobs[4]), full[5].weights_sha256, 4, 0))
                files.append({p.name for p in folder.iterdir()})
                assert peer._blob_version == 4 and bytes(peer._blob) == blobs[3]  # type: ignore[arg-type]
                await peer._fetch(Target(6, len(blobs[3]), full[4].weights_sha256, 4, 0))  # renumbered
                peer.load_pending()
                files.append({p.name for p in folder.iterdir()})
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert loaded == [(blobs[0], 1), (blobs[1], 2), (blobs[2], 3), (blobs[3], 4), (blobs[3], 6)]
    assert files[0] == {"1.payload"}
    assert files[1] == {"1.payload", "2.payload", "2.weights"}
    # Version 1's full payload is no longer relayed (keep_versions 2); 2's weights are no base.
    assert files[2] == {"2.payload", "3.payload", "3.weights"}
    assert files[3] == {"3.payload", "4.payload", "4.weights"}
    assert files[4] == {"4.payload", "5.payload", "4.weights"}, "a bad delta's output is not kept"
    assert files[5] == files[4]


class HangsUp(Source):
    """A learner that sends the manifest and hangs up before naming a swarm (as one stopping
    does): the peer's download fails before it began."""

    async def serve(self, stream: trio.abc.Stream, hello: Hello) -> None:
        await stream.send_all(encode_frame(ManifestFrame(self.sealed_manifest, session_signature(self.identity, hello.raw))))


def test_a_learner_hanging_up_after_the_manifest_fails_the_refresh_with_an_error_it_retries() -> None:
    """The download runs in a nursery of its links, which wraps what it raises; before the
    version is served that is the fetch's own error and must reach the follower as itself (a
    REFRESH_ERRORS one, retried), never as an exception group that would end the peer."""
    payload = os.urandom(4 * PIECE)
    manifest = build_manifest(run_id="run-1", version=3, payload=payload, piece_size=PIECE)
    peer_data = DataServer(PEER, "run-1")
    errors: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(3, HangsUp(LEARNER, manifest, seal(manifest, LEARNER), payload, {PEER.peer_id}))
            await nursery.start(learner.run)
            await nursery.start(peer_data.run)
            peer = follower(learner, peer_data, SimpleNamespace(version=2), nursery)
            with trio.fail_after(10):
                try:
                    await peer._nursery_start(Target(3, len(payload), manifest.weights_sha256, 4, 0), FULL)
                except BaseException as exc:  # noqa: BLE001 - what escapes is the point
                    errors.append(exc)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(errors) == 1 and isinstance(errors[0], follower_module.REFRESH_ERRORS), repr(errors)
    assert not isinstance(errors[0], BaseExceptionGroup)
