"""A rollout peer samples what the learner asks for per version, then waits (virtual time)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from echo_node.config import RunConfig, load_config
from echo_node.envs import load_env
from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.peer.rollout_peer import DEMAND_WAIT_S, Generator, RolloutPublisher
from echo_node.peer.weight_follower import Target, WeightFollower
from echo_node.weights.broadcast import DataServer
from tests.factories import ALICE
from tests.unit import env_plugins


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


def test_a_batch_doomed_mid_generation_is_stopped() -> None:
    """async: once the learner announces a version past S of the weights a batch began on, the
    batch is stale however it ends: the engine's hook stops it at the next decoding step."""
    from echo_node.ml.engine import TorchEngine
    from tests.factories import TASK, TOKENIZER
    from tests.sampling import tiny_model

    peer = peer_on_version(3, demand=6)
    peer.spec.staleness = 2
    peer.spec.group_size = 8
    peer.spec.sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=12)
    peer.session.policy = SimpleNamespace(tokenizer=TOKENIZER, task=TASK)
    peer.engine = TorchEngine(tiny_model(), eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    peer.engine.version = 3
    steps = []
    take = peer.follower.take_pending

    def announce_at_the_second_step():  # type: ignore[no-untyped-def]
        steps.append(len(steps))
        if len(steps) == 2:
            peer.follower.offer(Target(6, 10, b"\6" * 32, 6, 0))  # 3 < 6 - 2
        return take()

    peer.follower.take_pending = announce_at_the_second_step  # type: ignore[method-assign]

    async def main() -> object:
        return await peer.stoppably(partial(peer._generate, ["1+2=", "3+4="], 7), 2)

    assert trio.run(main) is None
    assert len(steps) == 2  # stopped at the step after the announcement, not at the batch's end
    assert peer.batches_abandoned == 0  # not a stop: nothing to cancel


def test_only_the_learners_own_announcement_can_doom_a_batch() -> None:
    """A batch is dropped by the peer itself when an announcement puts the learner past S of its
    weights, so a forged announcement of a far version would throw away every batch: the
    versions topic's validator takes only the run's learner's signed word for its own run."""
    from echo_node.net.transport import PeerAddr
    from protocol import Identity
    from protocol.envelope import seal
    from protocol.messages import VersionAnnounce

    learner, mallory = Identity.from_seed(b"\x61" * 32), Identity.from_seed(b"\x62" * 32)
    peer = peer_on_version(3, demand=6)
    peer.spec.staleness = 2
    peer.follower.session = SimpleNamespace(learner=PeerAddr(learner.peer_id, []))

    def announce(run_id: str, version: int) -> VersionAnnounce:
        return VersionAnnounce(run_id=run_id, version=version, size=10, sha256=b"\7" * 32, demand_groups=6, epoch=0)

    validate = peer.follower._validate_announce
    far = announce("run-1", 10**6)
    assert not validate(mallory.peer_id, mallory.peer_id, seal(far, mallory))  # signed by another key
    assert not validate(learner.peer_id, learner.peer_id, seal(announce("run-2", 10**6), learner))  # another run
    assert not validate(learner.peer_id, learner.peer_id, seal(far, learner)[:-1])  # torn
    assert not peer.doomed(3)
    assert validate(learner.peer_id, learner.peer_id, seal(far, learner))
    peer.follower.offer(Target(far.version, far.size, far.sha256, far.demand_groups, far.epoch))
    assert peer.doomed(3)


@pytest.mark.parametrize("mode", ["async", "pull"])
def test_weights_of_a_lost_history_are_neither_sampled_from_nor_sent(mode: str) -> None:
    """A learner that restarted without its history numbers its new epoch's versions from below.
    To it, tokens of the old weights name versions it never published (`future_version`, a ban
    of the peer), so a batch begun on them is discarded and no new one begins before the new
    epoch's weights are in."""
    peer = peer_on_version(1092, demand=6, mode=mode)
    peer.spec.staleness = 4
    assert not peer.doomed(1092)
    peer.follower.offer(Target(5, 10, b"\5" * 32, 6, 1))  # epoch 1, versions from 5
    assert peer.follower.newest is not None and peer.follower.newest.version == 5
    assert peer.doomed(1092) and peer.weights_too_old()
    peer.discard(1092, 8)
    assert (peer.batches_doomed, peer.groups_doomed) == (1, 8)
    peer.engine.version = 5
    assert not peer.doomed(5) and not peer.weights_too_old()


def test_a_batch_its_environment_ends_entirely_is_counted_and_the_seq_kept_for_a_new_version() -> None:
    """A run of episodes whose environment raises on every step: the batch's groups are counted
    by reason, nothing is published and the seq is not used (the learner sees no gap), and the
    peer waits for a new version instead of replaying the same seeds at once."""
    tok = CharTokenizer()
    spec = load_env(load_config(None, env__name="tests.unit.env_plugins:Guess"))
    env = dataclasses.replace(spec, factory=env_plugins.Raises)
    peer = peer_on_version(3, demand=6)
    engine = TorchEngine(build_model(tiny_llama_config(tok.vocab_size), seed=0), eos_id=tok.eos_id, pad_id=tok.pad_id, version=3)
    peer.engine = peer.session.engine = engine
    peer.session.env, peer.session.policy = env, SimpleNamespace(tokenizer=tok)  # type: ignore[attr-defined]
    peer.spec = peer.session.spec = SimpleNamespace(sync_mode="async", epoch=0, run_id="run-1", group_size=2,  # type: ignore[assignment]
                                                    staleness=4, sampling=SimpleNamespace(temperature=1.0, top_p=1.0))
    seq = peer.publisher.seq

    async def main() -> float:
        start = trio.current_time()
        await peer.play(3, seq, 2)
        return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == DEMAND_WAIT_S
    assert peer.env_dropped == {"env_error": 2} and peer.publisher.seq == seq and not peer.publisher.history


def test_a_peer_whose_environment_calls_all_hang_backs_off_and_keeps_running(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every step of its environment hangs. Each batch's hung calls pin their threads, until
    none is free (here 8, the process-wide bound lowered). The peer then plays nothing and backs
    off, 1 s, 2 s, 4 s... (virtual time), with one WARNING; it never raises. Once the calls end
    it plays again."""
    from echo_node.envs import bounded

    env_plugins.release_hung()
    env_plugins.RELEASE.clear()
    monkeypatch.setattr(bounded, "MAX_ENV_THREADS", 8)
    tok = CharTokenizer()
    spec = load_env(load_config(None, env__name="tests.unit.env_plugins:Guess"))
    peer = peer_on_version(3, demand=6)
    engine = TorchEngine(build_model(tiny_llama_config(tok.vocab_size), seed=0), eos_id=tok.eos_id, pad_id=tok.pad_id, version=3)
    peer.engine = peer.session.engine = engine
    peer.session.env = dataclasses.replace(spec, factory=env_plugins.Hangs, step_timeout_s=0.05)  # type: ignore[attr-defined]
    peer.session.policy = SimpleNamespace(tokenizer=tok)  # type: ignore[attr-defined]
    peer.spec = peer.session.spec = SimpleNamespace(sync_mode="async", epoch=0, run_id="run-1", group_size=2,  # type: ignore[assignment]
                                                    staleness=4, sampling=SimpleNamespace(temperature=1.0, top_p=1.0))
    seq = peer.publisher.seq

    async def batch() -> float:
        start = trio.current_time()
        await peer.play(3, seq, 2)
        return trio.current_time() - start

    async def main() -> list[float]:
        waits = [await batch() for _ in range(7)]
        await trio.to_thread.run_sync(env_plugins.release_hung)
        peer.session.env = dataclasses.replace(spec, factory=env_plugins.Raises)  # type: ignore[attr-defined]
        waits.append(await batch())
        return waits

    try:
        with caplog.at_level(logging.INFO, logger="echo_node.peer.rollout_peer"):
            waits = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        env_plugins.release_hung()
    # Two batches hang 4 calls each (a new version awaited after each), then no thread is free.
    assert waits == [DEMAND_WAIT_S, DEMAND_WAIT_S, 1.0, 2.0, 4.0, 8.0, 16.0, DEMAND_WAIT_S]
    assert peer.env_dropped == {"env_timeout": 4, "env_unavailable": 10, "env_error": 2}
    assert peer.env_backoff_s == 0.0 and peer.publisher.seq == seq and not peer.publisher.history
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "hung" in warnings[0].getMessage(), warnings
    assert any("free again" in r.getMessage() for r in caplog.records)
