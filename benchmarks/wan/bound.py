"""The minimum time to broadcast G bytes from one source to N peers, for any scheme.

Kumar & Ross, "Peer-assisted file distribution: the minimum distribution time" (2006), fluid
model with upload-limited source and peers and download-limited peers:

    T* = max( G / B0,                  the source must push out at least one full copy
              max_i G / Bdown_i,       every peer must take in a full copy, the slowest last
              N·G / (B0 + Σ_i Bup_i) ) N copies must be uploaded by someone, by all uplinks at once

With equal rates this is the issue's max(G/B0, G/Bdown, N·G/(B0 + N·Bup)). The bound is
achievable in the fluid model (infinitely fine pieces), so a good relay scheme lands a few
percent above it; a star (the source uploads N copies itself) takes N·G/B0.

Rates are in Mbit/s (10^6 bit/s, as tc's `mbit`); `efficiency` scales every rate, so
`efficiency = measured goodput / configured rate` turns the bound on configured rates into the
bound on what one TCP flow actually carries through a shaped link (≈0.956 at MTU 1500).
"""

from __future__ import annotations

from collections.abc import Sequence


def bound_s(
    g_bytes: int,
    b0: float,
    bup: Sequence[float],
    bdown: Sequence[float],
    *,
    efficiency: float = 1.0,
) -> float:
    """Lower bound in seconds; `bup[i]`/`bdown[i]` are peer i's uplink/downlink in Mbit/s."""
    if len(bup) != len(bdown):
        raise ValueError(f"bup has {len(bup)} peers but bdown has {len(bdown)}; give one rate per peer in each")
    if not bup:
        raise ValueError("no peers: the broadcast bound needs at least one receiving peer")
    if g_bytes < 0 or efficiency <= 0:
        raise ValueError("size must be ≥ 0 and efficiency > 0")
    if b0 <= 0 or min(bup) < 0 or min(bdown) <= 0:
        raise ValueError("the source uplink and every downlink must be > 0 Mbit/s; uplinks ≥ 0")
    bits = 8.0 * g_bytes / (1e6 * efficiency)  # Mbit, rates pre-scaled by the efficiency
    n = len(bup)
    return max(bits / b0, max(bits / d for d in bdown), n * bits / (b0 + sum(bup)))


def bound_with_departures_s(
    g_bytes: int,
    b0: float,
    survivors_bup: Sequence[float],
    survivors_bdown: Sequence[float],
    departed_bup: Sequence[float],
    depart_at_s: float,
    *,
    efficiency: float = 1.0,
) -> float:
    """Lower bound for the survivors when some peers leave at `depart_at_s` after the start.

    Departed peers may have uploaded until they left, so the capacity term credits them:
    (N_s·G − Σ_departed Bup·t) / (B0 + Σ_survivors Bup); the other two terms are unchanged.
    A relaxation (it ignores that departed peers can only upload what they had received), so
    still a valid lower bound; with no departures it equals `bound_s`."""
    base = bound_s(g_bytes, b0, survivors_bup, survivors_bdown, efficiency=efficiency)
    if not departed_bup:
        return base
    bits = 8.0 * g_bytes / (1e6 * efficiency)
    credited = sum(departed_bup) * depart_at_s  # Mbit they could have uploaded (scaled rates)
    capacity = (len(survivors_bup) * bits - credited) / (b0 + sum(survivors_bup))
    per_link = max(bits / b0, max(bits / d for d in survivors_bdown))
    return max(per_link, capacity)


def star_s(g_bytes: int, b0: float, bdown: Sequence[float], *, efficiency: float = 1.0) -> float:
    """Best time of the naive star (the source uploads every copy itself): the N copies share the
    source uplink and each peer is capped by its downlink, so max(N·G / B0, max_i G / Bdown_i);
    rates r_i = G/T meet both caps, so this is exact, not just a bound."""
    if not bdown or b0 <= 0 or min(bdown) <= 0 or efficiency <= 0:
        raise ValueError("need ≥ 1 peer, rates > 0 Mbit/s and efficiency > 0")
    bits = 8.0 * g_bytes / (1e6 * efficiency)
    return max(len(bdown) * bits / b0, max(bits / d for d in bdown))
