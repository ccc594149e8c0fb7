"""The swarm simulator: its clock, a small broadcast against the bound, the learner's idle time,
the real scheduler in the loop, and the rollout ledger under churn."""

from __future__ import annotations

import random

import pytest

from echo_node.sim import EventLoop, PeerSpec, SwarmConfig, run_swarm, simulate_broadcast
from protocol.capacity import Decision, broadcast_bound

MB = 1_000_000


def _pool(n: int, mu: float, *, down: float = 50 * MB, up: float = 50 * MB, price: float = 1.0) -> list[PeerSpec]:
    return [PeerSpec(f"w{i}", "test", mu=mu, price=price, down=down, up=up, lat=0.005) for i in range(n)]


# A small, fast run: 1 MiB weights, R = 32 rollouts per update of 2 s, a version every update.
FAST = SwarmConfig(
    model_bytes=1 << 20, learner_up=50 * MB, rollouts_per_update=32, t_train=2.0, kappa=1, staleness=3, batch=4,
    poisson=False, churn_per_hour=0.0, versions=20, tick_s=5.0, warmup_versions=3,
)


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(1.0, lambda: loop.after(0.5, seen.append, "a+"))
    loop.run()
    assert seen == ["a", "b", "a+", "c"] and loop.now == 2.0
    with pytest.raises(ValueError):
        loop.at(1.0, seen.append, "past")


def test_run_stops_at_until_and_when_told() -> None:
    loop = EventLoop()
    seen: list[int] = []
    for t in range(10):
        loop.at(float(t), seen.append, t)
    loop.run(until=3.0)
    assert seen == [0, 1, 2, 3] and loop.now == 3.0
    loop.run(stop=lambda: len(seen) == 6)
    assert seen == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_few_peers_on_symmetric_links_finish_at_about_the_bound(n: int) -> None:
    size, rate = 16 << 20, 10 * MB
    peers = [(rate, rate)] * n
    t = simulate_broadcast(size, rate, peers)
    bound = broadcast_bound(size, rate, [d for d, _ in peers], [u for _, u in peers])
    assert bound <= t <= 1.1 * bound


def test_a_broadcast_is_deterministic_for_a_seed_and_never_beats_the_bound() -> None:
    rng = random.Random(3)
    peers = [(rng.uniform(5, 20) * MB, rng.uniform(1, 5) * MB) for _ in range(12)]
    size = 2 << 20
    t = simulate_broadcast(size, 20 * MB, peers, seed=1, latency_s=0.01)
    assert t == simulate_broadcast(size, 20 * MB, peers, seed=1, latency_s=0.01)
    assert t >= broadcast_bound(size, 20 * MB, [d for d, _ in peers], [u for _, u in peers])


def test_a_big_pool_keeps_the_learner_busy() -> None:
    # 4 workers at 40/s = 160/s against the 16/s one update every 2 s consumes.
    result = run_swarm(FAST, _pool(4, 40.0))
    assert result.idle_sim < 0.03
    assert result.idle_pred == 0.0


def test_a_small_pool_idles_the_learner_by_what_it_lacks() -> None:
    # 4 workers at 1.2/s = 4.8/s: an update's 32 rollouts take 6.7 s to generate, 2 s to train.
    pool = _pool(4, 1.2)
    result = run_swarm(FAST, pool)
    throughput_bound = 1 - 4.8 * FAST.t_train / FAST.rollouts_per_update
    assert abs(result.idle_sim - throughput_bound) < 0.05
    assert abs(result.idle_sim - result.idle_pred) < 0.1


def test_the_scheduler_in_the_loop_is_the_real_one() -> None:
    # Cheap slow workers and dear fast ones: the cost-aware scheduler activates only what it needs.
    pool = _pool(6, 10.0, price=0.2) + [
        PeerSpec(f"h{i}", "test", mu=40.0, price=5.0, down=50 * MB, up=50 * MB, lat=0.005) for i in range(3)
    ]
    result = run_swarm(FAST, pool)
    assert result.decisions and all(isinstance(d, Decision) for d in result.decisions)
    last = result.decisions[-1]
    assert last.active and last.standby and all(p.startswith("w") for p in last.active)
    assert result.timeline[-1]["active"] == len(last.active)
    assert result.cost_per_hour_mean == pytest.approx(last.cost_per_hour, rel=0.01)


def test_churn_keeps_the_rollout_ledger_whole() -> None:
    cfg = SwarmConfig(**{**FAST.__dict__, "churn_per_hour": 400.0, "versions": 25, "seed": 7, "poisson": True})
    joiner_rng_ids: list[str] = []

    def joiner(rng: random.Random, peer_id: str) -> PeerSpec:
        joiner_rng_ids.append(peer_id)
        return PeerSpec(peer_id, "test", mu=rng.uniform(2, 8), price=1.0, down=50 * MB, up=50 * MB, lat=0.005)

    result = run_swarm(cfg, _pool(6, 5.0), joiner=joiner)
    g = result.ledger
    assert result.churn["left"] > 3 and result.churn["joined"] > 3 and joiner_rng_ids
    assert g["received"] == g["trained"] + g["stale"] + g["buffered"] + g["training"]
    assert g["sent"] >= g["received"] and g["trained"] > 0
    assert all(b.t_all is not None for b in result.broadcasts[:-1])
