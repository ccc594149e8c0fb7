"""A rollout peer samples what the learner asks for per version, then waits (virtual time)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from echo_node.config import RunConfig
from echo_node.rollout_peer import DEMAND_WAIT_S, Generator, RolloutPublisher
from echo_node.weights.broadcast import DataServer
from echo_node.weights.follower import Target, WeightFollower
from tests.factories import ALICE


def peer_on_version(version: int, demand: int, mode: str = "async") -> Generator:
    """A generator whose demand for `version` is met, with its real weight follower."""
    cfg = RunConfig(run_id="run-1", runs_dir=Path(tempfile.mkdtemp(prefix="echo-node-flow-")))
    session = SimpleNamespace(engine=SimpleNamespace(version=version), spec=SimpleNamespace(sync_mode=mode, epoch=0))
    follower = WeightFollower(cfg, None, DataServer(ALICE, "run-1"), session)  # type: ignore[arg-type]
    peer = Generator(cfg, session, follower, RolloutPublisher(cfg, ALICE, None))  # type: ignore[arg-type]
    follower.offer(Target(version, 10, b"\0" * 32, demand, 0))
    peer.produced, peer.produced_version = demand, version
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
                peer.follower.offer(Target(4, 10, b"\1" * 32, 5, 0))

            nursery.start_soon(announce)
            start = trio.current_time()
            await peer.wait_for_version()
            return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 1.25
    assert peer.follower.newest is not None and peer.follower.newest.version == 4 and peer.follower.demand == 5
    peer.track_version()
    assert (peer.produced_version, peer.produced) == (4, 0)


def test_verified_weights_wait_for_the_engine_once() -> None:
    peer = peer_on_version(3, demand=6)
    peer.follower._hand_over(b"weights of 2", 2)
    assert peer.follower.take_pending() is None  # older than what the engine runs
    peer.follower._hand_over(b"weights of 4", 4)
    assert peer.follower.take_pending() == (b"weights of 4", 4) and peer.follower.take_pending() is None


def test_no_new_version_releases_one_more_batch_after_the_wait() -> None:
    peer = peer_on_version(3, demand=20)  # met, and more than one batch

    async def main() -> float:
        start = trio.current_time()
        await peer.wait_for_version()
        return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == DEMAND_WAIT_S
    # A lost announcement must not stall the swarm: one batch's worth is released.
    assert peer.follower.demand - peer.produced == peer.cfg.rollout.groups_per_batch


def test_an_older_announcement_does_not_change_the_target() -> None:
    peer = peer_on_version(7, demand=6)
    peer.follower.offer(Target(5, 10, b"\2" * 32, 99, 0))
    assert peer.follower.newest is not None and peer.follower.newest.version == 7 and peer.follower.demand == 6


def test_async_does_not_sample_on_weights_the_learner_can_no_longer_admit() -> None:
    """A rollout is judged by its oldest token against the learner's version, which is at least
    the newest announced: weights older than that minus S only make stale rollouts."""
    peer = peer_on_version(3, demand=6)
    peer.spec.staleness = 2
    assert not peer.weights_too_old()
    peer.follower.offer(Target(5, 10, b"\1" * 32, 6, 0))
    assert not peer.weights_too_old()  # 3 >= 5 - 2: still admissible
    peer.follower.offer(Target(6, 10, b"\2" * 32, 6, 0))
    assert peer.weights_too_old()  # 3 < 6 - 2
    peer.engine.version = 6
    assert not peer.weights_too_old()
    pull = peer_on_version(3, demand=6, mode="pull")
    pull.spec.staleness = 0
    pull.follower.offer(Target(9, 10, b"\3" * 32, 6, 0))
    assert not pull.weights_too_old()  # pull refreshes before every batch anyway
