"""What a peer says or sends cannot bend the learner's capacity measurements: an installed
version beyond what was published is capped at the newest one, so one liar cannot end a
broadcast's timing; a flood of accepted groups keeps the controller's memory bounded and
changes only the flooder's own rate."""

from __future__ import annotations

import trio

from echo_node.capacity import _ARRIVALS_KEPT, CapacityController
from echo_node.config import CapacityConfig
from echo_node.learner import Learner
from protocol import Identity, StatusRequest


def test_an_install_claimed_beyond_the_published_version_is_capped(learner: Learner) -> None:
    learner.weights.offer(0, b"\0" * 100)
    peer = Identity.from_seed(b"\x62" * 32).peer_id

    async def main() -> None:
        learner.peers.join(peer, trio.current_time())
        for claim in (2**62, 10**6, -1):
            await learner._on_status(StatusRequest(run_id="run-1", installed_version=claim), peer)

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
