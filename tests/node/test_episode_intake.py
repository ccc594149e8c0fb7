"""A learner whose run has an environment takes episode batches through its gossip intake: the
validator's cheap checks, the consumer's re-run of every episode, the ban ladder, the replay
buffer, the journal and the trainer (a real `Learner`, host built, not started).

Hostile: a joined peer that fabricates what the environment answered passes the cheap checks and
is caught by the re-run (`bad_episode`, a ban; its buffered groups purged); a rollout batch where
episodes are due, an episode batch with a group too few, one from the future, one on a version
never published, one tagged as begun on another version, broken frames: each refused with its
reason and counted in the ledger, honest episodes still trained; true episodes whose model
tokens lie (made-up log-probs, a colder sampler) are caught by the spot checks. And a learner
that dies comes back with its episode steps redone and its buffered episodes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import trio

from echo_node.config import CheckpointConfig, EnvConfig, RLConfig, RunConfig
from echo_node.envs import is_env_id
from echo_node.envs.format import CharFormat
from echo_node.envs.gate import EpisodeGate
from echo_node.envs.peer import PlayedBatch, play_batch
from echo_node.learner.learner import Learner
from echo_node.learner.replay import group_from_record, group_record
from echo_node.ml import defaults
from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import AdditionTask, get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.ml.warmup import warmup
from echo_node.policy import Policy
from protocol import Identity, seal
from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from tests.factories import ALICE, BOB, CREATED, MALLORY, learner_tasks, make_batch, offer, start_learner

TOK = CharTokenizer()
RUN = "run-1"


@pytest.fixture(scope="module")
def warm() -> dict[str, torch.Tensor]:
    """The embedded model after its warm-up (cached on disk): its episodes earn some reward, so
    an update has a signal to train on."""
    model = build_model(tiny_llama_config(TOK.vocab_size), seed=0)
    warmup(model, TOK, AdditionTask(), config=defaults.WARMUP, cache_dir=Path.home() / ".cache" / "echo-node")
    return model.state_dict()


def env_learner(runs_dir: Path, warm: dict[str, torch.Tensor], problems: int = 2) -> Learner:
    """A learner of an environment run whose host is not started (announcements go nowhere);
    two groups a step, no checkpoint after the first: a restart redoes its steps from the journal."""
    cfg = RunConfig(run_id=RUN, runs_dir=runs_dir, env=EnvConfig(name="calc", options={"problems": problems}),
                    rl=RLConfig(groups_per_step=2, staleness=4), checkpoint=CheckpointConfig(every_versions=1000, min_interval_s=0))
    arch = tiny_llama_config(TOK.vocab_size)
    model = build_model(arch, seed=0)
    model.load_state_dict(warm)
    ln = Learner(cfg, Identity.from_seed(b"\x01" * 32), Policy(model, TOK, get_task("addition"), {"kind": "embedded", **arch}, TOK.to_dict()))

    async def announce(topic: str, data: bytes) -> None:
        pass

    ln.node.publish = announce  # type: ignore[method-assign]
    CREATED.append(ln)
    return ln


@pytest.fixture
def learner(tmp_path: Path, warm: dict[str, torch.Tensor]) -> Learner:
    """Started (version 0 published, which the spot checks load), ALICE and MALLORY joined."""
    ln = env_learner(tmp_path, warm)
    trio.run(start_learner, ln, (ALICE, MALLORY))
    # Their heartbeats say what they run: the torch engine on a CPU, whose honest log-prob
    # envelope is measured (the spot checks hold them to it).
    for peer in (ALICE, MALLORY):
        ln.capacity.heartbeat(peer.peer_id, 0.0, installed=0, price=0.0, engine="torch", device="cpu")
    return ln

def play(learner: Learner, identity: Identity, seq: int, *, groups: int = 2, temperature: float = 1.0) -> PlayedBatch:
    """What a peer on the learner's current weights plays for `seq` (its seeds are its slots'),
    at the run's temperature unless told otherwise."""
    engine = TorchEngine(learner.policy.model, eos_id=TOK.eos_id, pad_id=TOK.pad_id, version=learner.version)
    assert learner.env is not None
    out = play_batch(engine, CharFormat(TOK), learner.env, run_id=RUN, identity=identity, seq=seq, groups=groups,
                     group_size=learner.cfg.rl.group_size, temperature=temperature)
    assert out.batch is not None and out.frame is not None and not out.dropped
    return out


