"""What an operator and a volunteer see, through the CLI with real processes: the learner's
progress line and held-out evaluation, `--report-to tensorboard` read back, and the end of a run
told to peers (a stop: the peer waits for the restart; the end of the budget: it leaves)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from echo_node.metrics import read_metrics
from tests.integration.conftest import Cluster
from tests.tracking_files import tensorboard_scalars

pytestmark = pytest.mark.integration

PROGRESS = re.compile(
    r"progress: v(\d+) · ([\d.]+) updates/s · reward (-|[\d.]+) · held-out (-|[\d.]+ at v\d+) · rollouts \+([\d,]+) accepted, "
    r"\+([\d,]+) dropped.* · idle (\d+)% · staleness (-|[\d.]+) · peers (-|\d+ active, \d+ standby) · ([\d,.]+) MB out"
)


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"{what} within {timeout:g}s")


def log_of(cluster: Cluster, name: str) -> str:
    return (cluster.swarm.run_dir / "logs" / f"{name}.log").read_text(errors="replace")


def test_progress_tracking_and_the_end_of_the_run_reach_everyone(cluster: Cluster, tmp_path: Path) -> None:
    run = "ops"
    config = tmp_path / "run.toml"
    config.write_text("[report]\nprogress_s = 2.0\neval_every = 4\neval_prompts = 16\n")
    flags = ("--config", str(config), "--report-to", "tensorboard")
    cluster.start_bootstrap()
    learner, _ = cluster.start_learner(run, *flags)
    peer = cluster.start_peer("peer0", run)
    metrics = cluster.run_dir(run) / "metrics.jsonl"

    def versions() -> int:
        return max((int(r["version"]) for r in read_metrics(metrics) if r.get("event") == "train"), default=0)

    wait_for(lambda: versions() >= 8, 240, "the learner did not train 8 versions")
    wait_for(lambda: "rollouts +" in log_of(cluster, "learner") and
             any(int(m.group(5).replace(",", "")) > 0 for m in PROGRESS.finditer(log_of(cluster, "learner"))),
             30, "no progress line counted accepted rollouts")
    # A stop (a restart resumes the run): the peer is told, stays, and generates nothing meanwhile.
    learner.proc.send_signal(signal.SIGINT)
    assert learner.proc.wait(60) == 130
    wait_for(lambda: f"the learner stopped run {run} at version" in log_of(cluster, "peer0"), 30, "the peer was not told of the stop")
    time.sleep(3)
    assert peer.proc.poll() is None, "a stopped run's peer waits for the restart"

    # The restart resumes and spends its budget (a number of versions, not seconds: on a loaded
    # machine a time budget may hold none): the peer rejoins, then leaves with a summary line.
    stopped_at = next(int(r["version"]) for r in read_metrics(metrics) if r.get("event") == "run_ended")
    learner2, _ = cluster.start_learner(run, *flags, "--max-versions", str(stopped_at + 6), name="learner2")
    assert learner2.proc.wait(240) == 0
    assert peer.proc.wait(60) == 0, "the peer leaves on its own when the run finished"
    line = re.search(rf"run {run} finished at version (\d+): this peer published (\d+) rollouts", log_of(cluster, "peer0"))
    assert line is not None and int(line.group(2)) > 0

    records = read_metrics(metrics)
    ended = [(r["reason"], r["epoch"]) for r in records if r.get("event") == "run_ended"]
    assert ended == [("stopped", 0), ("finished", 1)]
    assert int(line.group(1)) == next(r["version"] for r in records if r.get("event") == "run_ended" and r["reason"] == "finished")

    # The progress line as printed, and its record.
    lines = [m for m in PROGRESS.finditer(log_of(cluster, "learner"))]
    assert lines and any(float(m.group(2)) > 0 and m.group(3) != "-" for m in lines)
    assert any(m.group(4) != "-" for m in lines), "the held-out accuracy reaches the line"
    progress = [r for r in records if r.get("event") == "progress"]
    assert progress and sum(r["accepted_window"] for r in progress) > 0

    # Held-out evaluations: at the start version and then every 4 versions, each of 16 prompts.
    evals = {int(r["version"]): float(r["eval_accuracy"]) for r in records if r.get("event") == "eval"}
    assert 0 in evals and len(evals) >= 2 and all(0.0 <= a <= 1.0 for a in evals.values())

    # --report-to tensorboard: the same numbers, read back from the event files.
    tb = tensorboard_scalars(cluster.run_dir(run) / "tracking" / "tensorboard")
    train = {int(r["version"]): float(r["reward_mean"]) for r in records if r.get("event") == "train"}
    assert tb["train/reward_mean"] == pytest.approx(train, abs=1e-6)
    assert tb["eval/accuracy"] == pytest.approx(evals, abs=1e-6)
    assert tb["progress/updates_per_s"]
