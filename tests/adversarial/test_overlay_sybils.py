"""Sybils trying to fill a newcomer's neighbour set (protocol/weights/overlay.py rule 2): the
learner draws a newcomer's neighbours, half of them from settled members, so a burst of fresh
identities created just before a victim joins cannot surround it, and identities that settled
long ago get no more than their share of the settled members."""

from __future__ import annotations

import random
import statistics

from protocol.weights.overlay import Overlay

K = 16


def swarm(settle_s: float, seed: int, honest: int = 60, sybils: int = 300) -> tuple[Overlay, set[str]]:
    ov = Overlay(random.Random(seed), degree=K, settle_s=settle_s)
    for i in range(honest):
        ov.join(f"h{i:04d}", reachable=True, now=float(i))
    bad = {f"s{i:04d}" for i in range(sybils)}
    for i, s in enumerate(sorted(bad)):  # a burst, right before the victim
        ov.join(s, reachable=True, now=1000.0 + i * 1e-3)
    return ov, bad


def test_a_burst_of_sybils_before_a_newcomer_fills_at_most_half_its_links() -> None:
    honest_links = []
    for seed in range(20):
        ov, bad = swarm(settle_s=60.0, seed=seed)
        ov.join("victim", reachable=True, now=1001.0)
        mine = ov.neighbours("victim")
        assert len(mine) >= K - 1
        honest_links.append(len(mine - bad))
    assert min(honest_links) >= K // 2, honest_links


def test_without_the_settled_half_the_same_burst_would_surround_it() -> None:
    # The attack is real: drawing from every member alike gives the burst its share of the
    # membership (300 of 360), and the victim few honest neighbours.
    honest_links = []
    for seed in range(20):
        ov, bad = swarm(settle_s=0.0, seed=seed)
        ov.join("victim", reachable=True, now=1001.0)
        honest_links.append(len(ov.neighbours("victim") - bad))
    assert statistics.fmean(honest_links) < K // 4, honest_links


def test_patient_sybils_get_their_share_of_the_settled_members_not_more() -> None:
    ov, bad = swarm(settle_s=60.0, seed=7, honest=300, sybils=100)  # a quarter, all settled by now
    shares = []
    for v in range(40):
        victim = f"v{v:03d}"
        ov.join(victim, reachable=True, now=5000.0 + v)
        shares.append(len(ov.neighbours(victim) & bad) / len(ov.neighbours(victim)))
    assert statistics.fmean(shares) <= 0.25 + 0.08, statistics.fmean(shares)
    assert max(shares) <= 0.6


def test_sybils_cannot_choose_whom_they_link_to_on_churn_either() -> None:
    # Sybils leaving and rejoining over and over, to be redrawn next to a target: the target's
    # links are refilled by the learner's draws, and its honest share does not erode.
    ov, bad = swarm(settle_s=60.0, seed=3, honest=200, sybils=50)
    ov.join("target", reachable=True, now=2000.0)
    start = len(ov.neighbours("target") - bad)
    now = 2000.0
    for round_ in range(10):
        for s in sorted(ov.neighbours("target") & bad):
            now += 0.01
            ov.leave(s, now=now)
            ov.join(s, reachable=True, now=now)
    assert len(ov.neighbours("target") - bad) >= min(start, K // 2)
