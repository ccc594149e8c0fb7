"""The naive star: the learner uploads the whole version to every peer itself, all at once.

One process per host. The learner (h0) computes the version's manifest once — sha256 of every
64 KiB piece, as a real publisher does — then serves each peer over its own TCP connection,
simultaneously, from one thread per peer. Each peer receives into memory, verifies every piece
against the manifest as it arrives (the CPU work a real peer does), checks the manifest root,
and acknowledges; the learner times start → last acknowledgement. All N copies leave through the
learner's uplink, so the ideal is N·G/B0 (`bound.star_s`), N× the bound T* when rates are equal.

Killed peers (`--kill`) are SIGKILLed by the orchestrator; the learner counts them as failed and
the time is that of the last survivor.

    .venv/bin/python -m benchmarks.wan.star --peers 8 --size-mb 64          # prints one JSON line
    .venv/bin/python -m benchmarks.wan.star --peers 8 --slow-half --kill 2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from benchmarks.wan import scenario as sc
from benchmarks.wan.calibrate import measure_goodput
from benchmarks.wan.netns import Topology, cleanup_stale, python_argv
from benchmarks.wan.wire import CHUNK, JsonLines, connect_retry, cpu_busy, cpu_jiffies, cpu_s, emit, last_json, listen, recv_exact

PORT = 5301
HELLO = struct.Struct("!I")  # peer index
HEADER = struct.Struct("!QII")  # size, piece size, piece count
ACK = b"ok"
MODULE = "benchmarks.wan.star"


def manifest(blob: bytes | memoryview) -> list[bytes]:
    view = memoryview(blob)
    return [hashlib.sha256(view[o : o + CHUNK]).digest() for o in range(0, len(view), CHUNK)]


# --- learner (h0) ------------------------------------------------------------------------------
def serve(bind: str, peers: int, size: int, timeout: float) -> None:
    blob = os.urandom(size)
    t = time.monotonic()
    digests = manifest(blob)
    manifest_s = time.monotonic() - t
    head = HEADER.pack(size, CHUNK, len(digests)) + b"".join(digests)
    conns: dict[int, Any] = {}
    with listen(bind, PORT, peers) as ls:
        ls.settimeout(timeout)
        while len(conns) < peers:
            c, _ = ls.accept()
            c.settimeout(timeout)
            conns[HELLO.unpack(recv_exact(c, HELLO.size))[0]] = c
    done: dict[int, float] = {}
    failed: dict[int, str] = {}
    t0 = time.monotonic()
    emit({"event": "start", "t0": t0, "manifest_s": manifest_s})

    def upload(i: int, c: Any) -> None:
        view = memoryview(blob)
        try:
            with c:
                c.sendall(head)
                for o in range(0, size, CHUNK):
                    c.sendall(view[o : o + CHUNK])
                if recv_exact(c, len(ACK)) != ACK:
                    raise ConnectionError("bad acknowledgement")
                done[i] = time.monotonic() - t0
        except OSError as e:  # a killed peer: reset / broken pipe / end of stream
            failed[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=upload, args=(i, c), daemon=True) for i, c in sorted(conns.items())]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    emit({"event": "done", "seconds": max(done.values()) if done else None,
          "per_peer_s": {str(i): round(s, 4) for i, s in sorted(done.items())},
          "failed": {str(i): m for i, m in sorted(failed.items())}, "cpu_s": cpu_s(), "manifest_s": manifest_s})


# --- peer (h1..hN) -----------------------------------------------------------------------------
def fetch(index: int, src: str, bind: str, timeout: float) -> dict[str, Any]:
    with connect_retry(src, PORT, bind=bind, deadline_s=timeout) as s:
        s.settimeout(timeout)
        s.sendall(HELLO.pack(index))
        size, piece, count = HEADER.unpack(recv_exact(s, HEADER.size))
        raw = recv_exact(s, 32 * count)
        digests = [raw[32 * j : 32 * j + 32] for j in range(count)]
        t_first = time.monotonic()
        buf = bytearray(size)
        view = memoryview(buf)
        got = verified = 0
        while got < size:
            k = s.recv_into(view[got:])
            if k == 0:
                raise ConnectionError(f"source ended after {got} of {size} bytes")
            got += k
            while verified < size and (got - verified >= piece or got == size):
                end = min(verified + piece, size)
                if hashlib.sha256(view[verified:end]).digest() != digests[verified // piece]:
                    raise ValueError(f"piece {verified // piece} fails its hash")
                verified = end
        s.sendall(ACK)
    return {"event": "fetched", "peer": index, "bytes": size, "seconds": time.monotonic() - t_first,
            "root": hashlib.sha256(raw).hexdigest(), "cpu_s": cpu_s()}


# --- orchestration -----------------------------------------------------------------------------
def run_star(topo: Topology, s: sc.Scenario, *, kill_after_s: float = 0.0, timeout: float = 540.0) -> dict[str, Any]:
    """Broadcast `s.size_bytes` from h0 to h1..hN by the star; kill `s.killed` at `kill_after_s`."""
    t_child = str(timeout)
    server = topo.run(0, python_argv(MODULE, "--serve", "--bind", topo.addr(0), "--n", str(s.peers),
                                     "--bytes", str(s.size_bytes), "--timeout", t_child),
                      cpus=s.learner_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peers = {i: topo.run(i, python_argv(MODULE, "--fetch", str(i), "--from", topo.addr(0), "--bind", topo.addr(i),
                                        "--timeout", t_child),
                         cpus=s.peer_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(1, s.peers + 1)}
    lines = JsonLines(server, "star learner in h0")
    start = lines.wait_for("start", 60)
    cpu0 = cpu_jiffies()
    if s.killed:
        time.sleep(max(0.0, start["t0"] + kill_after_s - time.monotonic()))
        for i in s.killed:
            os.killpg(peers[i].pid, signal.SIGKILL)
    done = lines.wait_for("done", timeout)
    busy = cpu_busy(cpu0, cpu_jiffies())
    fetched = [last_json(peers[i], 30, f"star peer h{i}") for i in s.survivors]
    for i in s.killed:
        peers[i].wait()
    server.wait(10)
    return {"seconds": done["seconds"], "per_peer_s": done["per_peer_s"], "failed": sorted(int(i) for i in done["failed"]),
            "manifest_s": done["manifest_s"], "learner_cpu_s": done["cpu_s"],
            "peers_cpu_s": round(sum(f["cpu_s"] for f in fetched), 3),
            "roots_agree": len({f["root"] for f in fetched}) == 1, "cpu_busy": busy}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    child = p.add_argument_group("child modes (started by the orchestrator inside a namespace)")
    child.add_argument("--serve", action="store_true")
    child.add_argument("--fetch", type=int, metavar="I", help="peer index")
    child.add_argument("--bind")
    child.add_argument("--from", dest="src")
    child.add_argument("--n", type=int)
    child.add_argument("--bytes", type=int)
    child.add_argument("--timeout", type=float, default=540.0)
    sc.add_arguments(p)
    p.add_argument("--calibrate-mb", type=float, default=16.0, help="MiB for the goodput measurement (0: skip)")
    a = p.parse_args(argv)
    if a.serve:
        serve(a.bind, a.n, a.bytes, a.timeout)
        return 0
    if a.fetch is not None:
        emit(fetch(a.fetch, a.src, a.bind, a.timeout))
        return 0
    emit(run(sc.from_args(a), calibrate_bytes=int(a.calibrate_mb * (1 << 20))))
    return 0


def run(s: sc.Scenario, *, calibrate_bytes: int = 16 << 20) -> dict[str, Any]:
    """Build the topology, calibrate one link (h1→h0), run the star; one JSON-able record."""
    cleanup_stale()
    t = time.monotonic()
    with s.topology() as topo:
        cal = (measure_goodput(topo, src=1, dst=0, nbytes=calibrate_bytes, src_cpus=s.peer_cpus,
                               dst_cpus=s.learner_cpus) if calibrate_bytes else None)
        eff = cal["efficiency"] if cal else 1.0
        kill_after = s.resolved_kill_after_s(eff)
        # Generous but bounded: children give up at 3× the star's ideal time (+60 s start-up).
        star = run_star(topo, s, kill_after_s=kill_after, timeout=min(540.0, 60 + 3 * s.star_ideal_s(eff)))
    bound_cfg, bound_cal = s.bound_s(), s.bound_s(eff)
    survivors_bound = s.survivors_bound_s(kill_after, eff) if s.kill else bound_cal
    return {
        "scheme": "star", **s.describe(), **star,
        "calibrated_mbit": cal["mbit_s"] if cal else None, "calibrated_link": "h1->h0" if cal else None,
        "efficiency": eff, "kill_after_s": kill_after if s.kill else None,
        "bound_s_configured": bound_cfg, "bound_s_calibrated": bound_cal, "bound_s_survivors": survivors_bound,
        "star_ideal_s_calibrated": s.star_ideal_s(eff),
        "ratio_to_bound": star["seconds"] / survivors_bound if star["seconds"] else None,
        "wall_s": time.monotonic() - t,
    }


if __name__ == "__main__":
    sys.exit(main())
