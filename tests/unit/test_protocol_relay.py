"""A receiver's rules for the source: pull with backpressure, relay first copies, repair late."""

from __future__ import annotations

from protocol.weights.relay import SourcePull


def drained(**kwargs: float) -> SourcePull:
    """A pull past its first relay (one piece taken, relayed, and the relay queue drained)."""
    pull = SourcePull(**kwargs)  # type: ignore[arg-type]
    assert pull.asks(0) == 1
    assert pull.piece(from_source=True, new=True, now=0.0)
    pull.relay_drained()
    return pull


def test_one_piece_first_until_its_relay_drained() -> None:
    pull = SourcePull(pipeline=2, backlog_pieces=4)
    assert pull.asks(backlog=0) == 1 and pull.asks(backlog=0) == 0  # one, while unmeasured
    pull.relay_drained()
    assert pull.asks(backlog=0) == 0  # nothing relayed yet: nothing measured
    assert pull.piece(from_source=True, new=True, now=1.0)
    assert pull.asks(backlog=1, drain_s=5.0) == 0  # its relay is still being pushed
    pull.relay_drained()
    assert pull.asks(backlog=0, drain_s=0.0) == 2


def test_pull_keeps_the_pipeline_full_while_relay_queues_are_short() -> None:
    pull = drained(pipeline=2, backlog_pieces=4)
    assert pull.asks(backlog=0) == 2 and pull.asks(backlog=0) == 0  # two outstanding
    assert pull.piece(from_source=True, new=True, now=1.0) and pull.asks(backlog=3, drain_s=1.9) == 1
    assert pull.asks(backlog=0) == 0


def test_a_relay_queue_that_drains_slowly_stops_the_pull() -> None:
    # Few pieces per link, but 99 links on a slow uplink: 2 s or more of pushes queued.
    pull = drained(pipeline=2, backlog_pieces=4, drain_s=2.0)
    assert pull.asks(backlog=1, drain_s=2.0) == 0 and pull.outstanding == 0
    assert pull.asks(backlog=1, drain_s=1.5) == 2


def test_a_slow_uplink_stops_taking_from_the_source() -> None:
    pull = SourcePull(pipeline=2, backlog_pieces=4)
    assert pull.asks(backlog=4) == 0 and pull.outstanding == 0


def test_a_busy_uplink_asks_for_direct_pieces_and_never_relays_them() -> None:
    pull = SourcePull(pipeline=2, backlog_pieces=4, drain_s=2.0, direct_drain_s=0.5, direct_pipeline=2)
    pull.asks(0)
    assert pull.mores(1, 1.0) == 0  # not before the first relay measured the uplink
    pull.piece(from_source=True, new=True, now=0.0)
    pull.relay_drained()
    assert pull.mores(3, 0.4) == 0  # a short queue in time (symmetric links): relays keep up
    assert pull.mores(1, 0.6) == 2 and pull.mores(1, 0.6) == 0  # up to direct_pipeline outstanding
    assert not pull.piece(from_source=True, new=True, now=1.0, direct=True)  # ours alone
    assert pull.direct_outstanding == 1 and pull.last_progress == 1.0
    assert pull.mores(1, 0.6) == 1
    pull.source_empty()  # "none" answers a `more` too
    assert pull.direct_outstanding == 0 and pull.mores(1, 5.0) == 0


def test_a_first_relay_still_going_after_first_relay_s_asks_for_direct_pieces() -> None:
    pull = SourcePull(first_relay_s=0.1, stall_s=3.0, last_progress=0.0)
    pull.asks(0)
    assert pull.piece(from_source=True, new=True, now=1.0)  # our first relay starts
    assert pull.wake_at(1.0, None) == 1.1  # look again when it turns first_relay_s old
    assert pull.mores(1, 0.0, now=1.05) == 0  # 37 ms on symmetric 100 Mbit/s links: done by then
    assert pull.mores(1, 0.0, now=1.1) == 2  # a slow uplink: the source's spare can go direct
    assert pull.wake_at(1.2, None) == 4.0
    pull.relay_drained()  # measured now: only the drain time counts from here
    assert pull.mores(1, 0.1, now=5.0) == 0 and pull.direct_outstanding == 2


def test_only_a_first_copy_from_the_source_is_relayed() -> None:
    pull = SourcePull()
    pull.asks(0)
    assert pull.piece(from_source=True, new=True, now=1.0)
    assert not pull.piece(from_source=True, new=False, now=1.0)  # a copy we already had
    assert not pull.piece(from_source=False, new=True, now=1.0)  # from a peer: it relays itself
    assert pull.outstanding == 0


def test_the_sources_answer_to_a_repair_is_not_relayed() -> None:
    pull = drained(pipeline=2)
    pull.asks(0)
    # New here, but asked for with `get`: its first receiver is already pushing it.
    assert not pull.piece(from_source=True, new=True, now=1.0, asked=True)
    assert pull.outstanding == 2 and pull.last_progress == 1.0  # not an answer to `next`


def test_an_empty_source_is_never_asked_again_and_repair_comes_sooner() -> None:
    pull = SourcePull(endgame_quiet_s=0.5, stall_s=3.0, last_progress=10.0)
    assert not pull.repair_due(12.0) and pull.wake_at(12.0, None) == 13.0
    pull.asks(0)
    pull.source_empty()
    assert pull.outstanding == 0 and pull.asks(0) == 0
    assert pull.repair_due(10.5) and not pull.repair_due(10.4)


def test_in_repair_the_loop_wakes_at_the_swarm_deadline_or_a_quiet_period() -> None:
    pull = SourcePull(stall_s=3.0, last_progress=0.0)
    assert pull.repair_due(3.0)
    assert pull.wake_at(3.0, 4.5) == 4.5
    assert pull.wake_at(3.0, 9.0) == 6.0
    assert pull.wake_at(3.0, None) == 6.0
