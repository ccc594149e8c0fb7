"""The learner's gate for episode batches (echo_node/envs/gate.py) against what a peer plays
(echo_node/envs/peer.py): an honest batch passes and trains; each forgery is dropped with its
reason, and only forgeries are blamed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from echo_node.config import load_config
from echo_node.envs import Env, EnvSpec, Message, load_env
from echo_node.envs.calc import CalcEnv
from echo_node.envs.format import CharFormat
from echo_node.envs.gate import COOLDOWN_MAX_S, EpisodeGate, RerunCooldown
from echo_node.envs.peer import PlayedBatch, play_batch
from echo_node.ml import defaults
from echo_node.ml.engine import TorchEngine
from echo_node.ml.grpo import PolicyOptimizer
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import AdditionTask
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.ml.warmup import warmup
from protocol.assignment import prompt_draw
from protocol.drops import DropReason
from protocol.envelope import seal
from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from protocol.identity import Identity
from tests.unit import env_plugins

torch.set_num_threads(1)
TOK = CharTokenizer()
FMT = CharFormat(TOK)
RUN = "agentic"
G = 4


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    m = build_model(tiny_llama_config(TOK.vocab_size), seed=0)
    warmup(m, TOK, AdditionTask(), config=defaults.WARMUP, cache_dir=Path.home() / ".cache" / "echo-node")
    return TorchEngine(m, eos_id=TOK.eos_id, pad_id=TOK.pad_id, version=2)


@pytest.fixture(scope="module")
def spec() -> EnvSpec:
    return load_env(load_config(None, env__name="calc", env__options={"problems": 2}))


@pytest.fixture(scope="module")
def peer() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def played(engine: TorchEngine, spec: EnvSpec, peer: Identity) -> PlayedBatch:
    out = play_batch(engine, FMT, spec, run_id=RUN, identity=peer, seq=9, groups=3, group_size=G, temperature=1.0)
    assert out.frame is not None and out.batch is not None and not out.dropped
    return out


def gate(spec: EnvSpec, **kw: object) -> EpisodeGate:
    args: dict[str, object] = {"spec": spec, "fmt": FMT, "run_id": RUN, "group_size": G, "vocab_size": TOK.vocab_size, "staleness": 4}
    args.update(kw)
    return EpisodeGate(**args)  # type: ignore[arg-type]


def test_an_honest_batch_passes_and_trains(engine: TorchEngine, spec: EnvSpec, peer: Identity, played: PlayedBatch) -> None:
    assert played.frame is not None
    got = gate(spec).check(played.frame, peer.peer_id, current_version=2)
    assert got.drop is None and len(got.groups) == 3
    stats = PolicyOptimizer(engine.model, lr=1e-4, pad_id=TOK.pad_id).step(got.groups)
    assert stats["groups"] == 3.0
    # Still admissible while within the staleness bound, in async; not in pull.
    assert gate(spec).check(played.frame, peer.peer_id, current_version=6).drop is None
    stale = gate(spec).check(played.frame, peer.peer_id, current_version=7)
    assert stale.drop == DropReason.STALE and not stale.blame
    assert gate(spec, mode="pull").check(played.frame, peer.peer_id, current_version=3).drop == DropReason.STALE


def _forge(played: PlayedBatch, peer: Identity, group: EpisodeGroup) -> bytes:
    assert played.batch is not None
    groups = (group,) + played.batch.groups[1:]
    return seal(dataclasses.replace(played.batch, groups=groups), peer)


def _retag(g: EpisodeGroup, fn: object) -> EpisodeGroup:
    eps = []
    for e in g.episodes:
        turns = tuple(dataclasses.replace(t, versions=tuple(fn(k, v) for v in t.versions)) for k, t in enumerate(e.turns))  # type: ignore[operator]
        eps.append(Episode(turns=turns, reward=e.reward))
    return dataclasses.replace(g, episodes=tuple(eps))


def test_forgeries_are_dropped_by_reason_and_blamed(spec: EnvSpec, peer: Identity, played: PlayedBatch) -> None:
    assert played.batch is not None
    g = played.batch.groups[0]
    check = gate(spec).check
    cases: dict[DropReason, bytes] = {}
    # A later turn tagged with a version the learner never had.
    cases[DropReason.FUTURE_VERSION] = _forge(played, peer, _retag(g, lambda k, v: v + 5 if k > 0 else v))
    # Another slot's episodes (the next group's, moved up): their first observation is not this seed's.
    cases[DropReason.BAD_EPISODE] = _forge(played, peer, dataclasses.replace(played.batch.groups[1], group_id=g.group_id))
    # One episode short of the run's group size.
    cases[DropReason.BAD_GROUP] = _forge(played, peer, dataclasses.replace(g, episodes=g.episodes[1:]))
    # A model turn longer than the run's turn budget (the wire would take it).
    long_turn = Turn(from_env=False, token_ids=(5,) * 40, logprobs=(-0.1,) * 40, versions=(2,) * 40)
    cases[DropReason.TOO_LONG] = _forge(played, peer, dataclasses.replace(
        g, episodes=(Episode(turns=(long_turn,), reward=0.0),) + g.episodes[1:]))
    # A token the model has no embedding for.
    cases[DropReason.OUT_OF_VOCAB] = _forge(played, peer, dataclasses.replace(g, prompt_ids=(TOK.vocab_size,)))
    for reason, frame in cases.items():
        got = check(frame, peer.peer_id, current_version=2)
        assert (got.drop, got.blame, got.groups) == (reason, True, []), (reason, got.detail)
    # Another identity's batch offered as the peer's (gossip names the origin); another run's.
    other = Identity.generate()
    assert played.batch is not None
    theirs = seal(dataclasses.replace(played.batch, peer_id=other.peer_id), other)
    assert check(theirs, peer.peer_id, current_version=2).drop == DropReason.WRONG_SENDER
    elsewhere = check(seal(dataclasses.replace(played.batch, run_id="other"), peer), peer.peer_id, current_version=2)
    assert elsewhere.drop == DropReason.WRONG_RUN and not elsewhere.blame
    assert check(b"\x00garbage", peer.peer_id, current_version=2).drop == DropReason.MALFORMED


class Broken(CalcEnv):
    def step(self, action: str) -> object:  # type: ignore[override]
        raise RuntimeError("learner-side bug")


class Stuck(CalcEnv):
    def step(self, action: str) -> object:  # type: ignore[override]
        env_plugins.RELEASE.wait(30)
        return super().step(action)


@pytest.mark.parametrize(("factory", "reason"), [
    (lambda: Broken(problems=2), DropReason.ENV_FAILED),
    (env_plugins.RaisesInInit, DropReason.ENV_FAILED),
    (lambda: Stuck(problems=2), DropReason.ENV_TIMEOUT),
    (env_plugins.HangsInInit, DropReason.ENV_TIMEOUT),
])
def test_the_environment_failing_on_the_learner_blames_nobody(
    spec: EnvSpec, peer: Identity, played: PlayedBatch, factory: Callable[[], Env], reason: DropReason
) -> None:
    """Raising or hanging, in a step or in the constructor: the batch is dropped with the reason,
    in the re-run's bound, and nobody is blamed."""
    assert played.frame is not None
    env_plugins.release_hung()
    env_plugins.RELEASE.clear()
    try:
        failing = dataclasses.replace(spec, factory=factory, step_timeout_s=0.2)
        got = gate(failing).check(played.frame, peer.peer_id, current_version=2)
    finally:
        env_plugins.release_hung()
    assert got.drop == reason and not got.blame, got.detail


