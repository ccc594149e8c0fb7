"""PieceSwarm on virtual time: order, pipelining, stalls, departures, bad pieces, endgame, seeders."""

from __future__ import annotations

import random
from typing import Any

import pytest

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.weights.pieces import Action, Cancel, PieceSwarm, Request

TIMEOUT = 10.0


def swarm(n: int, **kw: Any) -> PieceSwarm:
    kw.setdefault("request_timeout", TIMEOUT)
    return PieceSwarm(n, **kw)


def req(peer: str, index: int) -> Request:
    return Request(peer=peer, index=index)


def cancel(peer: str, index: int) -> Cancel:
    return Cancel(peer=peer, index=index)


def indices(actions: list[Action]) -> list[int]:
    return [a.index for a in actions if isinstance(a, Request)]


def test_rarest_first_then_sequential() -> None:
    for strategy, order in (("rarest", [4, 3, 2, 1, 0]), ("sequential", [0, 1, 2, 3, 4])):
        s = swarm(5, strategy=strategy, max_inflight_per_peer=5, endgame=False)
        s.peer_has("x", range(5))
        for peer, held in (("y", range(4)), ("z", range(3)), ("w", range(2)), ("v", range(1))):
            s.peer_has(peer, held)
        s.peer_has("x", [0, 0])  # repeated announcements count once
        assert indices(s.poll(0.0)) == order, strategy


def test_ties_break_by_index_or_by_the_given_rng() -> None:
    def first_requests(rng: random.Random | None) -> list[int]:
        s = swarm(64, rng=rng, max_inflight_per_peer=4)
        s.peer_has_all("learner")
        return indices(s.poll(0.0))

    assert first_requests(None) == [0, 1, 2, 3]
    assert first_requests(random.Random(1)) == first_requests(random.Random(1))
    assert first_requests(random.Random(1)) != first_requests(random.Random(2))  # peers spread out


def test_pipelining_depth_is_respected() -> None:
    s = swarm(10, max_inflight_per_peer=3)
    s.peer_has_all("learner")
    assert s.poll(0.0) == [req("learner", 0), req("learner", 1), req("learner", 2)]
    assert s.poll(1.0) == []
    s.received("learner", 1, True, 2.0)
    assert s.poll(2.0) == [req("learner", 3)]
    assert s.in_flight() == {req("learner", 0), req("learner", 2), req("learner", 3)}
    assert s.missing == 9 and s.progress == pytest.approx(0.1)


def test_stall_cancels_and_asks_another_peer_after_the_timeout() -> None:
    s2 = swarm(1, endgame=False)
    s2.peer_has("a", [0])
    s2.peer_has("b", [0])
    assert s2.poll(0.0) == [req("a", 0)]
    assert s2.next_deadline() == TIMEOUT
    assert s2.poll(TIMEOUT - 0.001) == []
    assert s2.poll(TIMEOUT) == [cancel("a", 0), req("b", 0)]
    assert s2.stalls == {"a": 1} and s2.next_deadline() == 2 * TIMEOUT
    s2.received("a", 0, True, TIMEOUT + 1)  # a late copy that verifies still counts...
    assert s2.complete
    assert s2.poll(TIMEOUT + 1) == [cancel("b", 0)]  # ...and calls off the re-request
    assert s2.next_deadline() is None


def test_a_stalled_peer_is_retried_only_when_nobody_else_has_the_piece() -> None:
    s = swarm(1)
    s.peer_has("a", [0])
    assert s.poll(0.0) == [req("a", 0)]
    assert s.poll(TIMEOUT) == [cancel("a", 0), req("a", 0)]
    assert s.stalls == {"a": 1}