def forged(played: PlayedBatch, identity: Identity, group: EpisodeGroup) -> bytes:
    assert played.batch is not None
    return seal(dataclasses.replace(played.batch, groups=(group, *played.batch.groups[1:])), identity)


def fabricate(group: EpisodeGroup) -> EpisodeGroup:
    """Every environment turn of the group's multi-turn episodes replaced by one the environment
    never gave (what a tool "answered" to the model's liking); the first episode made multi-turn
    if none is."""
    def lie(e: Episode) -> Episode:
        turns = tuple(dataclasses.replace(t, token_ids=tuple(reversed(t.token_ids)) + (t.token_ids[0],)) if t.from_env else t
                      for t in e.turns)
        return Episode(turns=turns, reward=e.reward)

    episodes = [lie(e) for e in group.episodes]
    if all(len(e.turns) == 1 for e in episodes):
        first = episodes[0].turns[0]
        fake = Turn(from_env=True, token_ids=(TOK.encode("7")[0],), logprobs=(), versions=())
        episodes[0] = Episode(turns=(first, fake, first), reward=1.0)
    return dataclasses.replace(group, episodes=tuple(episodes))


def test_an_environment_run_announces_its_environment_and_takes_only_episodes(learner: Learner) -> None:
    assert learner.env is not None and is_env_id(learner.spec().task) and learner.spec().task == learner.env.env_id
    # A rollout batch where episodes are due: the envelope's kind is refused, a strike.
    assert not offer(learner, seal(make_batch(identity=MALLORY, seq=1), MALLORY), MALLORY.peer_id)
    assert learner.buffer.ledger.dropped["malformed"] == 1 and learner.peers.penalties[MALLORY.peer_id] == 1
    honest = play(learner, ALICE, 5)
    assert honest.frame is not None and honest.batch is not None
    assert offer(learner, honest.frame, ALICE.peer_id)
    assert len(learner.buffer) == 2 and learner.buffer.ledger.received == 1 + honest.batch.num_samples
    # A newcomer's batch is spot-checked in full (probation): the episodes' model tokens passed.
    assert learner.verifier is not None and learner.verifier.stats.rows_spot_checked >= 8
    # What the journal keeps of a buffered group gives that group back, kind and all.
    (_, _, group), *_ = learner.buffer.live()
    assert isinstance(group, EpisodeGroup) and group_from_record(group_record(group)) == group
    learner.buffer.check()


def test_fabricated_observations_are_caught_by_the_re_run_and_the_publisher_banned(learner: Learner) -> None:
    first = play(learner, MALLORY, 1)
    assert first.frame is not None and first.batch is not None
    assert offer(learner, first.frame, MALLORY.peer_id)  # honest at first: buffered
    assert learner.buffer.trained_groups[MALLORY.peer_id] == 0 and len(learner.buffer) == 2
    second = play(learner, MALLORY, 2)
    assert second.batch is not None
    lie = forged(second, MALLORY, fabricate(second.batch.groups[0]))
    # The cheap checks cannot see it (a well-formed, signed, in-budget batch): the validator
    # passes it, and the consumer's re-run catches it.
    assert learner.intake.validate(MALLORY.peer_id, MALLORY.peer_id, lie)

    async def deliver() -> None:
        await learner.intake.deliver(lie, MALLORY.peer_id)

    trio.run(deliver)
    assert learner.peers.is_banned(MALLORY.peer_id)
    dropped = learner.buffer.ledger.dropped
    assert dropped["bad_episode"] == second.batch.num_samples
    assert dropped["purged"] == first.batch.num_samples
    assert len(learner.buffer) == 0
    # Honest episodes still get in and train; the update's groups are the episodes' (masked).
    honest = play(learner, ALICE, 3)
    assert honest.frame is not None and offer(learner, honest.frame, ALICE.peer_id)

    async def step() -> dict[str, float] | None:
        return await learner.trainer.step(learner.buffer.take(2, learner.version))

    stats = trio.run(step)
    assert stats is not None and not stats.get("skipped") and learner.trainer.version == 1, stats
    assert learner.buffer.ledger.trained == 2 * learner.cfg.rl.group_size
    learner.buffer.check()


