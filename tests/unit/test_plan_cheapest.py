"""`echo-node plan` chooses the cheapest set of workers that meets the target: exact where the
pool is small, greedy within a stated bound otherwise; `--dtype-factor` scales `--model-bytes`;
an infeasible plan names the input that makes it so.

The case from issue 29: w1 ($0.40/h, 2/s), w2 ($2.50/h, 10/s), w3 ($0.75/h, 2.5/s), target 3.3/s.
By ρ = price/μ the order is w1 (0.20), w2 (0.25), w3 (0.30), so the ρ prefix took w1 and w2 for
$2.90/h, while w1 and w3 give 4.5/s for $1.15/h: the $0.75/h worker meets what the $2.50/h one
was taken for.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest

from echo_node.cli import main
from echo_node.plan import (
    MBIT,
    Candidate,
    cheapest_set,
    plan_from_inputs,
    plan_from_status,
)
from protocol import capacity as capacity_module
from protocol.capacity import Worker, cheapest_prefix

ISSUE_POOL = [Worker("w1", 2.0, 0.40), Worker("w2", 10.0, 2.50), Worker("w3", 2.5, 0.75)]
# T_train 10 s, T_bcast 8 s, κ 2, R 18: μ_min = 2·18/(20 − 8) = 3/s, target γ·μ_min = 3.3/s.
ISSUE_STATUS: dict[str, Any] = {
    "t_train": 10.0, "t_bcast": 8.0, "rollouts_per_update": 18, "staleness": 3, "kappa": 2,
    "workers": [{"peer_id": w.peer_id, "mu": w.mu, "price": w.price} for w in ISSUE_POOL],
}
CSV = "peer_id,mu,price,bandwidth_mbit,up_mbit\nw1,2,0.40,1000,1000\nw2,10,2.50,1000,1000\nw3,2.5,0.75,1000,1000\n"


def cost(workers: list[Worker]) -> float:
    return math.fsum(w.price for w in workers)


def optimum(workers: list[Worker], goal: float) -> tuple[float, tuple[Worker, ...]]:
    """Every subset: the least cost that reaches `goal`."""
    best: tuple[float, tuple[Worker, ...]] = (math.inf, ())
    for size in range(len(workers) + 1):
        for subset in itertools.combinations(workers, size):
            if math.fsum(w.mu for w in subset) >= goal and cost(list(subset)) < best[0]:
                best = (cost(list(subset)), subset)
    return best


def run_cli(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def test_the_issue_case_takes_the_075_worker_not_the_250_one() -> None:
    assert [w.peer_id for w in cheapest_prefix(ISSUE_POOL, 3.3)] == ["w1", "w2"]  # the old answer, $2.90/h
    plan = plan_from_status(ISSUE_STATUS)
    assert plan["target"] == pytest.approx(3.3)
    assert plan["chosen"] == ["w1", "w3"]  # cheapest ρ first
    assert plan["cost_per_hour"] == pytest.approx(1.15)
    assert plan["choice"] == "exact" and plan["feasible"] is True
    assert plan["reason"].startswith("the cheapest set (exact search): 2 of 3 give 4.5/s")


def test_the_issue_case_offline_through_the_cli(tmp_path: Path) -> None:
    csv = tmp_path / "pool.csv"
    csv.write_text(CSV)
    # 1 MB versions over 1000 Mbit/s links: T_bcast 8 ms; T_train 10 s, κ 2 (--kappa 2), R 30:
    # μ_min = 2·30/(20 − 0.008) ≈ 3.0/s, target ≈ 3.3/s, as above.
    code, out, _ = run_cli(["plan", "--candidates", str(csv), "--model-bytes", "1e6", "--learner-up", "1000",
                            "--t-train", "10", "--rollouts-per-update", "30", "--staleness", "3", "--kappa", "2", "--json"])
    assert code == 0
    plan = json.loads(out)
    assert plan["target"] == pytest.approx(3.3, abs=0.01)
    assert plan["chosen"] == ["w1", "w3"] and plan["cost_per_hour"] == pytest.approx(1.15)


def test_dtype_factor_scales_model_bytes(tmp_path: Path) -> None:
    """Issue 29: `--dtype-factor` had no effect with `--model-bytes`."""
    csv = tmp_path / "pool.csv"
    csv.write_text(CSV)
    base = ["plan", "--candidates", str(csv), "--model-bytes", "4e9", "--learner-up", "1000", "--t-train", "10", "--json"]
    plans = {}
    for factor in ("1", "0.5"):
        code, out, _ = run_cli([*base, "--dtype-factor", factor])
        assert code == 0
        plans[factor] = json.loads(out)
    assert plans["1"]["inputs"]["model_bytes"] == 4e9
    assert plans["0.5"]["inputs"]["model_bytes"] == 2e9  # bf16 publications of fp32 weights
    assert plans["0.5"]["t_bcast_bound_s"] == pytest.approx(plans["1"]["t_bcast_bound_s"] / 2)


def test_the_exact_search_matches_every_subset_on_random_pools() -> None:
    rng = random.Random(29)
    for _ in range(300):
        pool = [
            Worker(f"w{i}", rng.choice([0.0, rng.uniform(0.1, 10), float(rng.randint(1, 5))]),
                   rng.choice([0.0, rng.uniform(0, 3), float(rng.randint(0, 4))]))
            for i in range(rng.randint(1, 9))
        ]
        total = math.fsum(w.mu for w in pool)
        if total == 0:
            continue
        goal = rng.uniform(0.01, total)
        choice = cheapest_set(pool, goal)
        assert choice.method == "exact"
        assert math.fsum(w.mu for w in choice.workers) >= goal
        assert cost(choice.workers) == pytest.approx(optimum(pool, goal)[0], abs=1e-9)


def test_the_greedy_costs_at_most_the_optimum_plus_its_dearest_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity_module, "EXACT_MAX_WORKERS", 0)  # the greedy answer for every pool
    # capacity.cheapest_prefix's own counterexample: the ρ prefix pays 1000 where 2 suffice.
    pool = [Worker("free", 9, 0), Worker("big", 1000, 1000), Worker("small", 1, 2)]
    assert cost(cheapest_prefix(pool, 10)) == 1000
    choice = cheapest_set(pool, 10)
    assert choice.method == "greedy" and cost(choice.workers) == 2
    rng = random.Random(7)
    for _ in range(300):
        pool = [Worker(f"w{i}", rng.uniform(0.1, 10), rng.choice([0.0, rng.uniform(0, 3), 10 * rng.random()]))
                for i in range(rng.randint(1, 9))]
        goal = rng.uniform(0.01, math.fsum(w.mu for w in pool))
        best, subset = optimum(pool, goal)
        got = cheapest_set(pool, goal).workers
        assert math.fsum(w.mu for w in got) >= goal
        assert cost(got) <= best + max((w.price for w in subset), default=0.0) + 1e-9  # the docstring's bound
        assert cost(got) <= 2 * best + 1e-9
        assert cost(got) <= cost(cheapest_prefix(pool, goal)) + 1e-9  # never worse than the ρ prefix


def test_a_large_pool_is_planned_in_seconds() -> None:
    rng = random.Random(3)
    pool = [Worker(f"w{i}", rng.uniform(0.5, 10), rng.uniform(0.1, 3)) for i in range(20_000)]
    started = time.perf_counter()
    choice = cheapest_set(pool, 0.3 * math.fsum(w.mu for w in pool))
    assert time.perf_counter() - started < 10  # ~0.2 s here; the ρ prefix alone was quadratic
    assert choice.method == "greedy"
    assert math.fsum(w.mu for w in choice.workers) >= 0.3 * math.fsum(w.mu for w in pool)


def test_a_hard_small_pool_falls_back_to_the_bounded_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal ρ everywhere is the search's worst case: past its node budget the greedy stands."""
    monkeypatch.setattr(capacity_module, "EXACT_MAX_NODES", 1000)
    pool = [Worker(f"w{i}", 1 + i * 0.01, 1 + i * 0.01) for i in range(24)]
    choice = cheapest_set(pool, 10.005)
    assert choice.method == "greedy"
    assert math.fsum(w.mu for w in choice.workers) >= 10.005


