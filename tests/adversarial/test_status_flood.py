"""Status requests are answered to anyone, within budgets: Sybils cannot make the learner spend
without bound on them, nor eat a joined peer's budget."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from echo_node.learner.door import STATUS_STRANGERS
from echo_node.learner.learner import Learner
from echo_node.net import rpc
from echo_node.net.ratelimit import RateLimits
from protocol import Identity, StatusRequest


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    limits = RateLimits(2.0, 4.0, max_keys=2)
    assert [limits.take("a", 0.0) for _ in range(5)] == [True] * 4 + [False]
    assert limits.take("a", 0.5) and not limits.take("a", 0.5)  # one token per half second
    assert limits.take("b", 0.5) and limits.take("c", 0.5)  # "a" forgotten: at most one burst
    assert limits.take("a", 0.5)


def test_strangers_share_one_budget_and_joined_peers_keep_theirs(learner: Learner) -> None:
    learner.weights.offer(0, b"\0" * 100)
    peer = Identity.from_seed(b"\x61" * 32).peer_id
    sybils = [Identity.from_seed(bytes([0x70 + i]) * 32).peer_id for i in range(12)]

    async def main() -> tuple[int, int, int]:
        learner.peers.join(peer, trio.current_time())
        answered = refused = 0
        for _ in range(10):
            for sybil in sybils:
                try:
                    await learner.door.on_status(StatusRequest(run_id="run-1"), sybil)
                    answered += 1
                except rpc.RequestRefused as exc:
                    assert exc.code == "rate_limited"
                    refused += 1
        honest = 0
        for _ in range(20):
            await learner.door.on_status(StatusRequest(run_id="run-1"), peer)  # never refused
            honest += 1
        return answered, refused, honest

    answered, refused, honest = trio.run(main, clock=trio.testing.MockClock())
    assert answered == pytest.approx(STATUS_STRANGERS[1], abs=1) and refused == 120 - answered and honest == 20