def test_refusals_on_arrival_are_counted_with_their_reason(learner: Learner) -> None:
    played = play(learner, MALLORY, 4)
    assert played.batch is not None
    g = played.batch.groups[0]
    cases = {
        "bad_group": forged(played, MALLORY, dataclasses.replace(g, episodes=g.episodes[1:])),
        "future_version": forged(played, MALLORY, _retag(g, 3)),
    }
    for reason, frame in cases.items():
        assert not offer(learner, frame, MALLORY.peer_id), reason
        assert learner.buffer.ledger.dropped[reason] == played.batch.num_samples - (reason == "bad_group"), reason
    assert not learner.peers.is_banned(MALLORY.peer_id) and learner.peers.penalties[MALLORY.peer_id] == 2
    # The learner at version 2, having published only 0 (every K-th version is published):
    # tokens of version 1 name weights no peer ever had.
    learner.trainer.version = 2
    learner.peers.join(BOB.peer_id, 0.0)
    theirs = play(learner, BOB, 4)
    assert theirs.batch is not None
    unpublished = forged(theirs, BOB, _retag(theirs.batch.groups[0], 1))
    assert not offer(learner, unpublished, BOB.peer_id)
    assert learner.buffer.ledger.dropped["unpublished_version"] == theirs.batch.num_samples
    assert learner.peers.penalties[BOB.peer_id] == 1
    # Another slot's episodes (the batch's next group, moved up): the re-run of this slot's seed
    # sees another first observation.
    moved = forged(played, MALLORY, dataclasses.replace(played.batch.groups[1], group_id=g.group_id))
    assert offer(learner, moved, MALLORY.peer_id)  # the cheap checks pass; the re-run does not
    assert learner.buffer.ledger.dropped["bad_episode"] == played.batch.num_samples
    assert learner.peers.is_banned(MALLORY.peer_id)
    learner.buffer.check()


def _retag(g: EpisodeGroup, version: int) -> EpisodeGroup:
    """Every model token of the group tagged `version`."""
    episodes = tuple(Episode(turns=tuple(dataclasses.replace(t, versions=(version,) * len(t.versions)) for t in e.turns),
                             reward=e.reward) for e in g.episodes)
    return dataclasses.replace(g, episodes=episodes)


def test_a_batch_that_is_not_an_episode_batch_is_malformed_not_a_crash(learner: Learner) -> None:
    batch = EpisodeBatch(run_id=RUN, peer_id=MALLORY.peer_id, seq=7, groups=play(learner, MALLORY, 7).batch.groups)  # type: ignore[union-attr]
    frame = seal(batch, MALLORY)
    for bad in (frame[:-3], frame + b"\x00", b"\x93\x01\x02"):
        assert not offer(learner, bad, MALLORY.peer_id)
    assert sum(learner.buffer.ledger.dropped.values()) == 3
    learner.buffer.check()


