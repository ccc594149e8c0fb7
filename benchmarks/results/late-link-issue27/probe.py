"""A late, slow member at SmolLM2's publication size: how much each honest peer queues to it.

A 540 MiB version (SmolLM2-135M's fp32 weights: 2,160 pieces of 256 KiB; random bytes, the
broadcast does not look inside), three honest peers fetch it, then a member dials late and
reads at 40 MB/s. Prints one JSON line: the pieces each honest peer relayed (what a late link
was sent at once before the catch-up was bounded) and the longest queue to the late member.
Run from the repository root: `PYTHONPATH=. python benchmarks/results/late-link-issue27/probe.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio

from benchmarks.trickle import Trickle
from echo_node.weights import broadcast
from echo_node.weights.broadcast import DataServer, Receiver, Source, tcp_connect
from echo_node.weights.fetch import fetch_version
from protocol import Identity, seal
from protocol.weights.manifest import build_manifest, choose_piece_size

SIZE = 540 * 2**20
RATE = 40_000_000
LEARNER = Identity.from_seed(b"\x01" * 32)
HONEST = [Identity.from_seed(bytes([0x10 + i]) * 32) for i in range(3)]
LATE = Identity.from_seed(b"\x2e" * 32)


def main() -> None:
    piece = choose_piece_size(SIZE)
    payload = os.urandom(SIZE)
    manifest = build_manifest(run_id="run-1", version=7, payload=payload, piece_size=piece)
    relays: dict[str, tuple[str, int]] = {}
    source = Source(LEARNER, manifest, seal(manifest, LEARNER), payload, {p.peer_id for p in [*HONEST, LATE]}, relays)
    results: dict[str, bytes] = {}
    relayed: dict[str, int] = {}
    longest = 0
    refill = Receiver._refill_source

    def watched(self: Receiver, _sent: object = None) -> None:
        nonlocal longest
        link = self.links.get(LATE.peer_id)
        if link is not None and self.identity.peer_id != LATE.peer_id:
            longest = max(longest, link.queued_pieces)
            relayed[self.identity.peer_id] = len(self.relaying)
        refill(self, _sent)

    async def fetch(server: DataServer, learner: DataServer, rate: float = 0) -> None:
        async def connect(host: str, port: int) -> trio.abc.Stream:
            stream = await tcp_connect(host, port)
            return Trickle(stream, rate) if rate else stream

        async with trio.open_nursery() as links:
            _, data, _ = await fetch_version(server, links, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port,
                                             version=7, connect=connect)
            results[server.identity.peer_id] = bytes(data)
            await trio.sleep_forever()  # serve the others

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(7, source)
            await nursery.start(learner.run)
            servers = {p.peer_id: DataServer(p, "run-1") for p in [*HONEST, LATE]}
            for server in servers.values():
                await nursery.start(server.run)
            for p in HONEST:  # the late member is not listed: it dials the others
                relays[p.peer_id] = ("127.0.0.1", servers[p.peer_id].port)
            async with trio.open_nursery() as inner:
                for p in HONEST:
                    inner.start_soon(fetch, servers[p.peer_id], learner)
                while len(results) < len(HONEST):
                    await trio.sleep(0.05)
                t0 = time.monotonic()
                inner.start_soon(fetch, servers[LATE.peer_id], learner, RATE)
                while len(results) < len(HONEST) + 1:
                    await trio.sleep(0.05)
                print(f"late member done in {time.monotonic() - t0:.1f} s", file=sys.stderr)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    Receiver._refill_source = watched  # type: ignore[method-assign]
    try:
        trio.run(run)
    finally:
        Receiver._refill_source = refill  # type: ignore[method-assign]
    assert all(data == payload for data in results.values())
    print(json.dumps({
        "pieces": manifest.num_pieces, "piece_kib": piece // 1024, "relayed_per_peer": sorted(relayed.values()),
        "longest_queue_to_late_link": longest, "queue_mib": round(longest * piece / 2**20, 1),
        "laggard_pieces": broadcast.LAGGARD_PIECES,
    }))


if __name__ == "__main__":
    main()
