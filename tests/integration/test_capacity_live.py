"""The capacity controller and the operator's metrics in a real swarm on loopback.

A learner and two priced peers, each with a Prometheus endpoint: the learner measures the peers'
throughput and its own times and records capacity decisions in metrics.jsonl; its endpoint, read
by `echo-node status` as an operator would, shows the pool, the cost rate and the ledger; a
peer's endpoint shows what it installed and published.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from echo_node.metrics import read_metrics
from echo_node.status import scrape
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_capacity_decisions_and_metrics_endpoints(cluster: Cluster) -> None:
    run = "capacity"
    config = cluster.root / "run.toml"
    config.write_text("[capacity]\ntick_s = 3.0\nwindow_s = 5.0\n")
    learner_port, peer_port = _free_port(), _free_port()
    cluster.start_bootstrap()
    learner, _ = cluster.start_learner(run, "--config", str(config), "--metrics-port", str(learner_port), "--seconds", "600")
    prices = {"peer0": 0.5, "peer1": 2.0}
    peers = [
        cluster.start_peer("peer0", run, "--price-per-hour", "0.5", "--metrics-port", str(peer_port)),
        cluster.start_peer("peer1", run, "--price-per-hour", "2.0"),
    ]
    metrics = cluster.run_dir(run) / "metrics.jsonl"
    deadline, decisions = time.monotonic() + 300, []
    while time.monotonic() < deadline and not decisions:
        # A decision once both peers were measured (each one window after it joined).
        records = read_metrics(metrics) if metrics.exists() else []
        decisions = [r for r in records if r.get("event") == "capacity" and len(r["workers"]) == 2]
        time.sleep(1)
    assert decisions, "no capacity decision over both peers within 300 s"
    d = decisions[-1]
    # Both peers measured from what the learner accepted, priced as they claimed.
    assert sorted(w["price"] for w in d["workers"].values()) == sorted(prices.values())
    assert all(w["mu"] > 0 for w in d["workers"].values())
    assert d["t_train"] > 0 and d["t_bcast"] > 0 and d["mu_pool"] > 0
    assert d["idle_predicted"] is not None and d["delta_max_predicted"] >= d["kappa"]

    # The operator's view: `echo-node status` on the learner's endpoint.
    status = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "status", "--learner", f"127.0.0.1:{learner_port}", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert status.returncode == 0, status.stderr
    values = json.loads(status.stdout)
    assert values["role"] == "learner" and values["run_id"] == run
    assert values["echo_version"] >= 1 and values["echo_rollouts_received_total"] > 0
    assert values["echo_active_peers"] + values["echo_standby_peers"] == 2
    assert values["echo_cost_per_hour"] in (0.5, 2.0, 2.5)
    assert sorted(w["price"] for w in values["workers"].values()) == sorted(prices.values())
    # `echo-node plan --learner`: the capacity model over the learner's own measurements.
    plan = subprocess.run(
        [sys.executable, "-m", "echo_node.cli", "plan", "--learner", f"127.0.0.1:{learner_port}", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert set(planned["chosen"]) <= set(values["workers"]) and planned["chosen"]
    assert planned["t_bcast_source"] == "measured" and planned["kappa"] >= 1
    peer = scrape(f"127.0.0.1:{peer_port}")
    assert peer["role"] == "peer" and peer["echo_installed_version"] >= 0 and peer["echo_price_per_hour"] == 0.5
    assert peer["echo_rollouts_published_total"] > 0 and peer["echo_bytes_down_total"] > 0
    for p in peers:
        cluster.swarm.stop(p)
    cluster.swarm.stop(learner)
