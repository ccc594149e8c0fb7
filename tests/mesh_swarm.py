"""A weight version on the bounded-degree overlay among real data servers, sources and receivers
(echo_node/weights/mesh.py) over the in-memory network (echo_node/net/memory.py), for tests on
trio's virtual clock. Peers may be hostile: a `MeshReceiver` subclass given per peer."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio
import trio.testing

from echo_node.net.framing import read_frame
from echo_node.net.memory import MemorySwarm
from echo_node.weights.broadcast import DataServer
from echo_node.weights.fetch import open_version
from echo_node.weights.mesh import MeshReceiver, PeerOverlay, SeedSource
from protocol import Identity, seal
from protocol.weights.datachannel import MAX_WIRE_FRAME, Neighbours, PeerEntry, decode_frame
from protocol.weights.manifest import build_manifest

LEARNER = Identity.from_seed(b"\x01" * 32)
RUN = "run-1"
VERSION = 7


class Recording(MeshReceiver):
    """An honest receiver that records who it linked with, who the learner ever listed as its
    neighbour, and its most links at once."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.linked: set[str] = set()
        self.listed: set[str] = set()
        self.most = 0

    def _set_neighbours(self, entries: tuple[PeerEntry, ...]) -> None:
        super()._set_neighbours(entries)
        self.listed |= self.members

    async def _run_link(self, stream: trio.abc.Stream, remote: str) -> None:
        if remote != self.source_id:
            self.linked.add(remote)
            self.most = max(self.most, len(self.links) + 1)
        await super()._run_link(stream, remote)


def peers(n: int, first: int = 0x20) -> list[Identity]:
    return [Identity.from_seed(i.to_bytes(2, "big") * 16) for i in range(first, first + n)]


@dataclass
class MeshRun:
    source: SeedSource
    overlay: PeerOverlay
    payload: bytes
    results: dict[str, bytes] = field(default_factory=dict)
    receivers: dict[str, MeshReceiver] = field(default_factory=dict)
    servers: dict[str, DataServer] = field(default_factory=dict)
    finished_at: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    learner: DataServer | None = None  # the learner's data server (its bans)


async def _fetch(server: DataServer, links: trio.Nursery, cls: type[MeshReceiver], learner_port: int,
                 learner_host: str) -> tuple[bytes, MeshReceiver]:
    manifest, stream = await open_version(server, learner_id=LEARNER.peer_id, host=learner_host, port=learner_port, version=VERSION)
    first = decode_frame(await read_frame(stream, max_len=MAX_WIRE_FRAME), num_pieces=manifest.num_pieces, from_source=True)
    assert isinstance(first, Neighbours), f"the learner served the version by {type(first).__name__}"
    receiver = cls(server, manifest, source_id=LEARNER.peer_id)
    server.register(manifest.version, receiver)
    return bytes(await receiver.run(links, stream, first)), receiver


def run_mesh(
    identities: list[Identity],
    *,
    size: int = 96 * 16 * 1024 + 77,
    piece_size: int = 16 * 1024,
    degree: int = 12,
    source_degree: int = 4,
    unreachable: frozenset[str] = frozenset(),
    classes: Mapping[str, type[MeshReceiver]] | None = None,
    late: frozenset[str] = frozenset(),
    linger_s: float = 30.0,
    deadline_s: float = 600.0,
    wait_for: Callable[[MeshRun], bool] | None = None,
    on_ready: Callable[[MeshRun], None] | None = None,
) -> MeshRun:
    """Every identity fetches version 7 from the learner; those in `late` start after all the
    others finished (`on_ready` hears the run once every data server listens, before any
    fetch). Peers not in `classes` are `Recording`s. Runs on trio's virtual clock; returns what
    each got."""
    payload = os.urandom(size)
    manifest = build_manifest(run_id=RUN, version=VERSION, payload=payload, piece_size=piece_size)
    members = {p.peer_id: 0.0 for p in identities}
    relays: dict[str, tuple[str, int]] = {}
    overlay = PeerOverlay(members, relays, mode="mesh", degree=degree, source_degree=source_degree, settle_s=0.0)
    source = SeedSource(LEARNER, manifest, seal(manifest, LEARNER), payload, overlay)
    run = MeshRun(source, overlay, payload)
    classes = classes or {}

    async def main() -> None:
        swarm = MemorySwarm()
        async with trio.open_nursery() as nursery:
            _, net = swarm.node(LEARNER)
            learner = run.learner = DataServer(LEARNER, RUN, advertise_host=net.address, net=net)
            learner.register(VERSION, source)
            await nursery.start(learner.run)
            for p in identities:
                _, pnet = swarm.node(p)
                server = run.servers[p.peer_id] = DataServer(p, RUN, advertise_host=pnet.address, net=pnet)
                await nursery.start(server.run)
                if p.peer_id not in unreachable:
                    relays[p.peer_id] = (server.host, server.port)
            if on_ready is not None:
                on_ready(run)
            early_done = trio.Event()

            async def fetch(p: Identity) -> None:
                if p.peer_id in late:
                    await early_done.wait()
                cls = classes.get(p.peer_id, Recording)
                try:
                    async with trio.open_nursery() as links:
                        data, receiver = await _fetch(run.servers[p.peer_id], links, cls, learner.port, learner.host)
                        run.results[p.peer_id] = data
                        run.receivers[p.peer_id] = receiver
                        run.finished_at[p.peer_id] = trio.current_time()
                        await trio.sleep(linger_s)  # keep serving the others
                        links.cancel_scope.cancel()
                except Exception as exc:  # a hostile peer may be cut: recorded, never the run's end
                    run.errors[p.peer_id] = f"{type(exc).__name__}: {exc}"

            async def everyone() -> None:
                async with trio.open_nursery() as fetches:
                    early = [p for p in identities if p.peer_id not in late]
                    for p in early:
                        fetches.start_soon(fetch, p)
                    honest_early = {p.peer_id for p in early if p.peer_id not in classes}
                    while not honest_early <= run.results.keys():
                        await trio.sleep(0.05)
                    early_done.set()
                    for p in identities:
                        if p.peer_id in late:
                            fetches.start_soon(fetch, p)

            with trio.move_on_after(deadline_s):
                async with trio.open_nursery() as inner:
                    inner.start_soon(everyone)
                    while wait_for is None or not wait_for(run):
                        await trio.sleep(0.05)
                        if wait_for is None and all(p.peer_id in run.results or classes.get(p.peer_id, Recording) is not Recording
                                                    for p in identities):
                            break
                    inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return run
