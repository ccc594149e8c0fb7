"""The learner's capacity controller: ECHO-2's model (protocol/capacity.py) fed with what the
learner measures, deciding which peers generate and which stand by.

Inputs, and who is believed:
- μ_i, a peer's throughput, is measured here, from rollouts of that peer the learner *accepted*
  (verified, admitted) and when they arrived, on the learner's clock; a peer's claims never
  enter it. It is the rate at which the peer works while it has work. Each announcement of a
  version starts a demand cycle in which each peer is asked for `demand` rollouts: a peer that
  delivers them before the next announcement was busy from the cycle's start until the
  arrival that completed them, and then waited; one that does not was busy the whole cycle.
  μ_i = Σ rollouts / Σ busy time over the cycles of the last `window_s` in which it was active.
  The demand is met only by an arrival begun on the cycle's version or a newer one: a stock
  made on older weights while idle and sent at a cycle's start would otherwise count as
  instant work, an unbounded rate; so it counts only over the time real work took.
  Accepted rollouts per second would measure the learner's demand instead (a fast peer that
  makes its share early waits for the next version) and rank fast peers with slow ones. Busy
  time starts at the announcement, not at the peer's install (a claim), so the rate errs low by
  the broadcast time; a peer can only lower its own μ by sending less or later.
  Time before a peer's first accepted group (loading the model, fetching weights, warming up)
  is not work: its measurement starts at that arrival, which itself is not counted.
  While a peer stands by it produces nothing, so its last rate as an active peer is kept; only
  the time it is active counts, so a peer woken during a cycle is busy from its waking.
- The learner's waits: it says when it starts waiting for a batch (`waiting`) and when it has
  one (`working`), on the same clock as `tick`.
- T_train is the median of the last updates' durations; T_bcast the median, over recent
  versions, of the time from publication until ⌈n/γ⌉ of the n active peers said (in their
  heartbeats) that they installed it. Before either is measured, nobody is put on standby.
- Price, engine and device come from heartbeats: claims, used to rank and to report only. A
  peer that lies about its price only changes how early it is activated. The installed version
  is a claim too (capped at the newest published): T_bcast waits for ⌈n/γ⌉ of n active peers,
  so a few peers claiming early installs cannot end the timing alone.

Rules:
- A peer is measured before it is ranked: until it has been joined for one window it generates
  (standby would leave it at μ = 0 for ever).
- Nothing freezes a rate. Cycles start only at announcements, and nothing is announced while
  nothing is trained: free identities that meet one cycle's demand in a burst and go silent
  would keep their rate for ever, and a priced peer they put on standby would never be woken.
  So: the cycle under way, while its demand is unmet, is busy time until now, however late
  the next announcement comes. An active peer with no accepted rollout for `window_s` (or for one
  publication period, κ·T_train + T_bcast, if longer: a fast peer that met its demand waits
  that long for the next version) has μ = 0, and the scheduler replaces it at once.
- The learner's wait bounds any rate that overstates what arrives (such a burst, or a trickle
  after it that is never silent for a window): once it has waited `wake_after_s` for
  rollouts, every standby peer is woken, and no decision puts one back on standby until it
  trains again and `tick_s` has passed since the wake. So Sybils that win a standby decision,
  even one forced at once (an identity leaving breaks the target), idle the learner at most
  `wake_after_s` per `tick_s`, and to win the next one they must meet a new cycle's demand.
- Decisions come from the real `Scheduler` on its slow tick (or at once when the active set no
  longer covers the target); each one, its inputs and the model's predicted Δ_max and learner
  idle are recorded by the caller in metrics.jsonl; a wake is recorded the same way.
- With `rl.publish_auto`, κ follows `choose_kappa` on the measured T_train and T_bcast.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from echo_node.config import CapacityConfig
from protocol.capacity import Decision, Scheduler, Worker, choose_kappa, delta_max, mu_min, predicted_idle

# Samples kept for the medians; versions whose broadcast is still being timed; demand cycles,
# arrivals and active/standby changes kept per peer (those older than the window go sooner).
_STEPS_KEPT = 50
_BCASTS_KEPT = 20
_PENDING_KEPT = 16
_CYCLES_KEPT = 256
_ARRIVALS_KEPT = 4096
_CHANGES_KEPT = 64


@dataclass(slots=True)
class PeerState:
    joined_at: float
    price: float = 0.0
    engine: str = ""
    device: str = ""
    installed: int = -1
    # (time, version begun on, rollouts) of each accepted group, oldest first.
    arrivals: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=_ARRIVALS_KEPT))
    first_arrival: float | None = None
    # (time, active) whenever the decision changed its state; active before the first.
    changes: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=_CHANGES_KEPT))
    last_arrival: float | None = None  # of its last accepted group
    mu: float = 0.0
    measured: bool = False


class CapacityController:
    def __init__(
        self, cfg: CapacityConfig, *, rollouts_per_update: int, staleness: int, kappa: int, auto_kappa: bool,
        pipelined: bool = False,
    ) -> None:
        self.cfg = cfg
        # Peers generate on the weights they have while a version downloads (async mode): the
        # broadcast costs staleness, not generation time (protocol.capacity.mu_min).
        self.pipelined = pipelined
        self.rollouts_per_update = rollouts_per_update
        self.staleness = staleness
        self.kappa = kappa
        self.auto_kappa = auto_kappa
        self.kappa_warning: str | None = None
        self.scheduler = Scheduler(gamma=cfg.gamma, release_margin=cfg.release_margin, tick_s=cfg.tick_s)
        self.peers: dict[str, PeerState] = {}
        self.step_times: deque[float] = deque(maxlen=_STEPS_KEPT)
        self.bcast_times: deque[float] = deque(maxlen=_BCASTS_KEPT)
        self._published: dict[int, float] = {}  # versions whose broadcast is being timed
        # (start, version announced, rollouts asked of each peer) of each demand cycle, oldest first.
        self._cycles: deque[tuple[float, int, float]] = deque(maxlen=_CYCLES_KEPT)
        # None until the first decision: every peer generates.
        self.active: frozenset[str] | None = None
        self.decision: Decision | None = None
        if not cfg.wake_after_s > 0:
            raise ValueError(f"capacity.wake_after_s must be > 0 (inf never wakes), got {cfg.wake_after_s!r}")
        # Since when the learner has been waiting for a batch; None while it has one.
        self.waiting_since: float | None = None
        self._woken_at = -math.inf  # the last wake of the standby peers

    # -- inputs --------------------------------------------------------------------------------

    def heartbeat(self, peer: str, now: float, *, installed: int, price: float, engine: str, device: str) -> None:
        state = self._peer(peer, now)
        state.price, state.engine, state.device = price, engine, device
        if installed > state.installed:
            state.installed = installed
            self._check_broadcasts(now)

    def _peer(self, peer: str, now: float) -> PeerState:
        """The peer's state, begun now if it is new here."""
        state = self.peers.get(peer)
        if state is None:
            state = self.peers[peer] = PeerState(joined_at=now)
        return state

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)

    def step(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def published(self, version: int, now: float) -> None:
        self._published[version] = now
        for old in sorted(self._published)[:-_PENDING_KEPT]:
            del self._published[old]

    def announced(self, version: int, now: float, demand_rollouts: float) -> None:
        """`version` was announced asking each peer for `demand_rollouts`: a demand cycle starts."""
        self._cycles.append((now, version, demand_rollouts))

    def waiting(self, now: float) -> None:
        """The learner has too few admissible groups for an update and waits for rollouts."""
        if self.waiting_since is None:
            self.waiting_since = now

    def working(self, now: float) -> None:
        """The learner has a batch (or stopped waiting for one)."""
        self.waiting_since = None

    def accepted(self, peer: str, version: int, rollouts: int, now: float) -> None:
        """The learner accepted a group of `rollouts` from `peer`, begun on `version` (its
        oldest token's)."""
        state = self._peer(peer, now)
        state.last_arrival = now
        if state.first_arrival is None:
            state.first_arrival = now  # the end of its warm-up (module doc), not work
            return
        state.arrivals.append((now, version, rollouts))

    def _check_broadcasts(self, now: float) -> None:
        active = [s for p, s in self.peers.items() if self.is_active(p)]
        if not active:
            return
        needed = math.ceil(len(active) / self.cfg.gamma)
        for version, at in sorted(self._published.items()):
            if sum(1 for s in active if s.installed >= version) >= needed:
                self.bcast_times.append(now - at)
                del self._published[version]

    # -- measurements --------------------------------------------------------------------------

    @property
    def t_train(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def t_bcast(self) -> float | None:
        return statistics.median(self.bcast_times) if self.bcast_times else None

    def _measure(self, now: float, joined: Collection[str]) -> None:
        for peer in list(self.peers):
            if peer not in joined:
                del self.peers[peer]
        # The cycles that ended inside the window, and the one under way (which may be older).
        horizon = now - self.cfg.window_s
        cycles = list(self._cycles)
        first = next((i for i in range(len(cycles)) if i + 1 == len(cycles) or cycles[i + 1][0] > horizon), len(cycles))
        cycles = cycles[first:]
        since = cycles[0][0] if cycles else horizon
        for peer in joined:
            state = self._peer(peer, now)
            while state.arrivals and state.arrivals[0][0] < since:
                state.arrivals.popleft()
            while len(state.changes) > 1 and state.changes[1][0] < since:
                state.changes.popleft()  # the first one still says what held then
            if not self.is_active(peer):
                continue  # standing by: its last rate as an active peer stands
            # Ranked (`measured`) only after a window; its rate is shown from its first work on.
            if now - state.joined_at >= self.cfg.window_s:
                state.measured = True
            if now - _quiet_since(state) >= self._silence_s():
                state.mu = 0.0  # nothing delivered for a window while active (module doc)
                continue
            rollouts, busy = _work(cycles, now, state)
            if busy > 0:  # else it has not worked since it was woken: its last rate stands
                state.mu = rollouts / busy

    def _silence_s(self) -> float:
        """How long an active peer may deliver nothing before its μ is 0 (module doc)."""
        t_train, t_bcast = self.t_train, self.t_bcast
        period = self.kappa * t_train + t_bcast if t_train is not None and t_bcast is not None else 0.0
        return max(self.cfg.window_s, period)

    def _starved(self, now: float) -> bool:
        """Whether the learner has waited for rollouts past `wake_after_s`."""
        return self.waiting_since is not None and now - self.waiting_since >= self.cfg.wake_after_s

    def _held(self, now: float) -> bool:
        """Whether standby decisions wait (module doc): the learner starves, or a wake was less
        than a tick ago."""
        return self._starved(now) or now < self._woken_at + self.cfg.tick_s

    # -- decisions -----------------------------------------------------------------------------

    def tick(self, now: float, joined: Collection[str]) -> dict[str, Any] | None:
        """Measure, maybe decide; the decision's record (for metrics.jsonl) when one was made."""
        self._measure(now, joined)
        t_train, t_bcast = self.t_train, self.t_bcast
        if t_train is None or t_bcast is None or not self.cfg.enabled:
            return None
        if self.auto_kappa:
            choice = choose_kappa(self.staleness, t_train, t_bcast)
            self.kappa, self.kappa_warning = choice.kappa, choice.warning
        workers = [Worker(peer, s.mu, s.price) for peer, s in sorted(self.peers.items()) if s.measured]
        if not workers:
            return None
        if self._held(now):  # no decision: it could only put peers on standby
            return self._wake(now, workers, t_train, t_bcast)
        decision = self.scheduler.decide(
            now, workers, kappa=self.kappa, rollouts_per_update=self.rollouts_per_update, t_train=t_train, t_bcast=t_bcast,
            pipelined=self.pipelined,
        )
        if decision is None:
            return None
        self.decision = decision
        # Peers not measured yet are not in the decision: they generate until they are.
        moved = self._apply(now, decision.active | {p for p, s in self.peers.items() if not s.measured})
        return self._record(decision, workers, t_train, t_bcast, changed=decision.changed or moved)

    def _apply(self, now: float, active: frozenset[str]) -> bool:
        """Make `active` the active set, noting each peer whose state changed; whether any did."""
        before = {p: self.is_active(p) for p in self.peers}
        self.active = active
        moved = False
        for p, state in self.peers.items():
            if self.is_active(p) != before[p]:
                state.changes.append((now, not before[p]))
                moved = True
        return moved

    def _wake(self, now: float, workers: list[Worker], t_train: float, t_bcast: float) -> dict[str, Any] | None:
        """Every standby peer generates (module doc), a peer measured since the last wake too;
        the record when any was woken."""
        asleep = sorted(p for p in self.peers if not self.is_active(p))
        if not asleep or self.decision is None:
            return None
        self._apply(now, frozenset(self.peers))
        if self._starved(now):
            assert self.waiting_since is not None
            self._woken_at = now
            why = (f"the learner waited {now - self.waiting_since:.1f} s for rollouts (wake_after_s = "
                   f"{self.cfg.wake_after_s:g}), so the measured rates overstate what arrives")
        else:
            why = f"decisions wait tick_s = {self.cfg.tick_s:g} s after the wake at {self._woken_at:g}"
        d = self.decision
        woken = Decision(
            active=frozenset(self.peers),
            standby=frozenset(),
            target=d.target,
            mu_min=d.mu_min,
            mu_active=math.fsum(w.mu for w in workers),
            mu_pool=math.fsum(w.mu for w in workers),
            cost_per_hour=math.fsum(s.price for s in self.peers.values()),
            feasible=d.feasible,
            changed=True,
            reason=f"woke {len(asleep)} on standby: {why}",
        )
        return self._record(woken, workers, t_train, t_bcast, changed=True)

    def _record(self, decision: Decision, workers: list[Worker], t_train: float, t_bcast: float, *, changed: bool) -> dict[str, Any]:
        return {
            "event": "capacity",
            "kappa": self.kappa,
            "kappa_warning": self.kappa_warning,
            "t_train": round(t_train, 4),
            "t_bcast": round(t_bcast, 4),
            "rollouts_per_update": self.rollouts_per_update,
            "mu_min": _finite(decision.mu_min),
            "target": _finite(decision.target),
            "mu_pool": round(decision.mu_pool, 3),
            "mu_active": round(decision.mu_active, 3),
            "active": sorted(decision.active),
            "standby": sorted(decision.standby),
            "unmeasured": sorted(p for p, s in self.peers.items() if not s.measured),
            "cost_per_hour": round(decision.cost_per_hour, 4),
            "feasible": decision.feasible,
            "changed": changed,
            "reason": decision.reason,
            "delta_max_predicted": delta_max(self.kappa, t_train, t_bcast),
            "idle_predicted": round(self._idle(t_train, t_bcast, decision.mu_active), 4),
            "workers": {w.peer_id: {"mu": round(w.mu, 3), "price": w.price} for w in workers},
        }

    def engine_of(self, peer: str) -> tuple[str, str] | None:
        """The (engine, device) `peer`'s last heartbeat claimed; None before its first."""
        state = self.peers.get(peer)
        return None if state is None or not state.engine else (state.engine, state.device)

    def is_active(self, peer: str) -> bool:
        state = self.peers.get(peer)
        unmeasured = state is None or not state.measured
        return not self.cfg.enabled or self.active is None or unmeasured or peer in self.active

    def _idle(self, t_train: float, t_bcast: float, mu: float) -> float:
        return predicted_idle(self.kappa, self.rollouts_per_update, t_train, t_bcast, mu, pipelined=self.pipelined)

    def snapshot(self) -> dict[str, Any]:
        """What the operator's metrics show (prometheus, `echo-node status`, `echo-node plan
        --learner`); None where nothing is measured yet. One definition of each figure, the
        decisions' own: μ_i the rate measured above (shown from a peer's first work on, ranked
        after a window); μ of the pool Σ μ_i over the joined peers, of the active set over the
        active ones; μ_min, target (γ·μ_min) and predicted idle from `protocol.capacity` with
        this learner's κ, R, T_train, T_bcast and mode."""
        t_train, t_bcast = self.t_train, self.t_bcast
        active = [p for p in self.peers if self.is_active(p)]
        mu_active = math.fsum(self.peers[p].mu for p in active)
        needed = delta = idle = None
        if t_train is not None and t_bcast is not None:
            needed = mu_min(self.kappa, self.rollouts_per_update, t_train, t_bcast, pipelined=self.pipelined)
            delta, idle = delta_max(self.kappa, t_train, t_bcast), self._idle(t_train, t_bcast, mu_active)
        return {
            "kappa": self.kappa,
            "staleness": self.staleness,
            "rollouts_per_update": self.rollouts_per_update,
            "pipelined": float(self.pipelined),
            "t_train": t_train,
            "t_bcast": t_bcast,
            "mu_pool": math.fsum(s.mu for s in self.peers.values()),
            "mu_active": mu_active,
            # Infinite when no pool keeps up: the dashboard shows +Inf, not a stale number.
            "mu_min": needed,
            "mu_target": self.scheduler.gamma * needed if needed is not None else None,
            "workers": {p: {"mu": s.mu, "price": s.price, "active": float(self.is_active(p))} for p, s in self.peers.items()},
            "active_peers": len(active),
            "standby_peers": len(self.peers) - len(active),
            "cost_per_hour": sum(self.peers[p].price for p in active),
            "delta_max_predicted": delta,
            "idle_predicted": idle,
        }


def _active_at(state: PeerState, t: float) -> bool:
    active = True
    for at, value in state.changes:
        if at > t:
            break
        active = value
    return active


def _quiet_since(state: PeerState) -> float:
    """Since when an active peer has had nothing accepted: its last accepted group, when it
    joined or when it was last woken, whichever came last."""
    woken = state.changes[-1][0] if state.changes and state.changes[-1][1] else state.joined_at
    return max(woken, state.joined_at, state.last_arrival if state.last_arrival is not None else -math.inf)


def _active_spans(state: PeerState, start: float, end: float) -> list[tuple[float, float]]:
    """The parts of [start, end] in which the peer was active, in order."""
    spans: list[tuple[float, float]] = []
    active, since = _active_at(state, start), start
    for at, value in state.changes:
        if not start < at < end or value == active:
            continue
        if active:
            spans.append((since, at))
        active, since = value, at
    if active:
        spans.append((since, end))
    return [(a, b) for a, b in spans if b > a]


def _work(cycles: list[tuple[float, int, float]], now: float, state: PeerState) -> tuple[float, float]:
    """(rollouts, busy seconds) of a peer over the demand cycles given (module doc): a cycle
    counts from its start or the peer's first arrival, over the spans in which the peer was
    active, until the arrival that met the demand (one begun on the cycle's version or later),
    else until the next cycle (for the cycle under way: now, arrivals at now included)."""
    rollouts = busy = 0.0
    if state.first_arrival is None:
        return rollouts, busy
    arrivals = list(state.arrivals)
    k = 0
    for i, (start, version, demand) in enumerate(cycles):
        last = i + 1 == len(cycles)
        end = now if last else cycles[i + 1][0]
        got, met = 0.0, False
        for a, b in _active_spans(state, max(start, state.first_arrival), end):
            while k < len(arrivals) and arrivals[k][0] < a:
                k += 1  # sent while it stood by
            stop = b
            while k < len(arrivals) and (arrivals[k][0] < b or (last and b == end and arrivals[k][0] == b)):
                got += arrivals[k][2]
                k += 1
                if got >= demand and arrivals[k - 1][1] >= version:
                    stop, met = arrivals[k - 1][0], True
                    break
            busy += stop - a
            if met:
                break  # the rest of the cycle it waited for the next version
        rollouts += got
    return rollouts, busy


def _finite(x: float) -> float | None:
    """JSON has no infinity: an infeasible target is written as null."""
    return round(x, 4) if math.isfinite(x) else None
