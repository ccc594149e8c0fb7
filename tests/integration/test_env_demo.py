"""`echo-node demo --task calc` as a user runs it: real processes (the CLI, a rollout peer process,
the learner), the embedded model playing the calculator environment, every batch sealed and
re-run by the learner. An honest peer's episodes must never fail the re-run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_env_demo_trains_on_verified_episodes(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "demo", "--task", "calc", "--seconds", "10", "--no-progress",
         "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["demo"] == "env" and summary["task"] == "calc" and summary["steps"] >= 1
    # Honest episodes pass every check: the only drops allowed are stale ones (async).
    assert set(summary["drops"]) <= {"stale"}, summary["drops"]
    assert 0.0 <= summary["reward_first"] <= 1.0 and summary["episodes_per_s"] > 0


def test_env_demo_refuses_a_model_it_cannot_run(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "demo", "--task", "calc", "--model", str(tmp_path / "m"), "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode != 0 and "embedded model only" in out.stderr
