"""Episodes through the swarm: a learner whose run has an environment (`[env]`), a rollout peer
that plays it, and a hostile peer, as separate processes over libp2p on loopback. The embedded
model learns the built-in calculator environment.

The peer learns the run's environment from the spec (its id, built from its own `[env]`), plays
episode batches on its slots' seeds and gossips them; the learner re-runs every episode and
trains on them, partial ones too (weights swapped in between or inside an episode's turns). The
hostile peer gossips a signed, in-budget episode batch whose observations it made up: the re-run
catches it, the learner bans it and goes on training the honest peer's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from echo_node.config import load_config
from echo_node.envs import load_env
from echo_node.envs.format import CharFormat
from echo_node.envs.runner import run_groups
from echo_node.metrics import summarize_run
from echo_node.ml.engine import TorchEngine
from echo_node.net.p2p import P2PNode
from echo_node.policy import learner_policy
from protocol import Identity, seal
from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from tests.integration.conftest import Cluster
from tests.integration.test_swarm import assert_ledger, join_to_publish, summary, train_records, wait_for_versions

pytestmark = pytest.mark.integration

ENV_TOML = """
[env]
name = "calc"
[env.options]
problems = 2
"""
# Learning is judged over versions (tests/integration/test_swarm.py says why), and on the same
# episodes for both models: the run's final weights and its starting ones each play the same
# PROBLEMS calc problems, GROUP_SIZE times each, under one sampling seed (`played_return`).
# The sampled reward of the run's own updates is no such measure: its quarters' means differ by
# which problems each quarter drew (their difference over 120 versions ranged 0.009-0.063 in 13
# runs, 5 of them under 0.025). The paired gain of those runs' final weights: 0.032-0.052.
VERSIONS = 120
PROBLEMS = 256
GROUP_SIZE = 4
MIN_GAIN = 0.02
DEADLINE_S = 900


def made_up(run_id: str, peer_id: str, seq: int, group_size: int, version: int) -> EpisodeBatch:
    """Episodes no model played and no environment answered: well formed, within the default
    budgets, claimed on `version`; the first observation and the tool's answer are invented."""
    model = Turn(from_env=False, token_ids=(3, 4, 1), logprobs=(-0.1,) * 3, versions=(version,) * 3)
    answer = Turn(from_env=True, token_ids=(5,), logprobs=(), versions=())
    episode = Episode(turns=(model, answer, model), reward=1.0)
    group = EpisodeGroup(group_id="g0", prompt_ids=(0, 5, 6), episodes=(episode,) * group_size)
    return EpisodeBatch(run_id=run_id, peer_id=peer_id, seq=seq, groups=(group,))


async def lie(bootstrap: str, run_id: str, attacker: Identity, group_size: int, version: Callable[[], int]) -> None:
    """Gossip three made-up batches on the learner's newest published version, read once joined:
    a batch on a version the learner has left behind by more than S is dropped as stale
    unchecked, so an attacker that wants its lie trained claims a fresh one (and a join can
    outlast S versions on a loaded machine)."""
    node = P2PNode(attacker)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        topic = await join_to_publish(node, bootstrap, run_id)
        claimed = version()
        for seq in range(3):
            await node.publish(topic, seal(made_up(run_id, attacker.peer_id, seq, group_size, claimed), attacker))
        await trio.sleep(2)
        nursery.cancel_scope.cancel()


def played_return(model: PreTrainedModel | None) -> float:
    """The mean return of the embedded `model` (None: a run's starting weights, as its learner
    builds them) over PROBLEMS fixed calc problems (seeds 0...), GROUP_SIZE episodes each at the
    run's temperature, all under sampling seed 0."""
    cfg = load_config(None, env__name="calc", env__options={"problems": 2})
    start = learner_policy(cfg)
    tok = start.tokenizer
    engine = TorchEngine(start.model if model is None else model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    result = run_groups(engine, CharFormat(tok), load_env(cfg), range(PROBLEMS), group_size=GROUP_SIZE,
                        temperature=cfg.sampling.temperature, seed=0)
    returns = [e.reward for g in result.groups if g is not None for e in g.episodes]
    assert len(returns) == PROBLEMS * GROUP_SIZE, result.dropped
    return sum(returns) / len(returns)


# py-libp2p 0.8.1 leaves some TCP sockets of a closed in-process host to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_swarm_trains_on_verified_episodes_and_bans_a_peer_that_makes_them_up(cluster: Cluster, tmp_path: Path) -> None:
    run_id = "it-env"
    config = tmp_path / "env.toml"
    config.write_text(ENV_TOML)
    bootstrap = cluster.start_bootstrap()
    learner, _ = cluster.start_learner(run_id, "--config", str(config), "--mode", "async", "--seconds", str(DEADLINE_S))
    cluster.start_peer("peer0", run_id, "--config", str(config))
    wait_for_versions(cluster, run_id, 2, timeout=DEADLINE_S)
    attacker = Identity.generate()
    trio.run(lie, bootstrap, run_id, attacker, 8, lambda: int(train_records(cluster, run_id)[-1]["published"]))  # type: ignore[call-overload]
    gc.collect()  # the host's leaked sockets, under this test's warning filter
    wait_for_versions(cluster, run_id, VERSIONS, timeout=DEADLINE_S)
    learner.proc.send_signal(2)
    assert learner.proc.wait(120) == 130
    s = summary(cluster, run_id)
    dropped = s["rollouts_dropped"]
    assert isinstance(dropped, dict)
    # The made-up batch reached the re-run, which caught it: a ban, not a strike.
    assert dropped.get("bad_episode", 0) >= 8 and s["banned"] == [attacker.peer_id], (dropped, s["banned"])
    # The honest peer's episodes all passed: nothing else was refused (`overload`: a publisher on
    # probation has one batch checked at a time; the attacker's later ones waited in vain).
    assert set(dropped) <= {"bad_episode", "banned", "overload", "stale", "unused_at_exit", "no_signal"}, dropped
    assert_ledger(s)
    records = train_records(cluster, run_id)
    assert len(records) >= VERSIONS and all(int(r["groups"]) > 0 for r in records)  # type: ignore[call-overload]
    # Partial rollouts: weights swapped in mid-episode (between or inside turns) and the learner
    # re-ran and trained those episodes like any other.
    assert summarize_run(records)["spanning"] > 0
    # It learned: its final weights (exported at the stop) answer more of the same problems.
    final = AutoModelForCausalLM.from_pretrained(cluster.run_dir(run_id) / "model", dtype=torch.float32)
    before, after = played_return(None), played_return(final)
    assert after - before >= MIN_GAIN, (before, after, s["reward_first"], s["reward_last"])
    assert s["train_errors"] == 0 and str(s["task"]).startswith("env:calc@")
    # Every trained group is the honest peer's episodes (the attacker's were never buffered).
    trained = s["trained_groups"]
    assert isinstance(trained, dict) and attacker.peer_id not in trained and sum(trained.values()) >= VERSIONS
