"""Connection budgets: how many descriptors a node lets strangers hold, and which ones go first.

Every inbound TCP connection costs a descriptor before its first byte is read, and a process
that runs out of descriptors cannot open its own journal, checkpoints or dials: silent
connections would end the learner that way. So each listener admits connections through an
`Inbound` budget, and the budgets of one process together stay below its open-file limit minus
`RESERVED_FDS` (what the node itself must be able to open).

Rules of `Inbound`:
- A connection is *pending* from accept until it proved who it is (a signed hello, a Noise
  handshake) and *open* after. Pending connections are capped in total and per source address;
  when a cap is full, the oldest pending connection of that source (or, for the total, the oldest
  of all) is cut to make room if it has waited `CUT_AGE_S`, else the newcomer is refused (closed
  at once, before any task or handshake state exists for it). Cutting old ones keeps the
  listener usable under a flood: an honest peer proves itself within a round trip, a silent one
  is cut once it is old and newer connections arrive (and by the listener's own deadline). The
  age bounds what a flood costs: at most `pending / CUT_AGE_S` connections a second get past
  the refusal, each a task and a handshake's start; the rest cost an accept and a close.
- Open connections are capped in total and per source; one beyond is closed at once.
- Loopback sources share no per-source cap: every process of a one-machine swarm connects from
  127.0.0.1, and a process on this machine can do worse to a node than open sockets. The totals
  hold for them too.
"""

from __future__ import annotations

import errno
import logging
import resource
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from protocol.addresses import is_loopback

log = logging.getLogger(__name__)

# Descriptors a node keeps for itself whatever strangers do: the journal and checkpoint files,
# its own dials (bootstrap, DHT, relays, dial-back probes), the engine's and torch's files.
RESERVED_FDS = 256
# A pending connection is cut for a newcomer only once it has waited this long: longer than an
# honest hello or handshake takes on a slow link (one or two round trips), short enough that a
# flood's silent connections give their slots up quickly.
CUT_AGE_S = 0.5
# The soft open-file limit a node raises itself to at start, where the hard limit allows:
# enough for every listener's default caps with room to spare.
WANTED_FDS = 65536


def raise_open_file_limit(wanted: int = WANTED_FDS) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `wanted` (never above the hard limit, never
    lower); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a container may refuse; the caps below still fit
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


@dataclass(frozen=True, slots=True)
class Caps:
    pending: int
    pending_per_source: int
    open: int
    open_per_source: int


def share_of_descriptors(limit: int, weight: float, *, most: Caps) -> Caps:
    """One listener's caps: `weight` of the descriptors left after `RESERVED_FDS`, split one part
    pending to three parts open, never above `most` (a listener needs no more than that however
    large the limit is) and never below a working minimum."""
    room = max(0, limit - RESERVED_FDS) * weight
    pending = max(8, min(most.pending, int(room / 4)))
    opened = max(16, min(most.open, int(room - pending)))
    return Caps(
        pending=pending,
        pending_per_source=min(most.pending_per_source, pending),
        open=opened,
        open_per_source=min(most.open_per_source, opened),
    )


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted connection; `scope` is cancelled if the budget cuts it while it is pending."""

    source: str
    scope: trio.CancelScope
    since: float
    open: bool = False


@dataclass(slots=True)
class Inbound:
    """The admission of one listener's inbound connections (see the module rules)."""

    caps: Caps
    name: str = "listener"
    # Loopback sources share no per-source cap (the module rules); False: they do (tests).
    exempt_loopback: bool = True
    _pending: OrderedDict[Ticket, None] = field(default_factory=OrderedDict)
    _pending_by: Counter[str] = field(default_factory=Counter)
    _open_by: Counter[str] = field(default_factory=Counter)
    _open: int = 0
    # What the budget did, for the node's metrics and the hostile benchmark.
    cut: int = 0
    refused: int = 0

    def arrive(self, source: str, scope: trio.CancelScope, now: float) -> Ticket | None:
        """Admit a new connection from `source` as pending, or None: refuse it (close it at once,
        the cheapest answer). When a pending cap is full (the source's, else the total), the
        oldest pending connection under it is cut if it has waited `CUT_AGE_S`, else the
        newcomer is refused."""
        if self._limited(source) and self._pending_by[source] >= self.caps.pending_per_source:
            victim = next(t for t in self._pending if t.source == source)
        elif len(self._pending) >= self.caps.pending:
            victim = next(iter(self._pending))
        else:
            victim = None
        if victim is not None:
            if now - victim.since < CUT_AGE_S:
                self.refused += 1
                return None
            self._cut(victim)
        ticket = Ticket(source, scope, now)
        self._pending[ticket] = None
        self._pending_by[source] += 1
        return ticket

    def promote(self, ticket: Ticket) -> bool:
        """The connection proved itself: open it if the open caps allow (False: close it)."""
        if ticket.open or ticket not in self._pending:
            return ticket.open
        self._drop_pending(ticket)
        limited = self._limited(ticket.source)
        if self._open >= self.caps.open or (limited and self._open_by[ticket.source] >= self.caps.open_per_source):
            self.refused += 1
            return False
        ticket.open = True
        self._open += 1
        self._open_by[ticket.source] += 1
        return True

    def leave(self, ticket: Ticket) -> None:
        """The connection ended (either state; twice is harmless)."""
        if ticket.open:
            ticket.open = False
            self._open -= 1
            self._open_by[ticket.source] -= 1
            if not self._open_by[ticket.source]:
                del self._open_by[ticket.source]
        elif ticket in self._pending:
            self._drop_pending(ticket)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def opened(self) -> int:
        return self._open

    def _limited(self, source: str) -> bool:
        return not (self.exempt_loopback and is_loopback(source))

    def _cut(self, ticket: Ticket) -> None:
        self._drop_pending(ticket)
        ticket.scope.cancel()
        self.cut += 1
        if self.cut in (1, 100) or self.cut % 10_000 == 0:  # a flood is one line, not thousands
            log.warning("%s: %d connections cut before they proved who they are (a full pending budget of %d)",
                        self.name, self.cut, self.caps.pending)

    def _drop_pending(self, ticket: Ticket) -> None:
        del self._pending[ticket]
        self._pending_by[ticket.source] -= 1
        if not self._pending_by[ticket.source]:
            del self._pending_by[ticket.source]


