"""`echo-node learn` under torchrun: the update sharded with FSDP2 over two CPU ranks (gloo).

Rank 0 is the learner the swarm sees (libp2p node, intake, publications); rank 1 takes its part
of every update. What must hold: a peer's rollouts train the model (versions go up, the reward
is recorded, the ledger balances), SIGINT to torchrun stops the job with rank 0's summary and a
checkpoint, a second torchrun job resumes it, and a single-process learner refuses that
checkpoint in one line instead of loading sharded optimizer state it cannot use.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from echo_node.demo import Child, _is_ready, _wait_line
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_sharded(cluster: Cluster, run_id: str, name: str, *extra: str) -> Child:
    args = [
        "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "echo_node.cli", "learn", "--bootstrap", cluster.bootstrap_addr, "--run-id", run_id,
        "--runs-dir", str(cluster.root / "runs"), "--key-file", str(cluster.keys / "learner.key"), *extra,
    ]
    child = cluster.swarm.spawn(name, args, module="torch.distributed.run")
    ready = json.loads(_wait_line(child, _is_ready, 240, "ready"))
    cluster.learner_ids[run_id] = str(ready["peer_id"])  # what start_peer pins its peers to
    return child


def wait_versions(cluster: Cluster, run_id: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    metrics = cluster.run_dir(run_id) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and sum('"event": "train"' in line for line in metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"fewer than {n} updates within {timeout}s")


def test_torchrun_learner_trains_stops_and_resumes(cluster: Cluster) -> None:
    run = "sharded"
    cluster.start_bootstrap()
    learner = start_sharded(cluster, run, "learner")
    peer = cluster.start_peer("peer0", run)
    wait_versions(cluster, run, 10, timeout=180)
    learner.proc.send_signal(signal.SIGINT)  # torchrun forwards it; rank 0 checkpoints, then releases rank 1
    learner.proc.wait(timeout=90)  # torchrun itself exits 1 on a signal (its SignalException)
    log = (cluster.swarm.run_dir / "logs" / "learner.log").read_text()
    assert f"run {run} stopped on SIGINT" in log, log[-3000:]
    summary = json.loads((cluster.run_dir(run) / "summary.json").read_text())
    assert summary["device"] == "2 ranks on cpu"
    assert summary["versions"] >= 10
    dropped = sum(summary["rollouts_dropped"].values())
    assert summary["rollouts_received"] == summary["rollouts_accepted"] + dropped + summary["rollouts_buffered"]
    first_versions = summary["versions"]

    # One process cannot take over a sharded run's optimizer state: one line, no traceback.
    single = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "learn", "--bootstrap", cluster.bootstrap_addr, "--run-id", run,
         "--runs-dir", str(cluster.root / "runs"), "--key-file", str(cluster.keys / "learner.key"), "--seconds", "5"],
        capture_output=True, text=True, timeout=180,
    )
    assert single.returncode == 2, single.stderr[-3000:]
    assert "as many learner processes as wrote it" in single.stderr and "Traceback" not in single.stderr

    # A second torchrun job resumes where the first stopped.
    again = start_sharded(cluster, run, "learner2", "--seconds", "5")
    assert again.proc.wait(timeout=240) == 0, (cluster.swarm.run_dir / "logs" / "learner2.log").read_text()[-3000:]
    resumed = json.loads((cluster.run_dir(run) / "summary.json").read_text())
    assert resumed["resumed"] is not None and resumed["epoch"] > summary["epoch"]
    assert resumed["versions"] >= first_versions
    cluster.swarm.stop(peer)
