"""SequenceTracker: duplicates, gaps, the floor rule, the window, giving up, eviction."""

from __future__ import annotations

import pytest

from protocol import Observation, SequenceTracker

NEW, DUP, OLD = Observation.NEW, Observation.DUPLICATE, Observation.TOO_OLD


def test_in_order_no_gaps() -> None:
    t = SequenceTracker()
    assert [t.observe("p", s) for s in range(5)] == [NEW] * 5
    assert t.missing("p") == [] and t.highest("p") == 4


def test_duplicates() -> None:
    t = SequenceTracker()
    t.observe("p", 0)
    t.observe("p", 1)
    assert t.observe("p", 1) is DUP and t.observe("p", 0) is DUP
    assert t.observe("q", 1) is NEW  # per publisher


def test_gaps_reported_oldest_first_and_filled() -> None:
    t = SequenceTracker()
    for s in (0, 1, 4, 7):
        t.observe("p", s)
    assert t.missing("p") == [2, 3, 5, 6]
    assert t.observe("p", 5) is NEW
    assert t.missing("p") == [2, 3, 6]
    assert t.observe("p", 5) is DUP


def test_first_seen_seq_sets_the_floor() -> None:
    t = SequenceTracker()
    assert t.observe("p", 57) is NEW
    assert t.missing("p") == []  # never ask for 0..56
    t.observe("p", 59)
    assert t.missing("p") == [58]
    assert t.observe("p", 50) is NEW  # late, reordered: inside the window, not seen
    assert t.observe("p", 50) is DUP
    assert t.missing("p") == [58]  # the floor does not move down


def test_window_too_old_and_gap_limits() -> None:
    t = SequenceTracker(window=16, max_missing=4)
    t.observe("p", 0)
    t.observe("p", 10)
    assert t.missing("p") == [1, 2, 3, 4]  # capped, oldest first
    t.observe("p", 20)  # window now covers 5..20
    assert t.observe("p", 4) is OLD
    assert t.observe("p", 5) is NEW
    assert t.missing("p") == [6, 7, 8, 9]
    t.observe("p", 25)  # window 10..25: 6..9 fell out
    assert t.missing("p")[0] == 11


def test_jump_beyond_window_resets() -> None:
    t = SequenceTracker(window=16)
    t.observe("p", 3)
    assert t.observe("p", 3 + 16) is NEW
    assert t.missing("p") == []  # a restart, not 15 losses
    assert t.observe("p", 3) is OLD
    t.observe("p", 3 + 18)
    assert t.missing("p") == [20]


def test_exactly_window_behind_is_too_old_one_less_is_tracked() -> None:
    t = SequenceTracker(window=8)
    t.observe("p", 0)
    t.observe("p", 7)  # offset 7: still within
    assert t.missing("p") == [1, 2, 3, 4, 5, 6]
    t.observe("p", 8)
    assert t.observe("p", 0) is OLD
    assert t.observe("p", 1) is NEW


def test_mark_given_up() -> None:
    t = SequenceTracker()
    for s in (0, 5):
        t.observe("p", s)
    t.mark_given_up("p", [1, 2, 99, -3])
    assert t.missing("p") == [3, 4]
    assert t.observe("p", 2) is NEW  # a given-up seq that turns up is still new data
    assert t.observe("p", 2) is DUP
    t.mark_given_up("unknown", [1])  # no-op
    t.observe("p", 8)  # given-up state shifts with the window
    assert t.missing("p") == [3, 4, 6, 7]


def test_eviction_of_least_recently_seen() -> None:
    t = SequenceTracker(max_publishers=3)
    for p in ("a", "b", "c"):
        t.observe(p, 0)
    t.observe("a", 1)  # a is now most recent
    t.observe("d", 0)  # evicts b
    assert "b" not in t and "a" in t and len(t) == 3
    assert t.observe("b", 0) is NEW  # starts over
    assert "c" not in t


def test_forget_and_validation() -> None:
    t = SequenceTracker()
    t.observe("p", 1)
    t.forget("p")
    assert "p" not in t and t.missing("p") == [] and t.highest("p") is None
    with pytest.raises(ValueError):
        t.observe("p", -1)
    with pytest.raises(ValueError):
        SequenceTracker(window=0)


def test_default_bounds_hold_under_large_gaps() -> None:
    t = SequenceTracker()
    t.observe("p", 0)
    t.observe("p", 4095)
    missing = t.missing("p")
    assert len(missing) == 256 and missing[0] == 1 and missing == sorted(missing)


