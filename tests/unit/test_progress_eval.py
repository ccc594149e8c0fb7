"""The learner's progress line (echo_node/learner/progress.py) and held-out evaluation
(echo_node/learner/evaluation.py), on the real embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo_node.config import load_config
from echo_node.learner.evaluation import HeldOutEval, evaluator
from echo_node.learner.progress import Progress, Totals
from echo_node.ml.engine import TorchEngine
from echo_node.ml.rollout import generate_groups
from echo_node.policy import learner_policy


def test_the_progress_window_counts_what_changed_since_the_last_line() -> None:
    p = Progress(Totals(t=100.0, version=40, accepted=1000, dropped={"stale": 10}, idle_s=5.0, bytes_up=1_000_000))
    p.trained(0.25, 1.0)
    p.trained(0.75, 2.0)
    line, r = p.tick(
        Totals(t=110.0, version=60, accepted=1640, dropped={"stale": 25, "duplicate": 3}, idle_s=7.5, bytes_up=3_500_000),
        eval_version=55, eval_accuracy=0.5, active=2, standby=1,
    )
    # A resumed run's speed is the window's: 20 versions in 10 s, whatever the version number.
    assert r["updates_per_s"] == pytest.approx(2.0)
    assert r["reward_mean"] == pytest.approx(0.5)
    assert r["staleness_mean"] == pytest.approx(1.5)
    assert r["accepted_window"] == 640
    assert r["dropped_window"] == {"duplicate": 3, "stale": 15}
    assert r["idle_window"] == pytest.approx(0.25)
    assert (r["bytes_up"], r["bytes_up_window"]) == (3_500_000, 2_500_000)
    assert line.startswith("progress: v60 · 2.00 updates/s · reward 0.500 · held-out 0.500 at v55")
    assert "+640 accepted, +18 dropped (duplicate 3, stale 15)" in line
    assert "idle 25% · staleness 1.50 · peers 2 active, 1 standby · 3.5 MB out (+2.5)" in line
    # The next window starts where this one ended: nothing trained in it reads "-", not 0.
    line, r = p.tick(Totals(t=115.0, version=60, accepted=1640, dropped={"stale": 25, "duplicate": 3}, idle_s=12.5,
                            bytes_up=3_500_000))
    assert r["reward_mean"] is None and r["staleness_mean"] is None and r["dropped_window"] == {}
    assert r["updates_per_s"] == 0 and r["idle_window"] == pytest.approx(1.0)
    assert "reward - · held-out - ·" in line and "+0 dropped ·" in line and "peers -" in line


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("eval")
    # The warm-up gives the embedded model some accuracy to measure (cached after the first run).
    return learner_policy(load_config(None, runs_dir=str(tmp)))


def test_the_evaluation_scores_the_published_weights_greedily(policy) -> None:  # type: ignore[no-untyped-def]
    held_out = HeldOutEval(policy, prompts=48, max_new_tokens=4, every=1)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    result = held_out.evaluate(3, policy.publication())
    # The same prompts, greedily, on the policy's own weights.
    engine = TorchEngine(policy.model, eos_id=policy.tokenizer.eos_id, pad_id=policy.tokenizer.pad_id)
    groups = generate_groups(engine, policy.tokenizer, policy.task, held_out.prompts, group_size=1, temperature=0.0,
                             max_new_tokens=4)
    expected = sum(g.rewards[0] for g in groups) / len(groups)
    assert result.version == 3 and result.prompts == 48
    assert result.accuracy == pytest.approx(expected)
    assert 0 < result.accuracy  # the warmed-up model answers some
    assert held_out.last == result
    # Its own model: the policy's weights are untouched.
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    # Another version's weights give that version's score: here weights that answer nothing.
    with torch.no_grad():
        for k, v in policy.model.state_dict().items():
            if "lm_head" in k or "embed" in k:
                v.zero_()
        blob = policy.publication()
        for k, v in policy.model.state_dict().items():
            v.copy_(before[k])
    assert held_out.evaluate(4, blob).accuracy == 0.0


def test_the_prompt_set_is_fixed_whatever_the_run(policy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a = HeldOutEval(policy, prompts=16, max_new_tokens=4, every=1)
    b = HeldOutEval(policy, prompts=16, max_new_tokens=4, every=1)
    assert a.prompts == b.prompts and len(set(a.prompts)) > 1


def test_a_version_due_while_one_runs_is_skipped_not_queued(policy) -> None:  # type: ignore[no-untyped-def]
    e = HeldOutEval(policy, prompts=4, max_new_tokens=4, every=5)
    assert e.due(0)
    e.start()
    assert not e.due(3)  # not due yet
    assert not e.due(5) and e.skipped == 1  # due, but one is running
    e.done()
    assert not e.due(7)  # the multiple of 5 it belonged to was skipped
    # With rl.publish_every > 1 not every version is published: the first one past a multiple is due.
    assert e.due(11)
    e.done()
    assert not e.due(14) and e.due(16)


def test_zero_turns_the_evaluation_off(policy) -> None:  # type: ignore[no-untyped-def]
    assert evaluator(policy, prompts=0, max_new_tokens=4, every=5) is None
    assert evaluator(policy, prompts=8, max_new_tokens=4, every=0) is None
    with pytest.raises(ValueError, match="report needs"):
        load_config(None, report__eval_every=-1)
