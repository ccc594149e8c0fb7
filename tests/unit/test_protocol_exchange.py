"""Piece exchange on the overlay (protocol/weights/exchange.py): a receiver's requests to its
neighbours and the learner's sends to the peers it serves."""

from __future__ import annotations

import math
import random

import pytest

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.weights.exchange import ENDGAME_COPIES, HAVE_BATCH_S, HAVE_SEED_GAP_S, Exchange, SeedPlan, bits_of, have_due


def exchange(num_pieces: int = 16, **kwargs: object) -> Exchange:
    return Exchange(num_pieces, random.Random(0), **kwargs)  # type: ignore[arg-type]


def test_only_announced_pieces_are_asked_and_at_most_pipeline_per_neighbour() -> None:
    ex = exchange(pipeline=2)
    ex.neighbour_up("a")
    assert ex.requests("a", 0.0) == []  # it announced nothing
    assert ex.has("a", 3) and ex.has("a", 5) and ex.has("a", 7)
    asked = ex.requests("a", 0.0)
    assert len(asked) == 2 and set(asked) <= {3, 5, 7}
    assert ex.requests("a", 0.0) == []  # pipeline full
    assert not ex.has("b", 1)  # not a neighbour: ignored


def test_one_request_per_piece_outside_the_endgame() -> None:
    ex = exchange(pipeline=4)
    for p in "ab":
        ex.neighbour_up(p)
        for i in range(8):
            ex.has(p, i)
    first, second = ex.requests("a", 0.0), ex.requests("b", 0.0)
    assert not set(first) & set(second)


def test_rarest_first_after_the_random_start() -> None:
    # Of `sample` random candidates the neighbour offers, the one the fewest neighbours hold.
    rare = 0
    for seed in range(200):
        ex = Exchange(64, random.Random(seed), pipeline=1, random_first=0, sample=16)
        for p in "abc":
            ex.neighbour_up(p)
        for i in range(64):
            ex.has("a", i)
        for i in range(63):  # piece 63 is the one only "a" holds
            ex.has("b", i)
            ex.has("c", i)
        rare += ex.requests("a", 0.0) == [63]
    # Uniform would pick it 1/64 of the time; 16 samples find it 1 - (63/64)^16 = 22 % of the time.
    assert rare >= 30, rare


def test_a_piece_arriving_elsewhere_cancels_the_other_requests() -> None:
    ex = exchange(pipeline=1)
    ex.neighbour_up("a")
    ex.has("a", 2)
    assert ex.requests("a", 0.0) == [2]
    assert ex.received("learner", 2)  # the learner's copy came first
    assert ex.take_cancels() == [("a", 2)]
    assert not ex.received("a", 2)  # the late copy: counted as waste, not new
    assert ex.wasted == 1


def test_endgame_duplicates_only_the_last_pieces() -> None:
    ex = exchange(num_pieces=8, pipeline=8, endgame_pieces=2)
    ex.neighbour_up("a")
    ex.neighbour_up("b")
    for i in range(8):
        ex.has("a", i)
        ex.has("b", i)
    assert len(ex.requests("a", 0.0)) == 8
    assert ex.requests("b", 0.0) == []  # 8 missing > 2: no copies yet
    for i in range(6):
        ex.received("a", i)
    dup = ex.requests("b", 1.0)
    assert sorted(dup) == [6, 7] and all(ex.requested[i] == ENDGAME_COPIES for i in dup)


def test_a_leaving_neighbour_frees_its_requests_for_the_others() -> None:
    ex = exchange(pipeline=2)
    for p in "ab":
        ex.neighbour_up(p)
        ex.has(p, 0)
        ex.has(p, 1)
    assert sorted(ex.requests("a", 0.0)) == [0, 1]
    assert ex.requests("b", 0.0) == []
    ex.neighbour_gone("a")
    assert sorted(ex.requests("b", 0.0)) == [0, 1]
    assert ex.availability[0] == 1


def test_a_neighbour_that_never_answers_is_given_up_and_the_piece_asked_elsewhere() -> None:
    ex = exchange(pipeline=1, request_timeout=5.0)
    for p in "ab":
        ex.neighbour_up(p)
        ex.has(p, 4)
    holder = ex.requests("a", 0.0) and "a" or ex.requests("b", 0.0) and "b"
    other = "b" if holder == "a" else "a"
    assert ex.requests(other, 1.0) == []
    assert ex.expire(4.9) == [] and ex.next_deadline() == 5.0
    assert ex.expire(5.0) == [(holder, 4)] and ex.stalls == {holder: 1}
    assert ex.requests(other, 5.0) == [4]


