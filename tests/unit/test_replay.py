"""The replay buffer's ledger: every rollout trained or dropped with a reason, exactly once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from echo_node.learner.replay import TRAINED_IDS_KEPT, ReplayBuffer, group_bytes
from protocol.drops import DropReason
from protocol.messages import RolloutGroup
from tests.factories import make_group


def ids(groups: list[RolloutGroup]) -> list[int]:
    """The `n` each group was made with (make_group names it f"g{n}")."""
    return [int(g.group_id[1:]) for g in groups]


def test_async_window_admits_current_minus_s_and_drops_older() -> None:
    buf = ReplayBuffer(mode="async", staleness=2, capacity_groups=16)
    assert buf.offer(make_group(version=8), current_version=10) is None
    assert buf.offer(make_group(version=7), current_version=10) == DropReason.STALE
    assert buf.offer(make_group(version=11), current_version=10) == DropReason.FUTURE_VERSION
    assert buf.ledger.received == 24 and buf.ledger.dropped == {"stale": 8, "future_version": 8}
    buf.check()


def test_pull_admits_only_the_current_version() -> None:
    buf = ReplayBuffer(mode="pull", staleness=4, capacity_groups=16)
    assert buf.offer(make_group(version=3), current_version=3) is None
    assert buf.offer(make_group(version=2), current_version=3) == DropReason.STALE
    # The learner moves on: the waiting group is now stale and is dropped when a batch is taken.
    assert buf.take(4, current_version=4) == []
    assert buf.ledger.dropped["stale"] == 16
    buf.check()


def test_staleness_is_rechecked_when_a_batch_is_taken() -> None:
    buf = ReplayBuffer(mode="async", staleness=1, capacity_groups=16)
    for v in (5, 6, 7):
        buf.offer(make_group(version=v, n=v), current_version=7)
    assert buf.ledger.dropped["stale"] == 8  # v5 at arrival
    batch = buf.take(8, current_version=8)  # v6 is now 2 behind: dropped; v7 kept
    assert ids(batch) == [7]
    assert buf.ledger.dropped["stale"] == 16
    buf.mark_trained(batch)
    buf.check()


def test_overload_drops_the_oldest_group() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=2)
    for seq in range(3):
        buf.offer(make_group(n=seq), current_version=0)
    assert ids(buf.take(5, 0)) == [2, 1]
    assert buf.ledger.dropped == {"overload": 8}


def test_a_batch_is_the_freshest_admissible_data() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=16)
    for seq, v in enumerate((5, 7, 6, 7, 5)):
        buf.offer(make_group(version=v, n=seq), current_version=7)
    # Newest version first; among equals, the latest arrival.
    assert ids(buf.take(3, current_version=7)) == [3, 1, 2]
    assert ids(buf.take(3, current_version=7)) == [4, 0]


def test_a_group_at_its_last_admissible_version_goes_before_fresher_ones() -> None:
    """Skipped for fresher groups now, it would be dropped as stale after this update."""
    buf = ReplayBuffer(mode="async", staleness=2, capacity_groups=16)
    for seq, v in enumerate((8, 10, 9, 10)):
        buf.offer(make_group(version=v, n=seq), current_version=10)
    # v8 expires with this update (10 - S); the rest by freshness.
    first = buf.take(2, current_version=10)
    assert ids(first) == [0, 3]
    # v9 is not at its last chance yet: the freshest go first.
    second = buf.take(1, current_version=10)
    assert ids(second) == [1]
    buf.mark_trained(first + second)
    assert buf.ledger.dropped == {}
    buf.check()


def test_rejects_and_exit_are_counted() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=8)
    buf.reject(DropReason.MALFORMED)  # undecodable message: one rollout
    buf.reject(DropReason.BAD_SIGNATURE, 8)
    buf.offer(make_group(), current_version=0)
    buf.close()
    assert buf.ledger.as_dict() == {
        "received": 17,
        "trained": 0,
        "dropped": {"bad_signature": 8, "malformed": 1, "unused_at_exit": 8},
    }
    buf.check()


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReplayBuffer(mode="async", staleness=1, capacity_groups=0)


def test_restored_groups_are_taken_again_and_stay_counted() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=8)
    for seq in range(4):
        buf.offer(make_group(n=seq), current_version=0)
    batch = buf.take(2, 0)
    buf.restore(batch)  # the step never ran
    assert ids(buf.take(2, 0)) == ids(batch) == [3, 2]
    again = batch + buf.take(4, 0)
    assert ids(again) == [3, 2, 1, 0]
    buf.mark_trained(again)
    buf.check()
    assert buf.ledger.trained == 32


def _spanning(oldest: int, newest: int, n: int) -> RolloutGroup:
    """A group whose completions were interrupted by a weight swap: tokens of two versions."""
    g = make_group(n=n, version=newest)
    samples = tuple(replace(s, token_versions=(oldest,) * 2 + (newest,) * (len(s.token_versions) - 2)) for s in g.samples)
    return replace(g, samples=samples)


def test_a_completion_spanning_versions_is_judged_by_its_oldest_token() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=8)
    assert buf.offer(_spanning(5, 9, n=0), current_version=10) == DropReason.STALE
    assert buf.offer(_spanning(6, 10, n=1), current_version=10) is None
    # One version later the admitted group's oldest tokens are 5 behind: it ages out.
    assert buf.take(1, current_version=11) == []
    assert buf.ledger.dropped == {"stale": 16}
    buf.check()


def test_a_flood_evicts_the_flooders_own_groups() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=4)
    buf.offer(make_group(n=1), 0, "honest")
    for i in range(10):
        buf.offer(make_group(n=100 + i), 0, "flooder")
    kept = {buf.origin(g) for g in buf.take(4, 0)}
    assert kept == {"honest", "flooder"} and buf.ledger.dropped == {"overload": 7 * 8}


def test_bytes_are_bounded_as_well_as_groups() -> None:
    one = group_bytes(make_group(tokens=64))
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=1000, capacity_bytes=3 * one)
    for i in range(10):
        buf.offer(make_group(n=i, tokens=64), 0, "p")
    assert len(buf) == 3 and buf.bytes == 3 * one
    buf.mark_trained(buf.take(2, 0))
    assert buf.bytes == one
    buf.check()


def test_one_origin_gets_at_most_its_share_of_a_step_while_others_have_data() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=100, max_share=0.5)
    for i in range(6):
        buf.offer(make_group(n=i, version=1), 1, "fast")
    for i in range(2):
        buf.offer(make_group(n=10 + i, version=0), 1, "slow")
    step = buf.take(4, 1)
    assert sorted(buf.origin(g) for g in step) == ["fast", "fast", "slow", "slow"]
    # Alone, a peer still fills a whole step.
    assert [buf.origin(g) for g in buf.take(4, 1)] == ["fast"] * 4


def test_a_failed_step_is_counted_not_restored() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=10)
    for i in range(3):
        buf.offer(make_group(n=i), 0, "p")
    buf.mark_failed(buf.take(2, 0), DropReason.TRAIN_ERROR)
    assert buf.ledger.dropped == {"train_error": 16} and len(buf) == 1
    buf.check()


def test_groups_later_updates_could_not_fit_go_first_and_a_step_grows_to_keep_them() -> None:
    """Earliest deadline first where it matters: with S = 6 and 8 groups a step, 24 groups begun
    on one version with two updates left cannot all be trained by two updates of 8. The first
    takes the oldest that must go now, freshest groups after; with `rescue` it takes up to that
    many more rather than let them expire."""
    def fill(buf: ReplayBuffer) -> None:
        for n in range(24):
            buf.offer(make_group(version=5, n=n), current_version=10)  # 2 updates left: v10, v11
        for n in range(100, 108):
            buf.offer(make_group(version=10, n=n), current_version=10)  # fresh

    plain = ReplayBuffer(mode="async", staleness=6, capacity_groups=64)
    fill(plain)
    first = plain.take(8, current_version=10)
    assert all(g.min_version == 5 for g in first)  # 24 - 8·1 = 16 must go now: a step holds 8
    second = plain.take(8, current_version=11)
    assert all(g.min_version == 5 for g in second)
    plain.evict_stale(12)
    assert plain.ledger.dropped == {"stale": 8 * 8}  # the third step's worth expired

    rescued = ReplayBuffer(mode="async", staleness=6, capacity_groups=64)
    fill(rescued)
    first = rescued.take(8, current_version=10, rescue=8)
    assert len(first) == 16 and all(g.min_version == 5 for g in first)
    second = rescued.take(8, current_version=11, rescue=8)
    assert len(second) == 8 and all(g.min_version == 5 for g in second)  # no more than must go
    third = rescued.take(8, current_version=12, rescue=8)
    assert ids(third) == list(range(107, 99, -1))
    assert rescued.ledger.dropped == {}
    rescued.mark_trained(first + second + third)
    rescued.check()


def test_a_rescued_step_keeps_each_origins_share() -> None:
    """A larger step is no larger share for one peer: old groups of one origin cannot use the
    rescue to fill a step while others have data (max_share holds of the step's new size)."""
    buf = ReplayBuffer(mode="async", staleness=2, capacity_groups=100, max_share=0.5)
    for n in range(12):
        buf.offer(make_group(version=8, n=n), 10, "old")  # last chance: all 12 must go now
    for n in range(20, 28):
        buf.offer(make_group(version=10, n=n), 10, "fresh")
    step = buf.take(4, 10, rescue=4)
    assert len(step) == 8
    assert sorted(buf.origin(g) for g in step) == ["fresh"] * 4 + ["old"] * 4


def test_the_ids_of_an_origins_last_trained_groups_are_kept_and_bounded() -> None:
    buf = ReplayBuffer(mode="async", staleness=4, capacity_groups=256)
    for seq in range(TRAINED_IDS_KEPT + 6):  # one group a step
        buf.offer(make_group(n=seq), current_version=0, origin="mallory")
        buf.mark_trained(buf.take(1, 0))
    buf.offer(make_group(n=999), current_version=0, origin="alice")
    buf.mark_trained(buf.take(1, 0))
    assert buf.trained_groups == {"mallory": TRAINED_IDS_KEPT + 6, "alice": 1}
    assert list(buf.trained_ids["alice"]) == ["g999"]
    kept = buf.trained_ids["mallory"]
    assert list(kept) == [f"g{n}" for n in range(6, TRAINED_IDS_KEPT + 6)]  # the first trained went first
