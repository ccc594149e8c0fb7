"""The write-ahead journal: a durable prefix survives any tear, transactions are all or nothing,
junk costs one record per flush, segments rotate and go."""

from __future__ import annotations

import os
import resource
import signal
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from echo_node.learner.journal import SEGMENT_GLOB, Journal, frame, read_segment, replay_records


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


@contextmanager
def rlimit(which: int, soft: int) -> Iterator[None]:
    """This process under a lower soft `which` limit for a moment (the hard one stays)."""
    old = resource.getrlimit(which)
    resource.setrlimit(which, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(which, old)


def test_a_write_the_disk_refuses_leaves_no_torn_frame_and_its_retry_lands_whole(tmp_path: Path) -> None:
    j = journal(tmp_path)
    j.append(["seen", "peer", 0])
    j.flush()
    size = segment(j).stat().st_size
    j.append(["seen", "peer", 1, "x" * 4000])
    # A file-size limit makes the kernel refuse the write past it (EFBIG), after part of it
    # landed: what a full disk does to a write in flight.
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with rlimit(resource.RLIMIT_FSIZE, size + 100), pytest.raises(OSError):
            j.flush()
    finally:
        signal.signal(signal.SIGXFSZ, previous)
    assert segment(j).stat().st_size == size  # cut back: no torn frame for the retry to follow
    assert j.pending  # what failed is still to be written
    j.flush()
    records, problem = read_segment(segment(j))
    assert problem is None
    assert records == [["seen", "peer", 0], ["seen", "peer", 1, "x" * 4000]]


def test_the_journal_still_writes_when_the_process_has_no_descriptor_left(tmp_path: Path) -> None:
    j = journal(tmp_path)
    j.append(["seen", "peer", 0])
    j.flush()
    in_use = len(os.listdir("/proc/self/fd"))
    held: list[int] = []
    with rlimit(resource.RLIMIT_NOFILE, in_use + 8):
        try:
            while True:  # every descriptor taken, as by a flood of connections
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            for i in range(1, 4):
                j.append(["seen", "peer", i])
                j.flush()
        finally:
            for fd in held:
                os.close(fd)
    assert [r[2] for r in replay_records(j.directory, 0)] == [0, 1, 2, 3]
