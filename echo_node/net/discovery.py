"""Joining the swarm: bootstrap dialing and learner lookup, with backoff and one deadline.

Written against the transport's `Discovery` seam (echo_node/net/transport.py) rather than
libp2p, so retries and deadlines are tested on trio's virtual clock. A volunteer on a flaky link should get in if any bootstrap answers
before the deadline; if none does, `JoinError` names every address tried and why it failed, and
the CLI prints that one line instead of a traceback.

Anyone can announce a run id. A peer without a pin (RUN_ID@PEER_ID) therefore joins nothing
until exactly one provider of the run answers as its learner (`find_sole_learner`): it asks
each one a side-effect-free question first, and refuses to choose among several.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import trio

from echo_node.net.transport import Discovery, PeerAddr
from protocol.addresses import AddressError, is_loopback, parse_tcp_multiaddr

log = logging.getLogger(__name__)

# Without a pin, the provider records are looked up once more this long after the first answers:
# a learner's record may reach the DHT a moment after an impostor's (or the other way round),
# and a peer that decided on the first look alone would join whichever came first. One more
# look, not a wait for quiet: an impostor can always announce later, and a pin is the defence.
SECOND_LOOK_S = 2.0
# Reasons quoted in a one-line error, at most (a DHT answer holds up to 20 records).
MAX_REASONS = 5


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


async def connect_bootstrap(
    node: Discovery, addrs: Sequence[str], *, deadline_s: float, backoff: Backoff = Backoff()
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
    node: Discovery, key: str, *, what: str, deadline_s: float, backoff: Backoff = Backoff(), pin: str | None = None
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
    node: Discovery, key: str, *, what: str, deadline_s: float, backoff: Backoff = Backoff(), pin: str | None = None
) -> PeerAddr:
    """The first of `find_providers`."""
    return (await find_providers(node, key, what=what, deadline_s=deadline_s, backoff=backoff, pin=pin))[0]


@dataclass(frozen=True, slots=True)
class Probe:
    """What one provider of a run said when asked, side-effect free, whether it is the run's
    learner: `answers` when it answered for the run on a stream authenticated to its peer id."""

    answers: bool
    why: str = ""


ProbeFn = Callable[[PeerAddr], Awaitable[Probe]]


async def find_sole_learner(
    node: Discovery, key: str, *, run_id: str, deadline_s: float, probe: ProbeFn, backoff: Backoff = Backoff(),
    second_look_s: float = SECOND_LOOK_S,
) -> PeerAddr:
    """The one provider of `run_id` that answers as its learner, joined by nothing yet.

    Each round: the records (waited for, as `find_providers` does), each peer asked with `probe`,
    one more look after `second_look_s` for a record that came a moment later, then a decision.
    Several answer: `JoinError` naming them all and how to pin one (choosing would let an
    impostor take this peer). None answers: looked up again with backoff until the deadline.
    """
    deadline = trio.current_time() + deadline_s
    delays = backoff.delays()
    while True:
        left = max(0.0, deadline - trio.current_time())
        probes: dict[str, tuple[PeerAddr, Probe]] = {}
        await _probe_new(await find_providers(node, key, what=f"learner for run {run_id!r}", deadline_s=left, backoff=backoff),
                         probes, probe)
        await trio.sleep(second_look_s)
        await _probe_new(await _look_once(node, key), probes, probe)
        answering = sorted(pid for pid, (_, p) in probes.items() if p.answers)
        if len(answering) > 1:
            raise several_learners(run_id, answering)
        if answering:
            return probes[answering[0]][0]
        delay = next(delays)
        if trio.current_time() + delay >= deadline:
            reasons = [f"{pid}: {p.why}" for pid, (_, p) in sorted(probes.items())]
            more = f"; and {len(reasons) - MAX_REASONS} more" if len(reasons) > MAX_REASONS else ""
            raise JoinError(f"no provider of run {run_id!r} answered as its learner within {round(deadline_s)}s: "
                            + "; ".join(reasons[:MAX_REASONS]) + more)
        log.info("no provider of run %r answered as its learner yet; looking again in %.2fs", run_id, delay)
        await trio.sleep(delay)


def several_learners(run_id: str, peer_ids: Sequence[str]) -> JoinError:
    return JoinError(
        f"{len(peer_ids)} peers answer as the learner of run {run_id!r}: {', '.join(peer_ids)}; this peer joins none of "
        f"them without a pin: pass --run-id {run_id}@PEER_ID (or --learner PEER_ID) with the one its operator published"
    )


async def _look_once(node: Discovery, key: str) -> list[PeerAddr]:
    try:
        return list(await node.find_providers(key))
    except Exception as exc:  # the first look found records: this one only adds to them
        log.info("second provider lookup failed (%s)", exc)
        return []


async def _probe_new(found: Sequence[PeerAddr], probes: dict[str, tuple[PeerAddr, Probe]], probe: ProbeFn) -> None:
    """Probe the peers of `found` not probed yet, all at once (the caller's `probe` bounds each)."""
    new = {p.peer_id: p for p in found if p.peer_id not in probes}

    async def one(peer: PeerAddr) -> None:
        result = await probe(peer)
        probes[peer.peer_id] = (peer, result)
        log.info("provider %s of the run %s", peer.peer_id, "answers as its learner" if result.answers else f"is not its learner: {result.why}")

    async with trio.open_nursery() as nursery:
        for peer in new.values():
            nursery.start_soon(one, peer)


def check_first_learner_allowed(bootstrap: Sequence[str]) -> None:
    """`net.insecure_first_learner` joins whoever answers first, so it is allowed only where no
    other machine can announce the run id: every bootstrap address on loopback. ValueError else."""
    off = [a for a in bootstrap if not _on_loopback(a)]
    if off or not bootstrap:
        where = off[0] if off else "no bootstrap address"
        raise ValueError(
            f"--insecure-first-learner (net.insecure_first_learner) joins whoever announces the run first, so it is "
            f"allowed only with every bootstrap on loopback (a demo on one machine), not {where}: pin the learner "
            f"with --run-id RUN_ID@PEER_ID instead"
        )


def on_loopback(peer: PeerAddr) -> bool:
    """Every address `peer` was found at is a loopback IP (and it has one)."""
    return bool(peer.addrs) and all(_on_loopback(a) for a in peer.addrs)


def _on_loopback(maddr: str) -> bool:
    try:
        return is_loopback(parse_tcp_multiaddr(maddr).host)
    except AddressError:
        return False