def test_a_neighbour_advertising_pieces_it_lacks_is_dropped_after_bad_copies() -> None:
    ex = exchange(pipeline=4, max_bad_pieces=3)
    ex.neighbour_up("liar")
    ex.neighbour_up("honest")
    for i in range(4):
        ex.has("liar", i)
        ex.has("honest", i)
    for i in ex.requests("liar", 0.0):
        ex.received("liar", i, ok=False)  # what it sends fails the hash check
    assert "liar" in ex.banned and "liar" not in ex.neighbours()
    assert not ex.has("liar", 5)  # its announcements no longer count
    assert sorted(ex.requests("honest", 1.0)) == [0, 1, 2, 3]


@pytest.mark.parametrize("index", [-1, 16, 1 << 40, 2.0, True])
def test_a_piece_outside_the_version_is_a_protocol_violation_and_changes_nothing(index: object) -> None:
    # A negative index would wrap into a bytearray and 16 would run off its end: every way a
    # neighbour names a piece is checked against [0, num_pieces) before it touches any state.
    ex = exchange(num_pieces=16)
    ex.neighbour_up("a")
    with pytest.raises(RemoteProtocolError):
        ex.has("a", index)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError):
        ex.received("a", index)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError):
        ex.has_many("a", [3, index])  # type: ignore[list-item]
    sp = plan(num_pieces=16, peers="a")
    with pytest.raises(RemoteProtocolError):
        sp.has("a", index)  # type: ignore[arg-type]
    assert ex.availability == [0] * 16 and ex.requests("a", 0.0) == [] and ex.count == 0
    assert sp.pick(["a"]) is not None  # the plan still serves it


def test_an_announcement_mask_beyond_the_version_is_refused() -> None:
    ex = exchange(num_pieces=16)
    ex.neighbour_up("a")
    for bits in (-1, 1 << 16, (1 << 17) - 1, 3.0, True):
        with pytest.raises(RemoteProtocolError):
            ex.has_bits("a", bits)  # type: ignore[arg-type]
    assert ex.has_bits("a", bits_of([0, 15], 16)) and sorted(ex.requests("a", 0.0)) == [0, 15]


def test_pieces_held_or_requested_are_never_offered_again_until_a_request_is_given_up() -> None:
    ex = exchange(num_pieces=8, pipeline=8, random_first=0)
    for p in "ab":
        ex.neighbour_up(p)
        ex.has_bits(p, (1 << 8) - 1)
    first = ex.requests("a", 0.0)
    assert sorted(first) == list(range(8)) and ex.requests("b", 0.0) == []
    ex.received("a", first[0])
    ex.neighbour_gone("a")  # its seven requests are free to ask elsewhere at once
    assert sorted(ex.requests("b", 1.0)) == sorted(first[1:])
    assert ex.availability[first[1]] == 1


def answer_every(ex: Exchange, peer: str, took: float, rounds: int) -> list[int]:
    """Answer each of `peer`'s requests `took` seconds after it was made; the depths seen."""
    now, depths = 0.0, []
    for _ in range(rounds):
        asked = ex.requests(peer, now)
        depths.append(len(asked))
        for index in asked:
            now += took
            ex.received(peer, index, now=now)
    return depths


def test_the_depth_follows_the_neighbours_rate() -> None:
    # horizon 0.1 s: answers every 0.02 s cover it with 1 + 5 requests (capped at 4); answers
    # every 0.4 s (a home uplink shared by its neighbours) with one.
    fast, slow = exchange(num_pieces=64, pipeline=4, horizon=0.1), exchange(num_pieces=64, pipeline=4, horizon=0.1)
    for ex in (fast, slow):
        ex.neighbour_up("a")
        ex.has_bits("a", (1 << 64) - 1)
        assert ex.depth("a") == 1  # unmeasured: one request
    assert answer_every(fast, "a", 0.02, 6)[-1] == 4 and fast.depth("a") == 4
    assert answer_every(slow, "a", 0.4, 6) == [1] * 6 and slow.depth("a") == 1
    # A fast neighbour that slows down loses its depth: the average follows within a few pieces.
    answer_every(fast, "a", 0.5, 3)
    assert fast.depth("a") == 1
    assert fast.depth("nobody") == 0


