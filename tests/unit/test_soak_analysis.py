"""The soak benchmark's analysis (benchmarks/soak.py): records in, numbers out, no processes."""

from __future__ import annotations

import random

from benchmarks.soak import (
    checks,
    dropped_delta,
    first_update_after,
    growth,
    install_check,
    last_published,
    learner_kill_times,
    ledger,
    max_peer_lag,
    newest_installed,
    parse_jsonl,
    plan_churn,
    reused_versions,
    rollouts_published,
    version_around,
)


def pub(version: int, sha: str, epoch: int = 1, wall: float = 0.0) -> dict:
    return {"event": "published", "version": version, "sha256": sha, "epoch": epoch, "wall": wall}


def inst(version: int, sha: str | None, epoch: int | None = 1, wall: float = 0.0) -> dict:
    r = {"event": "installed", "version": version, "wall": wall}
    if sha is not None:
        r["sha256"] = sha
    if epoch is not None:
        r["epoch"] = epoch
    return r


def test_parse_jsonl_counts_torn_lines() -> None:
    text = '{"event": "train", "version": 1}\n{"event": "tr{"event": "train", "version": 2}\n\n[1]\n{"event": "x"}'
    recs, bad = parse_jsonl(text)
    assert [r["event"] for r in recs] == ["train", "x"]
    assert bad == 2


def test_reused_versions_one_number_two_weights() -> None:
    metrics = [pub(1, "a"), pub(2, "b"), {"event": "train", "version": 2}, pub(2, "b"), pub(2, "c", epoch=2), pub(3, "d", epoch=2)]
    assert reused_versions(metrics) == [2]
    assert reused_versions([pub(1, "a"), pub(1, "a", epoch=2)]) == []  # the same weights republished
    assert reused_versions([]) == []


def test_install_check_matches_by_epoch_when_named() -> None:
    metrics = [pub(5, "a", epoch=1), pub(5, "b", epoch=2), pub(6, "c", epoch=2)]
    peers = {
        "peer0": [inst(5, "a", epoch=1), inst(5, "b", epoch=2), inst(6, "c", epoch=2)],
        "peer1": [inst(5, "b", epoch=1),  # epoch 1 published "a" for version 5
                  inst(6, "x", epoch=None),  # no epoch: any sha of the version would do, "x" is none
                  inst(7, "y"),  # never published
                  inst(6, None)],  # no sha
    }
    out = install_check(metrics, peers)
    assert out["installs"] == 7
    assert out["mismatch"] == 2
    assert out["unmatched"] == 1 and out["unmatched_versions"] == [7]
    assert out["without_sha"] == 1
    assert {(e["peer"], e["version"]) for e in out["examples"]} == {("peer1", 5), ("peer1", 6)}


def test_ledger_of_summary_and_of_train_record() -> None:
    summary = {"rollouts_received": 100, "rollouts_accepted": 80, "rollouts_dropped": {"stale": 15, "dup": 2},
               "rollouts_buffered": 0, "lost_messages": 3}
    assert ledger(summary) == {"received": 100, "trained": 80, "dropped": {"stale": 15, "dup": 2}, "buffered": 0, "lost": 3}
    train = {"event": "train", "received": 50, "trained": 40, "dropped": {"stale": 4}, "buffered": 6}
    assert ledger(train)["lost"] == 0


def test_first_update_after_restart_by_epoch_or_wall() -> None:
    train = [
        {"event": "train", "version": 10, "epoch": 1, "wall": 100.0},
        {"event": "train", "version": 11, "epoch": 2, "wall": 125.5},
        {"event": "train", "version": 12, "epoch": 2, "wall": 126.0},
    ]
    assert first_update_after(train, 110.0, epoch=2) == 15.5
    assert first_update_after(train, 110.0, epoch=3) is None
    no_epochs = [{k: v for k, v in r.items() if k != "epoch"} for r in train]
    assert first_update_after(no_epochs, 110.0) == 15.5
    assert first_update_after(no_epochs, 200.0) is None


def test_version_around_a_kill() -> None:
    train = [{"event": "train", "version": v, "wall": w} for v, w in [(9, 1.0), (10, 2.0), (1, 5.0), (2, 6.0)]]
    assert version_around(train, kill_wall=3.0, restart_wall=4.0) == {"before_kill": 10, "first_after": 1}


