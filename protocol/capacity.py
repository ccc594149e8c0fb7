"""ECHO-2's capacity model and the cost-aware activation scheduler, as pure functions.

Job: say how much rollout capacity keeps the learner busy, how stale rollouts can get, and which
workers to pay for. Pure: handed `now` and measured rates, never reads a clock; the I/O layer
measures workers and acts on a `Decision`.

Notation (ECHO-2): R rollouts per learner update; T_train seconds per update; κ (kappa) updates
per published version; T_bcast seconds from a publication until workers generate on it; worker i
delivers μ_i rollouts/s at price c_i per hour.

Rules (each is a test in tests/unit/test_capacity.py):
1. Overlap: no training bubbles while κ·T_train ≥ T_bcast + κ·R / Σ_{i∈A} μ_i, i.e. the next κ
   updates' rollouts are broadcast for and generated while the learner trains the current κ.
2. Provisioning: Σ μ_i ≥ μ_min(κ) = κ·R / (κ·T_train − T_bcast), defined only when
   κ·T_train > T_bcast; otherwise no pool is enough (μ_min = inf).
3. Staleness: Δ_max ≤ κ + ⌈(1 − 1/κ)·T_bcast / T_train⌉. With T_bcast < T_train the ceiling is at
   most 1, so κ = S − 1 keeps Δ_max ≤ S; a slower broadcast forces a smaller κ (`choose_kappa`).
4. Activation: minimise Σ c_i subject to Σ μ_i ≥ γ·μ_min(κ), γ = 1.1 of headroom for measurement
   noise. Measured free workers are always active; the rest is `cheapest_set` (exact branch and
   bound on small pools, a greedy within a proven bound otherwise); unmeasured workers (μ = 0)
   go last. Between decisions, standby workers are added at once by ρ_i = c_i/μ_i when the
   target breaks; releasing happens only once capacity exceeds the target by
   `release_margin`, and decisions come on a slow tick: a worker is not started and stopped on
   every wobble of a measurement (no churn), unless the target is broken (then at once). When
   the cheapest set of the whole pool costs less than the active set by more than
   `release_margin` of its cost (a cheap worker joined, prices or rates moved), the active set
   becomes that set: kept workers are not kept at any price. The first decision takes it.
5. Greedy by ratio is not the exact optimum (this is a covering knapsack): the prefix's cost is
   at most the optimum plus the price of its last worker (`cheapest_prefix`), but no constant
   factor bounds it; `optimal_cost` solves small pools exactly to measure the gap.
6. μ and prices come from untrusted peers and noisy measurements: NaN, inf, negatives and
   non-numbers raise ValueError when a `Worker` is built, so they never reach a decision.
7. Flow control (`groups_to_ask`): at each publication the pool is asked for what the learner
   will train until the publication after it, less what it already holds: async, κ·G for the
   κ updates of this version plus RESERVE_UPDATES·G in reserve, minus the admissible groups
   buffered; pull, G (nothing buffered survives a version there). The reserve is what the
   learner trains on while the next batch is generated (a peer delivers a batch at a time, not
   a group at a time). It does not count the batches already in flight when the ask is made,
   which arrive on top of it, so every further update's worth of reserve is a surplus that
   ages in the buffer and goes stale. A fixed multiple of κ·G overshoots by that multiple
   whenever the pool keeps up, and the overshoot is what goes stale; subtracting the buffer
   makes any overshoot shrink the next ask.
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

__all__ = [
    "GAMMA",
    "MAX_EXACT_WORKERS",
    "RESERVE_UPDATES",
    "Choice",
    "Decision",
    "KappaChoice",
    "Scheduler",
    "Worker",
    "broadcast_bound",
    "cheapest_prefix",
    "cheapest_set",
    "choose_kappa",
    "delta_max",
    "groups_to_ask",
    "mu_min",
    "optimal_cost",
    "overlap_holds",
    "predicted_idle",
    "random_activation",
]

GAMMA = 1.1  # provision 10 % above μ_min: measured rates are noisy and the formula has no slack
MAX_EXACT_WORKERS = 20  # optimal_cost is exponential in the worst case
RESERVE_UPDATES = 1  # rule 7: updates' worth of groups asked for beyond the next κ updates


def _number(name: str, value: object, *, positive: bool = False, allow_inf: bool = False) -> float:
    """`value` as a float, or ValueError naming `name`: a real number, not NaN, >= 0 (> 0 if
    `positive`), finite unless `allow_inf`. bool is refused: True is no rate."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got an integer too large for a float") from None
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return v


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _model(kappa: int, rollouts_per_update: float, t_train: float, t_bcast: float) -> tuple[int, float, float, float]:
    return (
        _count("kappa", kappa, 1),
        _number("rollouts_per_update", rollouts_per_update, positive=True),
        _number("t_train", t_train, positive=True),
        _number("t_bcast", t_bcast),
    )