def test_a_neighbours_rate_from_an_earlier_version_sets_its_first_depth() -> None:
    # The time its answers took last version (0.02 s) starts it at the depth that gives, and the
    # average goes on from there; without one it starts with a one-piece probe.
    last = exchange(num_pieces=64, pipeline=4, horizon=0.1)
    last.neighbour_up("a")
    last.has_bits("a", (1 << 64) - 1)
    assert last.timing("a") is None
    answer_every(last, "a", 0.02, 6)
    took = last.timing("a")
    assert took is not None and abs(took - 0.02) < 1e-9
    ex = exchange(num_pieces=64, pipeline=4, horizon=0.1)
    ex.neighbour_up("a", took=took)
    ex.neighbour_up("b", took=0.5)
    ex.neighbour_up("c", took=None)
    assert (ex.depth("a"), ex.depth("b"), ex.depth("c")) == (4, 1, 1)
    ex.has_bits("a", (1 << 64) - 1)
    assert len(ex.requests("a", 0.0)) == 4
    assert ex.timing("nobody") is None


def test_an_answer_times_from_its_request_or_the_previous_answer() -> None:
    # Two requests out at once: the second answer's time is from the first answer, not from
    # when it was asked, so queueing behind its sibling is not counted twice.
    ex = exchange(num_pieces=8, pipeline=2, horizon=0.1)
    ex.neighbour_up("a")
    ex.has_bits("a", 0xFF)
    ex.received("a", ex.requests("a", 0.0)[0], now=0.02)  # depth 1 + 0.1 // 0.02 -> 2 (the cap)
    first, second = ex.requests("a", 0.02)
    ex.received("a", first, now=0.06)
    ex.received("a", second, now=0.10)
    assert ex.depth("a") == 2  # each answer took 0.04 s after the previous one


def test_a_neighbour_cannot_time_its_way_past_the_pipeline() -> None:
    # A hostile neighbour controls its timing: answers "before" they were asked, or at once,
    # still leave it at most `pipeline` requests; answers to requests it was never sent are
    # not timed.
    ex = exchange(num_pieces=64, pipeline=3, horizon=0.1)
    ex.neighbour_up("m")
    ex.has_bits("m", (1 << 64) - 1)
    for index in ex.requests("m", 5.0):
        ex.received("m", index, now=1.0)  # earlier than asked
    assert ex.depth("m") == 3 and len(ex.requests("m", 5.0)) == 3
    before = ex.depth("m")
    ex.received("m", 63 if not ex.have[63] else 62, now=100.0)  # never asked of it
    assert ex.depth("m") == before


def test_bad_pieces_buy_no_depth() -> None:
    # Fast answers that fail their hash check are not timed: the sender keeps one request.
    ex = exchange(num_pieces=64, pipeline=4, horizon=0.1)
    ex.neighbour_up("m")
    ex.has_bits("m", (1 << 64) - 1)
    now = 0.0
    for _ in range(2):  # (a third bad piece bans it)
        (index,) = ex.requests("m", now)
        now += 0.001
        ex.received("m", index, ok=False, now=now)
        assert ex.depth("m") == 1


def test_without_a_horizon_the_depth_is_the_pipeline() -> None:
    ex = exchange(num_pieces=16, pipeline=3)
    ex.neighbour_up("a")
    ex.has_bits("a", 0xFFFF)
    assert ex.depth("a") == 3
    assert answer_every(ex, "a", 10.0, 2) == [3, 3]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(LocalProtocolError):
        Exchange(0, random.Random(0))
    with pytest.raises(LocalProtocolError):
        Exchange(4, random.Random(0), pipeline=0)
    for horizon in (0.0, -1.0, float("nan")):
        with pytest.raises(LocalProtocolError):
            Exchange(4, random.Random(0), horizon=horizon)
    with pytest.raises(LocalProtocolError):
        SeedPlan(4, random.Random(0), width=0)


# --- the learner ----------------------------------------------------------------------------


