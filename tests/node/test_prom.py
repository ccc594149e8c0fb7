"""The Prometheus endpoint: snapshot -> metrics, and the trio HTTP server under real and hostile
clients on loopback.

Time-based tests run on trio's virtual clock (`MockClock(autojump_threshold=0)`) with trio
socket clients in the same run: the clock jumps only when every task waits, so the server's
timeouts fire at their virtual deadlines. The one test with a real HTTP client (urllib in a
thread) runs on the real clock: a thread's socket work is invisible to the virtual clock, which
would jump past the server's timeouts while urllib is still sending.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from echo_node import prom
from echo_node.prom import CONTENT_TYPE, HEAD_TIMEOUT_S, MAX_CONNECTIONS, MAX_HEAD_BYTES, MetricsExporter, serve_metrics
from tests.factories import closed_by_server

LEARNER_SNAPSHOT = {
    "version": 12,
    "steps_per_s": 0.5,
    "learner_idle": 0.25,
    "staleness_mean": 1.5,
    "mu_pool": 3.0,
    "mu_min": 2.0,
    "mu_target": 2.2,
    "active_peers": 4,
    "standby_peers": 1,
    "cost_per_hour": 6.5,
    "bytes_up": 1000,
    "bytes_down": 2000,
    "rollouts_received": 300,
    "rollouts_accepted": 290,
    "drops": {"stale": 7, "bad_signature": 3},
    "bans": 2,
    "kappa": 2,
    "delta_max_predicted": 3,
    "idle_predicted": 0.1,
    "not_a_metric": "ignored",
}


def samples(text: bytes | str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, parsed the way Prometheus parses a scrape."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(parsed: dict, name: str, role: str = "learner", **labels: str) -> float:
    return parsed[(name, frozenset({"role": role, "run_id": "run-1", **labels}.items()))]


def run_virtual(fn: Callable[[], Awaitable[object]]) -> object:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def exchange(port: int, data: bytes, source: str | None = None) -> bytes:
    """Send `data` (from loopback address `source`), then read until the server closes; a reset
    counts as the close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    out = bytearray()
    try:
        await stream.send_all(data)
        while chunk := await stream.receive_some(1 << 16):
            out += chunk
    except trio.BrokenResourceError:
        pass
    await stream.aclose()
    return bytes(out)


def with_server(exporter: MetricsExporter, body: Callable[[int], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
    """A trio main that serves `exporter` on a free loopback port while `body(port)` runs."""

    async def main() -> object:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_metrics, exporter, "127.0.0.1", 0))
            result = await body(port)
            nursery.cancel_scope.cancel()
        return result

    return main


def learner() -> MetricsExporter:
    exporter = MetricsExporter("learner", run_id="run-1")
    exporter.update(LEARNER_SNAPSHOT)
    return exporter


# --- The exporter ---------------------------------------------------------------------------


def test_a_learner_snapshot_becomes_labelled_metrics_of_the_right_types() -> None:
    text = learner().render().decode()
    parsed = samples(text)
    assert value(parsed, "echo_version") == 12
    assert value(parsed, "echo_mu_pool") == 3.0
    assert value(parsed, "echo_learner_idle_ratio") == 0.25
    assert value(parsed, "echo_bytes_up_total") == 1000
    assert value(parsed, "echo_rollouts_accepted_total") == 290
    assert value(parsed, "echo_rollouts_dropped_total", reason="stale") == 7
    assert value(parsed, "echo_rollouts_dropped_total", reason="bad_signature") == 3
    assert value(parsed, "echo_banned_peers") == 2
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["echo_rollouts_dropped"] == "counter"
    assert types["echo_bytes_down"] == "counter"
    assert types["echo_mu_min"] == "gauge"
    assert not any("not_a_metric" in name for name, _ in parsed)
    assert not any(name == "echo_metrics_bad_values_total" for name, _ in parsed)  # nothing bad yet


def test_a_peer_snapshot_and_a_partial_update_keep_the_last_values() -> None:
    exporter = MetricsExporter("peer", run_id="run-1")
    exporter.update({"installed_version": 4, "rollouts_published": 10, "active": True, "price_per_hour": 1.2})
    exporter.update({"rollouts_published": 12, "drops": {"stale": 1}})
    exporter.update({"drops": {"overload": 2}})  # cumulative per reason: stale keeps its count
    parsed = samples(exporter.render())
    assert value(parsed, "echo_installed_version", "peer") == 4
    assert value(parsed, "echo_rollouts_published_total", "peer") == 12
    assert value(parsed, "echo_active", "peer") == 1
    assert value(parsed, "echo_rollouts_dropped_total", "peer", reason="stale") == 1
    assert value(parsed, "echo_rollouts_dropped_total", "peer", reason="overload") == 2