@dataclass(frozen=True, slots=True)
class Worker:
    """A rollout peer as the scheduler sees it; every field is checked when built (rule 6)."""

    peer_id: str
    mu: float  # measured rollouts/s (>= 0; 0 = not measured yet)
    price: float  # cost per hour (>= 0; 0 = volunteer)
    bandwidth: float | None = None  # bytes/s down (informational; the scheduler ignores it)

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise ValueError(f"peer_id must be a non-empty string, got {self.peer_id!r}")
        # Stored as floats so that equal workers compare and hash equal whatever type came in.
        object.__setattr__(self, "mu", _number(f"mu (worker {self.peer_id!r})", self.mu))
        object.__setattr__(self, "price", _number(f"price (worker {self.peer_id!r})", self.price))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", _number(f"bandwidth (worker {self.peer_id!r})", self.bandwidth))


def mu_min(kappa: int, rollouts_per_update: float, t_train: float, t_bcast: float, *, pipelined: bool = False) -> float:
    """The least pool rate, rollouts/s, with no training bubbles (rule 2); inf when
    κ·T_train <= T_bcast: the broadcast alone outlasts κ updates, so no pool is enough.

    `pipelined`: the workers keep generating on the weights they have while a version
    downloads and swap it in mid-generation (this implementation's async mode), so the
    broadcast costs staleness (rule 3), not generation time: μ_min = κ·R/(κ·T_train) = R/T_train."""
    k, r, tt, tb = _model(kappa, rollouts_per_update, t_train, t_bcast)
    slack = k * tt - (0.0 if pipelined else tb)  # seconds of generation per κ updates
    return k * r / slack if slack > 0 else math.inf


def overlap_holds(
    kappa: int, rollouts_per_update: float, t_train: float, t_bcast: float, mu_pool: float, *, pipelined: bool = False
) -> bool:
    """Whether κ·T_train ≥ T_bcast + κ·R/μ_pool (rule 1; without the T_bcast term when
    `pipelined`). Computed as μ_pool ≥ μ_min, the same inequality solved for μ, so that this
    and `mu_min` never disagree at the boundary."""
    pool = _number("mu_pool", mu_pool)
    return pool >= mu_min(kappa, rollouts_per_update, t_train, t_bcast, pipelined=pipelined)


def delta_max(kappa: int, t_train: float, t_bcast: float) -> int:
    """The worst staleness, in versions, of a rollout when training on it (rule 3).

    The ceiling is taken in exact rational arithmetic on each float's shortest decimal form (the
    number as written: 0.3 is 3/10). In floats (1 − 1/κ)·T_bcast/T_train lands an ulp either side
    of an integer and moves Δ_max by one: κ = 2, T_train = 0.3, T_bcast = 4.2 is 7 exactly, so
    Δ_max = 9, but 0.5·4.2/0.3 = 7.000000000000001 in floats."""
    k = _count("kappa", kappa, 1)
    tt = _number("t_train", t_train, positive=True)
    tb = _number("t_bcast", t_bcast)
    return k + math.ceil(Fraction(k - 1) * Fraction(repr(tb)) / (k * Fraction(repr(tt))))


