"""The learner's capacity controller (echo_node/learner/capacity_controller.py) on hand-made measurements: peers'
throughput is the rate at which the learner accepted their work while they had work, T_bcast
comes from heartbeats, standby follows the real scheduler's decisions, and nobody stands by
before it was measured."""

from __future__ import annotations

import pytest

from echo_node.config import CapacityConfig
from echo_node.learner.capacity_controller import CapacityController

R = 64  # rollouts per update


def controller(**cfg: object) -> CapacityController:
    return CapacityController(
        CapacityConfig(**{"tick_s": 30.0, "window_s": 20.0, **cfg}), rollouts_per_update=R, staleness=4, kappa=3, auto_kappa=False  # type: ignore[arg-type]
    )


def drive(
    c: CapacityController, rates: dict[str, float], prices: dict[str, float], seconds: int, start: float = 0.0,
) -> list[dict[str, object]]:
    """`seconds` of one tick a second, a version announced every 3 s asking more than anyone
    makes (every peer works all the time): each active peer delivers its rate's worth at the
    end of every second, and heartbeats the newest version 0.5 s after it was published."""
    records = []
    for t in range(seconds):
        now = start + t
        if t:
            for p in rates:
                if c.is_active(p):
                    c.accepted(p, (t - 1) // 3, int(rates[p]), now)
        if t % 3 == 0:
            c.published(t // 3, now)
            c.announced(t // 3, now, 10_000.0)
        for p in rates:
            c.heartbeat(p, now + 0.5, installed=t // 3, price=prices[p], engine="torch", device="cpu")
        c.step(1.0)
        record = c.tick(now, list(rates))
        if record is not None:
            records.append(record)
    return records


def test_cheapest_peers_stay_active_and_the_rest_stand_by() -> None:
    c = controller()
    # μ_min(κ=3) = 3·64 / (3·1.0 − 0.5) = 76.8/s; target γ·μ_min = 84.5/s.
    rates = {"cheap": 60.0, "mid": 40.0, "dear": 80.0, "free": 10.0}
    prices = {"cheap": 1.0, "mid": 1.0, "dear": 10.0, "free": 0.0}
    records = drive(c, rates, prices, 70)
    assert c.t_train == 1.0 and c.t_bcast == 0.5
    last = records[-1]
    # Measured at their rates (the first second of each peer's first cycle delivers nothing).
    assert {p: w["mu"] for p, w in last["workers"].items()} == pytest.approx(rates, rel=0.05)
    assert last["mu_min"] == 76.8
    # By price per rollout/s: free (0), cheap (1/60), mid (1/40) = 110/s >= 84.5; dear stands by.
    assert last["active"] == ["cheap", "free", "mid"] and last["standby"] == ["dear"]
    assert not c.is_active("dear") and c.is_active("cheap")
    assert last["cost_per_hour"] == 2.0 and last["feasible"]
    assert last["delta_max_predicted"] == 4


def test_nobody_stands_by_before_it_was_measured() -> None:
    c = controller()
    drive(c, {"a": 50.0}, {"a": 1.0}, 10)
    assert c.decision is None and c.is_active("a") and c.is_active("newcomer")


def test_a_late_joiner_generates_until_measured() -> None:
    c = controller()
    rates = {"a": 200.0, "b": 200.0}
    drive(c, rates, {"a": 1.0, "b": 5.0}, 70)
    assert not c.is_active("b")  # a alone covers the target
    late = {**rates, "c": 30.0}
    drive(c, late, {"a": 1.0, "b": 5.0, "c": 0.0}, 5, start=70)
    assert c.is_active("c")  # joined 5 s ago: not measured yet, so it generates


def test_disabled_controller_keeps_everyone_active() -> None:
    c = controller(enabled=False)
    drive(c, {"a": 200.0, "b": 200.0}, {"a": 1.0, "b": 5.0}, 70)
    assert c.is_active("a") and c.is_active("b") and c.decision is None


def test_auto_kappa_follows_the_measured_times() -> None:
    c = CapacityController(CapacityConfig(window_s=5.0), rollouts_per_update=R, staleness=6, kappa=5, auto_kappa=True)
    drive(c, {"a": 200.0}, {"a": 0.0}, 40)
    assert c.kappa == 5 and c.kappa_warning is None  # S - 1, since T_bcast (0.5) < T_train (1.0)


def test_a_peer_that_meets_its_demand_early_is_measured_by_its_speed() -> None:
    # Each version asks 24 rollouts of each peer. "fast" delivers them 0.5 s after the
    # announcement and waits; "slow" delivers 12 per 1.5 s and never meets it. Both deliver
    # 24 per 3 s, but only "slow" is at its limit: accepted rollouts per second (8/s each)
    # would rank them equal.
    c = controller()
    for v in range(30):
        at = 3.0 * v
        c.announced(v, at, 24.0)
        c.accepted("fast", v, 8, at + 0.25)
        c.accepted("fast", v, 16, at + 0.5)
        c.accepted("slow", v, 12, at + 1.5)
        c.accepted("slow", v, 12, at + 3.0 - 1e-6)
        c.tick(at + 3.0, ["fast", "slow"])  # the cycle under way counts until now
    assert c.peers["fast"].mu == 48.0 and c.peers["slow"].mu == pytest.approx(8.0)


def test_a_slow_peer_is_measured_over_cycles_without_arrivals() -> None:
    # One group of 40 every 10 s, versions every 3 s: most cycles see nothing arrive, and the
    # peer was busy through all of them (it never met a demand of 100).
    c = controller(window_s=60.0)
    for t in range(121):
        if t % 3 == 0:
            c.announced(t // 3, float(t), 100.0)
        if t and t % 10 == 0:
            c.accepted("slow", (t - 1) // 3, 40, float(t))
        c.tick(float(t), ["slow"])
    assert c.peers["slow"].mu == pytest.approx(4.0, rel=0.05)


def test_standby_time_is_not_counted_as_work() -> None:
    c = controller()
    c.announced(0, 0.0, 100.0)
    c.accepted("p", 0, 5, 0.0)  # its first group: the end of its warm-up, not counted
    c.accepted("p", 0, 20, 1.0)
    c.tick(1.0, ["p"])
    c.peers["p"].changes.append((2.0, False))  # put on standby at 2 s, active again at 10 s
    c.peers["p"].changes.append((10.0, True))
    c.announced(1, 3.0, 100.0)  # starts during standby: not counted
    c.announced(2, 12.0, 100.0)
    c.accepted("p", 2, 30, 13.0)
    c.accepted("p", 2, 30, 14.0)
    c.tick(21.0, ["p"])  # joined at 0 s: measured once a 20 s window has passed
    # 20 rollouts from its first group to its standby (2 s), nothing in the 2 s from its waking
    # to the next cycle, then 60 in the 9 s of the cycle under way.
    assert c.peers["p"].mu == 80 / 13


def test_a_peer_woken_during_a_cycle_is_busy_from_its_waking_until_now() -> None:
    # Nothing is announced after version 0 (the learner trains nothing): the cycle under way,
    # whose demand is unmet, counts from the peer's waking until now.
    c = controller()
    c.announced(0, 0.0, 1000.0)
    c.accepted("p", 0, 5, 0.0)  # its first group: the end of its warm-up, not counted
    c.accepted("p", 0, 10, 1.0)
    c.accepted("p", 0, 10, 2.0)
    c.peers["p"].changes.append((3.0, False))  # standby from 3 s, woken at 10 s
    c.peers["p"].changes.append((10.0, True))
    for t in range(11, 21):
        c.accepted("p", 0, 10, float(t))
    c.tick(20.0, ["p"])
    assert c.peers["p"].mu == 120 / 13  # 20 in its first 3 s, 100 in the 10 s since its waking


def test_a_fast_peer_waiting_for_a_slow_learner_keeps_its_rate() -> None:
    # A version every 13 s (κ·T_train + T_bcast = 3·4 + 1): a peer that meets its demand in
    # 1 s and then waits 12 s for the next version is silent for longer than the 5 s window,
    # but not for longer than a publication period: it is waiting, not gone.
    c = controller(window_s=5.0)
    for v in range(8):
        at = 13.0 * v
        c.published(v, at)
        c.announced(v, at, 20.0)
        c.step(4.0)
        c.accepted("fast", v, 20, at + 1.0)
        c.heartbeat("fast", at + 1.0, installed=v, price=1.0, engine="torch", device="cpu")
        for t in range(2, 13):
            c.tick(at + t, ["fast"])
            if v >= 2:
                assert c.peers["fast"].mu > 1.0
    assert c.t_train == 4.0 and c.t_bcast == 1.0


def test_a_cycle_longer_than_the_window_still_measures() -> None:
    c = controller(window_s=5.0)
    c.announced(0, 0.0, 1000.0)
    for t in range(1, 31):
        c.accepted("p", 0, 2, float(t))
        c.tick(float(t), ["p"])
    assert c.peers["p"].mu == 2.0


def test_a_stock_made_on_older_weights_is_not_instant_work() -> None:
    # "hoarder" makes 24 rollouts on the new version in 2 s (12/s) and also sends 24 made on
    # the previous version while it waited, the moment a version is announced. Meeting the
    # demand with them would claim an unbounded rate; it is credited 48 over the 2 s its work
    # on the new weights took (it did make them, in time it would otherwise have idled).
    c = controller()
    for v in range(1, 30):
        at = 3.0 * v
        c.announced(v, at, 24.0)
        c.accepted("hoarder", v - 1, 24, at + 0.01)
        c.accepted("hoarder", v, 24, at + 2.0)
        c.tick(at + 3.0, ["hoarder"])
    assert c.peers["hoarder"].mu == pytest.approx(24.0)


def test_warm_up_before_the_first_rollouts_is_not_work() -> None:
    # Joined at 0, loading and fetching until its first group at 8 s, then 10/s.
    c = controller()
    c.announced(0, 0.0, 10_000.0)
    c.heartbeat("p", 0.0, installed=-1, price=1.0, engine="torch", device="cpu")
    for t in range(8, 31):
        c.accepted("p", 0, 10, float(t))
    c.tick(30.0, ["p"])
    assert c.peers["p"].mu == pytest.approx(10.0)  # not 220 / 30
