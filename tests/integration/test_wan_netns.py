"""The WAN harness: the broadcast bound (pure), and shaped namespaces that always go away.

The namespace tests need root and iproute2 (`ip netns`, `tc`, a bridge); they build 2–3 peer
topologies at 20 Mbit/s, move a few MB, and take ~10 s in all. The NAT test also needs nftables
(`nft`) and takes ~3.5 s (two deliberate 1.5 s connect timeouts).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from benchmarks.wan.bound import bound_s, bound_with_departures_s, star_s
from benchmarks.wan.calibrate import measure_goodput
from benchmarks.wan.netns import (
    REPO_ROOT,
    Rates,
    Topology,
    cleanup_stale,
    list_namespaces,
    nat_available,
    nat_lan,
    netns_available,
)
from benchmarks.wan.p2p import PIECE, run_p2p
from benchmarks.wan.scenario import Scenario
from benchmarks.wan.star import run_star
from echo_node.sim import simulate_broadcast

MB = 1 << 20
G = 64 * MB
MBIT_64MB = 8 * G / 1e6  # 536.870912 Mbit


# --- the bound (pure) ---------------------------------------------------------------------------
def test_equal_rates_source_uplink_dominates() -> None:
    # the defaults: N=8, 100 Mbit/s everywhere → G/B0 (N·G/(9·B0) is smaller)
    assert bound_s(G, 100, [100] * 8, [100] * 8) == pytest.approx(MBIT_64MB / 100)
    assert star_s(G, 100, [100] * 8) == pytest.approx(8 * MBIT_64MB / 100)


def test_capacity_term_dominates_when_peer_uplinks_are_slow() -> None:
    # 8 peers with 10 Mbit/s uplinks: N·G/(B0 + ΣBup) = 8·G/180 > G/100
    assert bound_s(G, 100, [10] * 8, [100] * 8) == pytest.approx(8 * MBIT_64MB / 180)


def test_slowest_downlink_dominates() -> None:
    assert bound_s(G, 100, [100] * 4, [100, 100, 100, 20]) == pytest.approx(MBIT_64MB / 20)


def test_unequal_rates_half_the_peers_slow() -> None:
    # 4 peers at 100, 4 at 25 both ways: downlink term G/25 beats capacity 8·G/(100+500)
    up = [100] * 4 + [25] * 4
    assert bound_s(G, 100, up, up) == pytest.approx(MBIT_64MB / 25)
    # same uplinks, fast downlinks: capacity 8·G/(100+500) = G/75 > G/100
    assert bound_s(G, 100, up, [100] * 8) == pytest.approx(8 * MBIT_64MB / 600)
    # slow source: 8·G/(10+500) vs G/10 → G/10
    assert bound_s(G, 10, up, [100] * 8) == pytest.approx(MBIT_64MB / 10)


def test_efficiency_scales_every_rate() -> None:
    assert bound_s(G, 100, [100] * 8, [100] * 8, efficiency=0.956) == pytest.approx(MBIT_64MB / 95.6)


def test_single_peer_is_one_link() -> None:
    assert bound_s(G, 50, [0], [80]) == pytest.approx(MBIT_64MB / 50)


def test_departures_credit_uploads_before_leaving() -> None:
    up = [10.0] * 8
    assert bound_with_departures_s(G, 100, up, [100] * 8, [], 5.0) == bound_s(G, 100, up, [100] * 8)
    # 6 survivors at 10 Mbit up; 2 peers (10 Mbit up) left after 5 s having uploaded ≤ 100 Mbit
    t = bound_with_departures_s(G, 100, [10.0] * 6, [100] * 6, [10.0, 10.0], 5.0)
    assert t == pytest.approx(max(MBIT_64MB / 100, (6 * MBIT_64MB - 100) / 160))


@pytest.mark.parametrize(
    ("args", "msg"),
    [((G, 100, [100], [100, 100]), "one rate per peer"), ((G, 100, [], []), "no peers"),
     ((G, 0, [100], [100]), "must be > 0")],
)
def test_bound_rejects_bad_input(args: tuple[Any, ...], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        bound_s(*args)


# --- namespaces (root + iproute2) ---------------------------------------------------------------
_why_not = netns_available()


def _ours(topo_tag: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(topo_tag + "-")]


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
def test_shaped_link_carries_its_rate_and_namespaces_go_away() -> None:
    rates = Rates(up_mbit=20, down_mbit=20)
    with Topology([rates] * 3, prefix="ewant") as topo:
        assert sorted(_ours(topo.run_tag)) == sorted(topo.namespaces)
        assert topo.addr(0) == "10.77.0.1" and topo.addr(2) == "10.77.0.3"
        r = measure_goodput(topo, src=1, dst=0, nbytes=2 * MB, src_cpus={0}, dst_cpus={0}, timeout=30)
        sleeper = topo.run(2, ["sleep", "60"])
    assert 0.85 <= r["efficiency"] <= 1.0, r
    assert _ours(topo.run_tag) == []
    assert sleeper.returncode is not None  # killed and reaped on exit


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
def test_namespaces_and_processes_go_away_on_exception() -> None:
    topo = Topology([Rates(), Rates()], prefix="ewant")
    with pytest.raises(RuntimeError, match="boom"), topo:
        sleeper = topo.run(1, ["sleep", "60"], cpus={0})
        raise RuntimeError("boom")
    assert _ours(topo.run_tag) == []
    assert sleeper.returncode is not None


_ORCHESTRATOR = """
import time
from benchmarks.wan.netns import Rates, Topology
with Topology([Rates(), Rates()], prefix="ewant") as topo:
    topo.run(1, ["sleep", "60"])
    print("up", flush=True)
    time.sleep(60)
