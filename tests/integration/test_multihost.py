"""A swarm across hosts: bootstrap, learner and three rollout peers each in its own network
namespace with its own address, one peer behind a NAT that drops inbound connections, all
started through the `echo-node` CLI with the README's flags (`benchmarks/wan/swarm_netns.py`).

The learner must train >= 20 versions; every peer, the NAT'd one too, must install the newest
published version and have rollouts accepted; the NAT'd peer must not be handed out as a relay,
the others must; and no process may log a traceback. Needs root, iproute2 and nftables (`.ci/run`
installs them); skipped with the reason where namespaces are unavailable.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from benchmarks.wan.netns import Rates, Topology, nat_available
from benchmarks.wan.swarm_netns import NetnsSwarm

pytestmark = pytest.mark.integration

_why_not = nat_available()
VERSIONS = 20
NAT_HOST = 4


@pytest.mark.skipif(_why_not is not None, reason=f"multi-host netns: {_why_not}")
def test_a_swarm_across_hosts_trains_with_a_peer_behind_nat(tmp_path: Path) -> None:
    t0 = time.monotonic()
    hosts = [Rates(up_mbit=None, down_mbit=None)] * 4 + [Rates(up_mbit=None, down_mbit=None, nat=True)]
    with Topology(hosts, prefix="emh") as topo:
        swarm = NetnsSwarm(topo, tmp_path, "multihost")
        try:
            swarm.start_bootstrap()
            ready = swarm.start_learner("--seconds", "600")
            # The learner publishes its own interface's address, not the wildcard it listens on.
            assert ready["addrs"] == [f"/ip4/{topo.addr(1)}/tcp/4001/p2p/{swarm.peer_ids['learner']}"]
            peers = [swarm.start_peer(h) for h in (2, 3, NAT_HOST)]
            nat = f"peer{NAT_HOST}"
            verdicts = lambda: {r["peer"]: r["relay"] for r in swarm.learner_records("reachability")}  # noqa: E731
            swarm.wait("the learner's dial-back verdicts", lambda: len(verdicts()) == 3, 60)
            swarm.wait(f"{VERSIONS} versions", lambda: any(r["version"] >= VERSIONS for r in swarm.learner_records()), 240)
            newest = swarm.learner_records()[-1]["published"]
            swarm.wait(f"every peer installing version {newest}", lambda: all(swarm.newest_installed(p) >= newest for p in peers), 90)
            summary = swarm.stop_learner()
        finally:
            swarm.close()
        logs = {name: swarm.log(name) for name in swarm.procs}
    by_id = summary["peers"]
    for name in peers:
        pid = swarm.peer_ids[name]
        assert by_id[pid]["accepted"] > 0, (name, by_id)
        # Dialed back at its data port: the two on the bridge answered, the one behind NAT did not.
        assert verdicts()[pid] is by_id[pid]["relay"] is (name != nat), (name, by_id[pid])
    assert summary["versions"] >= VERSIONS
    assert summary["rollouts_received"] == (
        summary["rollouts_accepted"] + sum(summary["rollouts_dropped"].values()) + summary["rollouts_buffered"]
    )
    # The NAT'd peer was told so, and said so in words a volunteer can act on.
    assert any(not r["relay"] for r in swarm.peer_records(nat, "reachability"))
    assert "could not dial this peer's data port" in logs[nat]
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name} logged a traceback:\n{text[-3000:]}"
    print(f"multi-host swarm: {summary['versions']} versions in {time.monotonic() - t0:.1f}s (pid {os.getpid()})")
