"""ECHO-2's capacity model and the cost-aware scheduler (protocol/capacity.py): hand-worked
formulas, exact activation sets, hysteresis and ticks, greedy against the exact optimum, and
hostile inputs."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from benchmarks.wan.bound import bound_s
from protocol.capacity import (
    GAMMA,
    Scheduler,
    Worker,
    broadcast_bound,
    cheapest_prefix,
    choose_kappa,
    delta_max,
    mu_min,
    optimal_cost,
    overlap_holds,
    predicted_idle,
    random_activation,
)

MBIT = 1e6 / 8  # bytes/s in one Mbit/s

# ---------------------------------------------------------------- formulas, worked by hand


def test_mu_min_and_delta_max_worked_example() -> None:
    # R = 64, T_train = 2 s, κ = 3, T_bcast = 1.5 s:
    # μ_min = κ·R / (κ·T_train − T_bcast) = 192 / (6 − 1.5) = 42.67 rollouts/s
    assert mu_min(3, 64, 2.0, 1.5) == pytest.approx(192 / 4.5)
    assert mu_min(3, 64, 2.0, 1.5) == pytest.approx(42.6667, abs=1e-4)
    # Δ_max = κ + ⌈(1 − 1/κ)·T_bcast/T_train⌉ = 3 + ⌈(2/3)·0.75⌉ = 3 + ⌈0.5⌉ = 4
    assert delta_max(3, 2.0, 1.5) == 4


def test_mu_min_is_inf_when_the_broadcast_outlasts_kappa_updates() -> None:
    assert mu_min(1, 64, 2.0, 2.0) == math.inf  # κ·T_train = 2 = T_bcast: no time left to generate
    assert mu_min(2, 64, 1.0, 3.0) == math.inf  # 2 < 3
    assert mu_min(4, 64, 1.0, 3.0) == pytest.approx(4 * 64 / 1.0)  # 4 − 3 = 1 s: 256/s
    assert not overlap_holds(1, 64, 2.0, 2.0, mu_pool=1e12)


def test_delta_max_edges() -> None:
    assert delta_max(1, 1.0, 100.0) == 1  # (1 − 1/1) = 0: κ = 1 is never stale past one version
    assert delta_max(5, 1.0, 0.0) == 5  # instant broadcast: Δ_max = κ
    assert delta_max(3, 1.0, 3.0) == 5  # 3 + ⌈(2/3)·3⌉ = 3 + 2, an exact integer is not rounded up
    # 2 + ⌈0.5·4.2/0.3⌉ = 2 + 7; floats give 7.000000000000001 and would say 10.
    assert delta_max(2, 0.3, 4.2) == 9


def test_overlap_holds_exactly_from_mu_min_up() -> None:
    floor = mu_min(3, 64, 2.0, 1.5)
    assert overlap_holds(3, 64, 2.0, 1.5, floor)
    assert overlap_holds(3, 64, 2.0, 1.5, 100.0)
    assert not overlap_holds(3, 64, 2.0, 1.5, floor * (1 - 1e-9))
    assert not overlap_holds(3, 64, 2.0, 1.5, 0.0)


def test_predicted_idle_at_below_and_above_mu_min() -> None:
    floor = mu_min(3, 64, 2.0, 1.5)
    assert predicted_idle(3, 64, 2.0, 1.5, floor) == 0.0
    assert predicted_idle(3, 64, 2.0, 1.5, 2 * floor) == 0.0
    # μ_pool = 32/s: cycle = max(6, 1.5 + 192/32) = max(6, 7.5) = 7.5 s; idle = 1 − 6/7.5 = 0.2
    assert predicted_idle(3, 64, 2.0, 1.5, 32.0) == pytest.approx(0.2)
    assert predicted_idle(3, 64, 2.0, 1.5, 0.0) == 1.0
    # Infeasible κ = 1, T_train = 1, T_bcast = 2, R = 10, μ = 10: cycle = 2 + 1 = 3 s, idle = 2/3
    assert predicted_idle(1, 10, 1.0, 2.0, 10.0) == pytest.approx(2 / 3)
    # More workers always help, even where no pool is enough.
    assert predicted_idle(1, 10, 1.0, 2.0, 100.0) < predicted_idle(1, 10, 1.0, 2.0, 10.0)


# ---------------------------------------------------------------- choosing κ


def test_choose_kappa_is_s_minus_one_when_the_broadcast_is_faster_than_an_update() -> None:
    choice = choose_kappa(4, 2.0, 1.5)
    assert (choice.kappa, choice.delta_max, choice.warning) == (3, 4, None)
    assert choose_kappa(1, 2.0, 1.5) == choose_kappa(1, 2.0, 0.0)  # S = 1: κ = 1, Δ_max = 1
    assert (choose_kappa(1, 2.0, 1.5).kappa, choose_kappa(1, 2.0, 1.5).warning) == (1, None)


def test_choose_kappa_takes_a_smaller_kappa_for_a_slow_broadcast_with_a_warning() -> None:
    # S = 6, T_train = 1, T_bcast = 2: κ = 5 gives 5 + ⌈0.8·2⌉ = 7 > 6; κ = 4 gives 4 + ⌈0.75·2⌉ = 6.
    choice = choose_kappa(6, 1.0, 2.0)
    assert (choice.kappa, choice.delta_max) == (4, 6)
    assert choice.warning is not None and "κ = 4 < S − 1 = 5" in choice.warning
    # T_bcast = T_train is not slow enough to force anything: 4 + ⌈0.75⌉ = 5 <= S = 5.
    assert choose_kappa(5, 1.0, 1.0) == choose_kappa(5, 1.0, 0.5)
    assert choose_kappa(5, 1.0, 1.0).warning is None


def test_choose_kappa_warns_when_no_pool_can_avoid_bubbles_or_s_is_zero() -> None:
    # S = 2: κ = 1 = S − 1, Δ_max = 1, but κ·T_train = 1 <= T_bcast = 1.5: μ_min = inf.
    choice = choose_kappa(2, 1.0, 1.5)
    assert (choice.kappa, choice.delta_max) == (1, 1)
    assert choice.warning is not None and "no pool" in choice.warning
    zero = choose_kappa(0, 2.0, 1.0)
    assert (zero.kappa, zero.delta_max) == (1, 1)
    assert zero.warning is not None and "exceeds S = 0" in zero.warning


def test_choose_kappa_is_the_largest_fit_by_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(200):
        s, tt, tb = rng.randint(1, 12), rng.uniform(0.1, 3.0), rng.uniform(0.0, 8.0)
        fits = [k for k in range(1, max(1, s - 1) + 1) if delta_max(k, tt, tb) <= s]
        assert choose_kappa(s, tt, tb).kappa == max(fits)  # κ = 1 always fits when S >= 1


def test_choose_kappa_is_fast_for_huge_ratios() -> None:
    choice = choose_kappa(10**9, 1.0, 1e6)  # bisection, not 10^6 steps down from S − 1
    assert choice.delta_max <= 10**9 < delta_max(choice.kappa + 1, 1.0, 1e6)


# ---------------------------------------------------------------- broadcast bound


def test_broadcast_bound_worked_example() -> None:
    # G = 100 MB; source 100 Mbit/s = 12.5 MB/s; downlinks 50/100/200 Mbit/s; uplinks 10/20/30.
    # G/b0 = 8 s; slowest downlink 1e8/6.25e6 = 16 s; 3·1e8/(12.5e6 + 7.5e6) = 15 s -> 16 s.
    downs, ups = [50 * MBIT, 100 * MBIT, 200 * MBIT], [10 * MBIT, 20 * MBIT, 30 * MBIT]
    assert broadcast_bound(1e8, 100 * MBIT, downs, ups) == pytest.approx(16.0)
    # Fast downlinks: the capacity term binds, 15 s.
    assert broadcast_bound(1e8, 100 * MBIT, [1000 * MBIT] * 3, ups) == pytest.approx(15.0)


def test_broadcast_bound_matches_the_wan_benchmark_bound_in_mbit() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(1, 8)
        g = rng.randint(1, 10**10)
        b0 = rng.uniform(1, 1000)
        up = [rng.uniform(0, 1000) for _ in range(n)]
        down = [rng.uniform(1, 1000) for _ in range(n)]
        ours = broadcast_bound(g, b0 * MBIT, [d * MBIT for d in down], [u * MBIT for u in up])
        assert ours == pytest.approx(bound_s(g, b0, up, down), rel=1e-12)


# ---------------------------------------------------------------- the scheduler

# κ = 1, R = 10, T_train = 1 s, T_bcast = 0: μ_min = 10/s, target = γ·μ_min = 11/s,
# release only above 11·1.25 = 13.75/s.
MODEL = {"kappa": 1, "rollouts_per_update": 10, "t_train": 1.0, "t_bcast": 0.0}
TARGET = GAMMA * 10


def pool(**mu_price: tuple[float, float]) -> list[Worker]:
    return [Worker(pid, mu, price) for pid, (mu, price) in mu_price.items()]


# ρ = price/μ: a 0.1, b 0.2, c 0.3, d 0.4; u is not measured yet.
BASE = {"a": (5.0, 0.5), "b": (5.5, 1.1), "c": (1.0, 0.3), "d": (10.0, 4.0), "u": (0.0, 0.0)}


def test_first_decision_is_the_cheapest_prefix() -> None:
    # a 5 -> a+b 10.5 < 11 -> a+b+c 11.5 >= 11: {a, b, c}, 1.9/h.
    decision = Scheduler().decide(0.0, pool(**BASE), **MODEL)
    assert decision is not None
    assert decision.active == {"a", "b", "c"} and decision.standby == {"d", "u"}
    assert decision.mu_min == pytest.approx(10.0) and decision.target == pytest.approx(TARGET)
    assert decision.mu_active == pytest.approx(11.5) and decision.mu_pool == pytest.approx(21.5)
    assert decision.cost_per_hour == pytest.approx(1.9)
    assert decision.feasible and decision.changed and "added 3" in decision.reason
    assert [w.peer_id for w in cheapest_prefix(pool(**BASE), TARGET)] == ["a", "b", "c"]


def test_hysteresis_keeps_at_plus_ten_percent_and_releases_at_plus_thirty() -> None:
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)
    # a measured faster: 5.6 + 5.5 + 1 = 12.1 = target + 10 %. Releasing c would still leave
    # 11.1 >= 11, but 12.1 <= 13.75: kept.
    plus10 = sched.decide(30.0, pool(**{**BASE, "a": (5.6, 0.5)}), **MODEL)
    assert plus10 is not None and plus10.active == {"a", "b", "c"} and not plus10.changed
    assert plus10.mu_active == pytest.approx(1.1 * TARGET) and plus10.reason.startswith("kept")
    # 7.8 + 5.5 + 1 = 14.3 = target + 30 % > 13.75: release by highest ρ while >= 11:
    # c (ρ 0.3) leaves 13.3, yes; b (0.2) would leave 7.8, no; a would leave 6.5, no.
    plus30 = sched.decide(60.0, pool(**{**BASE, "a": (7.8, 0.5)}), **MODEL)
    assert plus30 is not None and plus30.active == {"a", "b"} and plus30.changed
    assert plus30.mu_active == pytest.approx(13.3) and "released 1" in plus30.reason


def test_no_decision_before_the_tick_while_the_target_holds() -> None:
    sched = Scheduler(tick_s=30.0)
    assert sched.decide(0.0, pool(**BASE), **MODEL) is not None
    joined = pool(**BASE, n=(50.0, 0.1))  # a far cheaper newcomer: not worth churn mid-tick
    assert sched.decide(29.9, joined, **MODEL) is None
    at_tick = sched.decide(30.0, joined, **MODEL)
    # At the tick the newcomer alone covers the target for 0.1/h instead of 1.9/h: the active
    # set becomes the cheapest set.
    assert at_tick is not None and at_tick.active == {"n"} and at_tick.changed
    assert at_tick.cost_per_hour == pytest.approx(0.1) and "the cheapest set" in at_tick.reason
    assert sched.decide(59.9, joined, **MODEL) is None  # the tick restarts at each decision


def test_a_cheaper_set_replaces_the_active_one_only_past_the_margin() -> None:
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)  # {a, b, c}: 1.9/h
    # d becomes cheap: the cheapest set {c, d} (1 + 10 >= 11) costs 0.3 + 1.2 = 1.5/h, 21 %
    # less: within the 25 % margin, kept.
    slightly = sched.decide(30.0, pool(**{**BASE, "d": (10.0, 1.2)}), **MODEL)
    assert slightly is not None and slightly.active == {"a", "b", "c"} and not slightly.changed
    # At 0.4/h {c, d} costs 0.7/h, 63 % less: switched. (The ρ prefix, {d, a}, costs 0.9/h:
    # the exact search finds the set the prefix misses.)
    cheaper = sched.decide(60.0, pool(**{**BASE, "d": (10.0, 0.4)}), **MODEL)
    assert cheaper is not None and cheaper.active == {"c", "d"} and cheaper.changed
    assert cheaper.cost_per_hour == pytest.approx(0.7) and "exact search" in cheaper.reason


def test_an_active_worker_leaving_forces_an_immediate_decision() -> None:
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)
    without_b = pool(**{k: v for k, v in BASE.items() if k != "b"})
    # a + c = 6 < 11: add d (next by ρ) -> 16 > 13.75: release c (leaves 15), not a (leaves 10).
    decision = sched.decide(1.0, without_b, **MODEL)
    assert decision is not None and decision.active == {"a", "d"} and decision.changed
    assert "added 1" in decision.reason and "released 1" in decision.reason
    # A departure forces a decision even when the rest still covers the target: a + b = 14.5.
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)
    decision = sched.decide(1.0, pool(**{k: v for k, v in BASE.items() if k != "c"} | {"a": (9.0, 0.5)}), **MODEL)
    assert decision is not None and decision.active == {"a", "b"}


def test_capacity_falling_below_the_target_forces_an_immediate_decision() -> None:
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)
    # a measured at 4/s: 10.5 < 11. Add d -> 20.5 > 13.75; release by highest ρ while >= 11:
    # d would leave 10.5, no; c leaves 19.5, yes; b leaves 14, yes; a would leave 10, no.
    decision = sched.decide(1.0, pool(**{**BASE, "a": (4.0, 0.5)}), **MODEL)
    assert decision is not None and decision.active == {"a", "d"}
    assert decision.cost_per_hour == pytest.approx(4.5) and decision.feasible


def test_an_infeasible_pool_is_all_active_and_reported() -> None:
    short = Scheduler().decide(0.0, pool(x=(3.0, 1.0), y=(4.0, 9.0), u=(0.0, 2.0)), **MODEL)
    assert short is not None and short.active == {"x", "y", "u"} and not short.feasible
    assert "infeasible" in short.reason and short.mu_pool == pytest.approx(7.0)
    # κ·T_train = 1 <= T_bcast = 1: no pool is enough; target and μ_min are inf.
    slow = Scheduler().decide(0.0, pool(**BASE), **{**MODEL, "t_bcast": 1.0})
    assert slow is not None and slow.active == set(BASE) and not slow.feasible
    assert slow.target == math.inf and slow.mu_min == math.inf and "T_bcast" in slow.reason
    empty = Scheduler().decide(0.0, [], **MODEL)
    assert empty is not None and empty.active == frozenset() and not empty.feasible
    assert empty.reason == "no workers known"


def test_an_infeasible_pool_re_decides_only_when_someone_can_be_added() -> None:
    sched = Scheduler(tick_s=30.0)
    short = pool(x=(3.0, 1.0), y=(4.0, 9.0))
    sched.decide(0.0, short, **MODEL)
    assert sched.decide(1.0, short, **MODEL) is None  # everyone already works
    joined = sched.decide(2.0, short + pool(z=(5.0, 1.0)), **MODEL)  # 12 >= 11 now
    assert joined is not None and joined.active == {"x", "y", "z"} and joined.feasible


def test_min_active_is_a_floor_on_the_count() -> None:
    # big alone covers 11; min_active = 2 adds the next by ρ (small, 0.5) and forbids releasing
    # it although 22 > 13.75.
    workers = pool(big=(20.0, 1.0), small=(2.0, 1.0), x=(3.0, 3.0))
    decision = Scheduler(min_active=2).decide(0.0, workers, **MODEL)
    assert decision is not None and decision.active == {"big", "small"} and "min_active" in decision.reason
    assert Scheduler(min_active=1).decide(0.0, workers, **MODEL).active == {"big"}  # type: ignore[union-attr]
    few = Scheduler(min_active=5).decide(0.0, workers, **MODEL)
    assert few is not None and few.active == {"big", "small", "x"}  # all there are


def test_unmeasured_workers_go_last_ranked_by_price() -> None:
    workers = pool(u_dear=(0.0, 5.0), u_free=(0.0, 0.0), m=(12.0, 100.0))
    decision = Scheduler().decide(0.0, workers, **MODEL)
    assert decision is not None and decision.active == {"m"}  # free, but no measured rate
    order = cheapest_prefix(pool(u_dear=(0.0, 5.0), u_free=(0.0, 0.0), m=(3.0, 100.0)), TARGET)
    assert [w.peer_id for w in order] == ["m", "u_free", "u_dear"]


def test_ties_in_price_per_rate_go_to_the_faster_worker_then_the_peer_id() -> None:
    workers = pool(z=(4.0, 0.4), y=(8.0, 0.8), x=(4.0, 0.4))  # ρ = 0.1 for all three
    assert [w.peer_id for w in cheapest_prefix(workers, 100.0)] == ["y", "x", "z"]


def test_decision_fields_add_up() -> None:
    rng = random.Random(11)
    sched = Scheduler(tick_s=0.0)
    for t in range(30):
        workers = [Worker(f"p{i}", rng.choice([0.0, rng.uniform(0.1, 8)]), rng.uniform(0, 5)) for i in range(6)]
        d = sched.decide(float(t), workers, **MODEL)
        assert d is not None
        by_id = {w.peer_id: w for w in workers}
        assert d.active | d.standby == set(by_id) and not d.active & d.standby
        assert d.mu_active == pytest.approx(sum(by_id[p].mu for p in d.active))
        assert d.cost_per_hour == pytest.approx(sum(by_id[p].price for p in d.active))
        assert d.feasible == (d.mu_pool >= d.target)
        assert (d.mu_active >= d.target) if d.feasible else d.active == set(by_id)


# ---------------------------------------------------------------- greedy, random, optimal


def test_optimal_cost_matches_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(100):
        workers = [Worker(f"p{i}", rng.uniform(0.5, 20), rng.uniform(0, 10)) for i in range(rng.randint(1, 7))]
        target = rng.uniform(0.1, 1.0) * sum(w.mu for w in workers)
        brute = min(
            sum(w.price for w in combo)
            for n in range(len(workers) + 1)
            for combo in itertools.combinations(workers, n)
            if math.fsum(w.mu for w in combo) >= target
        )
        cost, chosen = optimal_cost(workers, target)
        assert cost == pytest.approx(brute, abs=1e-9)
        assert math.fsum(w.mu for w in chosen) >= target


def test_greedy_is_within_the_last_workers_price_of_optimal() -> None:
    # cost(prefix) <= OPT + price of its last worker: the prefix minus that worker is part of the
    # fractional optimum (ρ order), which costs no more than the integer OPT.
    rng = random.Random(1)
    for _ in range(300):
        workers = [
            Worker(f"p{i}", rng.choice([0.0, *[rng.uniform(0.5, 20)] * 4]), rng.choice([0.0, rng.uniform(0, 10)]))
            for i in range(rng.randint(1, 12))
        ]
        capable = math.fsum(w.mu for w in workers)
        if capable == 0:
            continue
        target = rng.uniform(0.05, 1.0) * capable
        greedy = cheapest_prefix(workers, target)
        g_cost = math.fsum(w.price for w in greedy)
        opt, _ = optimal_cost(workers, target)
        assert opt - 1e-9 <= g_cost <= opt + greedy[-1].price + 1e-9


def test_greedy_has_no_constant_ratio_to_optimal() -> None:
    # A free worker of 9/s, then by ρ: 1000/s at 1000/h (ρ 1), 1/s at 2/h (ρ 2); target 10/s.
    workers = pool(free=(9.0, 0.0), big=(1000.0, 1000.0), small=(1.0, 2.0))
    assert [w.peer_id for w in cheapest_prefix(workers, 10.0)] == ["free", "big"]  # 1000/h
    assert optimal_cost(workers, 10.0) == (2.0, [Worker("free", 9.0, 0.0), Worker("small", 1.0, 2.0)])


def test_random_activation_is_the_priceless_baseline() -> None:
    workers = pool(**BASE)
    chosen = random_activation(workers, TARGET, random.Random(0))
    assert math.fsum(w.mu for w in chosen) >= TARGET and all(w.mu > 0 for w in chosen)
    assert chosen == random_activation(workers, TARGET, random.Random(0))  # seeded: repeatable
    assert {w.peer_id for w in random_activation(workers, 1e9, random.Random(0))} == {"a", "b", "c", "d"}
    rng = random.Random(2)
    costs = [math.fsum(w.price for w in random_activation(workers, TARGET, rng)) for _ in range(200)]
    assert min(costs) >= optimal_cost(workers, TARGET)[0] - 1e-9
    assert sum(costs) / len(costs) > math.fsum(w.price for w in cheapest_prefix(workers, TARGET))


def test_optimal_cost_limits() -> None:
    with pytest.raises(ValueError, match="at most 20"):
        optimal_cost([Worker(f"p{i}", 1.0, 1.0) for i in range(21)], 1.0)
    with pytest.raises(ValueError, match="above the whole pool"):
        optimal_cost(pool(x=(1.0, 1.0)), 2.0)
    assert optimal_cost(pool(x=(1.0, 1.0)), 0.0) == (0.0, [])
    twenty = [Worker(f"p{i:02}", 1.0 + i % 7, 1.0 + (i * 37) % 11) for i in range(20)]
    cost, chosen = optimal_cost(twenty, 40.0)  # the largest size allowed, still quick
    assert math.fsum(w.mu for w in chosen) >= 40.0 and cost <= math.fsum(w.price for w in cheapest_prefix(twenty, 40.0))


# ---------------------------------------------------------------- hostile and invalid inputs


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, "3", True, None, 10**400])
@pytest.mark.parametrize("field", ["mu", "price", "bandwidth"])
def test_worker_rejects_non_finite_negative_and_non_numbers(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"peer_id": "p", "mu": 1.0, "price": 1.0, "bandwidth": 1.0}
    kwargs[field] = bad
    if field == "bandwidth" and bad is None:
        assert Worker(**kwargs).bandwidth is None  # type: ignore[arg-type]  # None = unknown
        return
    with pytest.raises(ValueError, match=field):
        Worker(**kwargs)  # type: ignore[arg-type]


def test_worker_fields_are_normalised_floats_and_ids_must_be_strings() -> None:
    assert Worker("p", 3, 0) == Worker("p", 3.0, 0.0) and isinstance(Worker("p", 3, 0).mu, float)
    for bad_id in ("", None, 7):
        with pytest.raises(ValueError, match="peer_id"):
            Worker(bad_id, 1.0, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 64, 2.0, 1.5), "kappa"),
        ((1.5, 64, 2.0, 1.5), "kappa"),
        ((True, 64, 2.0, 1.5), "kappa"),
        ((3, 0, 2.0, 1.5), "rollouts_per_update"),
        ((3, math.nan, 2.0, 1.5), "rollouts_per_update"),
        ((3, 64, 0.0, 1.5), "t_train"),
        ((3, 64, -2.0, 1.5), "t_train"),
        ((3, 64, math.inf, 1.5), "t_train"),
        ((3, 64, 2.0, -0.1), "t_bcast"),
        ((3, 64, 2.0, math.nan), "t_bcast"),
    ],
)
def test_model_functions_name_the_bad_argument(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        mu_min(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        predicted_idle(*args, 10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        Scheduler().decide(0.0, [], kappa=args[0], rollouts_per_update=args[1], t_train=args[2], t_bcast=args[3])  # type: ignore[arg-type]


def test_other_bad_arguments_are_named() -> None:
    for mu_pool in (math.nan, -1.0, math.inf):
        with pytest.raises(ValueError, match="mu_pool"):
            overlap_holds(3, 64, 2.0, 1.5, mu_pool)
    with pytest.raises(ValueError, match="staleness"):
        choose_kappa(-1, 1.0, 1.0)
    with pytest.raises(ValueError, match="kappa"):
        delta_max(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="peers_up"):
        broadcast_bound(1e6, 1e6, [1e6, 1e6], [1e6])
    with pytest.raises(ValueError, match="at least one"):
        broadcast_bound(1e6, 1e6, [], [])
    with pytest.raises(ValueError, match="learner_up"):
        broadcast_bound(1e6, 0.0, [1e6], [1e6])
    with pytest.raises(ValueError, match=r"peers_down\[1\]"):
        broadcast_bound(1e6, 1e6, [1e6, math.nan], [1e6, 1e6])
    with pytest.raises(ValueError, match=r"peers_up\[0\]"):
        broadcast_bound(1e6, 1e6, [1e6], [-1.0])
    with pytest.raises(ValueError, match="size_bytes"):
        broadcast_bound(math.inf, 1e6, [1e6], [1e6])
    for target in (math.nan, -1.0):
        with pytest.raises(ValueError, match="target"):
            cheapest_prefix(pool(**BASE), target)
        with pytest.raises(ValueError, match="target"):
            random_activation(pool(**BASE), target, random.Random(0))
    with pytest.raises(ValueError, match="target"):
        optimal_cost(pool(**BASE), math.inf)
    for kwargs in ({"gamma": 0.9}, {"gamma": math.nan}, {"release_margin": -0.1}, {"tick_s": math.inf}, {"min_active": -1}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            Scheduler(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="now"):
        Scheduler().decide(math.nan, pool(**BASE), **MODEL)


def test_a_pool_with_a_duplicate_or_a_foreign_object_is_refused() -> None:
    twice = [*pool(**BASE), Worker("a", 100.0, 0.0)]  # which of a's two rates is true?
    with pytest.raises(ValueError, match="appears twice"):
        Scheduler().decide(0.0, twice, **MODEL)
    with pytest.raises(ValueError, match="appears twice"):
        cheapest_prefix(twice, 1.0)
    with pytest.raises(ValueError, match="Worker"):
        cheapest_prefix([*pool(**BASE), ("x", 1.0, 1.0)], 1.0)  # type: ignore[list-item]


def test_a_rejected_call_leaves_the_scheduler_as_it_was() -> None:
    sched = Scheduler(tick_s=30.0)
    sched.decide(0.0, pool(**BASE), **MODEL)
    with pytest.raises(ValueError):
        sched.decide(1.0, [*pool(**BASE), Worker("a", 1.0, 1.0)], **MODEL)
    assert sched.decide(2.0, pool(**BASE), **MODEL) is None  # still on the tick from t = 0


def test_the_pool_is_asked_for_what_the_learner_will_train_less_what_it_holds() -> None:
    """Rule 7: async asks for κ updates plus one in reserve, minus the admissible buffer (never
    below 0); pull for one update whatever is buffered (nothing survives a version there)."""
    from protocol.capacity import RESERVE_UPDATES, groups_to_ask

    assert RESERVE_UPDATES == 1
    assert groups_to_ask(mode="async", groups_per_step=8, kappa=1, buffered=0) == 16
    assert groups_to_ask(mode="async", groups_per_step=8, kappa=4, buffered=8) == 32
    assert groups_to_ask(mode="async", groups_per_step=8, kappa=1, buffered=40) == 0
    assert groups_to_ask(mode="pull", groups_per_step=8, kappa=1, buffered=5) == 8
    for bad in ({"groups_per_step": 0}, {"kappa": 0}, {"buffered": -1}):
        with pytest.raises(ValueError):
            groups_to_ask(**{"mode": "async", "groups_per_step": 8, "kappa": 1, "buffered": 0, **bad})
