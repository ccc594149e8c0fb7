"""Clean stops: SIGINT and SIGTERM end every role with its cleanup done (the learner's summary
written) and exit status 128 + the signal number, without a traceback."""

from __future__ import annotations

import json
import signal
import time

import pytest

from echo_node.demo import Child, _is_ready, _wait_line
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

# A stop, the learner's summary, plots and checkpoint included, takes a few seconds.
STOP_TIMEOUT_S = 20
# The first learner in a fresh cache trains its warm-up (policy.py); later ones load it.
READY_TIMEOUT_S = 240


def start_lone_learner(cluster: Cluster, run_id: str) -> Child:
    """A learner with no bootstrap (none needed to serve), stopped by signals only."""
    learner = cluster.swarm.spawn(
        "learner",
        ["learn", "--mode", "async", "--threads", "1", "--run-id", run_id, "--runs-dir", str(cluster.root / "runs"),
         "--key-file", str(cluster.keys / "learner.key")],
    )
    _wait_line(learner, _is_ready, READY_TIMEOUT_S, "ready")
    return learner


def log_of(cluster: Cluster, child: Child) -> str:
    return (cluster.swarm.run_dir / "logs" / f"{child.name}.log").read_text()


def stop(child: Child, sig: signal.Signals) -> int:
    child.proc.send_signal(sig)
    return child.proc.wait(STOP_TIMEOUT_S)


def wait_for_log(cluster: Cluster, child: Child, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log_of(cluster, child):
        assert child.proc.poll() is None, f"{child.name} exited with {child.proc.returncode}:\n{log_of(cluster, child)}"
        assert time.monotonic() < deadline, f"{child.name} did not log {text!r} within {timeout:g}s"
        time.sleep(0.1)


def assert_learner_stopped(cluster: Cluster, learner: Child, run_id: str, sig: signal.Signals) -> dict[str, object]:
    assert stop(learner, sig) == 128 + sig
    log = log_of(cluster, learner)
    assert "Traceback" not in log, log
    assert f"stopping on {sig.name}: writing the summary" in log
    assert f"run {run_id} stopped on {sig.name}" in log
    summary: dict[str, object] = json.loads((cluster.run_dir(run_id) / "summary.json").read_text())
    assert summary["run_id"] == run_id
    return summary


def test_sigterm_stops_the_learner_with_its_summary(cluster: Cluster) -> None:
    run_id = "stop-sigterm"
    learner = start_lone_learner(cluster, run_id)
    assert_learner_stopped(cluster, learner, run_id, signal.SIGTERM)


def test_every_role_stops_cleanly_in_a_swarm(cluster: Cluster) -> None:
    """A rollout peer and the bootstrap on SIGTERM, then the learner on SIGINT (one swarm: each
    learner start costs seconds)."""
    run_id = "stop-swarm"
    cluster.start_bootstrap()
    learner, ready = cluster.start_learner(run_id, "--mode", "async", "--threads", "1")
    peer = cluster.start_peer("peer0", f"{run_id}@{ready['peer_id']}")
    wait_for_log(cluster, peer, f"joined run {run_id}", 120)
    assert stop(peer, signal.SIGTERM) == 128 + signal.SIGTERM
    peer_log = log_of(cluster, peer)
    assert "Traceback" not in peer_log, peer_log
    assert "stopping on SIGTERM: leaving the run" in peer_log

    boot = next(c for c in cluster.swarm.children if c.name == "bootstrap")
    assert stop(boot, signal.SIGTERM) == 128 + signal.SIGTERM
    boot_log = log_of(cluster, boot)
    assert "Traceback" not in boot_log, boot_log

    summary = assert_learner_stopped(cluster, learner, run_id, signal.SIGINT)
    assert summary["rollout_peers"] == 1
