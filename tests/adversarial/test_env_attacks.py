"""Hostile environments, and peers that aim the learner's environment at itself (issue 31), on a
real `Learner` of an environment run (host built, not started), in one trio run on virtual time.

- A peer's episode actions can make the learner's re-run of them hang (the peer chooses them,
  and a failed re-run blames nobody). The learner must live, count every batch, keep training
  on honest peers' episodes, and pay for the attacker's re-runs a bounded cost: one timeout,
  then its batches are dropped unplayed while the calls it hung still run and for a cooldown.
  When hung calls take every environment thread, every batch is dropped as env_unavailable
  (one WARNING) until they end, and then the learner re-runs again.
- An untrusted-only environment (non-deterministic, allowlisted peers) is not re-run: honest
  peers' episodes are trained, never judged by a re-run that cannot agree; the cheap structural
  checks still catch what they can see.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from echo_node.config import CheckpointConfig, EnvConfig, NetConfig, RLConfig, RunConfig, load_config, validate
from echo_node.envs import bounded, load_env
from echo_node.envs.format import CharFormat
from echo_node.envs.peer import PlayedBatch, play_batch
from echo_node.learner.learner import Learner
from echo_node.ml import defaults
from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import AdditionTask, get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.ml.warmup import warmup
from echo_node.policy import Policy
from protocol import Identity, seal
from protocol.episodes import Episode, Turn
from tests.factories import ALICE, CREATED, MALLORY, learner_tasks, start_learner
from tests.unit import env_plugins

TOK = CharTokenizer()
RUN = "run-1"
PLUGINS = "tests.unit.env_plugins:"


@pytest.fixture(scope="module")
def warm() -> dict[str, torch.Tensor]:
    model = build_model(tiny_llama_config(TOK.vocab_size), seed=0)
    warmup(model, TOK, AdditionTask(), config=defaults.WARMUP, cache_dir=Path.home() / ".cache" / "echo-node")
    return model.state_dict()


@pytest.fixture
def hung() -> object:
    """Hung plug-in calls for the test; released, and their threads ended, after it."""
    env_plugins.release_hung()
    env_plugins.RELEASE.clear()
    yield
    env_plugins.release_hung()


def env_learner(runs_dir: Path, warm: dict[str, torch.Tensor], env: EnvConfig, **cfg: object) -> Learner:
    """A learner of an environment run (two groups a step), host not started."""
    config = RunConfig(run_id=RUN, runs_dir=runs_dir, env=env, rl=RLConfig(groups_per_step=2, staleness=4),
                       checkpoint=CheckpointConfig(every_versions=1000, min_interval_s=0), **cfg)  # type: ignore[arg-type]
    validate(config)
    arch = tiny_llama_config(TOK.vocab_size)
    model = build_model(arch, seed=0)
    model.load_state_dict(warm)
    ln = Learner(config, Identity.from_seed(b"\x01" * 32), Policy(model, TOK, get_task("addition"), {"kind": "embedded", **arch}, TOK.to_dict()))

    async def announce(topic: str, data: bytes) -> None:
        pass

    ln.node.publish = announce  # type: ignore[method-assign]
    CREATED.append(ln)
    return ln


async def started(ln: Learner) -> None:
    await start_learner(ln, (ALICE, MALLORY))
    for peer in (ALICE, MALLORY):  # the torch engine on a CPU: its honest log-prob envelope is known
        ln.capacity.heartbeat(peer.peer_id, trio.current_time(), installed=0, price=0.0, engine="torch", device="cpu")


def play(ln: Learner, identity: Identity, seq: int) -> PlayedBatch:
    """What a peer on the learner's weights plays for `seq` (its slots' seeds)."""
    assert ln.env is not None
    engine = TorchEngine(ln.policy.model, eos_id=TOK.eos_id, pad_id=TOK.pad_id, version=ln.version)
    out = play_batch(engine, CharFormat(TOK), ln.env, run_id=RUN, identity=identity, seq=seq, groups=2,
                     group_size=ln.cfg.rl.group_size, temperature=1.0)
    assert out.batch is not None and out.frame is not None and not out.dropped, out.dropped
    return out


def has_signal(played: PlayedBatch) -> bool:
    """Whether some group of `played` has episodes whose returns differ (GRPO learns from it)."""
    assert played.batch is not None
    return any(len({e.reward for e in g.episodes}) > 1 for g in played.batch.groups)


async def send(ln: Learner, frame: bytes, origin: str) -> None:
    """The gossip path: the validator's cheap checks, then the consumer."""
    assert ln.intake.validate(origin, origin, frame)
    await ln.intake.deliver(frame, origin)


