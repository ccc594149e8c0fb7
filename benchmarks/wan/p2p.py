"""echo-node's P2P broadcast (echo_node/broadcast.py) run as one process per namespace host.

The learner (h0) builds a signed manifest of a random G-byte payload (64 KiB pieces), writes it
where the peers can read it (in the real system it travels on gossip), and starts handing out
pieces once every peer has connected; its clock starts then. Each peer dials the learner and
the peers after it (one link per pair), receives, verifies every piece against the manifest,
relays, repairs, and reports when the whole payload verifies (the version would go live).

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
from functools import partial
from pathlib import Path
from typing import Any

import trio

from benchmarks.wan import scenario as sc
from benchmarks.wan.netns import Topology, python_argv
from benchmarks.wan.wire import JsonLines, cpu_busy, cpu_jiffies, cpu_s, emit, last_json
from echo_node.broadcast import Membership, Receiver, Source, split_list
from protocol import Identity, seal
from protocol.envelope import open_envelope
from protocol.manifest import WeightManifest, build_manifest

PORT = 5401
MODULE = "benchmarks.wan.p2p"
PIECE = 64 * 1024
RUN_ID = "wan-bench"


def identity(tag: str, i: int) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"{tag}/{i}".encode()).digest())


def members(tag: str, peers: int) -> tuple[list[Identity], Membership]:
    ids = [identity(tag, i) for i in range(peers + 1)]
    return ids, Membership(x.peer_id for x in ids)


async def source_main(a: argparse.Namespace) -> None:
    ids, swarm_members = members(a.tag, a.peers)
    payload = os.urandom(a.bytes)
    manifest = build_manifest(run_id=RUN_ID, version=1, payload=payload, piece_size=PIECE)
    Path(a.manifest).write_bytes(seal(manifest, ids[0]))
    source = Source(ids[0], manifest, payload, swarm_members)
    source.gate = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(trio.serve_tcp, source.serve, PORT, host=a.bind))
        emit({"event": "ready"})
        with trio.fail_after(60):
            while len(source.connected) < a.peers:
                await trio.sleep(0.01)
        emit({"event": "start", "wall": time.time()})
        source.gate.set()
        with trio.move_on_after(a.timeout), trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                break
        emit({"event": "stats", "bytes_up": source.stats.bytes_up, "cpu_s": round(cpu_s(), 3)})
        nursery.cancel_scope.cancel()


async def peer_main(a: argparse.Namespace) -> dict[str, Any]:
    ids, swarm_members = members(a.tag, a.peers)
    me = ids[a.index]
    sealed = Path(a.manifest).read_bytes()
    manifest, _ = open_envelope(sealed, expected_kind=WeightManifest, expected_sender=ids[0].peer_id)
    assert isinstance(manifest, WeightManifest)
    receiver = Receiver(me, manifest, swarm_members, source_id=ids[0].peer_id)
    addr = {ids[i].peer_id: a.addrs.split(",")[i] for i in range(a.peers + 1)}

    async def connect(peer_id: str) -> trio.abc.Stream:
        with trio.fail_after(30):
            while True:
                try:
                    return await trio.open_tcp_stream(addr[peer_id], PORT)
                except OSError:
                    await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        await nursery.start(partial(trio.serve_tcp, receiver.accept, PORT, host=addr[me.peer_id]))
        # Peers first, the learner last: the learner starts handing out pieces once everyone
        # has reached it, and by then every relay link exists, so no early push is lost.
        dial, _ = split_list([x.peer_id for x in ids[1:]], me.peer_id)
        for other in dial:
            await receiver.dial(nursery, other, connect)
        await receiver.dial(nursery, ids[0].peer_id, connect)
        with trio.fail_after(a.timeout):
            payload = await receiver.run()
        done = time.time()
        # Keep serving a little: others may still be repairing from us.
        with trio.move_on_after(2.0):
            await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    return {"event": "done", "wall": done, "ok": hashlib.sha256(payload).digest() == manifest.weights_sha256,
            "bytes_up": receiver.stats.bytes_up, "bytes_down": receiver.stats.bytes_down,
            "bad_pieces": receiver.stats.bad_pieces, "cpu_s": round(cpu_s(), 3)}


def run_p2p(topo: Topology, s: sc.Scenario, *, tag: str, workdir: Path, kill_after_s: float = 0.0, timeout: float = 300.0) -> dict[str, Any]:
    manifest = str(workdir / "manifest.bin")
    addrs = ",".join(topo.addr(i) for i in range(s.peers + 1))
    common = ["--tag", tag, "--peers", str(s.peers), "--manifest", manifest, "--timeout", str(timeout)]
    source = topo.run(0, python_argv(MODULE, "--source", "--bind", topo.addr(0), "--bytes", str(s.size_bytes), *common),
                      cpus=s.learner_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = JsonLines(source, "p2p learner in h0")
    lines.wait_for("ready", 120)
    peers = {i: topo.run(i, python_argv(MODULE, "--peer", str(i), "--addrs", addrs, *common),
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
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", action="store_true")
    p.add_argument("--peer", type=int, dest="index")
    p.add_argument("--bind")
    p.add_argument("--addrs")
    p.add_argument("--bytes", type=int)
    p.add_argument("--tag", required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    if a.source:
        trio.run(source_main, a)
    else:
        emit(trio.run(peer_main, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
