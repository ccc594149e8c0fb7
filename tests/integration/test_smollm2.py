"""A real pretrained LLM end to end: SmolLM2-135M-Instruct (imported from its GGUF by
`echo-node import-gguf`'s converter) trained by a learner and two rollout peers, as separate
processes on loopback, on the built-in `math` task through the model's chat template, in fp32.

Too slow to learn anything on 2 cores (DESIGN.md): this checks that the whole path works on a
real checkpoint, not that the reward moves. What must hold: updates were trained and published,
every peer installed weights that differ from the initial ones, no honest peer was penalised,
banned or failed a check (the log-prob and sampling spot checks on a 49,152-token vocabulary
included), and the summary's fields are sane.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import pytest

from echo_node.metrics import read_metrics
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

# Above what the test waits for: the learner is stopped once every peer holds new weights (a
# learner that finishes exits at once, and a peer still fetching then never installs anything).
MAX_VERSIONS = 6
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
# Bounds the learner's training time should the peers stall: only a bound (the test stops the
# learner as soon as both peers hold new weights). 150 s ended a fresh-clone CI run under load
# before version 1 reached the peers.
SECONDS = 420

LEARNER_TOML = f"""
[task]
name = "math"
chat = true

[sampling]
max_new_tokens = 16

[rl]
group_size = {GROUP_SIZE}
groups_per_step = {GROUPS_PER_STEP}
lr = 1e-6

[checkpoint]
export = false

[report]
# The held-out evaluation runs on the real model too, on fewer prompts: on 2 cores the default 64
# take ~2 minutes of CPU from the learner and the peers.
eval_prompts = 8
"""
# One update's worth per engine call and gossip message (rollout_peer.py).
PEER_TOML = f"""
[rollout]
groups_per_batch = {GROUPS_PER_STEP}
"""


def test_smollm2_trains_in_a_swarm_of_two_peers(cluster: Cluster, smollm2_model: Path, tmp_path: Path) -> None:
    run = "smollm2"
    (tmp_path / "learner.toml").write_text(LEARNER_TOML)
    (tmp_path / "peer.toml").write_text(PEER_TOML)
    model = ("--model", str(smollm2_model), "--dtype", "float32", "--device", "cpu")
    t0 = time.monotonic()
    cluster.start_bootstrap()
    learner, _ = cluster.start_learner(
        run, *model, "--config", str(tmp_path / "learner.toml"), "--max-versions", str(MAX_VERSIONS), "--seconds", str(SECONDS)
    )
    peers = [cluster.start_peer(f"peer{i}", run, *model, "--config", str(tmp_path / "peer.toml")) for i in range(2)]
    # A learner that reaches MAX_VERSIONS exits at once and takes its pieces with it: a peer still
    # fetching the first new version then never installs it. So the learner is stopped (SIGINT, a
    # clean stop that writes the summary) once every peer holds new weights, or when it ends by
    # itself; the learner's own --seconds bounds the wait should the peers stall.
    peer_dir = cluster.run_dir(run) / "peers"
    deadline = time.monotonic() + SECONDS + 120
    while learner.proc.poll() is None and time.monotonic() < deadline:
        if len(_peers_with_new_weights(peer_dir)) == len(peers):
            break
        time.sleep(1.0)
    if learner.proc.poll() is None:
        # Not Swarm.stop's 10 s grace: the stop writes a checkpoint of 135M parameters with their
        # optimizer state (~1.6 GB in fp32), which took 10 s on a loaded 2-core machine.
        learner.proc.send_signal(signal.SIGINT)
    assert learner.proc.wait(timeout=120) in (0, 128 + signal.SIGINT), learner.proc.returncode
    for p in peers:
        cluster.swarm.stop(p)
    wall = time.monotonic() - t0

    summary = json.loads((cluster.run_dir(run) / "summary.json").read_text())
    assert (summary["model"], summary["dtype"], summary["device"]) == ("LlamaForCausalLM", "float32", "cpu")
    assert summary["task"].startswith("math")
    # A batch without reward variance makes no version, so SECONDS may end the run first.
    assert 1 <= summary["versions"] <= MAX_VERSIONS
    assert summary["rollouts_accepted"] >= summary["versions"] * GROUPS_PER_STEP * GROUP_SIZE
    learner_log = (cluster.swarm.run_dir / "logs" / "learner.log").read_text()
    assert "device cpu (model.device); dtype float32 (model.dtype)" in learner_log
    assert summary["rollout_peers"] == 2 and summary["train_errors"] == 0
    # Rewards are the mean of the first and last updates: numbers in the task's range.
    for key in ("reward_first", "reward_last"):
        assert isinstance(summary[key], float) and 0.0 <= summary[key] <= 1.0, summary[key]
    assert math.isfinite(summary["wall_s"]) and summary["wall_s"] > 0

    # Honest peers: never penalised or banned, every check passed.
    assert summary["penalties"] == {} and summary["banned"] == [], (summary["penalties"], summary["banned"])
    checks = summary["verification"]["checks"]
    failed = {c: v["fail"] for c, v in checks.items() if v["fail"]}
    assert not failed, (failed, summary["verification"])
    assert checks["logprobs"]["pass"] >= 1 and checks["sampling"]["pass"] >= 1, checks
    assert all(n > 0 for n in summary["trained_groups"].values()) and len(summary["trained_groups"]) >= 1

    # Every peer installed a version whose weights differ from the initial ones.
    paths = sorted(peer_dir.glob("*.jsonl"))
    assert len(paths) == len(peers)
    for path in paths:
        installs = [r for r in read_metrics(path) if r.get("event") == "installed"]
        assert path in _peers_with_new_weights(peer_dir), (path.name, [(r["version"], r["sha256"][:12]) for r in installs])
    print(f"smollm2 swarm: {wall:.1f} s wall, {summary['versions']} versions, rewards {summary['reward_first']} -> {summary['reward_last']}")


def _peers_with_new_weights(peer_dir: Path) -> set[Path]:
    """The peers' metrics files that record installs of at least two different digests."""
    done = set()
    for path in peer_dir.glob("*.jsonl"):
        digests = {r["sha256"] for r in read_metrics(path) if r.get("event") == "installed"}
        if len(digests) >= 2:
            done.add(path)
    return done