def predicted_idle(
    kappa: int, rollouts_per_update: float, t_train: float, t_bcast: float, mu_pool: float, *, pipelined: bool = False
) -> float:
    """The fraction of wall time the learner waits for rollouts, in [0, 1].

    Model: the run is a sequence of publication cycles. In one cycle the learner trains κ updates
    back to back (κ·T_train of work); meanwhile the version it published at the start reaches the
    workers after T_bcast and they generate the next κ·R rollouts at the pool rate, taking
    κ·R/μ_pool more. The cycle lasts the slower of the two, max(κ·T_train, T_bcast + κ·R/μ_pool),
    and the learner is busy κ·T_train of it, so idle = 1 − κ·T_train / cycle: 0 when the overlap
    holds (rule 1), 1 when μ_pool = 0 (nothing ever arrives).

    Assumptions: steady state with constant T_train, T_bcast and μ_pool; every rollout is
    admissible (none dropped as stale or invalid); the whole pool generates on the newest version
    only after it has fully arrived (no pipelining of broadcast and generation); the learner
    needs all of a cycle's κ·R rollouts before it stops waiting (no partial-batch steps).
    `pipelined` (see `mu_min`): the workers do not wait for the version, so the cycle is
    max(κ·T_train, κ·R/μ_pool) and idle = max(0, 1 − μ_pool·T_train/R)."""
    k, r, tt, tb = _model(kappa, rollouts_per_update, t_train, t_bcast)
    pool = _number("mu_pool", mu_pool)
    if overlap_holds(k, r, tt, tb, pool, pipelined=pipelined):
        return 0.0
    if pool == 0:
        return 1.0
    cycle = max(k * tt, (0.0 if pipelined else tb) + k * r / pool)
    return 1.0 - k * tt / cycle


def groups_to_ask(*, mode: str, groups_per_step: int, kappa: int, buffered: int) -> int:
    """Groups the whole pool is asked to sample for a version just published (rule 7), >= 0.

    `buffered`: admissible groups the learner holds at the publication."""
    g = _count("groups_per_step", groups_per_step, 1)
    k = _count("kappa", kappa, 1)
    held = _count("buffered", buffered, 0)
    if mode == "pull":
        return g  # on-policy: only this version's rollouts count, one update's worth
    return max(0, g * (k + RESERVE_UPDATES) - held)


@dataclass(frozen=True, slots=True)
class KappaChoice:
    kappa: int
    delta_max: int
    warning: str | None  # why this κ is not the S − 1 asked for, or why it cannot avoid bubbles


def choose_kappa(staleness: int, t_train: float, t_bcast: float) -> KappaChoice:
    """κ for a staleness bound S (rule 3): the largest κ in 1..max(1, S − 1) with Δ_max(κ) <= S.

    That is S − 1 whenever T_bcast < T_train (S >= 2). A slower broadcast can force a smaller κ
    (warned); S = 0 admits nothing asynchronous and even κ = 1 has Δ_max = 1 > S (warned, κ = 1).
    Also warned: a κ with κ·T_train <= T_bcast, for which no pool avoids bubbles (`mu_min` = inf).
    """
    s = _count("staleness", staleness, 0)
    tt = _number("t_train", t_train, positive=True)
    tb = _number("t_bcast", t_bcast)
    warnings: list[str] = []
    if delta_max(1, tt, tb) > s:  # Δ_max(1) = 1 whatever the timing, so only S = 0 lands here
        kappa = 1
        warnings.append(f"Δ_max = 1 exceeds S = {s} even at κ = 1")
    else:
        # Δ_max is non-decreasing in κ (both of its terms are), so bisect for the largest fit;
        # a linear scan down from S − 1 would take about T_bcast/T_train steps.
        lo, hi = 1, max(1, s - 1)  # invariant: Δ_max(lo) <= S
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if delta_max(mid, tt, tb) <= s:
                lo = mid
            else:
                hi = mid - 1
        kappa = lo
        if kappa < s - 1:
            warnings.append(f"T_bcast = {tb:g} s >= T_train = {tt:g} s forces κ = {kappa} < S − 1 = {s - 1}")
    if kappa * tt <= tb:
        warnings.append(f"κ·T_train = {kappa * tt:g} s <= T_bcast = {tb:g} s: no pool avoids training bubbles")
    return KappaChoice(kappa, delta_max(kappa, tt, tb), "; ".join(warnings) or None)


