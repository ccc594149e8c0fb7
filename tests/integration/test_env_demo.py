"""`echo-node demo --task calc` as a user runs it: a bootstrap, a learner and a rollout peer as
separate processes over libp2p, the embedded model playing the calculator environment, every
episode batch re-run by the learner before it trains. An honest peer's episodes never fail it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_env_demo_trains_on_verified_episodes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "demo", "--task", "calc", "--peers", "1", "--seconds", "15",
         "--no-progress", "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert str(summary["task"]).startswith("env:calc@") and summary["versions"] >= 1, summary
    # Honest episodes pass every check: what is dropped is stale, had no signal, was buffered at
    # the stop, or found the intake full while the learner re-ran the peer's earlier batch (a
    # publisher on probation has one batch in the intake at a time; on a loaded machine a re-run
    # outlasts the next batch: overload, no strike).
    assert set(summary["rollouts_dropped"]) <= {"stale", "no_signal", "unused_at_exit", "overload"}, summary["rollouts_dropped"]
    learner = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert learner["penalties"] == {} and learner["banned"] == [], (learner["penalties"], learner["banned"])
    assert summary["rollouts_accepted"] > 0 and 0.0 <= summary["reward_first"] <= 1.0


def test_env_demo_refuses_a_model_it_cannot_run(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "demo", "--task", "calc", "--model", str(tmp_path / "m"), "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode != 0 and "embedded model only" in out.stderr
