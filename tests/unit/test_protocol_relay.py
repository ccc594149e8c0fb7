"""A receiver's rules for the source: pull with backpressure, relay first copies, repair late."""

from __future__ import annotations

from protocol.weights.relay import SourcePull


def test_pull_keeps_the_pipeline_full_while_relay_queues_are_short() -> None:
    pull = SourcePull(pipeline=2, backlog_pieces=4)
    assert pull.asks(backlog=0) == 2 and pull.asks(backlog=0) == 0  # two outstanding
    assert pull.piece(from_source=True, new=True, now=1.0) and pull.asks(backlog=3) == 1
    assert pull.asks(backlog=0) == 0


def test_a_slow_uplink_stops_taking_from_the_source() -> None:
    pull = SourcePull(pipeline=2, backlog_pieces=4)
    assert pull.asks(backlog=4) == 0 and pull.outstanding == 0


def test_only_a_first_copy_from_the_source_is_relayed() -> None:
    pull = SourcePull()
    pull.asks(0)
    assert pull.piece(from_source=True, new=True, now=1.0)
    assert not pull.piece(from_source=True, new=False, now=1.0)  # a copy we already had
    assert not pull.piece(from_source=False, new=True, now=1.0)  # from a peer: it relays itself
    assert pull.outstanding == 0


def test_the_sources_answer_to_a_repair_is_not_relayed() -> None:
    pull = SourcePull(pipeline=2)
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
