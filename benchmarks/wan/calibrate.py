"""Goodput of one bulk TCP flow through one shaped link: the rate every bound is scaled by.

A sender in one host streams N bytes to a receiver in another; the receiver times the transfer
after the first eighth of it (so the shapers' initial 64 KB burst and TCP start-up do not count)
and reports Mbit/s of payload. Expect 0.956 × the configured rate at MTU 1500 (the payload
share of a 1514-byte frame; docs/platform.md) — `measure_goodput` checks a run lands near that.

    .venv/bin/python -m benchmarks.wan.calibrate --mbit 100 --size-mb 32      # builds h0+h1
    (children)  ... --serve --bind ADDR  |  --send --to ADDR --bytes N
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

from benchmarks.wan.netns import Rates, Topology, cleanup_stale, python_argv
from benchmarks.wan.wire import CHUNK, connect_retry, cpu_s, emit, last_json, listen, recv_exact

PORT = 5201  # every host has its own namespace, so fixed ports never collide across runs
HEADER = struct.Struct("!Q")


def serve(bind: str, port: int, timeout: float) -> dict[str, Any]:
    with listen(bind, port, 1) as ls:
        ls.settimeout(timeout)
        conn, _ = ls.accept()
    with conn:
        conn.settimeout(timeout)
        total = HEADER.unpack(recv_exact(conn, HEADER.size))[0]
        skip = total // 8
        buf = memoryview(bytearray(1 << 20))
        got, skipped, t_first, t_skip = 0, 0, 0.0, 0.0
        while got < total:
            k = conn.recv_into(buf[: min(len(buf), total - got)])
            if k == 0:
                raise ConnectionError(f"sender stopped after {got} of {total} bytes")
            if got == 0:
                t_first = time.monotonic()
            got += k
            if not t_skip and got >= skip:
                t_skip, skipped = time.monotonic(), got
        t_end = time.monotonic()
        conn.sendall(b"k")
    steady = (total - skipped) * 8 / 1e6 / max(t_end - t_skip, 1e-9)
    return {"event": "received", "bytes": total, "seconds": t_end - t_first,
            "mbit_s": steady, "mbit_s_overall": total * 8 / 1e6 / max(t_end - t_first, 1e-9), "cpu_s": cpu_s()}


def send(to: str, port: int, nbytes: int, bind: str | None, timeout: float) -> dict[str, Any]:
    payload = memoryview(bytes(CHUNK))
    with connect_retry(to, port, bind=bind, deadline_s=timeout) as s:
        s.settimeout(timeout)
        s.sendall(HEADER.pack(nbytes))
        left = nbytes
        while left:
            n = min(left, CHUNK)
            s.sendall(payload[:n])
            left -= n
        recv_exact(s, 1)
    return {"event": "sent", "bytes": nbytes, "cpu_s": cpu_s()}


def measure_goodput(
    topo: Topology, *, src: int = 1, dst: int = 0, nbytes: int = 32 << 20,
    src_cpus: Iterable[int] | None = None, dst_cpus: Iterable[int] | None = None, timeout: float = 120.0,
) -> dict[str, Any]:
    """One bulk flow src→dst through src's uplink and dst's downlink shapers.

    Returns the receiver's record plus `configured_mbit` (the tighter of the two shapers) and
    `efficiency` = steady goodput / configured."""
    mod = "benchmarks.wan.calibrate"
    rx = topo.run(dst, python_argv(mod, "--serve", "--bind", topo.addr(dst), "--timeout", str(timeout)),
                  cpus=dst_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tx = topo.run(src, python_argv(mod, "--send", "--to", topo.addr(dst), "--bind", topo.addr(src),
                                   "--bytes", str(nbytes), "--timeout", str(timeout)),
                  cpus=src_cpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    result = last_json(rx, timeout + 5, f"calibrate receiver in h{dst}")
    sent = last_json(tx, 10, f"calibrate sender in h{src}")
    rates = [r for r in (topo.hosts[src].up_mbit, topo.hosts[dst].down_mbit) if r is not None]
    configured = min(rates) if rates else None
    result.update(src=src, dst=dst, configured_mbit=configured, sender_cpu_s=sent["cpu_s"],
                  efficiency=(result["mbit_s"] / configured) if configured else None)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--serve", action="store_true", help="(child) receive one transfer on --bind")
    mode.add_argument("--send", action="store_true", help="(child) send --bytes to --to")
    p.add_argument("--bind", help="local address (child modes)")
    p.add_argument("--to", help="receiver address (--send)")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--bytes", type=int, default=32 << 20, help="(--send) payload bytes")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a child gives up")
    p.add_argument("--mbit", type=float, default=100.0, help="rate of every shaper (standalone run)")
    p.add_argument("--size-mb", type=float, default=32.0, help="MiB to transfer (standalone run)")
    p.add_argument("--mtu", type=int, default=1500)
    args = p.parse_args(argv)
    if args.serve:
        emit(serve(args.bind, args.port, args.timeout))
    elif args.send:
        emit(send(args.to, args.port, args.bytes, args.bind, args.timeout))
    else:
        cleanup_stale()
        rates = Rates(up_mbit=args.mbit, down_mbit=args.mbit)
        with Topology([rates, rates], mtu=args.mtu) as topo:
            emit({**measure_goodput(topo, nbytes=int(args.size_mb * (1 << 20)), src_cpus={1 % len(os.sched_getaffinity(0))}, dst_cpus={0}),
                  "event": "calibration"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