def plan(num_pieces: int = 8, peers: str = "abc", width: int = 8) -> SeedPlan:
    sp = SeedPlan(num_pieces, random.Random(0), width=width)
    for p in peers:
        sp.link(p, preferred=True)
    return sp


def test_one_piece_in_flight_per_peer_and_every_piece_once_before_any_twice() -> None:
    sp = plan(num_pieces=4, peers="ab")
    a = sp.pick(["a", "b"])
    b = sp.pick(["a", "b"])
    assert a is not None and b is not None and {a[0], b[0]} == {"a", "b"}
    assert sp.pick(["a", "b"]) is None  # both busy until their piece left
    sp.done("a")
    sp.done("b")
    sent = [a[1], b[1]]
    for _ in range(2):
        nxt = sp.pick(["a", "b"])
        assert nxt is not None
        sent.append(nxt[1])
        sp.done(nxt[0])
    assert sorted(sent) == [0, 1, 2, 3]  # four sends, four different pieces: rarest first


def test_the_peer_with_the_fewest_pieces_goes_first() -> None:
    sp = plan(peers="ab")
    for i in range(5):
        sp.has("a", i)
    assert sp.pick(["a", "b"])[0] == "b"  # type: ignore[index]


def test_a_peer_claiming_an_empty_store_draws_no_more_than_its_fair_share() -> None:
    sp = SeedPlan(1000, random.Random(1), width=4, fair_slack=8)
    for p in ("liar", "a", "b", "c"):
        sp.link(p, preferred=True)
    got = {p: 0 for p in ("liar", "a", "b", "c")}
    for step in range(2000):
        for n, p in enumerate(("a", "b", "c")):  # honest peers also fetch from their neighbours
            sp.has(p, (step * 7 + n) % 500)  # (never all: they keep needing the learner)
        pick = sp.pick(list(got))
        if pick is None:
            break
        got[pick[0]] += 1
        sp.done(pick[0])
    fair = sum(got.values()) / len(got)
    assert got["liar"] <= fair + 8 + 1, got
    assert len({i for i in range(1000) if sp.copies(i)}) >= 900  # the uplink still went to pieces


def test_each_piece_goes_to_a_peer_at_most_once_whatever_it_claims() -> None:
    sp = plan(num_pieces=6, peers="a")
    seen = []
    while (pick := sp.pick(["a"])) is not None:
        seen.append(pick[1])
        sp.done("a")
    assert sorted(seen) == list(range(6))


def test_a_complete_peer_is_replaced_in_the_served_set() -> None:
    sp = SeedPlan(4, random.Random(0), width=1)
    sp.link("a", preferred=True)
    sp.link("b")
    assert sp.served() == ["a"]
    for i in range(4):
        sp.has("a", i)
    assert sp.served() == ["b"]
    sp.drop("b")
    assert sp.served() == []


def test_a_piece_from_the_learner_is_announced_at_once_but_not_more_often_than_the_gap() -> None:
    # Any other piece waits for the batch; a learner's piece leaves at once...
    assert have_due(10.0, 0.0, from_learner=False) == 10.0 + HAVE_BATCH_S
    assert have_due(10.0, 0.0, from_learner=True) == 10.0
    # ... unless a `have` left less than the gap ago: then at the gap, still before the batch.
    assert have_due(10.0, 9.995, from_learner=True) == 9.995 + HAVE_SEED_GAP_S
    assert HAVE_SEED_GAP_S < HAVE_BATCH_S


def test_a_carried_timing_never_buys_more_than_the_pipeline() -> None:
    # A neighbour answered "instantly" (or the clock went back) last version: it starts at the
    # pipeline's depth, no deeper; a timing that is not a finite number is ignored (one-piece
    # probe), so nothing carried across versions widens what one neighbour can hold back.
    ex = exchange(num_pieces=64, pipeline=4, horizon=0.1)
    for peer, took in (("zero", 0.0), ("negative", -5.0), ("inf", math.inf), ("nan", math.nan)):
        ex.neighbour_up(peer, took=took)
        ex.has_bits(peer, (1 << 64) - 1)
    assert (ex.depth("zero"), ex.depth("negative"), ex.depth("inf"), ex.depth("nan")) == (4, 4, 1, 1)
    assert len(ex.requests("zero", 0.0)) == 4