def test_last_published_falls_back_to_train_records() -> None:
    assert last_published([pub(3, "a"), {"event": "train", "version": 9, "published": 9}, pub(8, "b")]) == 8
    assert last_published([{"event": "train", "version": 9, "published": 7}]) == 7
    assert last_published([]) is None


def test_newest_installed_of_the_current_incarnation_and_lag() -> None:
    recs = [inst(3, "a", wall=1.0), inst(9, "b", wall=2.0), {"event": "joined", "wall": 5.0}, inst(7, "c", wall=6.0)]
    assert newest_installed(recs) == 9
    assert newest_installed(recs, since_wall=4.0) == 7
    assert newest_installed(recs, since_wall=10.0) is None
    assert max_peer_lag(12, {"peer0": 7, "peer1": 11}) == 5
    assert max_peer_lag(12, {"peer0": 7, "peer1": None}) is None
    assert max_peer_lag(None, {"peer0": 7}) is None


def test_rollouts_published_sums_the_peers_batches() -> None:
    peers = {"peer0": [{"event": "published", "seq": 1, "groups": 8, "rollouts": 64}, inst(1, "a")],
             "peer1": [{"event": "published", "seq": 7, "groups": 2, "rollouts": 16}]}
    assert rollouts_published(peers) == 80


def test_growth_from_the_first_minute_to_the_end() -> None:
    samples = [(100.0, 200.0), (150.0, 210.0), (161.0, 220.0), (400.0, 231.0)]
    g = growth(samples, start_wall=100.0)
    assert g["first_minute"] == 220.0 and g["end"] == 231.0 and g["growth"] == 0.05
    assert g["first_at_s"] == 61.0 and g["end_at_s"] == 300.0
    assert growth(samples[:2], start_wall=100.0)["growth"] is None  # died before a minute
    assert growth([], start_wall=0.0)["end"] is None


def test_plan_is_seeded_and_bounded() -> None:
    window = 600.0
    a, b = plan_churn(7, window), plan_churn(7, window)
    assert a == b and a != plan_churn(8, window)
    kinds = [e["kind"] for e in a]
    assert kinds.count("learner_kill") == 2 and kinds.count("peer_stop") == 1
    kills = [e["t"] for e in a if e["kind"] == "learner_kill"]
    assert all(0.1 * window <= t <= 0.9 * window for t in kills) and kills[1] - kills[0] >= 90.0
    assert all(1.0 <= e["down_s"] <= 3.0 for e in a if e["kind"] == "learner_kill")
    for e in a:
        if e["kind"] == "peer_kill":
            assert e["t"] < window - 30.0 and 2.0 <= e["down_s"] <= 10.0 and 0 <= e["peer"] < 4
    assert [e["t"] for e in a] == sorted(e["t"] for e in a)


def test_learner_kills_spread_evenly_when_the_window_is_short() -> None:
    ts = learner_kill_times(random.Random(0), 100.0, 2, 90.0, tries=10)
    assert ts == [10.0, 90.0]
    assert learner_kill_times(random.Random(0), 100.0, 0, 90.0) == []


def test_checks() -> None:
    report = {"rollouts": {"lost": 0}, "reused_versions": 0, "peer_installed_mismatch": None,
              "restart_to_first_update_s": [12.0, 31.0], "max_peer_lag": 3, "keep_versions": 4,
              "learner_rss_mb": {"growth": 0.02}, "learner_fds": {"growth": 0.5}}
    c = checks(report)
    assert c == {"lost": True, "reused_versions": True, "peer_installed_mismatch": None, "restart_to_first_update": False,
                 "max_peer_lag": True, "rss_growth": True, "fds_growth": False}


def test_dropped_delta_around_a_restart() -> None:
    train = [{"event": "train", "wall": w, "dropped": d} for w, d in
             [(1.0, {"stale": 3}), (2.0, {"stale": 4, "duplicate": 5}), (10.0, {"duplicate": 50}), (30.0, {"duplicate": 70})]]
    assert dropped_delta(train, "duplicate", t0=5.0, t1=20.0) == 45
    assert dropped_delta(train, "duplicate", t0=0.5, t1=20.0) == 50
    assert dropped_delta(train, "duplicate", t0=5.0, t1=0.5) is None
