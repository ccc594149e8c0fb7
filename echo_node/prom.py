"""A Prometheus endpoint for operators: the node's once-a-second snapshot, scraped over HTTP.

Two halves:

- `MetricsExporter` turns a snapshot dict (built by the learner or a rollout peer every second)
  into Prometheus metrics in its own `CollectorRegistry`. Never the process-global registry:
  a process (or a test) may hold several exporters, and the global one would mix them and
  refuse a second registration of the same names.
- `serve_metrics` answers `GET /metrics` with a minimal HTTP/1.1 server written on trio, so the
  server is one more task in the node's nursery (the project rule), not prometheus_client's own
  thread server.

Rules of the exporter, and why:

- One custom collector, not `Gauge`/`Counter` objects. Every value in a snapshot is the node's
  own latest reading; most counters (bytes, rollouts, drops per reason) are cumulative counts
  kept elsewhere. A `Counter` can only be incremented, so mirroring a cumulative count through
  it would need delta bookkeeping (and would break on the node's restart); a `Gauge` named
  `..._total` would lie about its type. A collector that yields `CounterMetricFamily` with the
  cumulative value is how prometheus_client documents mirroring counters from another source,
  and it is exposed with the correct `counter` type (Prometheus handles a decrease as a reset).
- `role` and `run_id` are labels on every sample, fixed per exporter.
- A key absent from a snapshot keeps its last value (the snapshot may be partial); a key the
  table below does not know is ignored (the snapshot carries more than operators need).
- A bad value (not a real number, NaN, infinite, a negative count, an ill-formed `drops`
  entry) is skipped, its metric keeps its last value, and it is counted in
  `echo_metrics_bad_values_total{key=...}`: a bug in the snapshot shows on the dashboard, it
  never crashes the node. One exception: `+Inf` is a real reading for `mu_min` and `mu_target`
  (`protocol.capacity.mu_min` is infinite when no pool can keep up) and is exported as `+Inf`;
  skipping it would leave a stale finite value on the dashboard.
- `drops` is a mapping reason -> cumulative count, exported as
  `echo_rollouts_dropped_total{reason=...}`. Reasons are label values, so their number is
  capped (`MAX_DROP_REASONS`, `MAX_REASON_CHARS`): the vocabulary is closed
  (`protocol.drops.DropReason`, 25 values), and a snapshot that exceeds it is a bug, counted.

Rules of the server, and why: it listens on the network, and a stranger's scrapes must never
cost training (the server shares the node's event loop with it), so every connection is bounded:

- The page is rendered at most once per `RENDER_EVERY_S`, and only when the exporter took a
  snapshot since: every request in between is answered with the same cached bytes. A snapshot
  arrives about once a second, so a fresher page would show nothing new, and a render per
  request would let a GET flood spend the loop on `generate_latest`. A render that raised is
  cached too (answered 500), so a collector bug costs one render a second, not one per request.
- Each source has a token bucket (`CLIENT_RATE` requests/s, `CLIENT_BURST` at once; a scraper
  asks once every few seconds, `echo-node status` once), in a table of at most `MAX_CLIENTS`
  sources (the least recently seen is forgotten: it comes back full, which costs one burst). A
  request beyond it is answered a constant 429 at accept, its head never read, nothing rendered.
  A source is an IPv4 address, or an IPv6 /64: one host is handed a whole /64, so keying on the
  full address would give each attacker 2**64 buckets.
- At most `MAX_CONNECTIONS_PER_SOURCE` connections of one source at once, and `MAX_CONNECTIONS`
  in all; one beyond either is closed at once, without reading. The per-source cap is why one
  client holding connections open cannot lock out another address.
- A request head of at most `MAX_HEAD_BYTES`, read within `HEAD_TIMEOUT_S`: slowloris, oversized
  heads and garbage are cut there, the buffer never grows past the bound and no byte past it is
  read (the connection is closed, so a 1 MiB head costs what an 8 KiB one does).
- The answer sent within `SEND_TIMEOUT_S` (a client that never reads cannot hold a slot); one
  request per connection (`Connection: close`, no keep-alive, no body read).
- Nothing a client does raises out of the handler, which would end `trio.serve_tcp` and with it
  the node's nursery. Time is `trio.current_time()`, so tests run these bounds on a virtual clock.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from echo_node.net.ratelimit import RateLimits

__all__ = [
    "CLIENT_BURST",
    "CLIENT_RATE",
    "CONTENT_TYPE",
    "HEAD_TIMEOUT_S",
    "MAX_CLIENTS",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_SOURCE",
    "MAX_DROP_REASONS",
    "MAX_HEAD_BYTES",
    "METRICS",
    "MetricsExporter",
    "RENDER_EVERY_S",
    "SEND_TIMEOUT_S",
    "run_exporter",
    "serve_metrics",
]

log = logging.getLogger(__name__)

# The classic text exposition format: what every Prometheus server and scraper reads. Our names
# are plain ASCII, so the bytes `generate_latest` writes are this format whatever its default.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

MAX_CONNECTIONS = 64  # concurrent connections served; one more is closed at once
MAX_CONNECTIONS_PER_SOURCE = 4  # of one source at once: a scraper needs one
CLIENT_RATE = 2.0  # requests/s of one source: a scraper asks every few seconds, at most each second
CLIENT_BURST = 4.0  # requests of one source at once: a dashboard and `echo-node status` together
MAX_CLIENTS = 4096  # sources with a bucket; the least recently seen is forgotten
RENDER_EVERY_S = 1.0  # the snapshot's period: a fresher page would show nothing new
MAX_HEAD_BYTES = 8 * 1024  # a request line and headers; any real scraper sends a few hundred bytes
HEAD_TIMEOUT_S = 5.0  # for the whole head, from accept: a byte-a-second client is cut here
SEND_TIMEOUT_S = 5.0  # for the whole answer: a client that never reads is cut here
MAX_DROP_REASONS = 64  # distinct `reason` label values (DropReason has 25)
MAX_REASON_CHARS = 64

LABELS = ("role", "run_id")


@dataclass(frozen=True)
class _Spec:
    """How one snapshot key is exported."""

    name: str  # without `_total`: CounterMetricFamily appends it
    kind: Literal["gauge", "counter"]
    doc: str
    inf_ok: bool = False  # +Inf is a real reading of this key, not a bug


# Snapshot key -> metric. Learner and peer keys share one table: a key means the same on both
# roles (bytes, accepted rollouts), and `role` tells them apart.
METRICS: dict[str, _Spec] = {
    # Learner.
    "version": _Spec("echo_version", "gauge", "Current policy version of the learner."),
    "steps_per_s": _Spec("echo_steps_per_second", "gauge", "Optimizer steps per second."),
    "learner_idle": _Spec(
        "echo_learner_idle_ratio", "gauge", "Share of time the learner waited for rollouts."
    ),
    "staleness_mean": _Spec("echo_staleness_mean", "gauge", "Mean policy-version lag of trained rollouts."),
    "mu_pool": _Spec("echo_mu_pool", "gauge", "Measured rollout rate of every joined peer together (rollouts/s)."),
    "mu_active": _Spec("echo_mu_active", "gauge", "Measured rollout rate of the active peers together (rollouts/s)."),
    "pipelined": _Spec("echo_pipelined", "gauge", "1 if peers generate while a version downloads (async), else 0."),
    "mu_min": _Spec("echo_mu_min", "gauge", "Least rollout rate that keeps the learner busy (rollouts/s).", True),
    "mu_target": _Spec("echo_mu_target", "gauge", "Rollout rate the pool is sized for (rollouts/s).", True),
    "active_peers": _Spec("echo_active_peers", "gauge", "Rollout peers in the active set."),
    "standby_peers": _Spec("echo_standby_peers", "gauge", "Rollout peers on standby."),
    "cost_per_hour": _Spec("echo_cost_per_hour", "gauge", "Summed hourly price of the active peers."),
    "rollouts_received": _Spec("echo_rollouts_received", "counter", "Rollouts that reached the learner."),
    "bans": _Spec("echo_banned_peers", "gauge", "Peers banned now (bans expire, so not a counter)."),
    "kappa": _Spec("echo_kappa", "gauge", "Updates per broadcast (kappa)."),
    "delta_max_predicted": _Spec("echo_delta_max_predicted", "gauge", "Predicted largest policy lag of a rollout."),
    "t_train": _Spec("echo_t_train_seconds", "gauge", "Median learner update time (measured)."),
    "t_bcast": _Spec("echo_t_bcast_seconds", "gauge", "Median time from publication to 1/gamma of active peers installed."),
    "rollouts_per_update": _Spec("echo_rollouts_per_update", "gauge", "Rollouts one update trains on (R)."),
    "staleness": _Spec("echo_staleness_bound", "gauge", "The run's staleness bound S."),
    "idle_predicted": _Spec(
        "echo_learner_idle_predicted_ratio", "gauge", "Predicted learner idle share for the measured pool."
    ),
    # Rollout peer.
    "installed_version": _Spec("echo_installed_version", "gauge", "Policy version the peer samples with."),
    "rollouts_published": _Spec("echo_rollouts_published", "counter", "Rollouts the peer published."),
    "active": _Spec("echo_active", "gauge", "1 if the peer is in the active set, else 0."),
    "price_per_hour": _Spec("echo_price_per_hour", "gauge", "The peer's hourly price."),
    "episode_groups_dropped": _Spec(
        "echo_episode_groups_dropped", "counter", "Episode groups the peer's environment ended (errors, timeouts)."
    ),
    # Both.
    "rollouts_accepted": _Spec("echo_rollouts_accepted", "counter", "Rollouts the learner accepted."),
    "bytes_up": _Spec("echo_bytes_up", "counter", "Bytes sent."),
    "bytes_down": _Spec("echo_bytes_down", "counter", "Bytes received."),
}
DROPS_KEY = "drops"
# peer id -> {"mu", "price", "active"}: the capacity controller's view of each worker, replaced
# whole on each update (a peer gone is gone); at most MAX_WORKERS label values.
WORKERS_KEY = "workers"
MAX_WORKERS = 4096
_WORKER_FIELDS = {"mu": "Measured rollouts/s of a worker.", "price": "A worker's claimed hourly price.",
                  "active": "1 if the worker is in the active set, else 0."}


def _reading(value: Any, *, counter: bool, inf_ok: bool) -> float | None:
    """`value` as a float if it is a valid reading, else None. Real numbers only (bool is 0/1):
    a string or None in a snapshot is a bug, not something to parse."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int (or Fraction) beyond float range
        return None
    if math.isnan(x) or x == -math.inf or (x == math.inf and not inf_ok):
        return None
    if counter and x < 0:
        return None
    return x