def broadcast_bound(
    size_bytes: float, learner_up: float, peers_down: Sequence[float], peers_up: Sequence[float]
) -> float:
    """Seconds: the lower bound on broadcasting G bytes to N peers by any scheme (Kumar & Ross
    2006), max(G/b0, max_i G/d_i, N·G/(b0 + Σ u_i)): the source sends one full copy, the slowest
    downlink takes one in, and N copies leave through all uplinks together. Rates in bytes/s;
    benchmarks/wan/bound.py `bound_s` is the same bound in Mbit/s."""
    g = _number("size_bytes", size_bytes)
    b0 = _number("learner_up", learner_up, positive=True)
    if len(peers_down) != len(peers_up):
        raise ValueError(f"peers_down has {len(peers_down)} peers but peers_up has {len(peers_up)}")
    if not peers_down:
        raise ValueError("peers_down: the broadcast bound needs at least one receiving peer")
    downs = [_number(f"peers_down[{i}]", d, positive=True) for i, d in enumerate(peers_down)]
    ups = [_number(f"peers_up[{i}]", u) for i, u in enumerate(peers_up)]
    return max(g / b0, max(g / d for d in downs), len(downs) * g / (b0 + math.fsum(ups)))


def _pool(workers: Sequence[Worker]) -> list[Worker]:
    """The workers as a list; ValueError for a non-Worker or a peer id given twice (which of the
    two measurements would count?)."""
    pool = list(workers)
    seen: set[str] = set()
    for w in pool:
        if not isinstance(w, Worker):
            raise ValueError(f"workers must hold Worker objects, got {w!r}")
        if w.peer_id in seen:
            raise ValueError(f"workers: peer_id {w.peer_id!r} appears twice")
        seen.add(w.peer_id)
    return pool


def _rank(w: Worker) -> tuple[int, float, float, str]:
    """Cheapest first: measured workers by ρ = price/μ, ties to the higher μ (fewer workers for
    the same rate), then peer_id (deterministic); unmeasured ones (μ = 0: no ρ) after, by price."""
    if w.mu > 0:
        return (0, w.price / w.mu, -w.mu, w.peer_id)
    return (1, w.price, 0.0, w.peer_id)


def _rate(workers: Sequence[Worker]) -> float:
    # fsum: the total must not depend on the order workers are listed in.
    return math.fsum(w.mu for w in workers)


def _fill(chosen: list[Worker], candidates: Sequence[Worker], goal: float) -> int:
    """Append candidates in order to `chosen` until its rate reaches `goal`; how many were added."""
    added = 0
    for w in candidates:
        if _rate(chosen) >= goal:
            break
        chosen.append(w)
        added += 1
    return added


def _fill_count(chosen: list[Worker], candidates: Sequence[Worker], count: int) -> int:
    """Append candidates in order until `chosen` has `count` workers; how many were added."""
    more = list(candidates[: max(0, count - len(chosen))])
    chosen.extend(more)
    return len(more)


def cheapest_prefix(workers: Sequence[Worker], target: float) -> list[Worker]:
    """The shortest prefix of the workers ranked by ρ whose rate reaches `target`, in rank order;
    all of them when the pool falls short (rule 4).

    Gap to the optimum: the fractional covering knapsack is solved exactly by taking workers in
    ρ order, so the prefix without its last worker costs at most the optimum (the LP relaxation
    is a lower bound on the integer one); the prefix therefore costs at most optimum + the
    price of its last worker. No ratio bound holds: with a free worker of μ = 9, one of μ = 1000
    at price 1000 (ρ = 1) and one of μ = 1 at price 2 (ρ = 2), target 10, the prefix costs 1000
    and the optimum 2."""
    pool = _pool(workers)
    goal = _number("target", target, allow_inf=True)
    chosen: list[Worker] = []
    _fill(chosen, sorted(pool, key=_rank), goal)
    return chosen


def random_activation(workers: Sequence[Worker], target: float, rng: random.Random) -> list[Worker]:
    """The baseline without prices: capable workers (μ > 0) in random order until the rate
    reaches `target`; all capable ones when they fall short."""
    capable = [w for w in _pool(workers) if w.mu > 0]
    goal = _number("target", target, allow_inf=True)
    rng.shuffle(capable)
    chosen: list[Worker] = []
    _fill(chosen, capable, goal)
    return chosen


