"""echo-node's P2P broadcast (echo_node/weights/broadcast.py) run as one process per namespace host.

The learner (h0) builds a signed manifest of a random G-byte payload (64 KiB pieces) and starts
handing out pieces once every peer has connected; its clock starts then. Each peer dials the
learner, gets the manifest and the swarm from it, links up with the other peers (one link per
pair), receives, verifies every piece against the manifest, relays, repairs, and reports when
the whole payload verifies (the version would go live).

    .venv/bin/python -m benchmarks.wan_broadcast      # composes this with the star and the bound
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import trio

from benchmarks.wan import scenario as sc
from benchmarks.wan.netns import Topology, python_argv
from benchmarks.wan.wire import JsonLines, cpu_busy, cpu_jiffies, cpu_s, emit, last_json
from echo_node.weights.broadcast import DataServer, Source
from echo_node.weights.fetch import fetch_version
from echo_node.weights.mesh import MeshReceiver, PeerOverlay, SeedSource
from protocol import Identity, seal
from protocol.weights.manifest import build_manifest, choose_piece_size, payload_digest

PORT = 5401
MODULE = "benchmarks.wan.p2p"
PIECE = 64 * 1024
RUN_ID = "wan-bench"


def identity(tag: str, i: int) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"{tag}/{i}".encode()).digest())


async def source_main(a: argparse.Namespace) -> None:
    ids = [identity(a.tag, i) for i in range(a.peers + 1)]
    payload = os.urandom(a.bytes)
    # 64 KiB pieces, or the smallest size that fits the manifest's piece count (a real model).
    manifest = build_manifest(run_id=RUN_ID, version=1, payload=payload, piece_size=choose_piece_size(len(payload), PIECE))
    server = DataServer(ids[0], RUN_ID, bind_host=a.bind, port=PORT)
    # Every peer's data address, as the learner's dial-back probes would have proven them: a
    # member without one is listed unreachable and only dials out (two such peers never link).
    hosts = a.peer_addrs.split(",")
    relays = {x.peer_id: (host, PORT) for x, host in zip(ids[1:], hosts, strict=True)}
    members = frozenset(x.peer_id for x in ids[1:])  # a set: `in` on a generator would consume it
    source: Source | SeedSource
    if a.exchange == "mesh":
        overlay = PeerOverlay(members, relays, mode="mesh", degree=a.degree, settle_s=0.0)
        source = SeedSource(ids[0], manifest, seal(manifest, ids[0]), payload, overlay)
    else:
        source = Source(ids[0], manifest, seal(manifest, ids[0]), payload, members, relays)
    source.gate = trio.Event()
    server.register(1, source)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        emit({"event": "ready"})
        with trio.fail_after(60):
            # Hold pieces back until every peer is in: by then the relay links exist too.
            while len(source.swarm if isinstance(source, Source) else source.present) < a.peers:
                await trio.sleep(0.01)
        emit({"event": "start", "wall": time.time()})
        source.gate.set()
        with trio.move_on_after(a.timeout), trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                break
        emit({"event": "stats", "bytes_up": source.stats.bytes_up, "cpu_s": round(cpu_s(), 3)})
        nursery.cancel_scope.cancel()


async def peer_main(a: argparse.Namespace) -> dict[str, Any]:
    learner = identity(a.tag, 0)
    me = identity(a.tag, a.index)
    server = DataServer(me, RUN_ID, bind_host=a.bind, port=PORT)

    async def connect(host: str, port: int) -> trio.abc.Stream:
        with trio.fail_after(30):
            while True:
                try:
                    return await trio.open_tcp_stream(host, port)
                except OSError:
                    await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        cpu_before = cpu_s()  # start-up (imports, keys) is not the cost of moving bytes
        with trio.fail_after(a.timeout):
            manifest, payload, receiver = await fetch_version(
                server, nursery, learner_id=learner.peer_id, host=a.source, port=PORT, version=1, connect=connect
            )
        done = time.time()
        cpu_broadcast = cpu_s() - cpu_before
        # Keep serving a little: others may still be repairing from us.
        with trio.move_on_after(2.0):
            await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    # The overlay's own counts: requests given up on a neighbour, neighbours cut, copies wasted,
    # and answers we dropped unsent because their asker called them off.
    mesh = ({"stalls": sum(receiver.ex.stalls.values()), "cut": sum(receiver.cut.values()), "wasted": receiver.ex.wasted,
             "withdrawn": receiver.stats.withdrawn}
            if isinstance(receiver, MeshReceiver) else {})
    return {"event": "done", "wall": done, "ok": payload_digest(payload) == manifest.weights_sha256,
            "bytes_up": receiver.stats.bytes_up, "bytes_down": receiver.stats.bytes_down,
            "bad_pieces": receiver.stats.bad_pieces, "cpu_s": round(cpu_broadcast, 3), **mesh}


def run_p2p(topo: Topology, s: sc.Scenario, *, tag: str, kill_after_s: float = 0.0, timeout: float = 300.0) -> dict[str, Any]:
    common = ["--tag", tag, "--peers", str(s.peers), "--timeout", str(timeout), "--exchange", s.exchange, "--degree", str(s.degree)]
    addrs = ",".join(topo.addr(i) for i in range(1, s.peers + 1))
    source = topo.run(0, python_argv(MODULE, "--serve", "--bind", topo.addr(0), "--bytes", str(s.size_bytes),
                                     "--peer-addrs", addrs, *common),
                      cpus=s.learner_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = JsonLines(source, "p2p learner in h0")
    lines.wait_for("ready", 120)
    peers = {i: topo.run(i, python_argv(MODULE, "--peer", str(i), "--bind", topo.addr(i), "--source", topo.addr(0), *common),
                         cpus=s.peer_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(1, s.peers + 1)}
    start = lines.wait_for("start", 120)
    cpu0 = cpu_jiffies()
    if s.killed:
        time.sleep(max(0.0, start["wall"] + kill_after_s - time.time()))
        for i in s.killed:
            os.killpg(peers[i].pid, signal.SIGKILL)
    results = {i: last_json(peers[i], timeout, f"p2p peer h{i}") for i in s.survivors}
    busy = cpu_busy(cpu0, cpu_jiffies())
    for i in s.killed:
        peers[i].wait()
    source.send_signal(signal.SIGTERM)
    learner = lines.wait_for("stats", 30)
    source.wait(10)
    per_peer = {i: r["wall"] - start["wall"] for i, r in results.items()}
    down = sum(r["bytes_down"] for r in results.values())
    return {
        "seconds": max(per_peer.values()),
        "per_peer_s": {str(i): round(t, 3) for i, t in per_peer.items()},
        "all_verified": all(r["ok"] for r in results.values()),
        "peers_bytes_up": sum(r["bytes_up"] for r in results.values()),
        "peers_bytes_down": down,
        "peers_cpu_s": round(sum(r["cpu_s"] for r in results.values()), 3),
        "learner_bytes_up": learner["bytes_up"],
        "learner_cpu_s": learner["cpu_s"],
        "cpu_busy": busy,
        **({key: sum(r[key] for r in results.values()) for key in ("stalls", "cut", "wasted", "withdrawn")} if s.exchange == "mesh" else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help="run the learner's side")
    p.add_argument("--peer", type=int, dest="index")
    p.add_argument("--bind")
    p.add_argument("--source", help="the learner's address (peer side)")
    p.add_argument("--peer-addrs", help="the peers' addresses, comma-separated in index order (learner side)")
    p.add_argument("--bytes", type=int)
    p.add_argument("--tag", required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--exchange", choices=("push", "mesh"), default="push")
    p.add_argument("--degree", type=int, default=12)
    a = p.parse_args(argv)
    if a.serve:
        trio.run(source_main, a)
    else:
        emit(trio.run(peer_main, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
