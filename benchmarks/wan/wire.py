"""Blocking-socket helpers shared by the child processes (calibrate, star) and their parents."""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import time
from typing import Any

CHUNK = 64 * 1024  # 64 KiB chunks beat 1 MiB (pipeline fill ≈ N·chunk/rate; docs/platform.md)


def connect_retry(addr: str, port: int, *, bind: str | None, deadline_s: float) -> socket.socket:
    """Connect, retrying while the server is not listening yet (it starts concurrently)."""
    deadline = time.monotonic() + deadline_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if bind:
                s.bind((bind, 0))
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect((addr, port))
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def listen(addr: str, port: int, backlog: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(backlog)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            # A killed sender looks like a normal end of stream (docs/platform.md): lengths are
            # explicit.
            raise ConnectionError(f"stream ended after {got} of {n} bytes")
        got += k
    return bytes(buf)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def last_json(proc: subprocess.Popen[Any], timeout: float, what: str) -> dict[str, Any]:
    """Wait for a child that prints JSON lines on stdout; return its last one or raise with its stderr."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"{what} did not finish within {timeout:g}s; stderr: {_tail(err)}") from None
    lines = [ln for ln in (out or b"").decode(errors="replace").splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} exited with {proc.returncode}; stderr: {_tail(err)}")
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def _tail(err: bytes | None) -> str:
    return (err or b"").decode(errors="replace").strip()[-2000:] or "(empty)"


class JsonLines:
    """Reads a child's stdout JSON lines (and drains its stderr) without blocking past a deadline."""

    def __init__(self, proc: subprocess.Popen[Any], what: str) -> None:
        assert proc.stdout is not None and proc.stderr is not None, "start the child with stdout=stderr=PIPE"
        self.proc, self.what = proc, what
        self.records: list[dict[str, Any]] = []
        self._bufs = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b""}
        self._out, self._err = proc.stdout.fileno(), proc.stderr.fileno()
        self.stderr = b""

    def wait_for(self, event: str, timeout: float) -> dict[str, Any]:
        """The first record with this `event` (already seen or arriving within `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            for r in self.records:
                if r.get("event") == event:
                    return r
            if not self._pump(deadline):
                raise RuntimeError(f"{self.what}: no {event!r} record (exit {self.proc.poll()}); stderr: {_tail(self.stderr)}")

    def _pump(self, deadline: float) -> bool:
        """Read what is available; False once both streams ended or the deadline passed."""
        open_fds = [fd for fd in (self._out, self._err) if fd in self._bufs]
        left = deadline - time.monotonic()
        if not open_fds or left <= 0:
            return False
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            data = os.read(fd, 65536)
            if not data:
                del self._bufs[fd]
                continue
            if fd == self._err:
                self.stderr = (self.stderr + data)[-8192:]
                continue
            buf = self._bufs[fd] + data
            *lines, self._bufs[fd] = buf.split(b"\n")
            for ln in lines:
                if ln.startswith(b"{"):
                    self.records.append(json.loads(ln))
        return True


def cpu_jiffies() -> dict[str, list[int]]:
    """/proc/stat cpu lines ("cpu" = all cores): user nice system idle iowait irq softirq steal."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break
            name, *vals = line.split()
            out[name] = [int(x) for x in vals[:8]]
    return out


def cpu_busy(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, float]:
    """Busy share (not idle/iowait) of each core between two samples — whole machine, all users —
    and, for all cores together, the user / system / softirq shares (tbf and veth forwarding run
    in softirq, which no process's CPU time includes)."""
    res = {}
    for name, v1 in after.items():
        d = [a - b for a, b in zip(v1, before.get(name, v1))]
        total = sum(d) or 1
        res[name] = round((total - d[3] - d[4]) / total, 3)
        if name == "cpu":
            res.update(user=round((d[0] + d[1]) / total, 3), system=round(d[2] / total, 3),
                       softirq=round((d[5] + d[6]) / total, 3))
    return res
