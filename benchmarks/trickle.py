"""A neighbour that trickles: how long the honest peers of a broadcast wait because one member
reads what they push just fast enough not to be cut (`LINK_STALL_S` cuts below one 128 KiB
chunk in 5 s).

One process on loopback, pinned to one core: the learner's `Source`, `--peers` honest
`Receiver`s and one more member whose streams read at most RATE bytes a second (it is listed
without an address, so it dials the others and they push to it). For each rate: the time until
every honest peer holds the verified version, divided by the time of the same swarm with an
honest member in the trickler's place (run side by side, alternating), and the learner's upload
in copies of the version. Prints one JSON object as its last line.

    .venv/bin/python -m benchmarks.trickle
    .venv/bin/python -m benchmarks.trickle --rates 300000,1000000 --size-mb 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import trio

from echo_node.weights.broadcast import DataServer, Source, tcp_connect
from echo_node.weights.fetch import fetch_version
from protocol import Identity, seal
from protocol.weights.manifest import build_manifest

PIECE = 64 * 1024
LEARNER = Identity.from_seed(b"\x01" * 32)


class Trickle(trio.abc.Stream):
    """Reads at most `rate` bytes a second, 4 KiB at a time; sends as fast as it likes."""

    def __init__(self, stream: trio.abc.Stream, rate: float) -> None:
        self.stream, self.rate = stream, rate

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        n = min(max_bytes or 4096, 4096)
        await trio.sleep(n / self.rate)
        return await self.stream.receive_some(n)

    async def aclose(self) -> None:
        await self.stream.aclose()


def run_once(payload: bytes, peers: int, rate: float, limit_s: float) -> dict[str, Any]:
    """One broadcast: `peers` honest members plus one reading at `rate` B/s (0: honest too)."""
    manifest = build_manifest(run_id="run-1", version=7, payload=payload, piece_size=PIECE)
    honest = [Identity.from_seed(bytes([0x10 + i]) * 32) for i in range(peers)]
    extra = Identity.from_seed(b"\x2f" * 32)
    relays: dict[str, tuple[str, int]] = {}
    source = Source(LEARNER, manifest, seal(manifest, LEARNER), payload, {p.peer_id for p in [*honest, extra]}, relays)
    source.gate = trio.Event()
    done: dict[str, float] = {}

    async def slow(host: str, port: int) -> trio.abc.Stream:
        return Trickle(await tcp_connect(host, port), rate)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(7, source)
            await nursery.start(learner.run)
            servers = {p.peer_id: DataServer(p, "run-1") for p in [*honest, extra]}
            for server in servers.values():
                await nursery.start(server.run)
            for p in honest if rate else [*honest, extra]:
                relays[p.peer_id] = ("127.0.0.1", servers[p.peer_id].port)
            start = 0.0

            async def fetch(p: Identity, connect: Any) -> None:
                async with trio.open_nursery() as links:
                    _, data, _ = await fetch_version(servers[p.peer_id], links, learner_id=LEARNER.peer_id,
                                                     host="127.0.0.1", port=learner.port, version=7, connect=connect)
                    if bytes(data) != payload:
                        raise AssertionError(f"{p.peer_id} assembled other bytes")
                    done[p.peer_id] = time.monotonic() - start
                    await trio.sleep_forever()  # keep relaying until the others are done

            async with trio.open_nursery() as inner:
                for p in honest:
                    inner.start_soon(fetch, p, tcp_connect)
                inner.start_soon(fetch, extra, slow if rate else tcp_connect)
                while len(source.swarm) < peers + 1:
                    await trio.sleep(0.001)
                start = time.monotonic()
                source.gate.set()
                with trio.move_on_after(limit_s):
                    while sum(p.peer_id in done for p in honest) < peers:
                        await trio.sleep(0.005)
                inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
        return max((done.get(p.peer_id, limit_s) for p in honest), default=limit_s)

    seconds = trio.run(main)
    return {"seconds": round(seconds, 3), "learner_copies": round(source.stats.bytes_up / len(payload), 3),
            "all_done": seconds < limit_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=3, help="honest peers beside the trickler")
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument("--rates", default="100000,300000,1000000,3000000", help="the trickler's read rates, bytes/s")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--limit-s", type=float, default=60.0, help="a run's time limit")
    p.add_argument("--core", type=int, default=0)
    a = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity") and a.core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {a.core})
    payload = os.urandom(max(1, int(a.size_mb * (1 << 20)) // PIECE) * PIECE)
    rates = [float(r) for r in a.rates.split(",") if r]
    t0 = time.monotonic()
    honest: list[float] = []
    by_rate: dict[float, list[dict[str, Any]]] = {r: [] for r in rates}
    for _ in range(a.repeats):  # alternating, so that load drifts hit both alike
        for rate in rates:
            honest.append(run_once(payload, a.peers, 0.0, a.limit_s)["seconds"])
            by_rate[rate].append(run_once(payload, a.peers, rate, a.limit_s))
    base = statistics.median(honest)
    out = {
        "peers": a.peers, "size_bytes": len(payload), "piece_bytes": PIECE, "repeats": a.repeats,
        "honest_swarm_s": round(base, 3),
        "tricklers": [{
            "rate_bytes_s": rate,
            "seconds": [r["seconds"] for r in runs],
            "ratio_to_honest": round(statistics.median(r["seconds"] for r in runs) / base, 3),
            "learner_copies": [r["learner_copies"] for r in runs],
            "all_done": all(r["all_done"] for r in runs),
        } for rate, runs in by_rate.items()],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