class _SnapshotCollector(Collector):
    """Holds the latest valid reading per key and yields them as metric families on scrape."""

    def __init__(self, role: str, run_id: str) -> None:
        self._labels = [role, run_id]
        self._values: dict[str, float] = {}
        self._drops: dict[str, float] = {}
        self._bad: dict[str, int] = {}
        self._workers: dict[str, dict[str, float]] = {}

    def update(self, snapshot: Mapping[str, Any]) -> None:
        for key, value in snapshot.items():
            if key == DROPS_KEY:
                self._update_drops(value)
                continue
            if key == WORKERS_KEY:
                self._update_workers(value)
                continue
            spec = METRICS.get(key)
            if spec is None:
                continue
            x = _reading(value, counter=spec.kind == "counter", inf_ok=spec.inf_ok)
            if x is None:
                self._count_bad(key)
            else:
                self._values[key] = x

    def _update_drops(self, drops: Any) -> None:
        if not isinstance(drops, Mapping):
            self._count_bad(DROPS_KEY)
            return
        for reason, value in drops.items():
            x = _reading(value, counter=True, inf_ok=False)
            fits = reason in self._drops or len(self._drops) < MAX_DROP_REASONS
            if x is None or not isinstance(reason, str) or not 0 < len(reason) <= MAX_REASON_CHARS or not fits:
                self._count_bad(DROPS_KEY)
            else:
                self._drops[reason] = x

    def _update_workers(self, workers: Any) -> None:
        if not isinstance(workers, Mapping) or len(workers) > MAX_WORKERS:
            self._count_bad(WORKERS_KEY)
            return
        table: dict[str, dict[str, float]] = {}
        for peer, fields in workers.items():
            readings = {f: _reading(fields.get(f), counter=False, inf_ok=False) for f in _WORKER_FIELDS} if isinstance(fields, Mapping) else {}
            if not isinstance(peer, str) or not 0 < len(peer) <= MAX_REASON_CHARS * 2 or any(v is None for v in readings.values()) or not readings:
                self._count_bad(WORKERS_KEY)
                continue
            table[peer] = {f: float(v) for f, v in readings.items() if v is not None}
        self._workers = table

    def _count_bad(self, key: str) -> None:
        # `key` is a METRICS key or DROPS_KEY, never a caller's string: the label set is bounded.
        self._bad[key] = self._bad.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        for key, x in self._values.items():
            spec = METRICS[key]
            family_type = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = family_type(spec.name, spec.doc, labels=LABELS)
            family.add_metric(self._labels, x)
            yield family
        if self._drops:
            drops = CounterMetricFamily(
                "echo_rollouts_dropped", "Rollouts dropped, by reason (cumulative).", labels=(*LABELS, "reason")
            )
            for reason, x in self._drops.items():
                drops.add_metric([*self._labels, reason], x)
            yield drops
        for field, doc in _WORKER_FIELDS.items():
            if self._workers:
                family = GaugeMetricFamily(f"echo_worker_{field}", doc, labels=(*LABELS, "peer"))
                for peer, values in self._workers.items():
                    family.add_metric([*self._labels, peer], values[field])
                yield family
        bad = CounterMetricFamily(
            "echo_metrics_bad_values",
            "Snapshot values skipped as invalid (a bug in the node).",
            labels=(*LABELS, "key"),
        )
        for key, n in self._bad.items():
            bad.add_metric([*self._labels, key], n)
        yield bad