def test_skips_count_given_up_seqs_and_jumps_against_what_was_delivered() -> None:
    t = SequenceTracker(window=16)
    for s in (0, 1, 4, 7):
        t.observe("p", s)
    assert t.skips("p") == (0, 4)  # gaps are not skips until repair gives them up
    t.mark_given_up("p", [2, 3, 5])
    t.mark_given_up("p", [2, 3])  # twice is once
    assert t.skips("p") == (3, 4)
    assert t.observe("p", 5) is NEW  # a given-up seq that arrives after all is no skip
    assert t.skips("p") == (2, 5)
    t.observe("p", 7 + 100)  # a jump beyond the window passes over 99 owed seqs, and seq 6 was owed
    assert t.skips("p") == (102, 6) and t.missing("p") == []
    assert t.skips("nobody") == (0, 0)


def test_an_excused_gap_costs_nothing_once() -> None:
    t = SequenceTracker(window=16)
    t.observe("p", 0)
    t.excuse_next_gap("p")  # it rejoined: a restart moved its seqs on
    t.observe("p", 1000)
    assert t.skips("p") == (0, 2)
    t.observe("p", 1005)  # within the window: seqs 1001-1004 are owed again
    assert t.missing("p") == [1001, 1002, 1003, 1004]
    t.excuse_next_gap()  # every publisher: this side restarted
    t.observe("p", 1010)  # the gap 1006-1009 is excused; 1001-1004 stay below the new floor
    assert t.missing("p") == [] and t.skips("p") == (0, 4)
    t.observe("p", 2000)
    assert t.skips("p") == (989, 5)


def test_skip_counts_survive_a_snapshot_and_old_rows_restore() -> None:
    t = SequenceTracker(window=16)
    t.observe("p", 0)
    t.observe("p", 100)
    u = SequenceTracker(window=16)
    u.restore(t.snapshot())
    assert u.skips("p") == t.skips("p") == (99, 2)
    u.restore([["q", 3, 5, "5", "0"]])  # a checkpoint from before skips were counted
    assert u.skips("q") == (0, 1) and u.missing("q") == [4]
    with pytest.raises(ValueError):
        u.restore([["q", 3, 5, "5", "0", 1, -1]])


def test_owed_seqs_that_leave_the_window_unasked_are_skips() -> None:
    """Moving forward by less than the window pushes the oldest owed seqs out before repair asked
    for them: counted, or a publisher could skip most of every window by stepping just short of
    a jump."""
    t = SequenceTracker(window=16, max_missing=2)
    t.observe("p", 0)
    t.observe("p", 10)  # 1-9 owed
    assert t.skips("p") == (0, 2)
    t.observe("p", 20)  # 1-4 leave the window (it holds 5-20)
    assert t.skips("p") == (4, 3) and t.missing("p") == [5, 6] and t.owed("p") == 14 and t.owed("q") == 0
    t.excuse_next_gap("p")
    t.observe("p", 30)  # excused: what left (5-14) was forgiven
    assert t.skips("p") == (4, 4)


def test_disowned_seqs_are_counted_apart_and_kept() -> None:
    t = SequenceTracker(window=16)
    for s in (0, 5):
        t.observe("p", s)
    t.mark_given_up("p", [1, 2], disowned=True)
    t.mark_given_up("p", [1, 2, 3])  # the same seqs again count once; 3 is an ordinary give-up
    assert t.skips("p") == (3, 2) and t.disowned("p") == 2 and t.disowned("q") == 0
    u = SequenceTracker(window=16)
    u.restore(t.snapshot())
    assert u.disowned("p") == 2 and u.skips("p") == (3, 2)
    u.restore([["q", 3, 5, "5", "0", 1, 0]])  # a row from before disowned seqs were counted
    assert u.disowned("q") == 0
    with pytest.raises(ValueError):
        u.restore([["q", 3, 5, "5", "0", 1, 0, -1]])


def test_forgiving_what_is_owed_counts_nothing() -> None:
    """This side's restart: what was owed may since have left the publishers' histories."""
    t = SequenceTracker(window=16)
    for s in (0, 4):
        t.observe("p", s)
    t.forgive_owed()
    assert t.missing("p") == [] and t.skips("p") == (0, 2)
    t.mark_given_up("p", [1, 2, 3], disowned=True)  # a late answer to an earlier request
    assert t.skips("p") == (0, 2) and t.disowned("p") == 0
    t.observe("p", 6)  # forgiving is not an excuse: seq 5 is owed
    assert t.missing("p") == [5]
