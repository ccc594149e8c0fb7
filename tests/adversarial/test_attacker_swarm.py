"""The six attacker peers of benchmarks/attackers.py and the adaptive slot picker join a swarm
next to two honest peers: every one is caught by the check its lie fails, none of their groups
is trained, and no honest peer is ever flagged. The adaptive slot picker (honest answers to the
slots it chose) is caught once its skips pass the allowance.

The swarm runs in one process on virtual time (tests/memory_swarm.py), so the slot picker's
catch, which comes after a count of its skips at the pace the demand sets, is a matter of
versions, not of how loaded the machine is. The same attackers as their own processes over
libp2p: tests/integration/test_proven_attackers.py; what each does with verification off:
tests/adversarial/test_attack_classes.py, benchmarks/verification.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.attackers import ATTACKS
from echo_node.learner.intake import SKIP_ALLOWANCE
from echo_node.learner.learner import Learner
from echo_node.metrics import read_metrics
from tests.memory_swarm import run_memory_swarm

EXPECTED = {
    "fake_rewards": {"bad_reward"},
    "garbage": {"bad_logprobs", "bad_sampling"},
    "other_model": {"bad_logprobs"},
    "cherry_picked": {"bad_prompt"},
    "copier": {"bad_prompt"},
    "poison": {"bad_sampling", "bad_logprobs"},
}
# Caught only once its skipped seqs pass the intake's allowance (echo_node/learner/intake.py): it
# picks one slot in five, so it may publish about SKIP_ALLOWANCE / 4 honest batches of its
# choosing first (each one group). It samples with the seed of the slot it started from and
# publishes under the slot it picked: the sampler's replay (echo_node/learner/spot_check.py,
# check 6) proves that noise is not the picked slot's (bad_sampling) once it has checked enough
# of its tokens; whichever comes first.
# The rejoining slot picker samples each picked seq with its own seed (nothing for the replay to
# see) and joins again before publishing it: only its skips catch it, rejoins or not.
ADAPTIVE = {"slot_picker": {"bad_prompt", "bad_sampling"}, "rejoining_slot_picker": {"bad_prompt"}}
# After the last catch, honest rollouts keep being trained this many versions (none may be flagged).
AFTER_VERSIONS = 10


def test_every_attacker_is_caught_and_no_honest_peer_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = [*EXPECTED, *ADAPTIVE]
    all_caught_at: list[int] = []

    def done(learner: Learner, ids: dict[str, str]) -> bool:
        if not all_caught_at and all(learner.peers.is_banned(ids[n]) for n in names):
            all_caught_at.append(learner.version)
        return bool(all_caught_at) and learner.version >= all_caught_at[0] + AFTER_VERSIONS

    run = run_memory_swarm(tmp_path, peers=2, versions=None, generators={n: ATTACKS[n] for n in names}, stop_when=done)
    s = run.summary
    assert all_caught_at, f"not every attacker was caught: {s['verification']}"
    ids = run.named
    caught = {r["peer"]: r for r in read_metrics(run.learner.cfg.run_dir / "metrics.jsonl") if r.get("event") == "caught"}
    published = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    honest = [p for p in run.peer_ids if p not in ids.values()]
    for attack, reasons in EXPECTED.items():
        assert any(r["peer"] == ids[attack] for r in published), f"{attack} never published"
        record = caught.get(ids[attack])
        assert record is not None, f"{attack} was never caught: {s['verification']}"
        assert record["reason"] in reasons and record["batches"] <= 2, (attack, record)
        assert s["trained_groups"].get(ids[attack], 0) == 0, attack
    for attack, reasons in ADAPTIVE.items():
        record = caught.get(ids[attack])
        assert record is not None and record["reason"] in reasons, (attack, record, s["verification"])
        assert s["trained_groups"].get(ids[attack], 0) <= SKIP_ALLOWANCE, (attack, s["trained_groups"])
    assert len(honest) == 2
    for peer in honest:
        assert peer not in caught and peer not in s["banned"] and not s["penalties"].get(peer)
        assert s["trained_groups"].get(peer, 0) > 0