"""


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_everything_down(sig: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _ORCHESTRATOR], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        assert _ours(f"ewant-{proc.pid}")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert _ours(f"ewant-{proc.pid}") == [], err.decode()


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
def test_cleanup_stale_removes_only_dead_owners() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"ewant-{dead.pid}-hub", f"ewant-{os.getpid()}-stalecheck"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        assert stale in cleanup_stale("ewant")
        assert stale not in list_namespaces() and live in list_namespaces()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
def test_star_delivers_verified_copies_and_survives_a_killed_peer() -> None:
    s = Scenario(peers=3, size_bytes=2 * MB, b0_mbit=20, learner_down_mbit=20, bup_mbit=20, bdown_mbit=20,
                 kill=1, learner_cpus=frozenset({0}), peer_cpus=frozenset({0}))
    t = time.monotonic()
    with s.topology(prefix="ewant") as topo:
        r = run_star(topo, s, kill_after_s=0.3, timeout=30)
    assert r["failed"] == [1] and sorted(r["per_peer_s"]) == ["2", "3"] and r["roots_agree"]
    # two survivors' copies (and part of the killed one's) all leave through the 20 Mbit uplink
    assert r["seconds"] >= 0.9 * 2 * 8 * 2 * MB / 1e6 / 20
    assert time.monotonic() - t < 15


# --- NAT'd hosts (root + iproute2 + nftables) ---------------------------------------------------
def test_nat_addressing_keeps_bridge_scheme_and_bounds_the_private_subnets() -> None:
    topo = Topology([Rates(), Rates(), Rates(nat=True)], prefix="ewant")  # not built: pure addressing
    assert topo.addr(0) == topo.public_addr(0) == "10.77.0.1"
    assert topo.addr(1) == topo.public_addr(1) == "10.77.0.2"
    assert topo.public_addr(2) == "10.77.0.3" and topo.addr(2) == "10.100.2.2"
    assert topo.router_ns(2) == f"{topo.run_tag}-r2" and topo.router_ns(1) is None
    assert topo.namespaces == [topo.hub, f"{topo.run_tag}-r2", *(topo.ns(i) for i in range(3))]
    assert nat_lan(256) == ("10.101.0.1", "10.101.0.2")
    assert nat_lan(25855) == ("10.200.255.1", "10.200.255.2")
    with pytest.raises(ValueError, match="NAT'd hosts need"):
        nat_lan(25856)
    with pytest.raises(ValueError, match="NAT'd hosts need"):
        Topology([Rates()] * 25856 + [Rates(nat=True)], prefix="ewant")


_why_not_nat = nat_available()
_PORT = 5000

# Listens on every address of its namespace; prints "ready", then the peer of each connection.
_LISTEN = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {_PORT}))
s.listen()
print("ready", flush=True)
while True:
    c, peer = s.accept()
    print(peer[0], flush=True)
    c.close()
"""

# Tries each address in argv with a short timeout; prints "ok <own address>" or the error's name.
_CONNECT = f"""
import socket, sys
for host in sys.argv[1:]:
    try:
        c = socket.create_connection((host, {_PORT}), timeout=1.5)
        print("ok", c.getsockname()[0], flush=True)
        c.close()
    except OSError as e:
        print(type(e).__name__, flush=True)
"""


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return proc.stdout.readline().strip()


