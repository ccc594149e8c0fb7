"""A rollout peer fetching one weight version: the handshake with the learner, then the scheme
the learner serves the version by.

Rules:
- The handshake: our signed hello, the learner's signed manifest bound to that hello (a session
  signature: whoever answered at the learner's address must hold its key), checked against the
  announced (version, base) and weights digest; or a signed `unavailable`.
- The learner's next frame names the scheme: `peers` for the push mesh of
  echo_node/weights/broadcast.py (every peer linked to every other, one hop of relays),
  `neighbours` for the bounded-degree exchange of echo_node/weights/mesh.py. Anything else, or
  nothing within ROUTE_WAIT_S, is a protocol error of the learner's connection.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import trio

from echo_node.net.framing import read_frame, write_frame
from echo_node.weights.broadcast import FULL, ROUTE_WAIT_S, Connector, DataServer, Receiver, base_of
from echo_node.weights.mesh import MeshReceiver
from protocol.envelope import open_manifest
from protocol.errors import RemoteProtocolError
from protocol.weights.datachannel import MAX_WIRE_FRAME, ManifestFrame, Neighbours, NotServed, Peers, decode_frame, verify_session
from protocol.weights.manifest import WeightManifest

__all__ = ["Download", "Unavailable", "fetch_version", "open_version", "receive_version"]

# What a peer's download is, in either scheme: both expose `manifest`, `stats`, `reachable`,
# `missing` and `done`.
Download = Receiver | MeshReceiver


class Unavailable(Exception):
    """The learner does not offer this (version, base); ask for the full snapshot instead."""


async def fetch_version(
    server: DataServer,
    nursery: trio.Nursery,
    *,
    learner_id: str,
    host: str,
    port: int,
    version: int,
    base: int = FULL,
    weights_sha256: bytes | None = None,
    connect: Connector | None = None,
) -> tuple[WeightManifest, memoryview, Download]:
    """Join the broadcast of `version`: manifest from the learner, pieces from the swarm.

    The receiver is registered with `server` (so other peers can fetch from us) and its links
    live in `nursery`; the caller unregisters it when the version is no longer worth serving.
    """
    manifest, stream = await open_version(
        server, learner_id=learner_id, host=host, port=port, version=version, base=base,
        weights_sha256=weights_sha256, connect=connect,
    )
    payload, receiver = await receive_version(server, nursery, manifest, stream, learner_id=learner_id, connect=connect)
    return manifest, payload, receiver


async def receive_version(
    server: DataServer,
    nursery: trio.Nursery,
    manifest: WeightManifest,
    source_stream: trio.abc.Stream,
    *,
    learner_id: str,
    connect: Connector | None = None,
    on_start: Callable[[Download], None] | None = None,
    into: bytearray | memoryview | mmap.mmap | None = None,
) -> tuple[memoryview, Download]:
    """After `open_version`: register a receiver of the scheme the learner names and download the
    payload (`on_start` is handed the receiver first, e.g. to watch its progress; `into`: a
    buffer of the manifest's payload size to assemble it in, e.g. a mapped file)."""
    try:
        try:
            with trio.fail_after(ROUTE_WAIT_S):
                data = await read_frame(source_stream, max_len=MAX_WIRE_FRAME)
        except trio.TooSlowError:
            raise RemoteProtocolError(f"the learner named no swarm for version {manifest.version} within {ROUTE_WAIT_S:.0f}s") from None
        first = decode_frame(data, num_pieces=manifest.num_pieces, from_source=True)
    except BaseException:
        # No receiver owns the connection yet: it is closed here, or its descriptor leaks.
        await trio.aclose_forcefully(source_stream)
        raise

    def start(receiver: Download) -> None:
        if on_start is not None:
            on_start(receiver)
        server.register(manifest.version, receiver, base=base_of(manifest))

    if isinstance(first, Neighbours):
        mesh = MeshReceiver(server, manifest, source_id=learner_id, into=into, connect=connect)
        start(mesh)
        return await mesh.run(nursery, source_stream, first), mesh
    if isinstance(first, Peers):
        push = Receiver(server, manifest, source_id=learner_id, into=into, connect=connect)
        start(push)
        return await push.run(nursery, source_stream, first), push
    await trio.aclose_forcefully(source_stream)
    raise RemoteProtocolError(f"the learner's second frame is {type(first).__name__}, not peers or neighbours")


async def open_version(
    server: DataServer,
    *,
    learner_id: str,
    host: str,
    port: int,
    version: int,
    base: int = FULL,
    weights_sha256: bytes | None = None,
    connect: Connector | None = None,
) -> tuple[WeightManifest, trio.abc.Stream]:
    """The handshake with the learner: our hello, its signed manifest (checked) or `Unavailable`."""
    stream = await (connect or server.net.connect)(host, port)
    try:
        return await _handshake(server, stream, learner_id=learner_id, version=version, base=base, weights_sha256=weights_sha256)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def _handshake(
    server: DataServer, stream: trio.abc.Stream, *, learner_id: str, version: int, base: int, weights_sha256: bytes | None
) -> tuple[WeightManifest, trio.abc.Stream]:
    hello = server.hello(target=learner_id, version=version, base=base)
    await write_frame(stream, hello)
    first = decode_frame(await read_frame(stream, max_len=MAX_WIRE_FRAME), from_source=True)
    if isinstance(first, NotServed):
        verify_session(learner_id, hello, first.session, available=False)
        raise Unavailable(f"the learner does not offer version {version} against base {base}")
    if not isinstance(first, ManifestFrame):
        raise RemoteProtocolError("the learner's data channel did not start with a manifest")
    # Whoever answered at the learner's address must hold its key and answer this very hello:
    # the control frames that follow on this connection are then the learner's.
    verify_session(learner_id, hello, first.session)
    manifest = open_manifest(first.sealed, learner_peer_id=learner_id, run_id=server.run_id)
    manifest_base = base_of(manifest)
    if (manifest.version, manifest_base) != (version, base) or (
        weights_sha256 is not None and manifest.weights_sha256 != weights_sha256
    ):
        raise RemoteProtocolError(f"manifest for {manifest.version}/{manifest_base} does not match the announced {version}/{base}")
    return manifest, stream
