"""One WAN broadcast scenario: who has which link, how big a version is, who dies when.

Shared by `star` and by `benchmarks/wan_broadcast.py` so both read the same flags and build the
same topology. Conventions (deterministic, so runs compare):
- slow peers are the last ones, h(N−s+1)..hN, with `--slow-mbit` on both their up- and downlink;
- killed peers are the first ones, h1..hk (fast peers, when both are used: the harsher case for a
  relay scheme, whose best relays leave), SIGKILLed `kill_after_s` after the broadcast starts;
- `--size-mb` is MiB (2^20 bytes); rates are Mbit/s (10^6 bit/s, tc's `mbit`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from benchmarks.wan.bound import bound_s, bound_with_departures_s, star_s
from benchmarks.wan.netns import Rates, Topology


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    peers: int = 8
    size_bytes: int = 64 << 20
    b0_mbit: float = 100.0  # learner uplink
    learner_down_mbit: float = 100.0
    bup_mbit: float = 100.0
    bdown_mbit: float = 100.0
    slow_peers: int = 0
    slow_mbit: float = 25.0
    kill: int = 0
    kill_after_s: float | None = None  # None: half the calibrated bound
    mtu: int = 1500
    learner_cpus: frozenset[int] = frozenset({0})
    # Peers share both cores: each simulated host's kernel work (veth, bridge, tbf, TCP at MTU
    # 1500; ~12 CPU-s per GiB received per peer) runs on the core of the process that sends, and
    # eight hosts' worth on one core capped the mesh at 1.06-1.10x of the bound. Real peers each
    # have their own CPU; the learner uses ~5% of core 0 here.
    peer_cpus: frozenset[int] = frozenset({0, 1})
    # How the version travels among the peers: "push" (full mesh, echo_node/weights/broadcast.py)
    # or "mesh" (the bounded-degree overlay of `degree` links, echo_node/weights/mesh.py).
    exchange: str = "push"
    degree: int = 12

    def __post_init__(self) -> None:
        if self.peers < 1 or not 0 <= self.slow_peers <= self.peers or not 0 <= self.kill < self.peers:
            raise ValueError("need peers ≥ 1, 0 ≤ slow-peers ≤ peers and 0 ≤ kill < peers (someone must finish)")

    def peer_rates(self, i: int) -> Rates:
        """Rates of peer i (1-based host index)."""
        if i > self.peers - self.slow_peers:
            return Rates(up_mbit=self.slow_mbit, down_mbit=self.slow_mbit)
        return Rates(up_mbit=self.bup_mbit, down_mbit=self.bdown_mbit)

    def hosts(self) -> list[Rates]:
        return [Rates(up_mbit=self.b0_mbit, down_mbit=self.learner_down_mbit),
                *(self.peer_rates(i) for i in range(1, self.peers + 1))]

    def topology(self, *, prefix: str = "ewan") -> Topology:
        return Topology(self.hosts(), prefix=prefix, mtu=self.mtu)

    @property
    def killed(self) -> list[int]:
        return list(range(1, self.kill + 1))

    @property
    def survivors(self) -> list[int]:
        return list(range(self.kill + 1, self.peers + 1))

    def bound_s(self, efficiency: float = 1.0) -> float:
        """T* for all N peers (no departures)."""
        peers = [self.peer_rates(i) for i in range(1, self.peers + 1)]
        return bound_s(self.size_bytes, self.b0_mbit, [_r(p.up_mbit) for p in peers],
                       [_r(p.down_mbit) for p in peers], efficiency=efficiency)

    def survivors_bound_s(self, kill_after_s: float, efficiency: float = 1.0) -> float:
        """T* for the survivors, crediting killed peers' uploads before they died."""
        s = [self.peer_rates(i) for i in self.survivors]
        k = [self.peer_rates(i) for i in self.killed]
        return bound_with_departures_s(self.size_bytes, self.b0_mbit, [_r(p.up_mbit) for p in s],
                                       [_r(p.down_mbit) for p in s], [_r(p.up_mbit) for p in k],
                                       kill_after_s, efficiency=efficiency)

    def star_ideal_s(self, efficiency: float = 1.0) -> float:
        peers = [self.peer_rates(i) for i in range(1, self.peers + 1)]
        return star_s(self.size_bytes, self.b0_mbit, [_r(p.down_mbit) for p in peers], efficiency=efficiency)

    def resolved_kill_after_s(self, efficiency: float) -> float:
        return self.kill_after_s if self.kill_after_s is not None else 0.5 * self.bound_s(efficiency)

    def describe(self) -> dict[str, object]:
        peers = [self.peer_rates(i) for i in range(1, self.peers + 1)]
        return {"peers": self.peers, "exchange": self.exchange, "degree": self.degree, "size_bytes": self.size_bytes, "b0_mbit": self.b0_mbit,
                "bup_mbit": [p.up_mbit for p in peers], "bdown_mbit": [p.down_mbit for p in peers],
                "killed": self.killed, "mtu": self.mtu,
                "learner_cpus": sorted(self.learner_cpus), "peer_cpus": sorted(self.peer_cpus)}


