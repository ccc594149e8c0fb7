"""Joining the swarm: bootstrap dialing and learner lookup, with backoff and one deadline.

Written against the small `Dialer` seam rather than libp2p, so retries and deadlines are tested
on trio's virtual clock. A volunteer on a flaky link should get in if any bootstrap answers
before the deadline; if none does, `JoinError` names every address tried and why it failed, and
the CLI prints that one line instead of a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

log = logging.getLogger(__name__)


class JoinError(Exception):
    """The swarm could not be joined before the deadline."""


class DialError(Exception):
    """No listed address of a peer could be dialed; names each address and what happened on it
    (refused, timed out, a handshake that reached another peer id, skipped as unroutable)."""

    def __init__(self, peer_id: str, outcomes: Sequence[tuple[str, str]], *, hint: str = "") -> None:
        self.peer_id = peer_id
        self.outcomes = tuple(outcomes)
        self.hint = hint
        super().__init__(f"could not reach {peer_id}: {self.tried()}{'. ' + hint if hint else ''}")

    def tried(self) -> str:
        return "; ".join(f"{addr} ({what})" for addr, what in self.outcomes) or "no address known"


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.25
    max_s: float = 4.0
    factor: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield delay
            delay = min(self.max_s, delay * self.factor)


@dataclass(frozen=True, slots=True)
class PeerAddr:
    """A peer and the multiaddrs it can be dialed at."""

    peer_id: str
    addrs: tuple[str, ...]


class Dialer(Protocol):
    async def connect_multiaddr(self, maddr: str) -> str: ...

    async def find_providers(self, key: str, count: int = ...) -> Sequence[PeerAddr]: ...


async def connect_bootstrap(
    node: Dialer, addrs: Sequence[str], *, deadline_s: float, backoff: Backoff = Backoff()
) -> list[str]:
    """Dial every bootstrap address each round until at least one connects."""
    if not addrs:
        raise JoinError("no bootstrap address given (pass --bootstrap MULTIADDR)")
    last_error: dict[str, str] = {}
    with trio.move_on_after(deadline_s):
        for delay in backoff.delays():
            connected = []
            for addr in addrs:
                try:
                    with trio.fail_after(max(delay * 4, 2.0)):
                        connected.append(await node.connect_multiaddr(addr))
                except ValueError:
                    raise
                except DialError as exc:
                    last_error[addr] = "; ".join(what for _, what in exc.outcomes) + (f"; {exc.hint}" if exc.hint else "")
                except Exception as exc:  # any dial failure is retried; we report the last one
                    last_error[addr] = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
            if connected:
                return connected
            log.info("no bootstrap answered yet; retrying in %.2fs", delay)
            await trio.sleep(delay)
    tried = "; ".join(f"{a} ({last_error.get(a, 'timed out')})" for a in addrs)
    raise JoinError(f"could not reach any bootstrap peer within {deadline_s:g}s: tried {tried}")


async def find_providers(
    node: Dialer, key: str, *, what: str, deadline_s: float, backoff: Backoff = Backoff(), pin: str | None = None
) -> list[PeerAddr]:
    """Look provider records up until one appears (the learner may still be warming up); with
    `pin`, until the record of that peer id appears, and only it is returned. Anyone can
    announce a run id, so without a pin the caller must try each and check what it says."""
    with trio.move_on_after(deadline_s):
        for delay in backoff.delays():
            try:
                found = list(await node.find_providers(key))
            except Exception as exc:
                log.info("provider lookup for %s failed (%s); retrying", what, exc)
                found = []
            if pin is not None:
                found = [p for p in found if p.peer_id == pin]
            if found:
                return found
            await trio.sleep(delay)
    pinned = f" with peer id {pin}" if pin is not None else ""
    raise JoinError(f"no {what}{pinned} found in the DHT within {deadline_s:g}s")


async def find_provider(
    node: Dialer, key: str, *, what: str, deadline_s: float, backoff: Backoff = Backoff(), pin: str | None = None
) -> PeerAddr:
    """The first of `find_providers`."""
    return (await find_providers(node, key, what=what, deadline_s=deadline_s, backoff=backoff, pin=pin))[0]
