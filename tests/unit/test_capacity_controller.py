"""The learner's capacity controller (echo_node/capacity.py) on hand-made measurements: peers'
throughput is what the learner accepted, T_bcast comes from heartbeats, standby follows the
real scheduler's decisions, and nobody stands by before it was measured."""

from __future__ import annotations

from echo_node.capacity import CapacityController
from echo_node.config import CapacityConfig

R = 64  # rollouts per update


def controller(**cfg: object) -> CapacityController:
    return CapacityController(
        CapacityConfig(**{"tick_s": 30.0, "window_s": 20.0, **cfg}), rollouts_per_update=R, staleness=4, kappa=3, auto_kappa=False  # type: ignore[arg-type]
    )


def drive(
    c: CapacityController, rates: dict[str, float], prices: dict[str, float], seconds: int, start: float = 0.0,
    accepted: dict[str, int] | None = None,
) -> list[dict[str, object]]:
    """`seconds` of one tick a second; each active peer delivers its rate into `accepted`
    (cumulative, as the learner counts); every peer heartbeats the newest published version
    0.5 s after it was published (a publication every 3 s)."""
    records = []
    accepted = {} if accepted is None else accepted
    for p in rates:
        accepted.setdefault(p, 0)
    for t in range(seconds):
        now = start + t
        if t % 3 == 0:
            c.published(t // 3, now)
        for p in rates:
            if c.is_active(p):
                accepted[p] += int(rates[p])
            c.heartbeat(p, now + 0.5, installed=t // 3, price=prices[p], engine="torch", device="cpu")
        c.step(1.0)
        record = c.tick(now, accepted, list(rates))
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
    rates, accepted = {"a": 200.0, "b": 200.0}, {}
    drive(c, rates, {"a": 1.0, "b": 5.0}, 70, accepted=accepted)
    assert not c.is_active("b")  # a alone covers the target
    late = {**rates, "c": 30.0}
    drive(c, late, {"a": 1.0, "b": 5.0, "c": 0.0}, 5, start=70, accepted=accepted)
    assert c.is_active("c")  # joined 5 s ago: not measured yet, so it generates


def test_disabled_controller_keeps_everyone_active() -> None:
    c = controller(enabled=False)
    drive(c, {"a": 200.0, "b": 200.0}, {"a": 1.0, "b": 5.0}, 70)
    assert c.is_active("a") and c.is_active("b") and c.decision is None


def test_auto_kappa_follows_the_measured_times() -> None:
    c = CapacityController(CapacityConfig(window_s=5.0), rollouts_per_update=R, staleness=6, kappa=5, auto_kappa=True)
    drive(c, {"a": 200.0}, {"a": 0.0}, 40)
    assert c.kappa == 5 and c.kappa_warning is None  # S - 1, since T_bcast (0.5) < T_train (1.0)