def test_a_restarted_learner_redoes_its_episode_steps_and_takes_its_buffered_episodes_back(
    tmp_path: Path, warm: dict[str, torch.Tensor]
) -> None:
    """The journal's `admit` records carry the episode groups' kind: a learner that died after two
    versions and one more batch comes back at the same version with the same weights (its steps
    redone on the journaled episodes) and the same buffered episodes."""
    first = env_learner(tmp_path, warm)

    async def feed(seq: int) -> None:
        frame = play(first, ALICE, seq).frame
        assert frame is not None and first.intake.validate(ALICE.peer_id, ALICE.peer_id, frame)
        await first.intake.deliver(frame, ALICE.peer_id)
        await first._flush_journal()

    async def go() -> int:
        await start_learner(first, (ALICE,))
        async with learner_tasks(first):
            # A batch whose every group's episodes earned one reward makes no version (no_signal):
            # which seqs have a signal depends on the warm-up's last bits, so batches go in until
            # two versions are made.
            seq = 0
            while first.version < 2 and seq < 8:
                seq += 1
                await feed(seq)
                await first.update()
            await feed(seq + 1)
            return seq

    last = trio.run(go)
    assert first.version == 2 and len(first.buffer) == 2, (last, first.buffer.ledger.as_dict())
    second = env_learner(tmp_path, warm)
    trio.run(start_learner, second, (ALICE,))
    assert second.version == 2 and second.resumed is not None and not second.resumed.diverged
    assert second.resumed.redone == 2  # from the journal: no checkpoint since the start
    a, b = first.policy.model.state_dict(), second.policy.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "the redone steps landed elsewhere"
    assert [g for _, _, g in second.buffer.live()] == [g for _, _, g in first.buffer.live()]
    assert all(isinstance(g, EpisodeGroup) for _, _, g in second.buffer.live())
    assert second.buffer.ledger.as_dict() == first.buffer.ledger.as_dict()
    second.buffer.check()
    # Another environment is another run: its journaled episodes would be judged by the wrong one.
    second.state.checkpoint_now()  # (the config a resume is held to is a checkpoint's)
    third = env_learner(tmp_path, warm, problems=3)
    with pytest.raises(ValueError, match=r"another config \(env.options.problems: 2 -> 3\)"):
        trio.run(start_learner, third, (ALICE,))


def _claim(group: EpisodeGroup, logprob: float) -> EpisodeGroup:
    """The group with every model token's behaviour log-prob claimed as `logprob`."""
    episodes = tuple(Episode(turns=tuple(t if t.from_env else dataclasses.replace(t, logprobs=(logprob,) * len(t.logprobs))
                                         for t in e.turns), reward=e.reward) for e in group.episodes)
    return dataclasses.replace(group, episodes=episodes)


@pytest.mark.parametrize("how", ["forged_logprobs", "cold_sampler"])
def test_episodes_whose_model_tokens_were_not_sampled_as_claimed_are_caught(learner: Learner, how: str) -> None:
    """The re-run holds the environment's side of an episode; the spot checks hold the model's.
    Observations and returns here are what the environment gives (the re-run passes), but the
    model's tokens lie: their log-probs are made up (claimed near-certain, which would shrink
    their importance weights and hide any choice of actions), or they were sampled at a lower
    temperature than the run's (a sharper policy passed off as the run's). Caught on the
    publisher's first batch (probation checks it in full) and banned."""
    if how == "forged_logprobs":
        played = play(learner, MALLORY, 1)
        assert played.batch is not None
        frame = seal(dataclasses.replace(played.batch, groups=tuple(_claim(g, -0.01) for g in played.batch.groups)), MALLORY)
    else:
        played = play(learner, MALLORY, 1, temperature=0.3)
        assert played.frame is not None
        frame = played.frame
    assert learner.intake.validate(MALLORY.peer_id, MALLORY.peer_id, frame)

    async def deliver() -> None:
        await learner.intake.deliver(frame, MALLORY.peer_id)

    trio.run(deliver)
    dropped = learner.buffer.ledger.dropped
    assert learner.peers.is_banned(MALLORY.peer_id), dict(dropped)
    assert dropped["bad_logprobs"] + dropped["bad_sampling"] == played.batch.num_samples  # type: ignore[union-attr]
    assert "bad_episode" not in dropped  # the environment's side was true
    learner.buffer.check()


def test_a_batch_stale_on_arrival_is_dropped_as_stale_without_a_re_run(learner: Learner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async, S = 4: episodes begun on version 0 that reach a learner at version 5 are stale
    whatever they hold. They are counted as stale, never re-run (the environment's time is the
    learner's largest cost at high latency), and the publisher is not blamed."""
    played = play(learner, ALICE, 6)
    assert played.frame is not None and played.batch is not None
    learner.trainer.version = 5

    def never(*args: object) -> object:
        raise AssertionError("a stale batch was re-run")

    monkeypatch.setattr(EpisodeGate, "rerun", never)
    assert offer(learner, played.frame, ALICE.peer_id)
    assert learner.buffer.ledger.dropped == {"stale": played.batch.num_samples}
    assert not learner.peers.penalties and not learner.peers.is_banned(ALICE.peer_id)
    learner.buffer.check()