def test_departed_peer_pieces_are_requested_elsewhere() -> None:
    s = swarm(2, max_inflight_per_peer=2, endgame=False)
    s.peer_has("a", [0, 1])
    s.peer_has("b", [0])
    assert s.poll(0.0) == [req("a", 1), req("b", 0)]  # 1 is rarer; then the least loaded holder
    s.peer_gone("b", 1.0)
    assert s.poll(1.0) == [req("a", 0)]  # no cancel to a peer that is gone
    assert s.useful_peers() == ["a"]
    s.peer_has("b", [0])
    s.peer_gone("a", 1.5)
    assert s.poll(1.5) == [req("b", 0)]
    s.peer_gone("b", 2.0)
    s.peer_gone("nobody", 2.0)
    assert s.poll(2.0) == [] and s.next_deadline() is None and s.useful_peers() == []


def test_bad_piece_penalizes_and_asks_someone_else() -> None:
    s = swarm(1, endgame=False)
    s.peer_has("a", [0])
    s.peer_has("b", [0])
    assert s.poll(0.0) == [req("a", 0)]
    s.received("a", 0, False, 1.0)
    assert s.penalties == {"a": 1} and not s.banned
    assert s.poll(1.0) == [req("b", 0)]  # a is free and least loaded, but sent a bad copy of 0
    s.received("b", 0, False, 2.0)
    assert s.poll(2.0) == []  # nobody left who has not lied about piece 0
    assert not s.complete


def test_banned_after_max_bad_pieces() -> None:
    s = swarm(4, max_bad_pieces=2, max_inflight_per_peer=4)
    s.peer_has("mallory", range(4))
    assert indices(s.poll(0.0)) == [0, 1, 2, 3]
    s.received("mallory", 0, False, 1.0)
    s.received("mallory", 1, False, 1.0)
    assert s.banned == {"mallory"} and s.penalties == {"mallory": 2}
    assert s.poll(1.0) == [cancel("mallory", 2), cancel("mallory", 3)]
    s.peer_has("mallory", range(4))  # ignored from now on
    s.peer_has_all("mallory")
    assert s.useful_peers() == [] and s.poll(2.0) == []
    s.peer_has("honest", range(4))
    assert indices(s.poll(3.0)) == [0, 1, 2, 3]


def test_completion_and_serving() -> None:
    s = swarm(3)
    s.peer_has_all("learner")
    assert not s.can_serve(0)
    for action in s.poll(0.0):
        s.received(action.peer, action.index, True, 1.0)
    s.have(0)  # already had it: no effect
    assert s.complete and s.missing == 0 and s.progress == 1.0
    assert s.poll(2.0) == [] and s.next_deadline() is None
    assert s.held() == [0, 1, 2] and s.useful_peers() == []
    assert all(s.can_serve(i) for i in range(3))
    for bad in (-1, 3, True, "0", None):
        assert not s.can_serve(bad)


def test_have_from_elsewhere_cancels_its_request() -> None:
    s = swarm(2)
    s.peer_has_all("learner")
    assert indices(s.poll(0.0)) == [0, 1]
    s.have(1)
    assert s.poll(0.5) == [cancel("learner", 1)]
    assert s.can_serve(1) and s.held() == [1]


def test_seeder_is_spared_while_a_peer_has_the_piece() -> None:
    s = swarm(3, max_inflight_per_peer=1)
    s.peer_has_all("learner")
    s.peer_has("p", [0, 1])
    # Piece 2 only the learner has; 0 goes to p; 1 waits for p although the learner is... busy.
    assert s.poll(0.0) == [req("learner", 2), req("p", 0)]
    s.received("learner", 2, True, 1.0)
    assert s.poll(1.0) == []  # learner free now, but p has piece 1: wait for p
    s.received("p", 0, True, 2.0)
    assert s.poll(2.0) == [req("p", 1)]
    generous = swarm(2, max_inflight_per_peer=1, avoid_seeders=False)
    generous.peer_has_all("learner")
    generous.peer_has("p", [0, 1])
    assert generous.poll(0.0) == [req("learner", 0), req("p", 1)]


def test_seeder_takes_over_from_a_stalled_peer() -> None:
    s = swarm(1, max_inflight_per_peer=1)
    s.peer_has_all("learner")
    s.peer_has("p", [0])
    assert s.poll(0.0) == [req("p", 0)]
    assert s.poll(TIMEOUT) == [cancel("p", 0), req("learner", 0)]  # no endgame race onto p either


