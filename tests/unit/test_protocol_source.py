"""The learner's send rules for one version (protocol/weights/source.py): relays from the head of
the shared queue, direct pieces from its tail to peers that asked `more` and to every peer that
lacks an opened one, fewest pieces first, and at most one copy of each piece per link."""

from __future__ import annotations

import pytest

from protocol.errors import LocalProtocolError
from protocol.weights.source import MAX_CREDITS, SourcePlan


def plan_with(peers: list[str], num_pieces: int = 8) -> SourcePlan:
    plan = SourcePlan(num_pieces)
    for p in peers:
        plan.join(p)
    return plan


def test_relays_take_the_head_of_the_queue_and_none_once_it_is_empty() -> None:
    plan = plan_with(["a", "b"], num_pieces=3)
    assert [plan.next("a"), plan.next("b"), plan.next("a")] == [0, 1, 2]
    assert plan.next("b") is None
    assert plan.next("stranger") is None  # not linked: nothing


def test_no_direct_piece_without_a_more_or_an_opened_piece_to_finish() -> None:
    plan = plan_with(["a", "b"])
    assert plan.direct(["a", "b"]) == []  # nobody asked: relays carry everything (symmetric links)
    plan.more("a")
    assert plan.direct(["a", "b"]) == [("a", 7)]  # opened from the tail: relays take the head
    # The opened piece is owed to every peer, asked or not: the source delivers it itself.
    assert plan.wants("b") and not plan.wants("a")
    assert plan.direct(["a", "b"]) == [("b", 7)]
    assert plan.direct(["a", "b"]) == []


def test_an_idle_uplink_credits_every_peer_without_a_credit_while_untouched_pieces_remain() -> None:
    plan = plan_with(["a", "b", "c"], num_pieces=4)
    plan.more("a")
    plan.more("a")
    assert sorted(plan.idle()) == ["b", "c"]  # a holds credits already: not topped up
    assert sorted(p for p, _ in plan.direct(["a", "b", "c"])) == ["a", "b", "c"]
    assert plan.idle() == ["b", "c"]  # b's and c's credits were spent; a still holds one
    # Nothing untouched left (handed to relays or opened): no credit, whatever the idleness.
    while plan.next("a") is not None:
        pass
    assert plan.idle() == [] and all(i is None or i < 4 for _, i in plan.direct(["a", "b", "c"]))
    # Credits never lift the one-copy-per-link rule: a peer linked all along is sent each piece once.
    for _ in range(10):
        plan.idle()
        plan.direct(["b"])
    assert plan.held("b") <= 4


def test_only_idle_links_get_a_direct_piece_one_each() -> None:
    plan = plan_with(["a", "b"])
    for _ in range(3):
        plan.more("a")
    assert plan.direct(["b"]) == []  # a's link has something queued: not offered
    assert plan.direct(["a", "a"]) == [("a", 7)]  # one per idle link per call


def test_the_peer_with_the_fewest_pieces_from_the_source_goes_first() -> None:
    plan = plan_with(["a", "b", "c"])
    plan.next("b")
    plan.next("b")
    plan.next("c")
    for p in "abc":
        plan.more(p)
    assert [p for p, _ in plan.direct(["a", "b", "c"], budget=2)] == ["a", "c"]


def test_a_peer_finishes_the_direct_set_before_opening_a_new_piece() -> None:
    plan = plan_with(["a", "b"])
    plan.more("a")
    plan.more("a")
    plan.more("b")
    assert plan.direct(["a"]) == [("a", 7)]
    assert plan.direct(["a"]) == [("a", 6)]  # a holds the whole direct set: a new one
    assert plan.direct(["b"]) == [("b", 7)]  # b finishes the oldest first
    assert plan.direct_set == [7, 6]


def test_relays_and_direct_pieces_meet_in_the_queue_and_more_then_gets_none() -> None:
    plan = plan_with(["a"], num_pieces=2)
    plan.more("a")
    assert plan.direct(["a"]) == [("a", 1)]
    assert plan.next("a") == 0
    assert plan.next("a") is None
    plan.more("a")
    assert plan.direct(["a"]) == [("a", None)]  # "none": nothing more for it
    assert not plan.wants("a")  # its credits are spent


def test_a_peer_claiming_to_lack_everything_gets_each_piece_once_per_link() -> None:
    plan = plan_with(["greedy", "b"], num_pieces=4)
    got = [i for i in range(4) for _ in range(3) if plan.get("greedy", i)]  # asks every piece 3 times
    assert got == [0, 1, 2, 3]
    for _ in range(100):
        plan.more("greedy")
    assert plan.wants("greedy")
    while plan.direct(["greedy"]) not in ([], [("greedy", None)]):
        pass
    assert plan.held("greedy") == 4  # one copy of the version, whatever it asked
    assert plan.next("greedy") is None and plan.held("greedy") == 4
    # It cannot bank credits: at most MAX_CREDITS are held.
    plan.leave("greedy")
    plan.join("greedy")
    for _ in range(100):
        plan.more("greedy")
    assert len([1 for _ in range(10) if plan.direct(["greedy"])]) <= MAX_CREDITS


def test_gets_of_a_piece_already_sent_on_the_link_are_not_answered_until_it_reconnects() -> None:
    plan = plan_with(["a"])
    assert plan.next("a") == 0
    assert not plan.get("a", 0)
    assert plan.get("a", 1) and not plan.get("a", 1)
    assert not plan.get("a", 99) and not plan.get("stranger", 2)
    plan.leave("a")
    plan.join("a")
    assert plan.get("a", 1)  # a new link starts afresh


def test_a_piece_a_peer_already_fetched_is_neither_handed_to_it_to_relay_nor_sent_again() -> None:
    plan = plan_with(["a", "b"], num_pieces=4)
    assert plan.get("a", 0) and plan.get("a", 3)
    assert plan.next("a") == 1  # 0 would not be relayed by a (not new to it): the source keeps it
    assert plan.direct_set == [0]
    plan.more("a")
    assert plan.direct(["a"]) == [("a", 2)]  # 3 is opened for the others, not sent to a again
    assert plan.direct_set == [0, 3, 2]
    assert [plan.direct(["b"]) for _ in range(3)] == [[("b", 0)], [("b", 3)], [("b", 2)]]


def test_a_bad_size_is_refused() -> None:
    with pytest.raises(LocalProtocolError):
        SourcePlan(0)
