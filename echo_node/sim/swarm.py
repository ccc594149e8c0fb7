"""A whole swarm at scale: learner, rollout workers, weight broadcasts, churn and the capacity
scheduler, as one discrete-event simulation that drives the real protocol logic.

What is real: each version's broadcast is decided by the protocol's own piece-exchange state
machines (`protocol.weights.pieces.PieceSwarm`, `protocol.weights.relay.SourcePull`, driven as
`echo_node.weights.broadcast` drives them: `echo_node.sim.broadcast`), and who generates is
decided by the real `protocol.capacity.Scheduler` (its `Decision`s are kept in
`SwarmResult.decisions`). Bytes, GPUs and clocks are modelled (`echo_node.sim.net` for links).

Model (async mode, Echo):
- Learner: does one update of T_train seconds (constant) whenever R admissible rollouts are
  buffered, taking the freshest first (highest version); otherwise it idles until it has them.
  Its version counts updates; every κ updates it publishes the new version, which starts a
  broadcast of G bytes in pieces of `protocol.weights.manifest.choose_piece_size(G)` (or the
  configured size) from the learner's uplink.
- Staleness (the replay buffer's rule, `protocol/staleness.py`): a rollout of version v is
  admissible while v >= current − S; one that arrives older, or that a step leaves older, is
  dropped as stale. Ledger, checked after every buffer operation:
  received == trained + stale + buffered.
- Followers: every present worker follows the weights, active (generating) or standby (the
  `Decision`'s standby: everyone not active). A worker fetches one version at a time, like the
  follower (`echo_node.peer.weight_follower`): a publication finds it idle and it joins that
  version's broadcast, or busy and it joins the newest version's broadcast once its current one
  completes (late: members replay their relayed pieces to it). A worker that joins the swarm
  (churn) fetches the newest version at once, late, as a joining peer fetches the current
  version (docs/architecture.md, "Joining a run"); waiting for the next publication instead
  would deadlock a run whose every worker was replaced (no rollouts, so no next version).
- Generation: an active worker with weights generates batches of B rollouts, one after the
  other, each taking B/μ_i s (deterministic) or an exponential time of that mean (Poisson,
  default). A batch is tagged with the version installed when it started (its oldest token:
  async mode swaps weights mid-generation) and reaches the learner after both access latencies.
  A worker released to standby finishes its batch, then stops; a worker that leaves loses it.
- Churn: each present worker leaves at `churn_per_hour` per hour (exponential lifetimes); new
  workers arrive as a Poisson process of rate `churn_per_hour` × the initial pool size per hour,
  drawn from the same distributions (`echo_node.sim.population`). A leaving worker drops out of
  every broadcast mid-way (its links close).
- Scheduler: `Scheduler.decide` runs every `tick_s` and after every churn event (it answers None
  between ticks unless its target is broken) with the workers present, their *true* μ_i (as if
  each worker's rate were measured exactly), the configured T_train (constant here, so its
  measurement), and T_bcast = the median of the last `bcast_window` measured broadcasts, each
  from publication until ⌈1/γ⌉ of the workers active at publication hold it (before the first:
  `broadcast_bound` over the present pool, a prediction). Policies: "cost_aware" applies the
  `Decision`; "random" keeps the scheduler's target but draws the workers with
  `random_activation` (kept while they cover it, topped up at random when short, drawn again
  when above target·(1 + release_margin), the scheduler's own hysteresis); "all" makes every
  present worker active (the decisions are still taken and logged).
Outputs: per broadcast, its time until every member that joined at publication (and stayed)
holds it, its γ-time, and `broadcast_bound` over those members; the learner's idle fraction
and `predicted_idle` from the measured inputs (median T_bcast, time-averaged μ of the active
set), both over the window after the `warmup_versions`-th publication; cost per hour, active-set
size, μ_active, μ_pool and μ_min over time; stale drops; the simulation's wall time.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from echo_node.config import NetConfig
from echo_node.sim.broadcast import LEARNER_ID, SimBroadcast, SimReceiver
from echo_node.sim.events import EventLoop
from echo_node.sim.net import Node, Uplinks
from echo_node.sim.population import MBIT, PeerSpec, draw_peer
from protocol.capacity import GAMMA, Decision, Scheduler, Worker, broadcast_bound, predicted_idle, random_activation

__all__ = ["BroadcastRecord", "Policy", "SwarmConfig", "SwarmResult", "SwarmSim", "run_swarm"]

Policy = Literal["cost_aware", "random", "all"]
# Versions a node keeps serving (the learner its sources, a peer its relays): the live default.
KEEP_VERSIONS = NetConfig().keep_versions


@dataclass(frozen=True)
class SwarmConfig:
    model_bytes: int = 16 << 20
    piece_size: int | None = None  # None: choose_piece_size(model_bytes)
    learner_up: float = 1000 * MBIT  # bytes/s
    learner_lat: float = 0.002  # one-way, s
    rollouts_per_update: int = 256  # R
    t_train: float = 20.0  # s per update
    kappa: int = 2  # updates per publication
    staleness: int = 4  # S
    batch: int = 8  # B rollouts per batch
    poisson: bool = True
    churn_per_hour: float = 0.2
    versions: int = 20  # publications after version 0; the run ends when the last is broadcast
    max_sim_s: float = math.inf  # and at the latest at this simulated time,
    max_wall_s: float = math.inf  # or after this much real time (a budget for big swarms)
    policy: Policy = "cost_aware"
    tick_s: float = 30.0
    gamma: float = GAMMA
    release_margin: float = 0.25
    warmup_versions: int = 2
    bcast_window: int = 5
    seed: int = 0


@dataclass
class BroadcastRecord:
    version: int
    published_at: float
    members: int  # workers that joined at publication
    bound_s: float  # broadcast_bound over them
    active_need: int  # ⌈|active at publication| / γ⌉
    t_all: float | None = None  # publication until every member that stayed holds it
    t_gamma: float | None = None  # publication until active_need active workers hold it
    # When both times are known: links cut for overflow, pieces delivered, and of those the
    # copies the receiver already held (relays and repairs racing each other).
    overflows: int = 0
    deliveries: int = 0
    duplicates: int = 0
    # Still under way when the run ended: the mean share of the pieces its connected members hold.
    held_at_end: float | None = None


@dataclass
class SwarmResult:
    config: SwarmConfig
    broadcasts: list[BroadcastRecord]
    decisions: list[Decision]
    timeline: list[dict[str, float]]  # t, active, mu_active, mu_pool, mu_min, target, cost_per_hour
    idle_sim: float
    idle_pred: float
    t_train: float
    t_bcast_median: float
    mu_active_mean: float
    cost_per_hour_mean: float
    ledger: dict[str, int]
    churn: dict[str, int]  # workers that left and joined
    versions_published: int
    sim_s: float
    wall_s: float
    events: int
    learner_bytes_up: int


@dataclass(eq=False)
class _Worker:
    spec: PeerSpec
    node: Node
    present: bool = True
    active: bool = False
    generating: bool = False
    token: int = 0  # bumped when the worker leaves: its batch in progress is lost
    installed: int | None = None  # version whose weights it holds
    fetching: SimBroadcast | None = None
    serving: deque[SimBroadcast] = field(default_factory=deque)  # versions joined, newest last


@dataclass(eq=False)
class _Tracked:
    """A broadcast being measured."""

    bc: SimBroadcast
    record: BroadcastRecord
    waiting: set[str]  # members from publication, still present, not done
    active: set[str]  # workers active at publication, still present, not done
    active_done: int = 0


class SwarmSim:
    """One run of the model in the module doc: `run()` once, then read its `SwarmResult`."""

    def __init__(self, config: SwarmConfig, pool: list[PeerSpec], *, joiner: Callable[[random.Random, str], PeerSpec] = draw_peer) -> None:
        self.cfg = config
        # Separate streams, so that two policies run on one seed see the same churn.
        self.churn_rng = random.Random(config.seed)
        self.policy_rng = random.Random(config.seed + 1)
        self.gen_rng = random.Random(config.seed + 2)
        self.loop = EventLoop()
        self.uplinks = Uplinks(self.loop)
        self.learner = Node(LEARNER_ID, up=config.learner_up, down=math.inf, lat=config.learner_lat)
        self.scheduler = Scheduler(gamma=config.gamma, release_margin=config.release_margin, tick_s=config.tick_s)
        self.joiner = joiner
        self.initial_pool = len(pool)
        self.workers: dict[str, _Worker] = {}
        self._joined = 0
        self._left = 0
        # learner
        self.version = 0
        self.buffer: dict[int, int] = {}  # version -> rollouts buffered
        # received == trained + stale + buffered + training (taken by the update in progress);
        # sent: rollouts workers delivered (the rest still in flight); lost_in_churn: in batches
        # of workers that left mid-batch, never sent.
        self.ledger = {"received": 0, "trained": 0, "stale": 0, "buffered": 0, "training": 0, "sent": 0, "lost_in_churn": 0}
        self.training = False
        self._train_started = 0.0
        self.busy_s = 0.0
        self.window_start: float | None = None
        # broadcasts
        self.newest: SimBroadcast | None = None
        self.served: deque[SimBroadcast] = deque()  # the learner's, newest last
        self.tracked: dict[int, _Tracked] = {}
        self.records: list[BroadcastRecord] = []
        self.published = 0
        # scheduler
        self.decisions: list[Decision] = []
        self.timeline: list[dict[str, float]] = []
        self.random_active: set[str] = set()
        self.last_target = math.nan
        self.last_mu_min = math.nan
        # time integrals over the measurement window
        self._rates_at = 0.0
        self._cost_rate = 0.0
        self._mu_active = 0.0
        self.cost_integral = 0.0
        self.mu_integral = 0.0
        self.done = False
        for spec in pool:
            self._add_worker(spec)

    # --- running ------------------------------------------------------------------------------

    def run(self) -> SwarmResult:
        started = time.perf_counter()
        self._tick()
        self._publish()
        if self.cfg.churn_per_hour > 0:
            self._schedule_arrival()
        deadline = started + self.cfg.max_wall_s
        self.loop.run(until=self.cfg.max_sim_s, stop=lambda: self.done or time.perf_counter() > deadline)
        end = self.loop.now
        self._integrate(end)
        for t in self.tracked.values():
            held = [r.count / t.bc.num_pieces for r in t.bc.linked]
            t.record.held_at_end = statistics.fmean(held) if held else None
            t.record.overflows, t.record.deliveries, t.record.duplicates = t.bc.overflows, t.bc.deliveries, t.bc.duplicates
        window = end - self.window_start if self.window_start is not None else 0.0
        busy = self.busy_s
        if self.training:  # the update in progress counts up to the end
            busy += end - max(self._train_started, self.window_start or end)
        idle_sim = max(0.0, 1.0 - busy / window) if window > 0 else math.nan
        measured = [b.t_gamma for b in self.records if b.t_gamma is not None]
        t_bcast = statistics.median(measured) if measured else math.nan
        mu_mean = self.mu_integral / window if window > 0 else math.nan
        idle_pred = (
            predicted_idle(self.cfg.kappa, self.cfg.rollouts_per_update, self.cfg.t_train, t_bcast, mu_mean)
            if measured and window > 0 else math.nan
        )
        return SwarmResult(
            config=self.cfg,
            broadcasts=self.records,
            decisions=self.decisions,
            timeline=self.timeline,
            idle_sim=idle_sim,
            idle_pred=idle_pred,
            t_train=self.cfg.t_train,
            t_bcast_median=t_bcast,
            mu_active_mean=mu_mean,
            cost_per_hour_mean=self.cost_integral / window if window > 0 else math.nan,
            ledger=dict(self.ledger),
            churn={"left": self._left, "joined": self._joined},
            versions_published=self.published,
            sim_s=end,
            wall_s=time.perf_counter() - started,
            events=self.loop.events_run,
            learner_bytes_up=self.learner.bytes_up,
        )

    # --- workers and churn --------------------------------------------------------------------

    def _add_worker(self, spec: PeerSpec) -> _Worker:
        w = _Worker(spec, Node(spec.peer_id, up=spec.up, down=spec.down, lat=spec.lat))
        self.workers[spec.peer_id] = w
        if self.cfg.churn_per_hour > 0:
            life = self.churn_rng.expovariate(self.cfg.churn_per_hour / 3600.0)
            self.loop.at(self.loop.now + life, self._leave, w)
        return w

    def _present(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.present]

    def _schedule_arrival(self) -> None:
        rate = self.cfg.churn_per_hour * self.initial_pool / 3600.0
        self.loop.at(self.loop.now + self.churn_rng.expovariate(rate), self._arrive_worker)

    def _arrive_worker(self) -> None:
        self._joined += 1
        w = self._add_worker(self.joiner(self.churn_rng, f"j{self._joined:05d}"))
        if self.newest is not None:
            self._join(w, self.newest)  # a peer that joins the run fetches the current version
        self._schedule_arrival()
        self._decide()

    def _leave(self, w: _Worker) -> None:
        if not w.present:
            return
        self._integrate(self.loop.now)
        self._left += 1
        w.present = False
        w.token += 1
        if w.generating:
            self.ledger["lost_in_churn"] += self.cfg.batch
        w.generating = w.active = False
        self.random_active.discard(w.spec.peer_id)
        for bc in w.serving:
            bc.leave(w.spec.peer_id)
        for t in list(self.tracked.values()):
            self._forget(t, w.spec.peer_id, done=False)
        self._rates_changed()
        self._decide()

    # --- scheduler ----------------------------------------------------------------------------

    def _t_bcast(self) -> float:
        measured = [b.t_gamma for b in self.records if b.t_gamma is not None][-self.cfg.bcast_window:]
        if measured:
            return statistics.median(measured)
        pool = self._present()
        if not pool:
            return 0.0
        return broadcast_bound(self.cfg.model_bytes, self.learner.up, [w.node.down for w in pool], [w.node.up for w in pool])

    def _tick(self) -> None:
        if self.done:
            return
        self._decide()
        self.loop.at(self.loop.now + self.cfg.tick_s, self._tick)

    def _decide(self) -> None:
        pool = self._present()
        workers = [Worker(w.spec.peer_id, w.spec.mu, w.spec.price, w.spec.down) for w in pool]
        d = self.scheduler.decide(
            self.loop.now, workers, kappa=self.cfg.kappa, rollouts_per_update=self.cfg.rollouts_per_update,
            t_train=self.cfg.t_train, t_bcast=self._t_bcast(),
        )
        if d is None:
            return
        self.decisions.append(d)
        self.last_target, self.last_mu_min = d.target, d.mu_min
        if self.cfg.policy == "cost_aware":
            active = set(d.active)
        elif self.cfg.policy == "all":
            active = {w.peer_id for w in workers}
        else:
            active = self._random_set(workers, d.target)
        self._integrate(self.loop.now)
        for w in pool:
            was = w.active
            w.active = w.spec.peer_id in active
            if w.active and not was:
                self._start_batch(w)
        self._rates_changed()

    def _random_set(self, workers: list[Worker], target: float) -> set[str]:
        """The random baseline with the scheduler's hysteresis (module doc)."""
        kept = [w for w in workers if w.peer_id in self.random_active]
        rate = math.fsum(w.mu for w in kept)
        if rate < target:
            rest = [w for w in workers if w.peer_id not in self.random_active]
            kept += random_activation(rest, target - rate, self.policy_rng)
        elif rate > target * (1 + self.cfg.release_margin):
            kept = random_activation(workers, target, self.policy_rng)
        self.random_active = {w.peer_id for w in kept}
        return self.random_active

    def _rates_changed(self) -> None:
        """Record the active set's rates (after `_integrate` closed the previous interval)."""
        pool = self._present()
        active = [w for w in pool if w.active]
        self._mu_active = math.fsum(w.spec.mu for w in active)
        self._cost_rate = math.fsum(w.spec.price for w in active)
        self.timeline.append({
            "t": self.loop.now, "active": len(active), "pool": len(pool), "mu_active": self._mu_active,
            "mu_pool": math.fsum(w.spec.mu for w in pool), "mu_min": self.last_mu_min, "target": self.last_target,
            "cost_per_hour": self._cost_rate,
        })

    def _integrate(self, now: float) -> None:
        if self.window_start is not None:
            dt = now - max(self._rates_at, self.window_start)
            if dt > 0:
                self.cost_integral += self._cost_rate * dt
                self.mu_integral += self._mu_active * dt
        self._rates_at = now

    # --- generation ---------------------------------------------------------------------------

    def _start_batch(self, w: _Worker) -> None:
        if not (w.present and w.active) or w.generating or w.installed is None:
            return
        w.generating = True
        mean = self.cfg.batch / w.spec.mu
        duration = self.gen_rng.expovariate(1.0 / mean) if self.cfg.poisson else mean
        self.loop.at(self.loop.now + duration, self._batch_done, w, w.token, w.installed)

    def _batch_done(self, w: _Worker, token: int, version: int) -> None:
        if token != w.token:
            return  # the worker left meanwhile
        w.generating = False
        self.ledger["sent"] += self.cfg.batch
        self.loop.at(self.loop.now + w.node.lat + self.learner.lat, self._receive, version)
        self._start_batch(w)

    # --- learner ------------------------------------------------------------------------------

    def _receive(self, version: int) -> None:
        b = self.cfg.batch
        self.ledger["received"] += b
        if version < self.version - self.cfg.staleness:
            self.ledger["stale"] += b
        else:
            self.buffer[version] = self.buffer.get(version, 0) + b
            self.ledger["buffered"] += b
        self._check_ledger()
        self._try_train()

    def _try_train(self) -> None:
        r = self.cfg.rollouts_per_update
        if self.training or self.ledger["buffered"] < r or self.done:
            return
        need = r
        for v in sorted(self.buffer, reverse=True):  # freshest first
            take = min(need, self.buffer[v])
            self.buffer[v] -= take
            if not self.buffer[v]:
                del self.buffer[v]
            need -= take
            if not need:
                break
        self.ledger["buffered"] -= r
        self.ledger["training"] = r
        self.training = True
        self._train_started = self.loop.now
        self.loop.at(self.loop.now + self.cfg.t_train, self._trained)

    def _trained(self) -> None:
        now = self.loop.now
        if self.window_start is not None:
            self.busy_s += now - max(self._train_started, self.window_start)
        self.training = False
        self.ledger["trained"] += self.ledger["training"]
        self.ledger["training"] = 0
        self.version += 1
        floor = self.version - self.cfg.staleness
        for v in [v for v in self.buffer if v < floor]:
            n = self.buffer.pop(v)
            self.ledger["stale"] += n
            self.ledger["buffered"] -= n
        self._check_ledger()
        if self.version % self.cfg.kappa == 0:
            self._publish()
        self._try_train()

    def _check_ledger(self) -> None:
        g = self.ledger
        assert g["received"] == g["trained"] + g["stale"] + g["buffered"] + g["training"], g
        assert g["buffered"] == sum(self.buffer.values()), g

    # --- broadcasts ---------------------------------------------------------------------------

    def _publish(self) -> None:
        now = self.loop.now
        if self.published == self.cfg.warmup_versions:
            self._integrate(now)
            self.window_start = now
        if self.published > self.cfg.versions:
            return  # the run ends once the broadcasts still measured complete (`_settle`)
        self.published += 1
        bc = SimBroadcast(self.loop, self.uplinks, self.learner, self.version, self.cfg.model_bytes,
                          piece_size=self.cfg.piece_size, on_member_done=self._member_done)
        previous = self.tracked.get(self.newest.version) if self.newest is not None else None
        # A superseded broadcast is joined by nobody new (its links still serve what they queued):
        # an active worker that has not joined it by now never holds it.
        self.newest = bc
        if previous is not None:
            for peer_id in [p for p in previous.active if p not in previous.bc.receivers]:
                self._forget(previous, peer_id, done=False)
        self.served.append(bc)
        if len(self.served) > KEEP_VERSIONS:
            self.served.popleft().close_source()
        members = [w for w in self._present() if w.fetching is None]
        for w in members:
            self._join(w, bc)
        joined = [w for w in members if w.fetching is bc]
        active = {w.spec.peer_id for w in self._present() if w.active}
        record = BroadcastRecord(
            version=self.version, published_at=now, members=len(joined),
            bound_s=broadcast_bound(self.cfg.model_bytes, self.learner.up, [w.node.down for w in joined],
                                    [w.node.up for w in joined]) if joined else math.nan,
            active_need=math.ceil(len(active) / self.cfg.gamma),
        )
        self.records.append(record)
        self.tracked[self.version] = _Tracked(bc, record, waiting={w.spec.peer_id for w in joined}, active=active)
        self._settle(self.tracked[self.version])

    def _member_done(self, bc: SimBroadcast, r: SimReceiver) -> None:
        w = self.workers[r.id]
        t = self.tracked.get(bc.version)
        if t is not None:
            self._forget(t, r.id, done=True)
        if not w.present or w.fetching is not bc:
            return
        w.fetching = None
        if w.installed is None or bc.version > w.installed:
            w.installed = bc.version
        self._start_batch(w)
        newest = self.newest
        if newest is not None and newest.version > w.installed:
            self._join(w, newest)  # a follower fetches the newest version next

    def _join(self, w: _Worker, bc: SimBroadcast) -> None:
        """`w` fetches `bc`'s version, and serves it while it is one of its last KEEP_VERSIONS."""
        if bc.join(w.node) is None:
            return  # the learner's data channel bans it for now
        w.fetching = bc
        w.serving.append(bc)
        if len(w.serving) > KEEP_VERSIONS:
            w.serving.popleft().leave(w.spec.peer_id)

    def _forget(self, t: _Tracked, peer_id: str, *, done: bool) -> None:
        """`peer_id` holds the tracked version (done) or left; record the times it completes."""
        t.waiting.discard(peer_id)
        if peer_id in t.active:
            t.active.discard(peer_id)
            if done:
                t.active_done += 1
            else:  # the need cannot exceed who is left to reach it
                t.record.active_need = min(t.record.active_need, t.active_done + len(t.active))
        self._settle(t)

    def _settle(self, t: _Tracked) -> None:
        rec, elapsed = t.record, self.loop.now - t.record.published_at
        if rec.t_gamma is None and rec.active_need and t.active_done >= rec.active_need:
            rec.t_gamma = elapsed
        if rec.t_all is None and not t.waiting:
            rec.t_all = elapsed
        if (rec.t_gamma is not None or not rec.active_need) and rec.t_all is not None:
            rec.overflows, rec.deliveries, rec.duplicates = t.bc.overflows, t.bc.deliveries, t.bc.duplicates
            del self.tracked[rec.version]
            if self.published > self.cfg.versions and not self.tracked:
                self.done = True


def run_swarm(config: SwarmConfig, pool: list[PeerSpec], **kwargs: Callable[[random.Random, str], PeerSpec]) -> SwarmResult:
    return SwarmSim(config, pool, **kwargs).run()
