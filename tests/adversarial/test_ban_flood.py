"""Bans are no lever: an attacker earning them as fast as it can costs the learner's event loop
O(1) per ban (no file written there, no table scanned), the disk one write a second, and a
restart forgives none of them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import trio
import trio.testing

from echo_node.learner import banlog
from echo_node.learner.banlog import BanLog
from echo_node.learner.intake import MAX_BANS, PeerBook
from echo_node.learner.learner import Learner
from protocol import Identity


def test_a_flood_of_bans_writes_nothing_on_the_event_loop_and_once_a_second_after(learner: Learner) -> None:
    log = learner.intake.ban_log
    assert log is not None
    writes: list[int] = []
    sybils = [Identity.generate().peer_id for _ in range(1500)]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log.run, learner.peers.live_bans)
            for second in range(3):
                before = log.pending
                for sybil in sybils[second * 500 : (second + 1) * 500]:  # 500 bans a second, as fast as they come
                    learner.intake.ban(sybil, "test: a bad frame")
                # A ban itself only appends a line in memory (and writes no other file either).
                assert log.pending == before + 500
                assert not (learner.cfg.run_dir / "bans.json").exists()
                await trio.sleep(banlog.FLUSH_S)
                writes.append(log.writes)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    log.flush(learner.peers.live_bans)  # the stop's flush (Learner._finish)
    assert log.writes <= 4  # one write per second of flooding and the stop's, not one per ban
    lines = log.path.read_text().splitlines()
    assert len(lines) == 1500 and len({json.loads(line)["peer"] for line in lines}) == 1500


def test_a_full_ban_table_forgets_the_ban_ending_first_without_a_scan() -> None:
    book = PeerBook(ban_after=1)
    for i in range(MAX_BANS):
        book.banned[f"old-{i}"] = time.time() + 600 + i  # given in order, so ending in order
    assert book.penalize("newcomer")
    assert len(book.banned) == MAX_BANS and "old-0" not in book.banned and "newcomer" in book.banned


def test_bans_survive_a_restart_through_the_log_a_torn_line_and_the_older_file(tmp_path: Path) -> None:
    path = tmp_path / "bans.log"
    log = BanLog(path)
    until = time.time() + 600
    log.record("a", until_time=until)
    log.record("b", until_version=50)
    log.record("ended", until_time=time.time() - 1)
    log.flush(lambda: ({"a": until}, {"b": 50}))
    with path.open("a") as fh:
        fh.write('{"peer": "torn", "until_ti')  # a crash mid-write
    (tmp_path / "bans.json").write_text(json.dumps({"until_time": {"legacy": until}, "until_version": {}}))
    book = PeerBook()
    book.restore_bans(*BanLog(path).load())
    assert set(book.banned) == {"a", "legacy"} and book.banned_until_version == {"b": 50}


def test_the_log_is_compacted_to_the_live_bans_once_it_outgrows_them(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(banlog, "COMPACT_MIN", 100)
    log = BanLog(tmp_path / "bans.log")
    live = {f"p{i}": time.time() + 600 for i in range(10)}
    for round_ in range(50):  # 50 rounds of 10 short bans that end; 10 live ones stay
        for i in range(10):
            log.record(f"gone-{round_}-{i}", until_time=time.time() - 1)
        log.flush(lambda: (dict(live), {}))
    assert log.compactions >= 1
    assert len(log.path.read_text().splitlines()) <= banlog.COMPACT_MIN + 10
    book = PeerBook()
    book.restore_bans(*BanLog(log.path).load())
    assert set(book.banned) == set(live)


def test_an_identity_banned_at_once_for_a_data_channel_offence_stays_banned_after_a_restart(learner: Learner) -> None:
    attacker = Identity.generate()
    learner.peers.join(attacker.peer_id, 0.0)
    learner.intake.ban(attacker.peer_id, "data channel: a bad piece")
    assert learner.intake.ban_log is not None
    learner.intake.ban_log.flush(learner.peers.live_bans)  # what a stop does
    again = Learner(learner.cfg, learner.identity, learner.policy)
    assert again.peers.is_banned(attacker.peer_id)