def test_bad_values_are_skipped_and_counted_never_raised() -> None:
    exporter = learner()
    exporter.update(
        {
            "steps_per_s": math.nan,
            "version": math.inf,  # +Inf is a reading only for the capacity keys
            "bytes_up": -1,  # a negative count
            "bytes_down": 10**400,  # beyond float range
            "active_peers": "3",  # a string is a bug, not something to parse
            "kappa": None,
            "mu_min": math.inf,  # no pool keeps up: a real reading, exported as +Inf
            "drops": {"stale": math.nan, 1: 2, "": 1, "x" * 65: 1, "overload": 5},
        }
    )
    exporter.update({"drops": [("stale", 1)]})
    parsed = samples(exporter.render())
    assert value(parsed, "echo_steps_per_second") == 0.5  # the last good values stand
    assert value(parsed, "echo_version") == 12
    assert value(parsed, "echo_bytes_up_total") == 1000
    assert value(parsed, "echo_rollouts_dropped_total", reason="stale") == 7
    assert value(parsed, "echo_rollouts_dropped_total", reason="overload") == 5
    assert value(parsed, "echo_mu_min") == math.inf
    bad = {dict(labels)["key"]: v for (name, labels), v in parsed.items() if name == "echo_metrics_bad_values_total"}
    once = ("steps_per_s", "version", "bytes_up", "bytes_down", "active_peers", "kappa")
    assert bad == {k: 1 for k in once} | {"drops": 5}


def test_drop_reasons_are_capped_so_labels_stay_bounded() -> None:
    exporter = MetricsExporter("learner", run_id="run-1")
    exporter.update({"drops": {f"r{i}": i for i in range(prom.MAX_DROP_REASONS + 10)}})
    exporter.update({"drops": {"r0": 5}})  # a known reason still updates at the cap
    parsed = samples(exporter.render())
    reasons = [labels for name, labels in parsed if name == "echo_rollouts_dropped_total"]
    assert len(reasons) == prom.MAX_DROP_REASONS
    assert value(parsed, "echo_rollouts_dropped_total", reason="r0") == 5
    assert value(parsed, "echo_metrics_bad_values_total", key="drops") == 10


def test_exporters_do_not_share_a_registry() -> None:
    a, b = MetricsExporter("learner", run_id="run-1"), MetricsExporter("learner", run_id="run-1")
    a.update({"version": 1})
    b.update({"version": 2})
    assert value(samples(a.render()), "echo_version") == 1
    assert value(samples(b.render()), "echo_version") == 2


def test_sources_are_ipv4_addresses_or_ipv6_slash_64s() -> None:
    """The per-source limits key an IPv6 client by its /64 (a host holds a whole one), an
    IPv4-mapped one by its IPv4 address."""
    assert prom._source("10.0.0.1") == prom._source("::ffff:10.0.0.1") == "10.0.0.1"
    assert prom._source("2001:db8::1") == prom._source("2001:db8::ffff:1") == "2001:db8::/64"
    assert prom._source("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert prom._source("fe80::1%eth0") == "fe80::/64"


# --- The server -----------------------------------------------------------------------------


def test_a_real_http_client_scrapes_the_values_and_gets_404_elsewhere() -> None:
    def get(url: str) -> tuple[int, str, str, bytes]:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.headers["Content-Length"], answer.read()

    def get_status(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as e:
            e.close()
            return e.code

    async def body(port: int) -> None:
        base = f"http://127.0.0.1:{port}"
        status, content_type, length, text = await trio.to_thread.run_sync(get, base + "/metrics")
        assert (status, content_type, int(length)) == (200, CONTENT_TYPE, len(text))
        assert value(samples(text), "echo_cost_per_hour") == 6.5
        assert (await trio.to_thread.run_sync(get, base + "/"))[0] == 200
        assert await trio.to_thread.run_sync(get_status, base + "/nope") == 404

    trio.run(with_server(learner(), body))  # real clock: see the module docstring


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        (b"GET /metrics?x=1 HTTP/1.0\n\n", b"200"),  # bare LF and HTTP/1.0 are tolerated
        (b"HEAD /metrics HTTP/1.1\r\n\r\n", b"200"),
        (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\n", b"405"),
        (b"GET /metrics\r\n\r\n", b"400"),  # HTTP/0.9
        (b"GET  /metrics HTTP/1.1\r\n\r\n", b"400"),
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\xff\xfe\r\n\r\n", b"400"),  # a TLS hello
    ],
    ids=["get", "lf-http10", "head", "404", "post", "http09", "spaces", "binary"],
)
def test_each_request_gets_one_answer_and_the_connection_closes(request_bytes: bytes, status: bytes) -> None:
    async def body(port: int) -> bytes:
        return await exchange(port, request_bytes)

    answer = run_virtual(with_server(learner(), body))
    assert isinstance(answer, bytes)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status + b" ")
    assert b"Connection: close" in head
    assert f"Content-Length: {len(payload)}".encode() in head or request_bytes.startswith(b"HEAD")
    if request_bytes.startswith(b"HEAD"):
        assert payload == b""