def optimal_cost(workers: Sequence[Worker], target: float) -> tuple[float, list[Worker]]:
    """The least Σ price over sets with Σ μ >= `target`, and one such set in rank order.

    Exact branch and bound over workers with μ > 0, in ρ order, include-first, pruned by the
    fractional (LP) cost of covering what is still missing; for pools of at most
    MAX_EXACT_WORKERS, to measure `cheapest_prefix` against. ValueError above that, or when the
    whole pool cannot reach the target."""
    pool = _pool(workers)
    if len(pool) > MAX_EXACT_WORKERS:
        raise ValueError(f"workers: optimal_cost takes at most {MAX_EXACT_WORKERS}, got {len(pool)}")
    goal = _number("target", target)
    useful = sorted((w for w in pool if w.mu > 0), key=_rank)  # μ = 0 only adds cost
    if _rate(useful) < goal:
        raise ValueError(f"target {goal:g}/s is above the whole pool's {_rate(useful):g}/s")

    def lp_bound(i: int, need: float) -> float:
        """Least fractional cost of `need` more rollouts/s from useful[i:] (ρ order is optimal);
        never inf: a branch that cannot reach the target is cut by the reach test instead."""
        cost = 0.0
        for w in useful[i:]:
            if w.mu >= need:
                return cost + need / w.mu * w.price
            cost += w.price
            need -= w.mu
        return cost

    best_cost: float = math.inf
    best: list[Worker] = []

    def search(i: int, chosen: list[Worker], cost: float) -> None:
        nonlocal best_cost, best
        have = _rate(chosen)
        if have >= goal:
            if cost < best_cost:
                best_cost, best = cost, list(chosen)
            return
        if _rate(chosen + useful[i:]) < goal or cost + lp_bound(i, goal - have) >= best_cost:
            return
        chosen.append(useful[i])
        search(i + 1, chosen, cost + useful[i].price)
        chosen.pop()
        search(i + 1, chosen, cost)

    search(0, [], 0.0)
    return math.fsum(w.price for w in best), best


# The cheapest covering set (rule 4), for `echo-node plan` and the live `Scheduler`.
# The cheapest set of workers whose rates reach the target is a covering knapsack (minimise
# Σ price subject to Σ μ >= target): NP-hard in general, easy at the sizes plans have. Rules:
# - Exact where the pool is small: a branch and bound over the measured workers (μ > 0) in ρ
#   order (price/μ), include-first, pruned by the fractional (LP) cost of what is still missing,
#   seeded with the greedy answer below; for at most EXACT_MAX_WORKERS measured workers, and
#   within EXACT_MAX_NODES search nodes (equal-ρ pools are its worst case: 20 such workers took
#   0.9 s in `protocol.capacity.optimal_cost`). Past either limit the greedy answer stands.
# - Greedy with a bound otherwise (`_dearest_guess`): at most the optimum plus the price of the
#   optimum's dearest worker, so never more than twice the optimum.
# - Workers with μ = 0 (not measured) only add cost: never chosen while the target can be met.
# - A pool that cannot reach the target (or an infinite target) gets every worker, as
#   `cheapest_prefix` does: each still shortens the learner's wait.
# - Everything here is linear or O(n log n) in the pool outside the exact search
#   (`cheapest_prefix` re-sums its prefix per step: quadratic over a 100,000-worker file).