def aimed(played: PlayedBatch, identity: Identity, seq: int) -> bytes:
    """The batch with every episode one model turn that begins with the plug-in's cue: where the
    learner's re-run hangs. The budgets, versions and vocabulary are the run's; the first
    observation is the environment's (Guess's does not depend on the seed), so every check
    before the re-run passes."""
    assert played.batch is not None
    cue = tuple(TOK.encode(env_plugins.HangsOnCue.CUE)) + (TOK.eos_id,)
    v = played.batch.groups[0].episodes[0].first_version
    turn = Turn(from_env=False, token_ids=cue, logprobs=(-1.0,) * len(cue), versions=(v,) * len(cue))
    groups = tuple(dataclasses.replace(g, episodes=(Episode(turns=(turn,), reward=0.0),) * len(g.episodes))
                   for g in played.batch.groups)
    return seal(dataclasses.replace(played.batch, seq=seq, groups=groups), identity)


def test_a_peer_that_hangs_the_learners_re_run_costs_one_timeout_and_the_learner_trains_on(
    tmp_path: Path, warm: dict[str, torch.Tensor], hung: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    ln = env_learner(tmp_path, warm, EnvConfig(name=PLUGINS + "HangsOnCue", step_timeout_s=0.5))
    dropped = ln.buffer.ledger.dropped
    episodes = 2 * ln.cfg.rl.group_size  # per batch

    async def main() -> None:
        await started(ln)
        mallory = play(ln, MALLORY, 1)
        # 12 aimed batches of 16 episodes: 192 calls that would hang. The first batch is re-run
        # and hangs; the others are dropped unplayed while its calls hang.
        t0 = trio.current_time()
        for seq in range(1, 13):
            await send(ln, aimed(mallory, MALLORY, seq), MALLORY.peer_id)
        assert dropped["env_timeout"] == episodes and dropped["env_unavailable"] == 11 * episodes, dict(dropped)
        assert bounded.hung_threads(MALLORY.peer_id) == episodes
        assert not ln.peers.penalties and not ln.peers.is_banned(MALLORY.peer_id)  # nobody's fault it can prove
        assert trio.current_time() == t0  # no batch waited on anything but the re-run's own bound
        # An honest peer's episodes are re-run (fresh threads), buffered and trained. (The
        # peer's side plays in this process too: its later batches now, on published weights.)
        # Its first batch whose episodes' returns differ (a step needs signal); the seqs before
        # it are gaps the learner forgives (far below its allowance).
        honest = next(p for p in (play(ln, ALICE, seq) for seq in range(1, 17)) if has_signal(p))
        first = honest.batch.seq if honest.batch is not None else 0
        later = {k: play(ln, ALICE, first + k - 1).frame or b"" for k in (2, 3, 4)}
        await send(ln, honest.frame or b"", ALICE.peer_id)
        assert len(ln.buffer) == 2
        stats = await ln.trainer.step(ln.buffer.take(2, ln.version))
        assert stats is not None and not stats.get("skipped") and ln.trainer.version == 1, stats

        # Hung calls take every environment thread: every batch is dropped as env_unavailable,
        # with one WARNING, until they end.
        monkeypatch.setattr(bounded, "MAX_ENV_THREADS", bounded.env_threads() + episodes - 1)
        for seq in (2, 3):
            await send(ln, later[seq], ALICE.peer_id)
        assert dropped["env_unavailable"] == 13 * episodes and not ln.peers.penalties
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "environment thread" in r.getMessage()]
        assert len(warnings) == 1, warnings
        # They end: the learner re-runs again.
        await trio.to_thread.run_sync(env_plugins.release_hung)
        env_plugins.RELEASE.clear()
        await send(ln, later[4], ALICE.peer_id)
        assert len(ln.buffer) == 2, dict(dropped)

        # The attacker's cooldown outlasts its hung calls: one re-run's bound (a reset and
        # max_turns steps), doubled after each failure in a row.
        assert ln.intake.episodes is not None
        bound = ln.intake.episodes.rerun_bound_s
        assert bound == pytest.approx(0.5 * (1 + ln.cfg.env.max_turns))
        await send(ln, aimed(mallory, MALLORY, 13), MALLORY.peer_id)
        assert dropped["env_unavailable"] == 14 * episodes and dropped["env_timeout"] == episodes
        await trio.sleep(bound)
        await send(ln, aimed(mallory, MALLORY, 14), MALLORY.peer_id)  # re-run: hangs again
        assert dropped["env_timeout"] == 2 * episodes
        await trio.to_thread.run_sync(env_plugins.release_hung)
        await trio.sleep(bound * 2 - 0.5)
        await send(ln, aimed(mallory, MALLORY, 15), MALLORY.peer_id)
        assert dropped["env_timeout"] == 2 * episodes and dropped["env_unavailable"] == 15 * episodes
        # Re-run once its cooldown is over: the environment answers the cue now, and the
        # episode, claimed to end where the environment goes on, is the forgery it is.
        await trio.sleep(0.5)
        await send(ln, aimed(mallory, MALLORY, 16), MALLORY.peer_id)
        assert dropped["bad_episode"] == episodes and ln.peers.is_banned(MALLORY.peer_id)
        ln.buffer.check()

    with caplog.at_level(logging.INFO, logger="echo_node.learner.intake"):
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_untrusted_only_environment_trusts_allowlisted_peers_but_its_structure(
    tmp_path: Path, warm: dict[str, torch.Tensor]
) -> None:
    """Noisy answers from the global RNG: a re-run of an honest episode cannot agree with it.
    The learner does not re-run it: 10 honest batches of an allowlisted peer are trained, none
    judged bad_episode, nobody banned. What it can judge without the environment (here: tokens
    after a model turn's eos) is still a forgery, and a ban."""
    random.seed(31)
    allow = NetConfig(allow_peers=[ALICE.peer_id, MALLORY.peer_id])
    ln = env_learner(tmp_path, warm, EnvConfig(name=PLUGINS + "Noisy", untrusted_only=True), net=allow)
    assert ln.env is not None and not ln.env.deterministic
    dropped = ln.buffer.ledger.dropped

    async def main() -> None:
        await started(ln)
        async with learner_tasks(ln):
            for seq in range(1, 11):  # each played on the newest weights the learner published
                await send(ln, play(ln, ALICE, seq).frame or b"", ALICE.peer_id)
                assert len(ln.buffer) == 2 and not ln.peers.penalties, dict(dropped)
                await ln.update()
        assert ln.buffer.ledger.trained > 0 and set(dropped) <= {"no_signal"}, dict(dropped)
        played = play(ln, MALLORY, 1)
        assert played.batch is not None
        g = played.batch.groups[0]
        v, digit = g.episodes[0].first_version, TOK.encode("1")[0]
        on_after_eos = Turn(from_env=False, token_ids=(digit, TOK.eos_id, digit), logprobs=(-1.0,) * 3, versions=(v,) * 3)
        forged = dataclasses.replace(g, episodes=(Episode(turns=(on_after_eos,), reward=0.0),) + g.episodes[1:])
        frame = seal(dataclasses.replace(played.batch, groups=(forged, *played.batch.groups[1:])), MALLORY)
        await send(ln, frame, MALLORY.peer_id)
        assert dropped["bad_episode"] == played.batch.num_samples and ln.peers.is_banned(MALLORY.peer_id)
        assert not ln.peers.is_banned(ALICE.peer_id)
        ln.buffer.check()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_peer_plays_groups_of_one_start_on_an_environment_whose_resets_differ() -> None:
    """NoisyStart's first message is random: the runner plays a group's other episodes on copies of
    its first one's environment, made after its reset, so every group is kept and is one start.
    One that cannot be copied loses the group, counted (env_error), and never the peer."""
    random.seed(31)
    cfg = dict(env__untrusted_only=True, net__allow_peers=[ALICE.peer_id])
    engine = TorchEngine(build_model(tiny_llama_config(TOK.vocab_size), seed=0), eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    spec = load_env(load_config(None, env__name=PLUGINS + "NoisyStart", **cfg))  # type: ignore[arg-type]
    out = play_batch(engine, CharFormat(TOK), spec, run_id=RUN, identity=ALICE, seq=1, groups=8, group_size=4, temperature=1.0)
    assert out.batch is not None and len(out.batch.groups) == 8 and not out.dropped, out.dropped
    stuck = load_env(load_config(None, env__name=PLUGINS + "NoisyStartUncopyable", **cfg))  # type: ignore[arg-type]
    out = play_batch(engine, CharFormat(TOK), stuck, run_id=RUN, identity=ALICE, seq=2, groups=8, group_size=4, temperature=1.0)
    # A group whose 4 random resets agree (chance 1/1000 each) is kept; the others are not.
    assert sum(out.dropped.values()) + (len(out.batch.groups) if out.batch else 0) == 8
    assert set(out.dropped) == {"env_error"}, out.dropped