def test_a_publishers_failing_re_runs_cool_it_down_doubling() -> None:
    """RerunCooldown: no re-run while the publisher's calls hang; after a failed re-run none for
    the bound, then twice that after the next failure in a row, at most COOLDOWN_MAX_S; a
    completed re-run ends the streak; others are not affected."""
    c = RerunCooldown(base_s=2.0)
    assert not c.refuses("p", 0.0, hung=0) and c.refuses("p", 0.0, hung=1)
    assert c.record("p", DropReason.ENV_TIMEOUT, 10.0) == 2.0
    assert c.refuses("p", 11.9, hung=0) and not c.refuses("p", 12.0, hung=0) and not c.refuses("q", 11.0, hung=0)
    assert c.record("p", DropReason.ENV_FAILED, 12.0) == 4.0 and c.refuses("p", 15.9, hung=0)
    for k in range(3, 12):
        assert c.record("p", DropReason.ENV_TIMEOUT, 100.0 * k) == min(COOLDOWN_MAX_S, 2.0 * 2 ** (k - 1))
    assert c.record("p", DropReason.ENV_UNAVAILABLE, 1300.0) is None and c.refuses("p", 1300.0, hung=0)  # not a re-run's end
    assert c.record("p", None, 2000.0) is None and not c.refuses("p", 2000.0, hung=0)
    assert c.record("p", DropReason.ENV_TIMEOUT, 2001.0) == 2.0  # the streak began again
    assert c.record("q", DropReason.BAD_EPISODE, 2001.0) is None and not c.refuses("q", 2001.0, hung=0)


def test_a_failed_group_takes_the_later_ones_with_it(engine: TorchEngine, spec: EnvSpec, peer: Identity) -> None:
    """Group 1's seed breaks the environment: the batch carries group 0 only (the later groups
    would otherwise sit in slots that are not theirs), and the learner takes it."""
    bad_seed = prompt_draw(RUN, peer.peer_id, 12, 1)

    class FailsOnOneSeed(CalcEnv):
        def reset(self, seed: int) -> Message:
            if seed == bad_seed:
                raise RuntimeError("this seed breaks the environment")
            return super().reset(seed)

    flaky = dataclasses.replace(spec, factory=lambda: FailsOnOneSeed(problems=2))
    out = play_batch(engine, FMT, flaky, run_id=RUN, identity=peer, seq=12, groups=3, group_size=G, temperature=1.0)
    assert out.batch is not None and len(out.batch.groups) == 1 and out.dropped == {"env_error": 2}
    assert out.frame is not None
    assert gate(spec).check(out.frame, peer.peer_id, current_version=engine.version).drop is None