# Each listener's share of the descriptors left after RESERVED_FDS, and what it never needs more
# than. The shares leave a fifth for the metrics endpoint (its own small fixed caps) and slack.
# Data channel: a peer holds one connection per version it fetches or relays, plus its relay
# links. libp2p: one connection per peer (max_connections_per_peer=1), the DHT's too.
DATA_CHANNEL = (0.45, Caps(pending=256, pending_per_source=16, open=4096, open_per_source=64))
LIBP2P = (0.35, Caps(pending=256, pending_per_source=16, open=4096, open_per_source=32))


def listener_caps(share: tuple[float, Caps], limit: int | None = None) -> Caps:
    """A listener's caps under `limit` (default: this process's soft open-file limit now)."""
    if limit is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = WANTED_FDS if soft == resource.RLIM_INFINITY else soft
    weight, most = share
    return share_of_descriptors(limit, weight, most=most)


def peer_host(stream: object) -> str:
    """The IP address a stream comes from: a socket's peer, or what an in-memory stream says
    (`remote_host`); "" when it has none."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return str(getattr(stream, "remote_host", None) or "")
    try:
        return str(sock.getpeername()[0])
    except OSError:  # already reset by the peer
        return ""


def close_now(resource: object) -> None:
    """Close a socket stream or listener (or an in-memory one, which has `close`) without
    waiting: a refused or finished connection must not hold a descriptor past this line."""
    sock = getattr(resource, "socket", None)
    if sock is not None:
        sock.close()
    else:
        resource.close()  # type: ignore[attr-defined]


# accept() errors that mean "out of descriptors or memory for a moment", not a broken listener.
_ACCEPT_PRESSURE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
PRESSURE_PAUSE_S = 0.1


async def serve_admitted(
    listeners: Sequence[trio.abc.Listener[trio.abc.Stream]], handler: Callable[[trio.abc.Stream, Ticket], Awaitable[None]],
    inbound: Inbound,
) -> None:
    """Accept on `listeners` until cancelled; each connection `inbound` admits runs
    `handler(stream, ticket)` in its own task, in the cancel scope of its ticket (a cut ends
    it); one refused is closed at once, with no task (what `trio.serve_listeners` would spawn
    for every connection, the flood's included). The listeners are closed when it ends."""
    try:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(_accept_loop, listener, handler, inbound, nursery)
    finally:
        for listener in listeners:
            close_now(listener)


async def _accept_loop(
    listener: trio.abc.Listener[trio.abc.Stream], handler: Callable[[trio.abc.Stream, Ticket], Awaitable[None]], inbound: Inbound,
    nursery: trio.Nursery,
) -> None:
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _ACCEPT_PRESSURE:
                raise
            log.warning("%s: accept failed (%s); pausing %gs", inbound.name, exc.strerror, PRESSURE_PAUSE_S)
            await trio.sleep(PRESSURE_PAUSE_S)
            continue
        scope = trio.CancelScope()
        ticket = inbound.arrive(peer_host(stream), scope, trio.current_time())
        if ticket is None:
            close_now(stream)
            continue
        nursery.start_soon(_serve_one, stream, ticket, handler, inbound)


async def _serve_one(
    stream: trio.abc.Stream, ticket: Ticket, handler: Callable[[trio.abc.Stream, Ticket], Awaitable[None]],
    inbound: Inbound,
) -> None:
    try:
        with ticket.scope:
            await handler(stream, ticket)
    finally:
        inbound.leave(ticket)
        # Served, cut before it proved itself, or the node stopping: the socket goes with the
        # task (closing twice is harmless; a handler done with it may have closed it already).
        close_now(stream)
