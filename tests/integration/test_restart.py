"""A learner SIGKILLed mid-run and started again with the same command: the run resumes (new
epoch, version numbers going on, never reused), the rollout peer that rode through the outage
follows the new epoch and its rollouts are trained again, and the ledger holds across both."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from echo_node.metrics import read_metrics
from tests.integration.conftest import Cluster
from tests.integration.test_swarm import assert_ledger, summary

pytestmark = pytest.mark.integration


def records(cluster: Cluster, run_id: str, event: str) -> list[dict[str, object]]:
    return [r for r in read_metrics(cluster.run_dir(run_id) / "metrics.jsonl") if r.get("event") == event]


def peer_records(cluster: Cluster, run_id: str, event: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for path in (cluster.run_dir(run_id) / "peers").glob("*.jsonl"):
        out += [r for r in read_metrics(path) if r.get("event") == event]
    return out


def wait_until(what: str, predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        time.sleep(0.25)


# py-libp2p 0.8.1 leaves some TCP sockets of a closed in-process host to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_killed_learner_resumes_and_its_peer_follows(cluster: Cluster, tmp_path: Path) -> None:
    run_id = "it-restart"
    cluster.start_bootstrap()
    args = ("--mode", "async", "--threads", "1")
    learner, ready = cluster.start_learner(run_id, *args)
    assert ready["epoch"] == 0 and ready["version"] == 0
    cluster.start_peer("peer0", f"{run_id}@{ready['peer_id']}")
    wait_until("5 updates on the peer's rollouts", lambda: len(records(cluster, run_id, "train")) >= 5, 180)

    learner.proc.send_signal(signal.SIGKILL)
    learner.proc.wait(10)
    before = records(cluster, run_id, "published")
    last = max(int(r["version"]) for r in before)  # type: ignore[arg-type]
    time.sleep(1.0)

    killed_at = time.time()
    learner2, ready2 = cluster.start_learner(run_id, *args, name="learner-2")
    assert ready2["peer_id"] == ready["peer_id"] and ready2["epoch"] == 1
    # It goes on from where the killed one was (its journal is redone), never below.
    assert int(ready2["version"]) >= last  # type: ignore[call-overload]
    wait_until(
        "5 updates of the new epoch",
        lambda: sum(1 for r in records(cluster, run_id, "train") if r.get("epoch") == 1) >= 5,
        120,
    )
    first_update = next(float(r["wall"]) for r in records(cluster, run_id, "train") if r.get("epoch") == 1)  # type: ignore[arg-type]
    assert first_update - killed_at < 60, "the first update after the restart took too long"
    # The new epoch's announcements reach the peer, not only its status answers (py-libp2p's
    # message ids of the restarted learner once collided with its old ones, and only status
    # checks carried the new versions): its installs count the announcements it took.
    wait_until(
        "the peer installs 10 versions of the new epoch",
        lambda: sum(1 for r in peer_records(cluster, run_id, "installed") if r.get("epoch") == 1) >= 10,
        180,
    )
    last_install = [r for r in peer_records(cluster, run_id, "installed") if r.get("epoch") == 1][-1]
    assert int(last_install["announced"]) >= 5, last_install  # type: ignore[call-overload]

    learner2.proc.send_signal(signal.SIGINT)
    assert learner2.proc.wait(120) == 130  # a stop writes its checkpoint and announces the end (bounded)
    s = summary(cluster, run_id)
    assert_ledger(s)
    assert s["epoch"] == 1 and s["resumed"]["records"] > 0  # type: ignore[index]
    # No version number was published with two digests, across both epochs; and every
    # version the peer installed is the one the learner published under that number.
    digests: dict[int, set[str]] = {}
    for r in records(cluster, run_id, "published"):
        digests.setdefault(int(r["version"]), set()).add(str(r["sha256"]))  # type: ignore[arg-type]
    assert all(len(d) == 1 for d in digests.values()), digests
    installed = peer_records(cluster, run_id, "installed")
    assert installed and all({str(r["sha256"])} == digests.get(int(r["version"])) for r in installed)  # type: ignore[arg-type]
    # The peer never stopped: one process, rejoined once.
    peer = next(c for c in cluster.swarm.children if c.name == "peer0")
    assert peer.proc.poll() is None
    assert peer_records(cluster, run_id, "rejoined")
    # Its rollouts were trained in both epochs.
    trained = [r for r in records(cluster, run_id, "train")]
    assert {r.get("epoch") for r in trained} == {0, 1}
    assert json.loads((cluster.run_dir(run_id) / "epoch").read_text()) == {"epoch": 1}