EXACT_MAX_WORKERS = 24
EXACT_MAX_NODES = 500_000  # about 0.2 s of search


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen workers (cheapest ρ first) and how they were chosen: "exact" (proven
    cheapest), "greedy" (within the bound above) or "all" (the pool falls short)."""

    workers: list[Worker]
    method: Literal["exact", "greedy", "all"]


def _prefix(ranked: Sequence[Worker], goal: float) -> list[Worker]:
    """The shortest prefix of `ranked` whose rate reaches `goal` (all of it if none does)."""
    rate = 0.0
    for i, w in enumerate(ranked):
        if rate >= goal and _reaches(ranked[:i], goal):
            return list(ranked[:i])
        rate += w.mu
    return list(ranked)


def _cost(workers: Sequence[Worker]) -> float:
    return math.fsum(w.price for w in workers)


def _reaches(workers: Sequence[Worker], goal: float) -> bool:
    return math.fsum(w.mu for w in workers) >= goal


def cheapest_set(workers: Sequence[Worker], target: float) -> Choice:
    """The least-cost set of `workers` whose Σ μ reaches `target` (rules above)."""
    pool = list(workers)
    if math.isinf(target) or not _reaches(pool, target):
        return Choice(sorted(pool, key=_rank), "all")
    if target <= 0:
        return Choice([], "exact")
    useful = sorted((w for w in pool if w.mu > 0), key=_rank)
    best = _dearest_guess(useful, target)  # never dearer than the plain ρ prefix
    if len(useful) <= EXACT_MAX_WORKERS:
        found = _branch_and_bound(useful, target, best)
        if found is not None:
            return Choice(sorted(found, key=_rank), "exact")
    return Choice(sorted(best, key=_rank), "greedy")


def _branch_and_bound(useful: list[Worker], goal: float, seed: list[Worker]) -> list[Worker] | None:
    """The cheapest covering subset of `useful` (in ρ order), or None when the search passed
    EXACT_MAX_NODES before it proved its answer. `seed` covers the goal: the bound to beat."""
    n = len(useful)
    # Running sums over the ρ order: cum_mu[k] and cum_price[k] are over useful[:k].
    cum_mu = list(itertools.accumulate((w.mu for w in useful), initial=0.0))
    cum_price = list(itertools.accumulate((w.price for w in useful), initial=0.0))
    best = list(seed)
    best_cost = _cost(seed)
    chosen: list[Worker] = []
    nodes = 0

    def lp_cost(i: int, need: float) -> float:
        """The least fractional cost of `need` more from useful[i:] (ρ order is optimal for it):
        whole workers up to the one that completes it, then the share of that one it takes."""
        j = min(bisect.bisect_left(cum_mu, cum_mu[i] + need) - 1, n - 1)
        return cum_price[j] - cum_price[i] + (cum_mu[i] + need - cum_mu[j]) / useful[j].mu * useful[j].price

    def search(i: int, have: float, cost: float) -> bool:
        """False once the node budget is spent."""
        nonlocal best, best_cost, nodes
        nodes += 1
        if nodes > EXACT_MAX_NODES:
            return False
        if have >= goal and _reaches(chosen, goal):  # the running sum, then exactly
            if cost < best_cost:
                best, best_cost = list(chosen), cost
            return True
        if i == n or have + cum_mu[n] - cum_mu[i] < goal or cost + lp_cost(i, goal - have) >= best_cost:
            return True
        chosen.append(useful[i])
        if not search(i + 1, have + useful[i].mu, cost + useful[i].price):
            return False
        chosen.pop()
        return search(i + 1, have, cost)

    return best if search(0, 0.0, 0.0) else None


def _dearest_guess(useful: list[Worker], goal: float) -> list[Worker]:
    """Greedy with a bound, O(n log n): for each worker e taken as the dearest of the set, e plus
    the other workers no dearer than e in ρ order until the goal is reached; the cheapest of
    these sets, or the plain ρ prefix when none is cheaper. `useful` is in ρ order, every μ > 0,
    and the whole of it reaches `goal`.

    Bound: let O be a cheapest set and e its dearest worker. O − e reaches goal − μ_e with
    workers no dearer than e, so the fractional (LP) cost of reaching it in ρ order from those
    workers is at most c(O) − c_e; the integral ρ prefix exceeds that LP cost by at most its last
    worker's price, itself at most c_e. The set guessed from e therefore costs at most
    c_e + (c(O) − c_e) + c_e = c(O) + c_e <= 2·c(O), and the cheapest guess no more. Guesses
    in order of price stop at the first e with c_e >= the best cost so far (no set containing it
    can be cheaper): if that skips O's dearest worker, the best found already costs <= c(O).

    Rates and prices are summed in Fenwick trees over the ρ positions, so each guess is a
    prefix search in O(log n); the set found is then rebuilt and checked with exact sums."""
    n = len(useful)
    mu_tree = [0.0] * (n + 1)
    price_tree = [0.0] * (n + 1)

    def add(pos: int, mu: float, price: float) -> None:
        i = pos + 1
        while i <= n:
            mu_tree[i] += mu
            price_tree[i] += price
            i += i & -i

    top = 1 << n.bit_length()

    def shortest_prefix(need: float) -> tuple[int, float] | None:
        """(how many ρ positions, their price) for the first prefix whose rate reaches `need`."""
        pos, rate = 0, 0.0  # the longest prefix short of `need`: the next position completes it
        step = top
        while step:
            nxt = pos + step
            if nxt <= n and rate + mu_tree[nxt] < need:
                pos, rate = nxt, rate + mu_tree[nxt]
            step >>= 1
        if pos == n:
            return None
        count, price = pos + 1, 0.0
        while count > 0:
            price += price_tree[count]
            count -= count & -count
        return pos + 1, price

    position = {id(w): i for i, w in enumerate(useful)}
    by_price = sorted(useful, key=lambda w: (w.price, _rank(w)))
    best = _prefix(useful, goal)
    best_cost = _cost(best)
    best_guess: tuple[Worker, int] | None = None  # (e, positions taken)
    start = 0
    while start < n:
        price = by_price[start].price
        if price >= best_cost:
            break
        end = start
        while end < n and by_price[end].price == price:  # all workers no dearer than e are in
            add(position[id(by_price[end])], by_price[end].mu, by_price[end].price)
            end += 1
        for e in by_price[start:end]:
            need = goal - e.mu
            if need <= 0:
                found: tuple[int, float] | None = (0, 0.0)
            else:
                add(position[id(e)], -e.mu, -e.price)
                found = shortest_prefix(need)
                add(position[id(e)], e.mu, e.price)
            if found is not None and e.price + found[1] < best_cost:
                best_cost, best_guess = e.price + found[1], (e, found[0])
        start = end
    if best_guess is None:
        return best
    e, taken = best_guess
    rebuilt = [e] + [w for w in useful[:taken] if w is not e and w.price <= e.price]
    for w in useful[taken:]:  # the trees' rounding may have stopped one short of the goal
        if _reaches(rebuilt, goal):
            break
        if w is not e and w.price <= e.price:
            rebuilt.append(w)
    return rebuilt if _reaches(rebuilt, goal) and _cost(rebuilt) < _cost(best) else best



@dataclass(frozen=True, slots=True)
class Decision:
    active: frozenset[str]
    standby: frozenset[str]
    target: float  # γ·μ_min (inf if infeasible)
    mu_min: float
    mu_active: float  # Σ μ over the active set
    mu_pool: float  # Σ μ over every known worker
    cost_per_hour: float  # Σ price over the active set
    feasible: bool  # the whole pool reaches the target (and κ·T_train > T_bcast)
    changed: bool  # active set differs from the previous decision
    reason: str  # one short human line: why this set


class Scheduler:
    """Which workers to keep generating (rule 4), decided on a slow tick.

    State: the active set and the time of the last decision. `decide` returns None before the
    next tick unless the target is broken, i.e. an active worker left, or the active rate is
    below the target while some known worker is not active (one that could be added)."""

    def __init__(
        self, *, gamma: float = GAMMA, release_margin: float = 0.25, tick_s: float = 30.0, min_active: int = 1
    ) -> None:
        self.gamma = _number("gamma", gamma)
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (below μ_min the learner idles), got {gamma!r}")
        self.release_margin = _number("release_margin", release_margin)
        self.tick_s = _number("tick_s", tick_s)
        self.min_active = _count("min_active", min_active, 0)
        self._active: frozenset[str] = frozenset()
        self._last: float | None = None

    def decide(
        self,
        now: float,
        workers: Sequence[Worker],
        *,
        kappa: int,
        rollouts_per_update: float,
        t_train: float,
        t_bcast: float,
        pipelined: bool = False,
    ) -> Decision | None:
        """The active set for this pool and timing, or None before the next tick (see the class).

        Keep the active workers still known; add standby ones cheapest first (by ρ, unmeasured
        last) until the active rate reaches the target; top up to `min_active`; and only when
        the rate exceeds target·(1 + release_margin), release the most expensive (highest ρ)
        active workers whose departure keeps the rate at or above the target. Measured free
        workers (price 0, volunteers) are always active: they cost nothing and shorten the
        learner's waits. A pool that cannot reach the target is all active and reported
        infeasible."""
        if isinstance(now, bool) or not isinstance(now, numbers.Real) or not math.isfinite(now):
            raise ValueError(f"now must be a finite number, got {now!r}")
        pool = _pool(workers)
        floor = mu_min(kappa, rollouts_per_update, t_train, t_bcast, pipelined=pipelined)
        target = self.gamma * floor
        kept = sorted((w for w in pool if w.peer_id in self._active), key=_rank)
        broken = len(kept) < len(self._active) or (_rate(kept) < target and len(kept) < len(pool))
        if self._last is not None and now < self._last + self.tick_s and not broken:
            return None

        mu_pool = _rate(pool)
        feasible = math.isfinite(target) and mu_pool >= target
        active = list(kept)
        standby = [w for w in sorted(pool, key=_rank) if w.peer_id not in self._active]
        notes: list[str] = []
        if not pool:
            notes.append("no workers known")
        elif not feasible:
            # Everyone works: each worker still shortens the learner's wait (`predicted_idle`).
            why = (
                f"κ·T_train = {kappa * t_train:g} s <= T_bcast = {t_bcast:g} s, no pool avoids bubbles"
                if math.isinf(target)
                else f"the whole pool gives {mu_pool:.4g}/s < target {target:.4g}/s"
            )
            notes.append(f"infeasible: {why}; all {len(pool)} active")
        # A free worker (a volunteer) costs nothing to run: it is always active.
        free = [w for w in standby if w.price == 0 and w.mu > 0]
        active += free
        standby = [w for w in standby if w not in free]
        rate = _rate(active)
        added = _fill(active, standby, target)  # adding happens at once
        if added and feasible:
            notes.append(f"added {added} cheapest by price/μ: active {rate:.4g}/s was below target {target:.4g}/s")
        # min_active is a floor on the count whatever the rate (e.g. to keep someone measured).
        extra = _fill_count(active, standby[added:], self.min_active)
        if extra:
            notes.append(f"{extra} more for min_active = {self.min_active}")
        rate, ceiling = _rate(active), target * (1 + self.release_margin)
        if rate > ceiling:  # releasing only past the margin (hysteresis)
            released = 0
            for w in sorted(active, key=_rank, reverse=True):  # most expensive first
                if w.price == 0:
                    continue  # releasing a free worker saves nothing
                rest = [v for v in active if v is not w]
                if len(rest) >= self.min_active and _rate(rest) >= target:
                    active, released = rest, released + 1
            if released:
                notes.append(f"released {released} most expensive: active {rate:.4g}/s exceeded {ceiling:.4g}/s")
        if feasible:
            cost = math.fsum(w.price for w in active)
            best = [w for w in pool if w.price == 0 and w.mu > 0]
            rest = [w for w in pool if w not in best]
            choice = cheapest_set(rest, max(0.0, target - _rate(best)))
            best += choice.workers
            _fill_count(best, sorted((w for w in rest if w not in best), key=_rank), self.min_active)
            best_cost = math.fsum(w.price for w in best)
            # The first decision takes the cheapest set outright; later ones move to it only
            # past the margin (no churn for a few cents).
            first = not self._active
            if best_cost < cost * (1 - self.release_margin) or (first and best_cost < cost):
                how = "exact search" if choice.method == "exact" else "greedy within its bound"
                notes = [f"the cheapest set ({how}): {best_cost:.4g}/h instead of {cost:.4g}/h"]
                active = best
        if not notes:
            notes.append(f"kept: active {rate:.4g}/s covers target {target:.4g}/s within the release margin")

        ids = frozenset(w.peer_id for w in active)
        decision = Decision(
            active=ids,
            standby=frozenset(w.peer_id for w in pool) - ids,
            target=target,
            mu_min=floor,
            mu_active=_rate(active),
            mu_pool=mu_pool,
            cost_per_hour=math.fsum(w.price for w in active),
            feasible=feasible,
            changed=ids != self._active,
            reason="; ".join(notes),
        )
        self._active, self._last = ids, float(now)
        return decision
