"""A rollout peer across learner restarts: epochs followed, versions never taken twice with two
digests, a learner that stops answering looked for again (virtual clock)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from echo_node.config import NetConfig, RunConfig
from echo_node.net.discovery import JoinError
from echo_node.peer.rollout_peer import SeqReservation
from echo_node.peer.weight_follower import STALL_ABANDON_S, Target, TransferAbandoned, WeightFollower
from echo_node.weights.broadcast import DataServer
from tests.factories import ALICE


def follower(epoch: int = 1, **net: object) -> WeightFollower:
    cfg = RunConfig(run_id="run-1", runs_dir=Path(tempfile.mkdtemp(prefix="echo-node-epochs-")), net=NetConfig(**net))  # type: ignore[arg-type]
    session = SimpleNamespace(engine=SimpleNamespace(version=-1), spec=SimpleNamespace(sync_mode="async", epoch=epoch))
    return WeightFollower(cfg, None, DataServer(ALICE, "run-1"), session)  # type: ignore[arg-type]


def digest(n: int) -> bytes:
    return bytes([n]) * 32


def test_a_version_number_is_taken_with_one_digest_per_epoch() -> None:
    f = follower()
    assert f.offer(Target(5, 10, digest(5), 4, 1))
    assert not f.offer(Target(5, 10, digest(6), 4, 1)), "the same number with another digest"
    assert f.newest is not None and f.newest.sha256 == digest(5)
    assert f.offer(Target(5, 10, digest(5), 4, 1)), "the same announcement again is fine"


def test_an_older_epoch_is_ignored_and_a_newer_one_followed() -> None:
    f = follower(epoch=2)
    assert f.offer(Target(7, 10, digest(7), 4, 2))
    # A previous incarnation's announcement, replayed or late, even of a higher number.
    assert not f.offer(Target(9, 10, digest(9), 4, 1))
    assert f.newest is not None and f.newest.version == 7
    # A resumed learner goes on above the old numbers: followed, and re-joined.
    assert f.offer(Target(8, 10, digest(8), 4, 3))
    assert f.epoch == 3 and f.newest.version == 8 and f.rejoin_wanted.is_set()


def test_a_new_epoch_below_the_peers_newest_is_followed_anyway() -> None:
    """A learner that lost its run folder starts low again: the peer follows it at once rather
    than wait for a number above its newest, and swaps the weights in."""
    f = follower(epoch=1)
    f.engine.version = 40
    f._hand_over(b"weights of 40", 40)
    f._blob_sha, f._blob_epoch = digest(40), 1
    assert f.take_pending() is None  # the engine runs 40 already
    assert f.offer(Target(40, 10, digest(40), 4, 1))
    assert f.offer(Target(3, 10, digest(3), 4, 2))
    assert f.newest is not None and f.newest.version == 3 and f.needs(f.newest)
    f._hand_over(b"weights of 3", 3)
    assert f.take_pending() == (b"weights of 3", 3), "a new epoch's weights swap in whatever their number"
    # The old epoch's number 40 with its digest is forgotten: the new epoch may use it.
    assert f.offer(Target(40, 10, digest(41), 4, 2))


def test_a_lost_learner_is_looked_for_with_backoff_then_given_up() -> None:
    f = follower(learner_outage_s=100.0, backoff_initial_s=1.0, backoff_max_s=8.0)
    tries: list[float] = []

    async def rejoin() -> None:
        tries.append(trio.current_time())
        raise JoinError("no provider record yet")

    f._rejoin = rejoin

    async def main() -> None:
        f._last_contact = trio.current_time()
        await trio.sleep(5)
        with pytest.raises(JoinError, match="lost the learner: no answer for 100s"):
            await f.reconnect()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:4] == [1.0, 2.0, 4.0, 8.0] and max(gaps) == 10.0
    assert 100 <= tries[-1] - tries[0] + 5 <= 115


def test_a_learner_back_within_the_outage_is_rejoined() -> None:
    f = follower(learner_outage_s=100.0, backoff_initial_s=1.0)
    calls = []

    async def rejoin() -> None:
        calls.append(trio.current_time())
        if len(calls) < 3:
            raise JoinError("not found")

    async def status() -> Target:
        if len(calls) < 3:  # the old process is gone; the new one answers once rejoined
            raise ConnectionRefusedError("connection refused")
        f._last_contact = trio.current_time()
        target = Target(12, 10, digest(12), 4, 2)
        f.offer(target)
        return target

    f._rejoin = rejoin
    f.status = status  # type: ignore[method-assign]

    async def main() -> None:
        f._last_contact = trio.current_time() - 30
        await f.reconnect()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(calls) == 3 and f.reconnects == 1 and f.epoch == 2 and f._joined_epoch == 2


def test_a_learner_that_still_answers_is_not_rejoined() -> None:
    """A failed fetch (the version moved on, a relay died) is not an outage: one status check
    says so, and no rejoin (DHT lookup, join, dial-back) is spent."""
    f = follower()
    rejoins = []

    async def rejoin() -> None:
        rejoins.append(1)

    async def status() -> Target:
        f._last_contact = trio.current_time()
        return Target(12, 10, digest(12), 4, 1)

    f._rejoin = rejoin
    f.status = status  # type: ignore[method-assign]

    async def main() -> None:
        f._last_contact = trio.current_time() - 30
        await f.refresh_failed(TransferAbandoned("no piece for 10s"))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert rejoins == [] and f.reconnects == 0


def test_sequence_numbers_are_never_reused_across_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "peer.seq"
    first = SeqReservation(path)
    first.reserve(first.first + 10)
    # The clock steps back an hour before the restart: the reservation still wins.
    import echo_node.peer.rollout_peer as rp

    monkeypatch.setattr(rp.time, "time_ns", lambda: (first.first - 3_600_000) * 1_000_000)
    second = SeqReservation(path)
    assert second.first >= first.first + 10


def fetch_that_stalls(f: WeightFollower, *, pieces_every_s: float | None) -> None:
    """The follower's download: a receiver that gains a piece every `pieces_every_s` (None:
    never), for a version of 1000 pieces."""
    receiver = SimpleNamespace(missing=1000, manifest=SimpleNamespace(version=9))

    async def no_delta(target: Target) -> None:
        return None

    async def download(target: Target, base: int) -> tuple[bytes, None]:
        f._watch(receiver)  # type: ignore[arg-type]
        while receiver.missing:
            await trio.sleep(pieces_every_s if pieces_every_s is not None else 3600)
            receiver.missing -= 1
        return b"weights of 9", None  # the payload, and no store mapping

    f._fetch_delta = no_delta  # type: ignore[method-assign,assignment]
    f._nursery_start = download  # type: ignore[method-assign,assignment]


def test_a_download_that_stops_making_progress_is_abandoned() -> None:
    f = follower()
    fetch_that_stalls(f, pieces_every_s=None)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(f._watch_transfers)
            start = trio.current_time()
            with pytest.raises(TransferAbandoned, match="version 9: no piece for 1[01]s"):
                await f._fetch(Target(9, 10, digest(9), 4, 1))
            nursery.cancel_scope.cancel()
            return trio.current_time() - start

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert STALL_ABANDON_S < took <= STALL_ABANDON_S + 2
    assert f.take_pending() is None, "nothing of an abandoned download reaches the engine"


def test_a_slow_download_that_progresses_is_not_abandoned() -> None:
    f = follower()
    fetch_that_stalls(f, pieces_every_s=0.05)  # 50 s for 1000 pieces: slow, never stalled

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(f._watch_transfers)
            await f._fetch(Target(9, 10, digest(9), 4, 1))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    f.engine.version = 8
    assert f.take_pending() == (b"weights of 9", 9)


def test_a_newer_epoch_abandons_the_download_of_an_older_ones_version() -> None:
    f = follower(epoch=1)
    fetch_that_stalls(f, pieces_every_s=0.5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def restart() -> None:
                await trio.sleep(2)
                f.offer(Target(12, 10, digest(12), 4, 2))

            nursery.start_soon(restart)
            with pytest.raises(TransferAbandoned, match="the learner restarted"):
                await f._fetch(Target(9, 10, digest(9), 4, 1))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_learner_back_with_another_config_is_not_followed() -> None:
    """A restart may move the learner and bump its epoch and version; a spec that samples,
    scores or trains otherwise (or names another learner) is refused, field by field."""
    from dataclasses import replace

    from echo_node.peer.rollout_peer import spec_changes
    from protocol import RunSpec, SamplingParams

    spec = RunSpec(
        run_id="run-1", model={"hidden_size": 128}, tokenizer={"kind": "char"}, task="addition",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), sync_mode="async", staleness=4,
        group_size=8, current_version=40, learner_peer_id=ALICE.peer_id, epoch=1,
    )
    assert spec_changes(spec, replace(spec, current_version=97, epoch=2)) == []
    hotter = replace(spec, sampling=SamplingParams(temperature=1.5, top_p=1.0, max_new_tokens=4), epoch=2)
    assert spec_changes(spec, hotter) == ["sampling"]
    assert spec_changes(spec, replace(spec, staleness=8, sync_mode="pull", model={"hidden_size": 256})) == ["model", "sync_mode", "staleness"]


def test_status_is_asked_often_right_after_a_join_then_every_5_s() -> None:
    """Announcements are least reliable right after a (re)join: the status is the authority."""
    from echo_node.peer.weight_follower import JOINED_FAST_S, STATUS_FAST_S, STATUS_INTERVAL_S

    f = follower()
    asked: list[float] = []

    async def status() -> Target:
        asked.append(trio.current_time())
        f._last_contact = trio.current_time()
        return Target(1, 10, digest(1), 4, 1)

    f.status = status  # type: ignore[method-assign]

    async def main() -> None:
        f._joined_at = trio.current_time()
        with trio.move_on_after(JOINED_FAST_S + 20):
            await f._poll_status()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    early = [g for t, g in zip(asked, gaps) if t < JOINED_FAST_S - STATUS_FAST_S]
    assert early and all(g == STATUS_FAST_S for g in early)
    assert gaps[-1] == STATUS_INTERVAL_S
