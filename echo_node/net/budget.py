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
  of all) is cut to make room. Cutting the oldest, not refusing the newest, keeps the listener
  usable under a flood: an honest peer proves itself within milliseconds, a silent one is cut
  as soon as newer connections arrive (and by the listener's own pre-hello deadline anyway).
- Open connections are capped in total and per source; one beyond is closed at once.
- Loopback sources share no per-source cap: every process of a one-machine swarm connects from
  127.0.0.1, and a process on this machine can do worse to a node than open sockets. The totals
  hold for them too.
"""

from __future__ import annotations

import logging
import resource
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import trio

from protocol.addresses import is_loopback

log = logging.getLogger(__name__)

# Descriptors a node keeps for itself whatever strangers do: the journal and checkpoint files,
# its own dials (bootstrap, DHT, relays, dial-back probes), the engine's and torch's files.
RESERVED_FDS = 256
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

    def arrive(self, source: str, scope: trio.CancelScope) -> Ticket:
        """Admit a new connection from `source` as pending, cutting the oldest pending one of
        the same source or of all when a pending cap is full."""
        limited = self._limited(source)
        if limited and self._pending_by[source] >= self.caps.pending_per_source:
            self._cut(next(t for t in self._pending if t.source == source))
        elif len(self._pending) >= self.caps.pending:
            self._cut(next(iter(self._pending)))
        ticket = Ticket(source, scope)
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
    """The IP address a trio socket stream comes from ("" when it has none: a memory stream)."""
    sock = getattr(stream, "socket", None)
    try:
        return str(sock.getpeername()[0]) if sock is not None else ""
    except OSError:  # already reset by the peer
        return ""
