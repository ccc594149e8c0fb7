"""The learner's door: who may come in, and what a peer at it is told.

`Door` owns the run's two request-response protocols, JOIN and STATUS (echo_node/net/rpc.py):
the allowlist and the join rate limits, a join's entry in the peer table and the journal, the
status answers within their budgets (a joined peer's request is its heartbeat to the capacity
controller), and the dial-back of each joiner's data address that decides whether it is handed
out as a relay (its verdict is written to the peer table and the run's metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from echo_node.config import RunConfig
from echo_node.learner.capacity_controller import CapacityController
from echo_node.learner.intake import JoinRefused, PeerBook, RolloutIntake
from echo_node.learner.journal import Journal
from echo_node.learner.report import RunReport
from echo_node.learner.weight_publisher import WeightPublisher
from echo_node.net import rpc
from echo_node.net.p2p import interface_hosts
from echo_node.net.ratelimit import JoinLimits, RateLimits, RecentlySeen, TokenBucket
from echo_node.net.transport import Host
from echo_node.weights.broadcast import DataServer, ProbeFailed, probe
from protocol.addresses import dial_back_refusal
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import JoinRequest, JoinResponse, RunSpec, StatusRequest, StatusResponse

# Its lines are the learner's: they kept the logger they had in learner.py, so that an operator's
# filters and the CLI's stderr format (which names the logger) see the same lines as before.
log = logging.getLogger("echo_node.learner.learner")

# A joining peer's data address must answer a dial-back within this to be handed out as a relay
# (behind a NAT that drops inbound connections nothing answers at all); probes run this many at
# once, so a burst of joins cannot make the learner open sockets without bound.
PROBE_TIMEOUT_S = 5.0
PROBES_AT_ONCE = 8
# Joins whose dial-back waits for a slot: beyond this a joiner is not probed (so not a relay)
# until it joins again, and a flood of joins cannot queue tasks without bound.
MAX_PENDING_PROBES = 256
# A peer dialed back at an address is not dialed there again within this (a re-join keeps its
# verdict); at most this many (peer, address) pairs are remembered, the oldest forgotten.
DIAL_BACK_WINDOW_S = 600.0
MAX_DIALED = 8192
# Status requests answered per second: per joined peer (a pull-mode peer asks before every
# batch), and for all peers that have not joined together (they are answered, but Sybils cannot
# make the learner spend more than this on them).
STATUS_PER_PEER = (50.0, 100.0)  # rate, burst
STATUS_STRANGERS = (20.0, 40.0)


class Door:
    """The JOIN and STATUS handlers of one run, and the dial-back probes of the peers that join.

    A trio service: `run` registers the handlers on the node and holds the nursery the probes
    run in. Outside `run` (a test that calls `on_join` itself) a join is answered but nobody
    is dialed back."""

    def __init__(
        self, cfg: RunConfig, identity: Identity, *, peers: PeerBook, intake: RolloutIntake, journal: Journal,
        capacity: CapacityController, weights: WeightPublisher, data: DataServer, node: Host, report: RunReport,
        spec: Callable[[], RunSpec], epoch: Callable[[], int], demand_groups: Callable[[], int],
    ) -> None:
        """`data`: the learner's data server, whose address a join answer names (read at each
        answer: its port is bound when it starts). `spec`, `epoch`, `demand_groups`: the run's
        spec for a joiner, this start's epoch and the groups each peer is asked for, as they
        are when a request is answered."""
        self.cfg = cfg
        self.identity = identity
        self.peers = peers
        self.intake = intake
        self.journal = journal
        self.capacity = capacity
        self.weights = weights
        self.data = data
        self.node = node
        self.report = report
        self.spec = spec
        self.epoch = epoch
        self.demand_groups = demand_groups
        self._nursery: trio.Nursery | None = None  # the probes', while `run` runs
        self._allowed = frozenset(cfg.net.allow_peers)
        self._status_joined = RateLimits(*STATUS_PER_PEER, max_keys=cfg.net.max_peers)
        self._status_strangers = TokenBucket(*STATUS_STRANGERS, STATUS_STRANGERS[1], 0.0)
        self._probes = trio.CapacityLimiter(PROBES_AT_ONCE)
        self._probing: set[str] = set()
        self._joins = JoinLimits()
        # (peer, host, port) decided within DIAL_BACK_WINDOW_S: not dialed or recorded again.
        self._dialed = RecentlySeen(DIAL_BACK_WINDOW_S, MAX_DIALED)
        # This machine's addresses: a private, link-local or loopback address is dialed back
        # only on a network of that scope this learner is on itself.
        self._own_hosts = (*interface_hosts(), self.data.host)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the door: JOIN and STATUS are answered from here on (ready once they are), and
        the probes of joiners run in this service's nursery until it is cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.node.set_stream_handler(rpc.JOIN, self._serve_join)
                self.node.set_stream_handler(rpc.STATUS, self._serve(self.on_status))
                task_status.started()
                await trio.sleep_forever()
        finally:
            # The host outlives the door while the end of the run is announced: a join answered
            # then is not probed (its probe would have been cancelled before it dialed anyway).
            self._nursery = None

    # -- request handlers ----------------------------------------------------------------------

    def _serve(self, handler: rpc.Handler) -> Any:
        async def on_stream(stream: Any) -> None:
            with trio.move_on_after(30):
                await rpc.serve_one(stream, handler, on_bad=self._bad_request)

        return on_stream

    async def _serve_join(self, stream: Any) -> None:
        # The join handler also needs where the connection came from (a dial-back candidate).
        observed = getattr(stream, "remote_host", None)
        await self._serve(partial(self.on_join, observed=observed))(stream)

    async def on_join(self, request: Any, remote: str, *, observed: str | None = None) -> JoinResponse:
        if not isinstance(request, JoinRequest):
            raise RemoteProtocolError(f"join stream carried a {type(request).__name__}")
        self._check_run(request.run_id)
        if request.peer_id != remote:
            raise RemoteProtocolError(f"join request names {request.peer_id}, but the stream is from {remote}")
        if self._allowed and remote not in self._allowed:
            raise rpc.RequestRefused("not_allowed", "this run takes only the peers its operator listed")
        now = trio.current_time()
        if not self._joins.take(now, remote, observed or ""):
            raise rpc.RequestRefused("rate_limited", "too many joins; try again in a few seconds")
        again = remote in self.peers.joined
        try:
            self.peers.join(remote, now)
        except JoinRefused as exc:
            raise rpc.RequestRefused(exc.code, str(exc)) from None
        # A publisher this learner tracks goes on right after the highest seq it saw from it,
        # restarted or not: a new base of its own choosing would choose its next slots' prompts
        # (intake.py, skipped seqs), so no rejoin excuses a gap. Nothing to journal: the
        # tracker does not change.
        seq_from = self.intake.tracker.resume_at(remote)
        if again:  # a peer that lost its learner for a while: nothing new to journal or say
            log.debug("peer %s joined again", remote)
        else:
            self.journal.append(["join", remote])
            log.info("peer %s joined (%d peers)", remote, len(self.peers.joined))
        self.dial_back(remote, observed, request.data_port, now)
        return JoinResponse(spec=self.spec(), data_host=self.data.host, data_port=self.data.port, seq_from=seq_from)

    def dial_back(self, peer_id: str, observed: str | None, port: int, now: float) -> None:
        """Decide, by a dial-back, whether `peer_id` is handed out as a relay: at the address its
        join came from (the port may be the one it named: a 1:1 NAT or a port forward keeps it),
        never one it names (protocol/addresses.py: `dial_back_refusal`), and once per (peer,
        address) within `DIAL_BACK_WINDOW_S` (a re-join within it keeps the verdict)."""
        if not self._dialed.fresh((peer_id, observed, port), now):
            return  # decided within the window, dialed or not: no second probe, record or line
        if observed is None:
            self._verdict(peer_id, None, "the address its join came from is unknown")
            return
        target = (observed, port)
        if target == (self.data.host, self.data.port):
            self._verdict(peer_id, None, "it named this learner's own data address")
            return
        refusal = dial_back_refusal(observed, own_hosts=self._own_hosts, allow_private=self.cfg.net.dial_private)
        if refusal is not None:
            self._verdict(peer_id, None, f"{observed} is not dialed back: {refusal}")
            return
        self._schedule_probe(peer_id, [target])

    def _schedule_probe(self, peer_id: str, candidates: list[tuple[str, int]]) -> None:
        if self._nursery is None or peer_id in self._probing:
            return
        if len(self._probing) >= MAX_PENDING_PROBES:
            self._verdict(peer_id, None, f"not probed: {MAX_PENDING_PROBES} dial-backs already pending")
            return
        self._probing.add(peer_id)
        self._nursery.start_soon(self._probe, peer_id, candidates)

    async def _probe(self, peer_id: str, candidates: list[tuple[str, int]]) -> None:
        """Decide whether `peer_id` is handed out as a relay: only a data address that answered
        a dial-back as that peer is."""
        failures = []
        try:
            async with self._probes:
                for host, port in candidates:
                    with trio.move_on_after(PROBE_TIMEOUT_S):
                        try:
                            await probe(self.identity, self.cfg.run_id, peer_id, host, port, connect=self.data.net.connect)
                        except ProbeFailed as exc:
                            failures.append(str(exc))
                            continue
                        self._verdict(peer_id, (host, port), "")
                        return
                    failures.append(f"{host}:{port}: no answer within {PROBE_TIMEOUT_S:g}s")
            self._verdict(peer_id, None, "; ".join(failures) or "it named no address this learner may dial")
        finally:
            self._probing.discard(peer_id)

    def _verdict(self, peer_id: str, relay: tuple[str, int] | None, why: str) -> None:
        """Record whether `peer_id` is a relay (at `relay`) or not (and `why`); logged and written."""
        if relay is not None:
            self.peers.relays[peer_id] = relay
            self.peers.unreachable.pop(peer_id, None)
            log.info("peer %s is reachable at %s:%d: handed out as a relay", peer_id, *relay)
            self.report.write({"event": "reachability", "peer": peer_id, "relay": True, "addr": "%s:%d" % relay})
            return
        why = why[:500]  # it quotes what the peer's address answered
        self.peers.relays.pop(peer_id, None)
        self.peers.unreachable[peer_id] = why
        log.info("peer %s is not reachable from outside (%s): it downloads and contributes, but is not a relay", peer_id, why)
        self.report.write({"event": "reachability", "peer": peer_id, "relay": False, "why": why})

    async def on_status(self, request: Any, remote: str) -> StatusResponse:
        if not isinstance(request, StatusRequest):
            raise RemoteProtocolError(f"status stream carried a {type(request).__name__}")
        self._check_run(request.run_id)
        now = trio.current_time()
        allowed = self._status_joined.take(remote, now) if remote in self.peers.joined else self._status_strangers.take(now)
        if not allowed:
            raise rpc.RequestRefused("rate_limited", "too many status requests; peers that joined get their own budget")
        manifest = self.weights.manifest(self.weights.published)
        joined = remote in self.peers.joined
        if joined:  # the request is this peer's heartbeat (its claims: rank and report only)
            # A version not published yet cannot be installed: such a claim counts as the newest.
            installed = min(request.installed_version, self.weights.published)
            self.capacity.heartbeat(remote, now, installed=installed, price=request.price_per_hour,
                                    engine=request.engine, device=request.device)
        return StatusResponse(
            run_id=self.cfg.run_id,
            version=self.weights.published,
            weights_size=manifest.weights_size,
            weights_sha256=manifest.weights_sha256,
            demand_groups=self.demand_groups(),
            epoch=self.epoch(),
            active=not joined or self.capacity.is_active(remote),
        )

    def _check_run(self, run_id: str) -> None:
        if run_id != self.cfg.run_id:
            raise rpc.RequestRefused("wrong_run", f"this learner serves run {self.cfg.run_id!r}, not {run_id!r}")

    def _bad_request(self, peer_id: str, exc: Exception) -> None:
        log.warning("bad request from %s: %s", peer_id, exc)
        self.intake.penalize(peer_id, f"bad request: {exc}")
