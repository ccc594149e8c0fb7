"""A stranger cannot make the metrics endpoint cost training: floods of GETs, many held
connections and 1 MiB heads, against the real trio server on loopback.

Every test runs on trio's virtual clock (`MockClock(autojump_threshold=0)`) with trio socket
clients in the same run, as in tests/node/test_prom.py: loopback delivers a sent byte before
`send` returns, so the clock only jumps when every task waits on a deadline. The bounds below
are asserted against the virtual time that actually passed, so a jump can only loosen them.
Other sources are other loopback addresses (127.0.0.0/8 is all local on Linux).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from echo_node import prom
from echo_node.prom import (
    CLIENT_BURST,
    CLIENT_RATE,
    HEAD_TIMEOUT_S,
    MAX_CONNECTIONS_PER_SOURCE,
    MAX_HEAD_BYTES,
    RENDER_EVERY_S,
    run_exporter,
)
from tests.factories import closed_by_server
from tests.node.test_prom import exchange, learner, run_virtual, samples, value, with_server

GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
HUGE_HEAD = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (1 << 20) + b"\r\n\r\n"


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The virtual time of every render of any exporter (the real render, counted)."""
    times: list[float] = []
    real = prom.MetricsExporter.render

    def counted(self: prom.MetricsExporter) -> bytes:
        times.append(trio.current_time())
        return real(self)

    monkeypatch.setattr(prom.MetricsExporter, "render", counted)
    return times


@pytest.fixture
def server_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes the server side of port `bytes["port"]` received (the real receive, counted)."""
    count = {"port": -1, "bytes": 0}
    real = trio.SocketStream.receive_some

    async def counted(self: trio.SocketStream, max_bytes: int | None = None) -> bytes:
        server_side = self.socket.getsockname() == ("127.0.0.1", count["port"])
        data = await real(self, max_bytes)
        if server_side:
            count["bytes"] += len(data)
        return data

    monkeypatch.setattr(trio.SocketStream, "receive_some", counted)
    return count


def with_exporter(snapshot: Callable[[], dict[str, Any]], body: Callable[[int], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
    """A trio main running the node's own `run_exporter` on loopback while `body(port)` runs."""

    async def main() -> object:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(run_exporter, "learner", "run-1", "127.0.0.1", 0, snapshot))
            result = await body(port)
            nursery.cancel_scope.cancel()
        return result

    return main


def test_a_get_flood_renders_the_page_at_most_once_a_second(renders: list[float]) -> None:
    """192 GETs over four seconds, 24 at once from fresh addresses (so no rate limit applies):
    every one is answered 200, the page is rendered at most once per second, and it follows
    the snapshots (it is cached, not frozen)."""
    fed = 0

    def snapshot() -> dict[str, Any]:
        nonlocal fed
        fed += 1
        return {"version": fed}

    async def body(port: int) -> tuple[list[bytes], float]:
        start, answers = trio.current_time(), []

        async def one(source: str) -> None:
            answers.append(await exchange(port, GET, source))

        for round_ in range(8):
            async with trio.open_nursery() as nursery:
                for i in range(24):
                    nursery.start_soon(one, f"127.1.{round_}.{i + 1}")
            await trio.sleep(0.5)
        return answers, trio.current_time() - start

    answers, elapsed = run_virtual(with_exporter(snapshot, body))  # type: ignore[misc]
    assert len(answers) == 192 and all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
    assert 1 < len(renders) <= elapsed / RENDER_EVERY_S + 1
    assert all(b - a >= RENDER_EVERY_S for a, b in zip(renders, renders[1:]))
    last = samples(answers[-1].partition(b"\r\n\r\n")[2])
    assert value(last, "echo_version") >= fed - 2  # at most a render period and a snapshot behind


def test_a_client_over_its_budget_gets_429_and_another_address_is_still_served(renders: list[float]) -> None:
    async def body(port: int) -> tuple[list[bytes], float, bytes, float]:
        start = trio.current_time()
        flood = [await exchange(port, GET) for _ in range(40)]
        flood_s = trio.current_time() - start
        start = trio.current_time()
        other = await exchange(port, GET, "127.0.0.2")
        return flood, flood_s, other, trio.current_time() - start

    flood, flood_s, other, other_s = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    served = [a for a in flood if a.startswith(b"HTTP/1.1 200 ")]
    refused = [a for a in flood if not a.startswith(b"HTTP/1.1 200 ")]
    assert len(served) <= CLIENT_BURST + CLIENT_RATE * flood_s
    assert all(a == b"" or a.startswith(b"HTTP/1.1 429 ") for a in refused)
    assert any(a.startswith(b"HTTP/1.1 429 ") for a in refused)  # Linux reads the 429 before the reset
    assert other.startswith(b"HTTP/1.1 200 ") and other_s < 0.1
    assert len(renders) <= flood_s / RENDER_EVERY_S + 1


def test_one_client_holding_connections_cannot_take_the_slots_of_another() -> None:
    """100 connections from one address, held open without a byte: all but
    MAX_CONNECTIONS_PER_SOURCE are closed at once, and another address is answered."""

    async def body(port: int) -> tuple[int, bytes, float]:
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(100)]
        await trio.sleep(0.5)  # the server accepts them all (virtual time: until it is idle)
        closed = await closed_by_server(streams)
        start = trio.current_time()
        other = await exchange(port, GET, "127.0.0.2")
        other_s = trio.current_time() - start
        for stream in streams:
            await stream.aclose()
        return closed, other, other_s

    closed, other, other_s = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    assert closed == 100 - MAX_CONNECTIONS_PER_SOURCE
    assert other.startswith(b"HTTP/1.1 200 ") and other_s < 0.1


def test_a_one_mib_head_is_cut_after_max_head_bytes_and_a_flood_of_them_is_bounded(
    server_reads: dict[str, int],
) -> None:
    """One 1 MiB head: the server reads at most MAX_HEAD_BYTES of it and closes at once (not at
    the head timeout). Twenty from one address: only the ones within its budget are read."""

    async def body(port: int) -> tuple[bytes, float, int, int, float, bytes]:
        server_reads["port"] = port
        start = trio.current_time()
        one = await exchange(port, HUGE_HEAD)
        one_s, one_read = trio.current_time() - start, server_reads["bytes"]
        start = trio.current_time()
        for _ in range(20):
            await exchange(port, HUGE_HEAD)
        flood_read, flood_s = server_reads["bytes"] - one_read, trio.current_time() - start
        return one, one_s, one_read, flood_read, flood_s, await exchange(port, GET, "127.0.0.2")

    one, one_s, one_read, flood_read, flood_s, other = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    assert one == b"" and 0 < one_read <= MAX_HEAD_BYTES and one_s < HEAD_TIMEOUT_S
    assert flood_read <= (CLIENT_BURST + CLIENT_RATE * flood_s) * MAX_HEAD_BYTES
    assert other.startswith(b"HTTP/1.1 200 ")
