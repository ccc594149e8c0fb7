"""A rollout peer samples what the learner asks for per version, then waits (virtual time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from echo_node.config import RunConfig
from echo_node.rollout_peer import DEMAND_WAIT_S, RolloutPeer, Target
from tests.factories import ALICE


def peer_on_version(version: int, demand: int, mode: str = "async") -> RolloutPeer:
    peer = RolloutPeer(RunConfig(run_id="run-1"), ALICE)
    peer.engine = SimpleNamespace(version=version)  # type: ignore[assignment]
    peer.spec = SimpleNamespace(sync_mode=mode)  # type: ignore[assignment]
    peer._offer(Target(version, 10, b"\0" * 32, demand))
    peer._produced, peer._produced_version = demand, version
    return peer


@pytest.mark.parametrize("mode", ["async", "pull"])
def test_an_announcement_ends_the_wait_at_once(mode: str) -> None:
    """The count starts over for the new version. async samples on at once, on the weights it
    has (the new ones swap in mid-batch when they verify); pull refreshes first."""
    peer = peer_on_version(3, demand=6, mode=mode)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            async def announce() -> None:
                await trio.sleep(1.25)
                peer._offer(Target(4, 10, b"\1" * 32, 5))

            nursery.start_soon(announce)
            start = trio.current_time()
            await peer._wait_for_version()
            return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 1.25
    assert peer._newest is not None and peer._newest.version == 4 and peer._demand == 5
    peer._track_version()
    assert (peer._produced_version, peer._produced) == (4, 0)


def test_verified_weights_wait_for_the_engine_once() -> None:
    peer = peer_on_version(3, demand=6)
    peer._hand_over(b"weights of 2", 2)
    assert peer._take_pending() is None  # older than what the engine runs
    peer._hand_over(b"weights of 4", 4)
    assert peer._take_pending() == (b"weights of 4", 4) and peer._take_pending() is None


def test_no_new_version_releases_one_more_batch_after_the_wait() -> None:
    peer = peer_on_version(3, demand=20)  # met, and more than one batch

    async def main() -> float:
        start = trio.current_time()
        await peer._wait_for_version()
        return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == DEMAND_WAIT_S
    # A lost announcement must not stall the swarm: one batch's worth is released.
    assert peer._demand - peer._produced == peer.cfg.rollout.groups_per_batch


def test_an_older_announcement_does_not_change_the_target() -> None:
    peer = peer_on_version(7, demand=6)
    peer._offer(Target(5, 10, b"\2" * 32, 99))
    assert peer._newest is not None and peer._newest.version == 7 and peer._demand == 6