def _r(x: float | None) -> float:
    if x is None:
        raise ValueError("the bound needs every link shaped (a rate, not None)")
    return x


def _cpus(text: str) -> frozenset[int]:
    out = frozenset(int(t) for t in text.split(",") if t.strip())
    if not out or not out <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(f"cpus {text!r}: give a comma list of cores among {sorted(os.sched_getaffinity(0))}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    ncpu = len(os.sched_getaffinity(0))
    g = p.add_argument_group("scenario")
    g.add_argument("--peers", type=int, default=8, help="N rollout peers h1..hN (default 8)")
    g.add_argument("--size-mb", type=float, default=64.0, help="G, the weight version, MiB (default 64)")
    g.add_argument("--b0", type=float, default=100.0, help="learner uplink, Mbit/s (default 100)")
    g.add_argument("--learner-down", type=float, default=100.0, help="learner downlink, Mbit/s")
    g.add_argument("--bup", type=float, default=100.0, help="peer uplink, Mbit/s (default 100)")
    g.add_argument("--bdown", type=float, default=100.0, help="peer downlink, Mbit/s (default 100)")
    g.add_argument("--slow-peers", type=int, default=0, help="the last S peers get --slow-mbit both ways")
    g.add_argument("--slow-half", action="store_true", help="shorthand: --slow-peers N/2")
    g.add_argument("--slow-mbit", type=float, default=25.0)
    g.add_argument("--kill", type=int, default=0, help="SIGKILL peers h1..hk mid-broadcast")
    g.add_argument("--kill-after", type=float, default=None, help="seconds after the start (default: half the bound)")
    g.add_argument("--mtu", type=int, default=1500)
    g.add_argument("--learner-cpus", type=_cpus, default=frozenset({0}), help="default: 0")
    g.add_argument("--peer-cpus", type=_cpus, default=frozenset({0, 1 % ncpu}), help="default: 0,1 (see Scenario)")
    g.add_argument("--exchange", choices=("push", "mesh"), default="push",
                   help="push: the full mesh; mesh: the bounded-degree overlay (default push)")
    g.add_argument("--degree", type=int, default=12, help="links per peer on the overlay (--exchange mesh; default 12)")


def from_args(a: argparse.Namespace) -> Scenario:
    return Scenario(
        peers=a.peers, size_bytes=int(a.size_mb * (1 << 20)), b0_mbit=a.b0, learner_down_mbit=a.learner_down,
        bup_mbit=a.bup, bdown_mbit=a.bdown, slow_peers=a.peers // 2 if a.slow_half else a.slow_peers,
        slow_mbit=a.slow_mbit, kill=a.kill, kill_after_s=a.kill_after, mtu=a.mtu,
        learner_cpus=a.learner_cpus, peer_cpus=a.peer_cpus, exchange=a.exchange, degree=a.degree,
    )
