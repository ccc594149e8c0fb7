"""SIGTERM stops a rollout peer within a few seconds even in the middle of a generation batch.

Generation runs in a worker thread, which a trio cancellation cannot interrupt; the peer stops
it between two decoding steps (rollout_peer.py `Generator.stoppably`). Here a real peer
process whose batch takes ~20 s (`slow_peer`: 40 tokens at 0.5 s a step) is sent SIGTERM after
its second step: it must exit 143 within STOP_S, say it abandoned the batch, and publish nothing.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_signals import log_of, wait_for_log

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 40  # with slow_peer.SLOW_STEP_S, a batch takes ~20 s
# One step (0.5 s) to reach the check, then the peer's own shutdown (libp2p host, data channel).
STOP_S = 5.0


def test_sigterm_stops_a_peer_mid_batch(cluster: Cluster, tmp_path: Path) -> None:
    run = "stop-mid-batch"
    (tmp_path / "run.toml").write_text(f"[sampling]\nmax_new_tokens = {MAX_NEW_TOKENS}\n")
    cluster.start_bootstrap()
    _, ready = cluster.start_learner(run, "--config", str(tmp_path / "run.toml"), "--threads", "1")
    peer = cluster.swarm.spawn(
        "slow",
        ["--bootstrap", cluster.bootstrap_addr, "--run-id", f"{run}@{ready['peer_id']}", "--key-file", str(cluster.keys / "slow.key"),
         "--runs-dir", str(cluster.root / "runs"), "--threads", "1"],
        module="tests.integration.slow_peer",
    )
    wait_for_log(cluster, peer, "slow decoding step 2", 180)
    t0 = time.monotonic()
    peer.proc.send_signal(signal.SIGTERM)
    code = peer.proc.wait(timeout=60)
    took = time.monotonic() - t0
    log = log_of(cluster, peer)
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert took < STOP_S, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in log, log[-3000:]
    assert "abandoned a batch of" in log and "not published; 1 so far" in log, log[-3000:]
    assert "first rollouts published" not in log
    assert f"slow decoding step {MAX_NEW_TOKENS - 1}" not in log  # the batch did not run to its end
    print(f"peer exited {took:.2f} s after SIGTERM mid-batch")