def test_endgame_duplicates_the_last_pieces_and_cancels_the_loser() -> None:
    s = swarm(1)
    s.peer_has("a", [0])
    s.peer_has("b", [0])
    s.peer_has("c", [0])
    assert s.poll(0.0) == [req("a", 0), req("b", 0)]  # ENDGAME_COPIES = 2
    assert s.poll(1.0) == []
    s.received("b", 0, True, 1.0)
    assert s.complete and s.poll(1.0) == [cancel("a", 0)]
    s.received("a", 0, True, 1.5)  # the loser's copy arrives anyway: ignored
    assert s.poll(2.0) == []


def test_endgame_does_not_duplicate_onto_a_seeder() -> None:
    s = swarm(1)
    s.peer_has_all("learner")
    s.peer_has("p", [0])
    assert s.poll(0.0) == [req("p", 0)]
    s2 = swarm(1, avoid_seeders=False)
    s2.peer_has_all("learner")
    s2.peer_has("p", [0])
    assert s2.poll(0.0) == [req("learner", 0), req("p", 0)]


def test_bad_inputs() -> None:
    s = swarm(4)
    with pytest.raises(RemoteProtocolError, match="outside"):
        s.peer_has("a", [1, 4])
    assert s.useful_peers() == []  # validated before anything changed
    with pytest.raises(RemoteProtocolError):
        s.peer_has("a", [True])
    for index in (-1, 4, True):
        with pytest.raises(LocalProtocolError):
            s.received("a", index, True, 0.0)  # type: ignore[arg-type]
        with pytest.raises(LocalProtocolError):
            s.have(index)  # type: ignore[arg-type]
    for kw in (
        {"num_pieces": 0}, {"num_pieces": 4097}, {"request_timeout": 0.0}, {"max_inflight_per_peer": 0},
        {"strategy": "random"}, {"max_bad_pieces": 0},
    ):
        args: dict[str, Any] = {"num_pieces": 4, "request_timeout": 1.0, **kw}
        with pytest.raises(LocalProtocolError):
            PieceSwarm(**args)


def simulate(peers: int, pieces: int, *, avoid_seeders: bool, seed: int = 0) -> tuple[int, int]:
    """Lock-step swarm: every round each peer polls, requests are served within the round, and
    each new piece is announced to all. Returns (pieces the learner uploaded, rounds)."""
    names = [f"p{i}" for i in range(peers)]
    swarms = {
        n: swarm(pieces, max_inflight_per_peer=2, avoid_seeders=avoid_seeders, rng=random.Random(seed * 100 + i))
        for i, n in enumerate(names)
    }
    for n, s in swarms.items():
        s.peer_has_all("learner")
        for other in names:
            if other != n:
                s.peer_has(other, [])
    uploads = 0
    for rnd in range(10 * pieces):
        if all(s.complete for s in swarms.values()):
            return uploads, rnd
        served = []
        for n, s in swarms.items():
            for a in s.poll(float(rnd)):
                if isinstance(a, Request):
                    assert a.peer == "learner" or swarms[a.peer].can_serve(a.index)
                    served.append((n, a))
        for n, a in served:
            uploads += a.peer == "learner"
            swarms[n].received(a.peer, a.index, True, rnd + 0.5)
            for other in names:
                if other != n:
                    swarms[other].peer_has(n, [a.index])
    raise AssertionError("swarm did not finish")


def test_learner_upload_stays_near_one_copy_per_piece() -> None:
    # Uncoordinated peers with random tie-breaks still sometimes pick the same seeder-only piece
    # in the same round (the bound leaves headroom over what this simulation gives); sparing the
    # seeder saves the rest. Reaching ~1.0 needs the learner to hand out pieces itself (the
    # source's shared queue in echo_node/weights/broadcast.py).
    spared, rounds = simulate(8, 64, avoid_seeders=True)
    naive, naive_rounds = simulate(8, 64, avoid_seeders=False)
    assert spared <= 1.6 * 64, spared
    assert naive > spared
    assert rounds <= naive_rounds + 1, (rounds, naive_rounds)