class MetricsExporter:
    """The metrics of one node (`role`: "learner" or "peer"), in a registry of its own.

    Not thread-safe: call `update` and `render` from the node's trio thread (as `serve_metrics`
    does), never `render` from a worker thread while the trio thread updates."""

    def __init__(self, role: str, *, run_id: str) -> None:
        self.role = role
        self.run_id = run_id
        self.registry = CollectorRegistry()
        self._collector = _SnapshotCollector(role, run_id)
        self.registry.register(self._collector)
        self.generation = 0  # snapshots taken: a page rendered at this count is still current

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Take the readings of `snapshot` (keys: `METRICS`, plus `drops`); never raises on
        bad values, which are skipped and counted."""
        self._collector.update(snapshot)
        self.generation += 1

    def render(self) -> bytes:
        """The text exposition of every metric (what `GET /metrics` answers)."""
        return generate_latest(self.registry)


# --- The HTTP server ------------------------------------------------------------------------

_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")  # CRLF per RFC 9112; bare LF tolerated (§2.2)
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
    500: "Internal Server Error",
}
_PATHS = (b"/metrics", b"/")
_Admit = Literal["serve", "refuse", "drop"]


class _Page:
    """The exposition page of one exporter, rendered at most once per `RENDER_EVERY_S` and only
    after a new snapshot; every other request gets the cached bytes (None: the render raised)."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter
        self._body: bytes | None = None
        self._at = -math.inf
        self._generation = -1

    def get(self, now: float) -> bytes | None:
        current = self._generation == self._exporter.generation and self._body is not None
        if current or now - self._at < RENDER_EVERY_S:
            return self._body
        self._at, self._generation = now, self._exporter.generation
        try:
            self._body = self._exporter.render()
        except Exception:  # a bug in a collector: shown in the log and to the scraper, kept serving
            log.exception("rendering metrics failed")
            self._body = None
        return self._body


