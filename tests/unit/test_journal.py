"""The write-ahead journal: a durable prefix survives any tear, transactions are all or nothing,
junk costs one record per flush, segments rotate and go."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from echo_node.journal import SEGMENT_GLOB, Journal, frame, read_segment, replay_records


def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "journal")


def segment(j: Journal) -> Path:
    return sorted(j.directory.glob(SEGMENT_GLOB))[-1]


def test_records_come_back_in_order(tmp_path: Path) -> None:
    j = journal(tmp_path)
    for i in range(5):
        j.append(["seen", "peer", i])
    j.flush()
    j.append(["step", 1, [0, 1]])
    j.flush()
    assert list(replay_records(j.directory, 0)) == [["seen", "peer", i] for i in range(5)] + [["step", 1, [0, 1]]]


@pytest.mark.parametrize("cut", [1, 3, 7, 8, 9])
def test_a_torn_tail_ends_the_segment_at_the_last_whole_record(tmp_path: Path, cut: int) -> None:
    j = journal(tmp_path)
    j.append(["seen", "a", 1])
    j.append(["seen", "b", 2])
    j.flush()
    path = segment(j)
    path.write_bytes(path.read_bytes()[:-cut])
    records, problem = read_segment(path)
    assert records == [["seen", "a", 1]] and problem is not None and "torn" in problem


def test_a_flipped_bit_is_caught_by_the_checksum(tmp_path: Path) -> None:
    j = journal(tmp_path)
    j.append(["seen", "a", 1])
    j.append(["seen", "b", 2])
    j.flush()
    path = segment(j)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))
    records, problem = read_segment(path)
    assert records == [["seen", "a", 1]] and problem is not None and "checksum" in problem


def test_hostile_frames_are_refused_without_allocating(tmp_path: Path) -> None:
    """A length field of 4 GiB, a valid checksum over bytes that are not msgpack, a msgpack
    value that is not a record: each ends the segment there with its reason."""
    path = tmp_path / "seg-0000000000.wal"
    good = frame(["seen", "a", 1])
    for tail, reason in [
        (struct.pack("<II", 0xFFFFFFFF, 0), "torn record"),
        (struct.pack("<II", 1, zlib.crc32(b"\xc1")) + b"\xc1", "undecodable"),
        (struct.pack("<II", 1, zlib.crc32(b"\x05")) + b"\x05", "not a journal record"),
    ]:
        path.write_bytes(good + tail)
        records, problem = read_segment(path)
        assert records == [["seen", "a", 1]] and problem is not None and reason in problem


def test_a_transaction_is_one_frame(tmp_path: Path) -> None:
    j = journal(tmp_path)
    j.begin()
    j.append(["seen", "peer", 7])
    j.tally("stale", 8)  # inside a transaction: part of the batch's fate
    j.append(["admit", 0, "peer", []])
    j.commit()
    j.flush()
    assert list(replay_records(j.directory, 0)) == [["tx", [["seen", "peer", 7], ["reject", "stale", 8], ["admit", 0, "peer", []]]]]
    # Torn anywhere, none of it survives.
    path = segment(j)
    path.write_bytes(path.read_bytes()[:-1])
    assert list(replay_records(j.directory, 0)) == []


def test_a_flood_of_refusals_costs_one_record_per_flush(tmp_path: Path) -> None:
    j = journal(tmp_path)
    for _ in range(10_000):
        j.tally("bad_signature", 1)
    j.tally("not_joined", 3)
    assert j.pending == 1
    j.flush()
    assert list(replay_records(j.directory, 0)) == [["rejects", {"bad_signature": 10_000, "not_joined": 3}]]
    assert segment(j).stat().st_size < 100


def test_rotation_carries_and_old_segments_go(tmp_path: Path) -> None:
    j = journal(tmp_path)
    j.append(["seen", "a", 1])
    first = j.index
    second = j.rotate([["carry", 3, "a", []]])
    j.append(["seen", "a", 2])
    j.flush()
    assert second == first + 1
    assert list(replay_records(j.directory, second)) == [["carry", 3, "a", []], ["seen", "a", 2]]
    j.delete_before(second)
    assert [p.name for p in j.segments()] == [f"seg-{second:010d}.wal"]
    # A new journal on the same folder never appends to an old segment.
    assert Journal(j.directory).index == second + 1