def infeasible(**change: Any) -> dict[str, Any]:
    workers = [Candidate("a", 2, 1, bandwidth=1000 * MBIT, up=1000 * MBIT), Candidate("slow", 2, 1, bandwidth=10 * MBIT, up=MBIT)]
    args: dict[str, Any] = {"model_bytes": 1e9, "learner_up_mbit": 1000, "t_train": 10, "rollouts_per_update": 4,
                            "staleness": 3, "workers": workers, "pipelined": False}
    plan = plan_from_inputs(**{**args, **change})
    assert plan["feasible"] is False
    return plan


def test_an_infeasible_plan_names_the_input_that_makes_it_so() -> None:
    # 1 GB over a 100 Mbit/s learner uplink: 80 s per broadcast, κ·T_train = 10 s (κ 1 after auto).
    plan = infeasible(learner_up_mbit=100, workers=[Candidate("a", 2, 1, bandwidth=1000 * MBIT, up=1000 * MBIT)])
    assert "set by the learner uplink (--learner-up 100 Mbit/s)" in plan["reason"]
    assert "--learner-up above 800 Mbit/s" in plan["reason"]
    assert "versions under 1.25e+08 bytes" in plan["reason"] and "--t-train" in plan["reason"]
    # A worker's 10 Mbit/s downlink: 800 s per version, whatever the learner does.
    plan = infeasible()
    assert "the downlink of slow (10 Mbit/s in --candidates)" in plan["reason"]
    assert "(or slow left out)" in plan["reason"]
    # The pool: 2 rollouts/s against a target of 35.2.
    plan = infeasible(rollouts_per_update=64, workers=[Candidate("a", 2, 1, bandwidth=1000 * MBIT, up=1000 * MBIT)])
    assert "the whole pool gives 2/s < target" in plan["reason"]
    assert "needed from --candidates" in plan["reason"] and "--rollouts-per-update" in plan["reason"]
    assert plan["choice"] == "all"
