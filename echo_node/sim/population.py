"""Heterogeneous rollout workers drawn from stated distributions (the swarms the benchmarks use).

Distributions (chosen, not measured; each a guess at a volunteer / rented-GPU swarm on home links):
- Downlink: lognormal, median 63 Mbit/s, σ = 0.70, so 5 %-95 % ≈ 20-200 Mbit/s; clipped to
  [10, 1000] Mbit/s.
- Uplink: lognormal, median 14 Mbit/s, σ = 0.63, so 5 %-95 % ≈ 5-40 Mbit/s; clipped to
  [2, 200] Mbit/s and never above the same host's downlink (home links are asymmetric).
- One-way access latency: uniform 5-40 ms.
- GPU tier (share of workers, median rollouts/s, median $/h), roughly a GPU marketplace's
  consumer and datacenter cards on a small-model rollout workload:
  RTX 3090 (30 %, 1.0/s, $0.22), RTX 4090 (30 %, 1.7/s, $0.40), L40S (15 %, 2.0/s, $0.85),
  A100 (15 %, 3.0/s, $1.30), H100 (10 %, 5.0/s, $2.40): price per rollout/s from $0.22 to $0.48.
  Around its tier, a worker's μ is lognormal with σ = 0.25 (host, driver, contention) and its
  price lognormal with σ = 0.15 (market spread).
`scale_mu` multiplies every μ (to place a pool relative to μ_min).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["GPU_TIERS", "MBIT", "PeerSpec", "Tier", "draw_peer", "draw_peers"]

MBIT = 1e6 / 8  # bytes/s in one Mbit/s


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    share: float
    mu: float  # median rollouts/s
    price: float  # median $/h


GPU_TIERS: tuple[Tier, ...] = (
    Tier("rtx3090", 0.30, 1.0, 0.22),
    Tier("rtx4090", 0.30, 1.7, 0.40),
    Tier("l40s", 0.15, 2.0, 0.85),
    Tier("a100", 0.15, 3.0, 1.30),
    Tier("h100", 0.10, 5.0, 2.40),
)


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """A worker as the simulation knows it: true rates and price."""

    peer_id: str
    tier: str
    mu: float  # rollouts/s
    price: float  # $/h
    down: float  # bytes/s
    up: float  # bytes/s
    lat: float  # one-way access latency, s


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return math.exp(rng.gauss(math.log(median), sigma))


def draw_peer(rng: random.Random, peer_id: str, *, scale_mu: float = 1.0) -> PeerSpec:
    tier = rng.choices(GPU_TIERS, weights=[t.share for t in GPU_TIERS])[0]
    down = min(1000.0, max(10.0, _lognormal(rng, 63.2, 0.70)))
    up = min(down, 200.0, max(2.0, _lognormal(rng, 14.1, 0.63)))
    return PeerSpec(
        peer_id=peer_id,
        tier=tier.name,
        mu=scale_mu * _lognormal(rng, tier.mu, 0.25),
        price=_lognormal(rng, tier.price, 0.15),
        down=down * MBIT,
        up=up * MBIT,
        lat=rng.uniform(0.005, 0.040),
    )


def draw_peers(rng: random.Random, n: int, *, prefix: str = "w", scale_mu: float = 1.0) -> list[PeerSpec]:
    return [draw_peer(rng, f"{prefix}{i:05d}", scale_mu=scale_mu) for i in range(n)]