def _listen(topo: Topology, host: int) -> subprocess.Popen[str]:
    proc = topo.run(host, [sys.executable, "-c", _LISTEN], stdout=subprocess.PIPE, text=True)
    assert _readline(proc, 10) == "ready"
    return proc


def _connect(topo: Topology, host: int, *addrs: str) -> list[str]:
    proc = topo.run(host, [sys.executable, "-c", _CONNECT, *addrs], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    return out.split("\n")[:-1]


def _ip_in(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=10)


@pytest.mark.integration
@pytest.mark.skipif(_why_not_nat is not None, reason=f"WAN netns NAT: {_why_not_nat}")
def test_nat_host_connects_out_masqueraded_and_accepts_nothing_in() -> None:
    t = time.monotonic()
    unshaped = Rates(up_mbit=None, down_mbit=None)
    with Topology([unshaped, unshaped, Rates(up_mbit=20, down_mbit=20, nat=True)], prefix="ewant") as topo:
        router = topo.router_ns(2)
        assert router is not None and sorted(_ours(topo.run_tag)) == sorted(topo.namespaces)
        assert router in topo.namespaces

        # (a) out through the NAT: the host dials from its private address, h0 sees the router's
        on_h0 = _listen(topo, 0)
        assert _connect(topo, 2, topo.addr(0)) == [f"ok {topo.addr(2)}"]
        assert _readline(on_h0, 5) == topo.public_addr(2) != topo.addr(2)

        # control: inbound to a host on the bridge works, so (b) failing is the NAT's doing
        _listen(topo, 1)
        assert _connect(topo, 0, topo.addr(1)) == [f"ok {topo.addr(0)}"]

        # (b) nothing gets in: the private address is unroutable from the bridge (fails at once),
        # and the router's input chain drops a new connection to its public one (a timeout, not
        # the RST an unfiltered router would send) ...
        on_h2 = _listen(topo, 2)
        assert _connect(topo, 0, topo.addr(2), topo.public_addr(2)) == ["OSError", "TimeoutError"]
        # ... and even a peer that routes the private subnet via the router is stopped by the
        # forward chain (without it, ip_forward=1 would deliver the connection).
        _ip_in(topo.ns(0), "route", "add", f"{nat_lan(2)[0].rsplit('.', 1)[0]}.0/24", "via", topo.public_addr(2))
        assert _connect(topo, 0, topo.addr(2)) == ["TimeoutError"]
        on_h2.terminate()
        out, _ = on_h2.communicate(timeout=5)
        assert out == "", f"h2 accepted connections from {out.split()}"
        tag = topo.run_tag
    # (c) every namespace, the router's included, is gone
    assert _ours(tag) == [] and router not in list_namespaces()
    assert time.monotonic() - t < 10


@pytest.mark.integration
@pytest.mark.skipif(_why_not is not None, reason=f"WAN netns: {_why_not}")
def test_the_simulator_reproduces_a_live_broadcast() -> None:
    """echo_node.sim drives the real piece-exchange state machines over modelled links: over the
    same links (shaped namespaces, their measured goodput), its broadcast time must be the live
    one's, or what it says of 1,000 peers means nothing."""
    # Three peers with 10 Mbit/s up and 40 down, the learner 20 up: the relays' uplinks set
    # the pace (N·G / (B0 + ΣBup) = 2.0 s for 4 MiB), not the learner's.
    s = Scenario(peers=3, size_bytes=4 * MB, b0_mbit=20, learner_down_mbit=40, bup_mbit=10, bdown_mbit=40,
                 learner_cpus=frozenset({0}), peer_cpus=frozenset({0, 1}))
    with s.topology(prefix="ewant") as topo:
        efficiency = measure_goodput(topo, src=1, dst=0, nbytes=MB, timeout=30)["efficiency"]
        live = run_p2p(topo, s, tag="simcheck", timeout=60)
    assert live["all_verified"]
    mbit = 1e6 / 8 * efficiency
    peers = [(s.peer_rates(i).down_mbit * mbit, s.peer_rates(i).up_mbit * mbit) for i in range(1, s.peers + 1)]  # type: ignore[operator]
    simulated = simulate_broadcast(s.size_bytes, s.b0_mbit * mbit, peers, piece_size=PIECE)
    assert 0.85 <= live["seconds"] / simulated <= 1.25, (live, simulated, efficiency)