def test_an_oversized_head_is_cut_and_the_server_keeps_serving() -> None:
    async def body(port: int) -> tuple[bytes, bytes, bytes]:
        no_end = await exchange(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (100 * 1024))
        # The end of the head comes, but only past the bound: still no answer.
        late_end = await exchange(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n")
        good = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        return no_end, late_end, good

    no_end, late_end, good = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    assert no_end == b"" and late_end == b""
    assert good.startswith(b"HTTP/1.1 200 ")


def test_a_slow_client_is_dropped_at_the_head_timeout() -> None:
    """Slowloris: one byte a second of a head that never ends is cut after HEAD_TIMEOUT_S."""

    async def body(port: int) -> tuple[float, int, bytes]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        start, sent, got = trio.current_time(), 0, b""
        with trio.fail_after(HEAD_TIMEOUT_S + 5):
            try:
                while True:
                    await stream.send_all(b"G")
                    sent += 1
                    with trio.move_on_after(1):
                        got = await stream.receive_some(1 << 16)
                        break  # EOF: the server closed
            except trio.BrokenResourceError:
                pass
        await stream.aclose()
        return trio.current_time() - start, sent, got

    elapsed, sent, got = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    assert got == b""
    assert HEAD_TIMEOUT_S <= elapsed <= HEAD_TIMEOUT_S + 2
    assert sent <= HEAD_TIMEOUT_S + 2


def test_a_hundred_connections_are_bounded_and_the_server_recovers() -> None:
    """Connections beyond MAX_CONNECTIONS are closed at once; the held ones are cut at the
    head timeout; then a scrape is answered again. They come from 25 loopback addresses, four
    each, so the per-source cap (tests/adversarial/test_metrics_flood.py) is not what binds."""
    sources = [f"127.0.0.{10 + i}" for i in range(25)]
    assert len(sources) * prom.MAX_CONNECTIONS_PER_SOURCE == 100

    async def body(port: int) -> tuple[int, bytes, bytes]:
        streams = [
            await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
            for source in sources
            for _ in range(prom.MAX_CONNECTIONS_PER_SOURCE)
        ]
        await trio.sleep(1)  # the server accepts them all (virtual time: until it is idle)
        closed = await closed_by_server(streams)
        refused = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n", "127.0.1.1")  # no slot left
        await trio.sleep(HEAD_TIMEOUT_S)  # the held connections time out
        for stream in streams:
            await stream.aclose()
        answered = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        return closed, refused, answered

    closed, refused, answered = run_virtual(with_server(learner(), body))  # type: ignore[misc]
    assert closed == 100 - MAX_CONNECTIONS
    assert refused == b""
    assert answered.startswith(b"HTTP/1.1 200 ")


def test_a_failing_render_answers_500_and_is_retried_a_second_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A render that raised is cached like a page: within the second the scraper gets 500
    again without a second render (a collector bug costs one render a second, not one per
    request); a second later the render is tried again."""
    exporter = learner()
    real_render = exporter.render
    calls = iter([RuntimeError("a collector bug"), None])

    def render() -> bytes:
        error = next(calls)
        if error is not None:
            raise error
        return real_render()

    monkeypatch.setattr(exporter, "render", render)

    async def body(port: int) -> tuple[bytes, bytes, bytes]:
        first = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        again = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        await trio.sleep(prom.RENDER_EVERY_S)
        return first, again, await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")

    first, again, later = run_virtual(with_server(exporter, body))  # type: ignore[misc]
    assert first.startswith(b"HTTP/1.1 500 ") and again.startswith(b"HTTP/1.1 500 ")
    assert later.startswith(b"HTTP/1.1 200 ")
