"""The learner's write-ahead journal: every change to the rollout ledger, durable in order.

Job: a learner that crashes loses no rollout it accepted and counts none twice. Every event
that changes the ledger or the replay buffer is appended here (in memory), and `flush` writes
the pending records and fsyncs them. A checkpoint (echo_node/learner/checkpoint.py) names the segment
the journal switched to when it was taken; recovery (echo_node/learner/recovery.py) loads the
checkpoint and replays that segment and every later one.

Rules:
- Durable prefix: records reach the disk in the order they were appended, each framed as
  `[u32 length][u32 crc32][msgpack]`; a reader stops at the first torn or corrupt frame, so what
  survives a crash is always a prefix of what happened.
- Nothing the learner tells others may be ahead of the journal: a step and the publication of
  its version are flushed before the version is announced (so a version number a peer saw is
  always in the history a restart reads), and accepted groups are flushed at least every
  `flush_s` (what was accepted but not flushed when the learner died is asked for again by gap
  repair: the sequence tracker is rebuilt from the same prefix).
- Bounded: a segment holds what happened since the last checkpoint; `rotate` starts a new one
  whose first records carry the groups still buffered, and the learner checkpoints early when a
  segment passes `max_segment_bytes`. Old segments are deleted with the checkpoints that need them.

Records (msgpack arrays; `gid` is the journal's serial number of a buffered group):
    ["admit", gid, origin, group(, kind)]  a group entered the buffer (group: its wire form; kind
                                           "episode" for an EpisodeGroup, absent for a
                                           RolloutGroup: replay.py `group_record`)
    ["carry", gid, origin, group(, kind)]  a group still buffered when this segment began
    ["reject", reason, rollouts]           rollouts received and dropped before the buffer (a
                                           batch's fate, inside its transaction)
    ["rejects", {reason: rollouts}]        the same, summed since the last flush: refusals outside
                                           a transaction (bad signatures, strangers, bans...), so
                                           a flood of junk costs one record per flush, not one each
    ["seen", origin, seq]                  the sequence tracker took (origin, seq) as new
    ["drop", reason, [gid, ...]]           buffered groups dropped with a reason
    ["step", version, [gid, ...]]          one update trained these groups and made `version`
    ["step", version, [gid, ...], [w, ...]] ... with these loss weights (some publisher unproven)
    ["publish", version, sha256, size, epoch]   a version peers may fetch
    ["join", peer_id]                      a peer joined
    ["excuse", peer_id]                    its next gap is no skip (written on a rejoin before join
                                           answers named the seq to go on at; replayed as then)
    ["resume", version, epoch, sha256]     a start went on from `version` with these weights
    ["tx", [record, ...]]                  records durable together (`begin`/`commit`)
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from echo_node.durable import fsync_dir

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
# A record is at most one rollout group and its framing; anything larger is corruption.
MAX_RECORD_BYTES = 8 << 20
SEGMENT_GLOB = "seg-*.wal"


def segment_name(index: int) -> str:
    return f"seg-{index:010d}.wal"


def segment_index(path: Path) -> int:
    return int(path.name[4:-4])


def frame(record: list[Any]) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _HEADER.pack(len(body), zlib.crc32(body)) + body


def read_segment(path: Path) -> tuple[list[list[Any]], str | None]:
    """The records of a segment, up to the first bad frame, and what was wrong there (None if
    the file ended cleanly)."""
    data = path.read_bytes()
    records: list[list[Any]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _HEADER.size:
            return records, f"{path.name}: torn header at byte {pos}"
        length, crc = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if length > MAX_RECORD_BYTES or len(body) < length:
            return records, f"{path.name}: torn record at byte {pos}"
        if zlib.crc32(body) != crc:
            return records, f"{path.name}: checksum mismatch at byte {pos}"
        try:
            record = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, TypeError, OverflowError) as exc:
            return records, f"{path.name}: undecodable record at byte {pos}: {exc}"
        if not isinstance(record, list) or not record or not isinstance(record[0], str):
            return records, f"{path.name}: not a journal record at byte {pos}"
        records.append(record)
        pos += _HEADER.size + length
    return records, None


class StorageFailed(Exception):
    """The journal cannot be made durable (retries spent): the learner stops, as on a signal,
    with this one line, since nothing it has not journaled may be announced."""


class Journal:
    """Appends records to the current segment; `flush` makes them durable."""

    def __init__(self, directory: Path, *, max_segment_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self.max_segment_bytes = max_segment_bytes
        directory.mkdir(parents=True, exist_ok=True)
        existing = self.segments()
        self.index = segment_index(existing[-1]) + 1 if existing else 0
        self._pending: list[bytes] = []
        self._tx: list[list[Any]] | None = None
        self._tally: dict[str, int] = {}
        self.segment_bytes = 0
        self.flushes = 0
        self.bytes_written = 0
        self._fh: BinaryIO | None = None

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob(SEGMENT_GLOB), key=segment_index)

    @property
    def path(self) -> Path:
        return self.directory / segment_name(self.index)

    def append(self, record: list[Any]) -> None:
        if self._tx is not None:
            self._tx.append(record)
        else:
            self._pending.append(frame(record))

    def tally(self, reason: str, rollouts: int) -> None:
        """Count rollouts rejected outside a transaction (one "rejects" record per flush)."""
        if self._tx is not None:
            self._tx.append(["reject", reason, rollouts])
        else:
            self._tally[reason] = self._tally.get(reason, 0) + rollouts

    def begin(self) -> None:
        """Records appended until `commit` become one ["tx", [records]] frame: durable together
        or not at all (e.g. a batch's admitted groups and the seq that says it arrived)."""
        self._tx = []

    def commit(self) -> None:
        records, self._tx = self._tx, None
        if records:
            self._pending.append(frame(["tx", records]))

    @property
    def pending(self) -> int:
        return len(self._pending) + bool(self._tally)

    def take_pending(self) -> bytes:
        """The pending records as bytes, in order, and forget them: the caller writes them with
        `write` (in a worker thread) while new records keep arriving."""
        if self._tally:
            self._pending.append(frame(["rejects", self._tally]))
            self._tally = {}
        data, self._pending = b"".join(self._pending), []
        return data

    def write(self, data: bytes) -> None:
        """Append `data` (from `take_pending`) to the current segment and fsync it.

        The segment stays open between writes: its descriptor is taken once, so a process
        whose descriptors run out can still journal. A write that fails (OSError) leaves the
        segment as it was before it, cut back to its old length where part of `data` landed,
        so the caller can retry the same bytes without leaving a torn frame in front of them."""
        fh = self._segment()
        start = fh.tell()
        try:
            if data:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            self._cut_back(start)
            raise
        self.segment_bytes += len(data)
        self.bytes_written += len(data)
        self.flushes += 1

    def flush(self) -> None:
        """Write and fsync everything pending (synchronously); on an OSError what was pending
        stays pending."""
        data = self.take_pending()
        try:
            self.write(data)
        except OSError:
            self._pending.insert(0, data)
            raise

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            fh.close()

    def __del__(self) -> None:
        # A learner that died without closing (a crash, or a test that drops one as if it had)
        # leaves what it fsynced; the handle itself goes with it.
        self.close()

    def _segment(self) -> BinaryIO:
        if self._fh is None:
            new = not self.path.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("ab")
            if new:
                fsync_dir(self.directory)
        return self._fh

    def _cut_back(self, length: int) -> None:
        fh = self._fh
        try:
            if fh is not None:
                fh.truncate(length)
                return
        except (OSError, ValueError):  # the handle is unusable: the next write opens it again
            pass
        self._fh = None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass
        try:
            os.truncate(self.path, length)
        except OSError:
            log.error("journal: could not cut %s back to %d bytes after a failed write", self.path, length)

    def rotate(self, carry: list[list[Any]]) -> int:
        """Flush, then start the next segment with `carry` records first (the groups still
        buffered); returns the new segment's index. The caller holds no other writer."""
        self.flush()
        self.close()
        self.index += 1
        self.segment_bytes = 0
        for record in carry:
            self.append(record)
        self.flush()
        return self.index

    def delete_before(self, index: int) -> None:
        """Remove segments older than `index` (no retained checkpoint needs them)."""
        for path in self.segments():
            if segment_index(path) < index:
                path.unlink(missing_ok=True)


def replay_records(directory: Path, first: int) -> Iterator[list[Any]]:
    """Every record of segment `first` and the later ones, in order; a bad frame ends its segment
    with one warning (what follows it in that segment was never known to be durable)."""
    for path in sorted(directory.glob(SEGMENT_GLOB), key=segment_index):
        if segment_index(path) < first:
            continue
        records, problem = read_segment(path)
        if problem is not None:
            log.warning("journal: %s; %d records before it replayed", problem, len(records))
        yield from records
