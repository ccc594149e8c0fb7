"""The demand's slack follows the learner's idle time and the stale share (echo_node/demand.py)."""

from __future__ import annotations

from echo_node.demand import MAX_SLACK, MIN_SLACK, DemandSlack


def drive(d: DemandSlack, looks: int, *, received: int, stale: int, idle_s: float, train_s: float) -> list[float]:
    """`looks` looks, each adding these increments to the cumulative counters."""
    r = s = 0
    i = t = 0.0
    if d._last is not None:
        r, s, i, t = d._last
    out = []
    for _ in range(looks):
        r, s, i, t = r + received, s + stale, i + idle_s, t + train_s
        out.append(d.update(received=r, stale=s, idle_s=i, train_s=t))
    return out


def test_a_third_stale_and_a_busy_learner_lower_the_slack_to_its_floor() -> None:
    d = DemandSlack(slack=1.5)
    slacks = drive(d, 40, received=300, stale=100, idle_s=0.0, train_s=1.0)
    assert slacks[0] == 1.5  # the first look only takes the counters
    assert all(b < a for a, b in zip(slacks[1:], slacks[2:]) if a > MIN_SLACK)
    assert slacks[-1] == MIN_SLACK


def test_a_waiting_learner_raises_it_at_once_and_bounded() -> None:
    d = DemandSlack(slack=1.0)
    slacks = drive(d, 3, received=100, stale=50, idle_s=0.2, train_s=0.8)  # idle wins over stale
    assert slacks == [1.0, 1.15, 1.15 * 1.15]
    assert drive(d, 50, received=100, stale=0, idle_s=0.5, train_s=0.5)[-1] == MAX_SLACK


def test_nothing_happening_or_a_balanced_swarm_changes_nothing() -> None:
    d = DemandSlack(slack=1.3)
    assert drive(d, 5, received=0, stale=0, idle_s=1.0, train_s=0.0) == [1.3] * 5  # no run yet
    assert drive(d, 5, received=100, stale=2, idle_s=0.01, train_s=1.0) == [1.3] * 5
