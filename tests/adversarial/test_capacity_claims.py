"""What a peer says or sends cannot bend the learner's capacity measurements: an installed
version beyond what was published is capped at the newest one, so one liar cannot end a
broadcast's timing; a flood of accepted groups keeps the controller's memory bounded and
changes only the flooder's own rate; free identities that deliver a burst and go silent cannot
keep a priced peer on standby: their rates fall to 0 after a window of silence, and a learner
waiting for rollouts wakes every standby peer."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from echo_node.config import CapacityConfig
from echo_node.learner.capacity_controller import _ARRIVALS_KEPT, CapacityController
from echo_node.learner.learner import Learner
from protocol import Identity, StatusRequest


def test_an_install_claimed_beyond_the_published_version_is_capped(learner: Learner) -> None:
    learner.weights.offer(0, b"\0" * 100)
    peer = Identity.from_seed(b"\x62" * 32).peer_id

    async def main() -> None:
        learner.peers.join(peer, trio.current_time())
        for claim in (2**62, 10**6, -1):
            await learner.door.on_status(StatusRequest(run_id="run-1", installed_version=claim), peer)

    try:
        trio.run(main)
    finally:
        learner.report.close()
    # The largest claim counted as version 0, the newest published; a lower one never lowers it.
    assert learner.weights.published == 0 and learner.capacity.peers[peer].installed == 0


def test_a_flood_of_accepted_groups_is_bounded_and_touches_only_the_flooder() -> None:
    c = CapacityController(CapacityConfig(window_s=20.0), rollouts_per_update=64, staleness=4, kappa=3, auto_kappa=False)
    c.accepted("honest", 0, 8, 0.0)  # its first group: the end of its warm-up
    for v in range(10):
        c.announced(v, 3.0 * v, 24.0)
        c.accepted("honest", v, 24, 3.0 * v + 2.0)
    for i in range(10 * _ARRIVALS_KEPT):  # one rollout a group, all at once, on an old version
        c.accepted("flooder", 0, 1, 29.0)
    c.tick(30.0, ["honest", "flooder"])
    assert len(c.peers["flooder"].arrivals) == _ARRIVALS_KEPT
    assert c.peers["honest"].mu == 12.0  # 24 in the 2 s each cycle took
    assert c.peers["flooder"].mu < float("inf")


# -- Free identities that deliver a burst and go silent cannot freeze the controller. ------------
#
# "honest" costs 1/h and makes 100 rollouts/s; four free Sybils each make their 300-rollout
# demand in half a second (600/s), so the scheduler puts "honest" on standby. Then the Sybils
# stop: nothing is trained, so nothing is announced, and the cycle under way, whose demand they
# met, never ends.

SYBILS = tuple(f"sybil{i}" for i in range(4))
PEERS = ("honest", *SYBILS)
PRICES = {"honest": 1.0, **{s: 0.0 for s in SYBILS}}
WINDOW_S = 20.0
SILENT_AT = 60
LAST_VERSION = (SILENT_AT - 1) // 3  # announced at 57 s: its cycle never ends


def frozen_pool() -> CapacityController:
    """The controller after SILENT_AT seconds of the attack above: a version every 3 s asking
    300 rollouts of each peer, one update a second, heartbeats 0.5 s after each publication,
    a tick every second; "honest" on standby."""
    c = CapacityController(CapacityConfig(tick_s=30.0, window_s=WINDOW_S), rollouts_per_update=64, staleness=4, kappa=3, auto_kappa=False)
    for t in range(SILENT_AT):
        now = float(t)
        if t and c.is_active("honest"):
            c.accepted("honest", (t - 1) // 3, 100, now)
        if t % 3 == 0:
            c.published(t // 3, now)
            c.announced(t // 3, now, 300.0)
        c.step(1.0)
        c.tick(now, PEERS)
        for s in SYBILS:
            c.accepted(s, t // 3, 150, now + 0.25)
            c.accepted(s, t // 3, 150, now + 0.5)
        for p in PEERS:
            c.heartbeat(p, now + 0.5, installed=t // 3, price=PRICES[p], engine="torch", device="cpu")
    assert not c.is_active("honest") and c.peers["sybil0"].mu == 600.0
    return c


def silence(
    c: CapacityController, start: int, seconds: int, *, trickle_every: int = 0, peers: tuple[str, ...] = PEERS,
) -> list[float]:
    """`seconds` of ticks in which nothing is trained or announced; "honest" delivers 100/s
    while active; with `trickle_every`, each Sybil sends one rollout that often. The times at
    which "honest" was active."""
    active_at = []
    for t in range(start, start + seconds):
        now = float(t)
        if c.is_active("honest"):
            c.accepted("honest", LAST_VERSION, 100, now)
        for p in peers:
            if p != "honest" and trickle_every and t % trickle_every == 0:
                c.accepted(p, LAST_VERSION, 1, now)
            c.heartbeat(p, now, installed=LAST_VERSION, price=PRICES[p], engine="torch", device="cpu")
        c.tick(now, peers)
        if c.is_active("honest"):
            active_at.append(now)
    return active_at


def test_silent_sybils_rates_fall_to_zero_and_the_honest_peer_is_active_again() -> None:
    c = frozen_pool()
    last_burst = 59.5
    active_at = silence(c, 60, 400)  # the learner's waits are not reported: only the rates act
    assert all(c.peers[s].mu == 0.0 for s in SYBILS)
    # Back within the window of silence and one tick, and it stays (it delivers).
    assert active_at and active_at[0] <= last_burst + WINDOW_S + 1.0
    assert active_at == [float(t) for t in range(int(active_at[0]), 460)]
    # Measured from its activation, in the cycle that began while it stood by.
    assert c.peers["honest"].mu == pytest.approx(100.0, rel=0.02)


def test_a_burst_keeps_a_rate_for_at_most_a_window() -> None:
    c = frozen_pool()  # the Sybils' last group arrived at 59.5 s
    silence(c, 60, 20)
    assert all(c.peers[s].mu == 600.0 for s in SYBILS)  # 19.5 s of silence: still its rate
    silence(c, 80, 1)
    assert all(c.peers[s].mu == 0.0 for s in SYBILS)  # a whole window: nothing measured


def test_a_waiting_learner_wakes_every_standby_peer_and_keeps_them_awake() -> None:
    # The Sybils keep trickling one rollout every 5 s, so they are never silent for a window:
    # only the learner's wait tells that what their rates promise does not arrive.
    c = frozen_pool()
    c.waiting(60.0)
    woken_at = 60 + int(c.cfg.wake_after_s)
    assert not silence(c, 60, woken_at - 60, trickle_every=5)
    record = c.tick(float(woken_at), PEERS)
    assert record is not None and record["changed"] and record["standby"] == []
    assert str(record["reason"]).startswith("woke 1 on standby")
    # Awake through every scheduler tick while the learner still waits.
    active_at = silence(c, woken_at + 1, 300, trickle_every=5)
    assert active_at == [float(t) for t in range(woken_at + 1, woken_at + 301)]
    assert c.snapshot()["standby_peers"] == 0
    assert c.peers["sybil0"].mu == 600.0  # never silent for a window: the wait alone woke them


def test_after_a_wake_no_peer_stands_by_for_a_tick_even_when_a_sybil_forces_a_decision() -> None:
    c = frozen_pool()
    c.waiting(60.0)
    assert silence(c, 60, 11, trickle_every=5) == [70.0]  # woken at 70
    c.working(71.5)  # a batch: it trains again
    # A Sybil leaving breaks the target, which makes the scheduler decide at once.
    peers = PEERS[:-1]
    assert silence(c, 72, 28, trickle_every=5, peers=peers) == [float(t) for t in range(72, 100)]
    # A tick after the wake, decisions resume: the remaining Sybils' rates (never silent for a
    # window) win again, and the next long wait costs the learner another wake_after_s.
    assert not silence(c, 100, 1, trickle_every=5, peers=peers)


def test_waits_shorter_than_the_bound_wake_nobody() -> None:
    c = frozen_pool()
    wait = int(c.cfg.wake_after_s) - 1
    for start in range(60, 300, wait):
        c.waiting(float(start))
        assert not silence(c, start, wait, trickle_every=5)
        c.working(float(start + wait) - 0.5)
    assert not c.is_active("honest")


def test_the_learner_says_when_it_waits_for_rollouts(learner: Learner) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(learner._wait_for_batch)  # the buffer is empty: it waits
            await trio.sleep(15.0)
            assert learner.capacity.waiting_since == 0.0
            nursery.cancel_scope.cancel()
        assert learner.capacity.waiting_since is None

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        learner.report.close()
