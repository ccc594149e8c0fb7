"""End to end: the six attacker peers of benchmarks/attackers.py, each its own process, join a
real swarm next to two honest peers. Every one is caught by the check its lie fails, none of
their groups is trained, and no honest peer is ever flagged. The adaptive slot picker (honest
answers to the slots it chose) is caught once its skips pass the allowance. (What each attack does with
verification off: tests/adversarial/test_attack_classes.py, benchmarks/verification.py.)"""

from __future__ import annotations

import json
import signal
import time

import pytest

from echo_node.learner.intake import SKIP_ALLOWANCE
from echo_node.metrics import read_metrics
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

EXPECTED = {
    "fake_rewards": {"bad_reward"},
    "garbage": {"bad_logprobs", "bad_sampling"},
    "other_model": {"bad_logprobs"},
    "cherry_picked": {"bad_prompt"},
    "copier": {"bad_prompt"},
    "poison": {"bad_sampling", "bad_logprobs"},
}
# Caught only once its skipped seqs pass the intake's allowance (echo_node/learner/intake.py): it picks
# one slot in five, so it may publish about SKIP_ALLOWANCE / 4 honest batches of its choosing
# first (each one group).
# This slot picker samples with the seed of the slot it started from and publishes under the
# slot it picked: the sampler's replay (echo_node/learner/spot_check.py, check 6) proves that noise is not the
# picked slot's (bad_sampling) once it has checked enough of its tokens; whichever comes first.
ADAPTIVE = {"slot_picker": {"bad_prompt", "bad_sampling"}}
# Ten processes start at once on two cores: joining can take a minute, and the slot picker is
# caught by a count of its skips, which it reaches at the pace the demand sets (slower on a loaded
# machine). The learner runs until every attacker was caught (or this generous bound passed),
# then is stopped with SIGINT.
CAUGHT_WITHIN_S = 480
# After the last catch, honest rollouts keep being trained this long (none may be flagged).
AFTER_S = 10


def test_every_attacker_is_caught_and_no_honest_peer_is(cluster: Cluster) -> None:
    run_id = "it-attackers"
    cluster.start_bootstrap()
    learner, ready = cluster.start_learner(run_id, "--mode", "async", "--staleness", "4")
    honest = [cluster.start_peer(f"peer{i}", run_id) for i in range(2)]
    attackers = {
        attack: cluster.swarm.spawn(
            attack,
            [attack, "--bootstrap", cluster.bootstrap_addr, "--run-id", f"{run_id}@{ready['peer_id']}", "--key-file", str(cluster.keys / f"{attack}.key"),
             "--runs-dir", str(cluster.root / "runs")],
            module="benchmarks.attackers",
        )
        for attack in [*EXPECTED, *ADAPTIVE]
    }
    ids = {name: _peer_id(cluster, name) for name in [*EXPECTED, *ADAPTIVE, "peer0", "peer1"]}
    metrics = cluster.run_dir(run_id) / "metrics.jsonl"
    deadline = time.monotonic() + CAUGHT_WITHIN_S
    while time.monotonic() < deadline and not {ids[a] for a in [*EXPECTED, *ADAPTIVE]} <= {
        r["peer"] for r in read_metrics(metrics) if r.get("event") == "caught"
    }:
        assert learner.proc.poll() is None, "the learner exited"
        time.sleep(0.5)
    time.sleep(AFTER_S)
    learner.proc.send_signal(signal.SIGINT)
    assert learner.proc.wait(120) == 130  # a stop writes a checkpoint and announces the end (bounded)
    s = json.loads((cluster.run_dir(run_id) / "summary.json").read_text())
    caught = {r["peer"]: r for r in read_metrics(metrics) if r.get("event") == "caught"}
    for attack, reasons in EXPECTED.items():
        published = [line for line in attackers[attack].stdout_path.read_text().splitlines() if line.startswith("{")]
        assert published, f"{attack} never published"
        record = caught.get(ids[attack])
        assert record is not None, f"{attack} was never caught: {s['verification']}"
        assert record["reason"] in reasons and record["batches"] <= 2, (attack, record)
        assert s["trained_groups"].get(ids[attack], 0) == 0, attack
    for attack, reasons in ADAPTIVE.items():
        record = caught.get(ids[attack])
        assert record is not None and record["reason"] in reasons, (attack, record, s["verification"])
        assert s["trained_groups"].get(ids[attack], 0) <= SKIP_ALLOWANCE, (attack, s["trained_groups"])
    for name in ("peer0", "peer1"):
        assert ids[name] not in caught and ids[name] not in s["banned"] and not s["penalties"].get(ids[name])
        assert s["trained_groups"].get(ids[name], 0) > 0
    assert all(p.proc.poll() is None for p in honest)


def _peer_id(cluster: Cluster, name: str) -> str:
    from protocol.identity import load_or_create_key_file

    return load_or_create_key_file(cluster.keys / f"{name}.key").peer_id
