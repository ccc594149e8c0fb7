"""Capacity figures against a swarm whose answers are known: paced peers and a paced learner.

`benchmarks.paced` gives each process a floor on its work (a peer: seconds per group sampled,
injected as its generator; the learner: seconds per update), so the true rates are set by the
test rather than by a loaded CPU: peer "fast" samples a group of 8 rollouts per 1.0 s (8
rollouts/s), peer "slow" one per 2.0 s (4 rollouts/s). The learner (0.5 s per update of 64
rollouts) wants 128 rollouts/s, far more than the pool's 12: the peers never meet their
demand, so they work all the time, and each one's measured rate is its floor's rate.

Checked through the CLI, as an operator reads them: `echo-node status --json` (the learner's
metrics endpoint) and `echo-node plan --learner --json`, against the true rates and against
each other (one definition of each figure: the learner's controller, its metrics and the plan).
Tolerance: measured rates within 25 % of the floors' (a batch of 2 groups is 2 or 4 s of work,
a 20 s window holds 5 to 10 of them, and pacing is a floor: publication and gossip only add
time); the model's figures within 2 % of each other (they are read a moment apart).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from echo_node.demo import _is_ready, _wait_line
from echo_node.metrics import read_metrics
from protocol.identity import load_or_create_key_file
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

GROUP_SIZE = 8  # rl.group_size's default: rollouts per group
GROUP_S = {"fast": 1.0, "slow": 2.0}
TRUE_MU = {name: GROUP_SIZE / s for name, s in GROUP_S.items()}  # 8 and 4 rollouts/s
TRAIN_S = 0.5
R = 64  # rollouts per update: groups_per_step 8 x group_size 8
RATE_TOL = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "echo_node.cli", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _trained_after(metrics: Any, version: int) -> list[dict[str, Any]]:
    return [r for r in read_metrics(metrics) if r.get("event") == "train" and r["version"] > version]


def test_status_and_plan_report_the_paced_rates(cluster: Cluster) -> None:
    run = "paced"
    learner_cfg, peer_cfg = cluster.root / "learner.toml", cluster.root / "peer.toml"
    learner_cfg.write_text("[capacity]\ntick_s = 5.0\nwindow_s = 20.0\n")
    peer_cfg.write_text("[rollout]\ngroups_per_batch = 2\n")  # 2 or 4 s of work per message
    port = _free_port()
    boot = cluster.start_bootstrap()
    runs = str(cluster.root / "runs")
    learner = cluster.swarm.spawn(
        "learner",
        ["--train-s", str(TRAIN_S), "learn", "--bootstrap", boot, "--run-id", run, "--runs-dir", runs,
         "--key-file", str(cluster.keys / "learner.key"), "--config", str(learner_cfg), "--metrics-port", str(port),
         "--seconds", "600"],
        module="benchmarks.paced",
    )
    ready = json.loads(_wait_line(learner, _is_ready, 240, "ready"))
    # Each peer's key made here, so the test knows which peer id has which floor.
    ids = {name: load_or_create_key_file(cluster.keys / f"{name}.key").peer_id for name in GROUP_S}
    for name, group_s in GROUP_S.items():
        cluster.swarm.spawn(
            name,
            ["--group-s", str(group_s), "join", "--bootstrap", boot, "--run-id", f"{run}@{ready['peer_id']}",
             "--runs-dir", runs, "--key-file", str(cluster.keys / f"{name}.key"), "--config", str(peer_cfg)],
            module="benchmarks.paced",
        )
    metrics = cluster.run_dir(run) / "metrics.jsonl"
    deadline, decision = time.monotonic() + 300, None
    while time.monotonic() < deadline and decision is None:
        # The first decision over both peers: each measured for a window, T_train and T_bcast known.
        records = read_metrics(metrics) if metrics.exists() else []
        decision = next((r for r in records if r.get("event") == "capacity" and len(r["workers"]) == 2), None)
        time.sleep(1)
    assert decision is not None, "no capacity decision over both peers within 300 s"
    # Updates past the decision to measure idle over: an update takes R / 12 ≈ 5.3 s of the
    # peers' work, so wait for a count of them, not for a fixed time.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_trained_after(metrics, decision["version"])) < 3:
        time.sleep(1)

    status = _cli("status", "--learner", f"127.0.0.1:{port}", "--json")
    plan = _cli("plan", "--learner", f"127.0.0.1:{port}", "--json")
    workers = status["workers"]
    measured = {name: workers[ids[name]]["mu"] for name in GROUP_S}
    report = {"true": TRUE_MU, "measured": measured, "mu_pool": status["echo_mu_pool"],
              "t_train": status["echo_t_train_seconds"], "mu_min": status["echo_mu_min"],
              "target": status["echo_mu_target"], "idle_predicted": status["echo_learner_idle_predicted_ratio"]}
    print("paced capacity figures:", json.dumps(report))

    # μ per peer and of the pool: the floors' rates.
    for name, mu in measured.items():
        assert abs(mu - TRUE_MU[name]) <= RATE_TOL * TRUE_MU[name], report
    assert status["echo_mu_pool"] == pytest.approx(sum(measured.values()), rel=1e-9)
    assert status["echo_mu_active"] == pytest.approx(status["echo_mu_pool"], rel=1e-9)  # infeasible: all active
    # μ_min: async peers generate while a version downloads, so R / T_train; T_train is the floor
    # plus the real step (which must stay small next to it for the rates above to be the floors').
    t_train = status["echo_t_train_seconds"]
    assert TRAIN_S <= t_train <= 1.5 * TRAIN_S, report
    assert status["echo_pipelined"] == 1.0
    assert status["echo_mu_min"] == pytest.approx(R / t_train, rel=1e-6)
    assert status["echo_mu_target"] == pytest.approx(1.1 * status["echo_mu_min"], rel=1e-6)
    # Predicted idle, 1 − μ·T_train/R, against the learner's measured idle over its updates since.
    predicted = status["echo_learner_idle_predicted_ratio"]
    assert predicted == pytest.approx(1 - status["echo_mu_active"] * t_train / R, rel=1e-6)
    steps = _trained_after(metrics, decision["version"])
    assert len(steps) >= 3, "too few updates after the decision to measure idle"
    wait, train = sum(r["wait_s"] for r in steps[1:]), sum(r["train_s"] for r in steps[1:])
    assert abs(predicted - wait / (wait + train)) <= 0.1, (predicted, wait / (wait + train))
    # updates/s: this incarnation's, at the pool's rate (R rollouts per update).
    assert status["echo_steps_per_second"] <= 1.25 * sum(TRUE_MU.values()) / R

    # The plan from the learner's measurements: the same figures, the same κ, the reason named.
    assert plan["kappa"] == status["echo_kappa"] and plan["t_bcast_source"] == "measured"
    assert plan["mu_min"] == pytest.approx(status["echo_mu_min"], rel=0.02)
    assert plan["target"] == pytest.approx(status["echo_mu_target"], rel=0.02)
    assert plan["idle_predicted"] == pytest.approx(predicted, abs=0.02)
    assert not plan["feasible"] and sorted(plan["chosen"]) == sorted(ids.values())
    assert "the whole pool gives" in plan["reason"] and "more or faster peers" in plan["reason"]
    # The learner's own decision record uses the same definitions.
    assert decision["mu_min"] == pytest.approx(R / decision["t_train"], rel=1e-3)
    assert not decision["feasible"] and "the whole pool gives" in decision["reason"]