class _Admission:
    """Who may be answered. Pure: handed `now`. `admit` says "drop" (close at once: a cap is
    full), "refuse" (answer 429: the source's bucket is empty) or "serve"; a connection that was
    not dropped holds its slots until `release`."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # at most MAX_CONNECTIONS keys: a key leaves at zero
        self._total = 0
        self._rates = RateLimits(CLIENT_RATE, CLIENT_BURST, max_keys=MAX_CLIENTS)

    def admit(self, source: str, now: float) -> _Admit:
        held = self._open.get(source, 0)
        if held >= MAX_CONNECTIONS_PER_SOURCE or self._total >= MAX_CONNECTIONS:
            return "drop"
        self._open[source] = held + 1
        self._total += 1
        return "serve" if self._rates.take(source, now) else "refuse"

    def release(self, source: str) -> None:
        self._total -= 1
        held = self._open.pop(source) - 1
        if held:
            self._open[source] = held


def _source(address: str) -> str:
    """The key a peer address is limited under: the IPv4 address (also when mapped into IPv6),
    else the IPv6 /64 (a scope id ignored)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


async def run_exporter(
    role: str,
    run_id: str,
    host: str,
    port: int,
    snapshot: Callable[[], Mapping[str, Any]],
    *,
    every_s: float = 1.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A node's endpoint: serve an exporter and feed it `snapshot()` every `every_s`, until
    cancelled; started with the bound port (port 0: any)."""
    exporter = MetricsExporter(role, run_id=run_id)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve_metrics, exporter, host, port)
        log.info("metrics at http://%s:%d/metrics", host, bound)
        task_status.started(bound)
        while True:
            exporter.update(snapshot())
            await trio.sleep(every_s)


async def serve_metrics(
    exporter: MetricsExporter,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `exporter` at http://host:port/metrics until cancelled. `task_status.started` gets
    the bound port (port 0 binds any free one). The caller chooses `host`; operators should
    keep it on loopback or a private interface, the endpoint has no authentication."""
    page = _Page(exporter)
    admission = _Admission()

    async def handler(stream: trio.SocketStream) -> None:
        try:
            source = _source(str(stream.socket.getpeername()[0]))
        except OSError:  # the client is already gone
            await stream.aclose()
            return
        verdict = admission.admit(source, trio.current_time())
        if verdict == "drop":
            await stream.aclose()  # at a cap: no reading, no answer, the slot is the bound
            return
        try:
            if verdict == "serve":
                await _serve_one(stream, page)
            else:
                await _send(stream, _TOO_MANY)
        finally:
            admission.release(source)
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, port, host=host))
        # A host name that resolves to several addresses gets one listener each; with port 0
        # each has its own port, and the first is the one reported.
        task_status.started(listeners[0].socket.getsockname()[1])


async def _serve_one(stream: trio.SocketStream, page: _Page) -> None:
    """Read one request head and answer it; transport errors end the connection quietly."""
    head: bytes | None = None
    try:
        with trio.move_on_after(HEAD_TIMEOUT_S):
            head = await _read_head(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return  # the client reset or vanished mid-head: nothing to answer
    if head is None:  # EOF, too long, or the timeout fired: dropped without an answer
        return
    status, body, extra = _route(head, partial(page.get, trio.current_time()))
    await _send(stream, _response(status, body, extra, send_body=not head.startswith(b"HEAD ")))


async def _send(stream: trio.SocketStream, data: bytes) -> None:
    """Send `data` within `SEND_TIMEOUT_S`; a client that reset or vanished is not answered."""
    with trio.move_on_after(SEND_TIMEOUT_S):
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request head (without its blank line), or None on EOF or when it exceeds
    `MAX_HEAD_BYTES`. The buffer never holds more than `MAX_HEAD_BYTES`, and no byte past
    it is read."""
    buf = bytearray()
    while True:
        room = MAX_HEAD_BYTES - len(buf)
        if room <= 0:
            return None
        chunk = await stream.receive_some(room)
        if not chunk:
            return None
        # Search only where the end could be: the new bytes and the three before them.
        start = max(0, len(buf) - 3)
        buf += chunk
        end = _END_OF_HEAD.search(buf, start)
        if end is not None:
            return bytes(buf[: end.start()])


def _route(head: bytes, page: Callable[[], bytes | None]) -> tuple[int, bytes, list[tuple[str, str]]]:
    """(status, body, extra headers) for a request head; `page` is called only for a scrape.
    Only the request line matters: no header changes the answer."""
    parts = head.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return 400, b"bad request\n", []
    method, target, _ = parts
    if method not in (b"GET", b"HEAD"):
        return 405, b"method not allowed\n", [("Allow", "GET, HEAD")]
    if target.split(b"?", 1)[0] not in _PATHS:
        return 404, b"not found\n", []
    body = page()
    if body is None:
        return 500, b"internal error\n", []
    return 200, body, []


def _response(status: int, body: bytes, extra: list[tuple[str, str]], *, send_body: bool) -> bytes:
    content_type = CONTENT_TYPE if status == 200 else "text/plain; charset=utf-8"
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in extra),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head + body if send_body else head


# Built once: a source over its budget costs the server this constant send and nothing else.
_TOO_MANY = _response(429, b"too many requests\n", [("Retry-After", "1")], send_body=True)
