"""The learner's bans on disk: an append-only log, written off the event loop, compacted rarely.

Job: a restart does not forgive a ban, and giving one costs O(1) whatever how many are live.
Rewriting the whole table at every ban (what a JSON file of all bans needs) took 540 ms on the
event loop at 65,536 bans, so an attacker earning bans cheaply could stall the learner with them.

Rules:
- `record` only appends a line to memory; `flush` (in a worker thread, from `run`, at most once
  per `FLUSH_S`) appends what is pending and fsyncs it: however many bans a second are earned,
  the disk sees one write a second.
- The log holds every ban given, ended ones too; when it holds `COMPACT_RATIO` times more lines
  than there are live bans (and at least `COMPACT_MIN` lines), the flush rewrites it with the
  live ones only (a temp file and a rename: a crash leaves one whole file). Amortized, a ban
  costs O(1) lines written.
- Lines: `{"peer": ID, "until_time": wall-clock seconds}` or `{"peer": ID, "until_version": N}`.
  A torn last line (a crash mid-write) is skipped; the first format, `bans.json` beside it
  (one JSON object of every live ban), is still read at start.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import trio

from echo_node import offload
from echo_node.durable import fsync_dir

log = logging.getLogger(__name__)

FLUSH_S = 1.0
COMPACT_RATIO = 4
COMPACT_MIN = 4096
# A line is a peer id and a number; anything much longer is not ours.
MAX_LINE = 512

Bans = tuple[dict[str, float], dict[str, int]]  # (until wall-clock time, until version) by peer


class BanLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: list[str] = []
        self._lines = 0  # lines in the file (what compaction weighs against the live bans)
        self.writes = 0
        self.compactions = 0

    def load(self) -> Bans:
        """Every ban the log (and the older bans.json) holds, ended ones included: the caller
        keeps those still in force. Lines that do not parse are skipped with one warning."""
        by_time: dict[str, float] = {}
        by_version: dict[str, int] = {}
        legacy = self.path.with_name("bans.json")
        if legacy.exists():
            try:
                data = json.loads(legacy.read_text())
                if "until_time" not in data:  # the first format: {peer: until_time}
                    data = {"until_time": data, "until_version": {}}
                by_time.update({str(p): float(t) for p, t in data["until_time"].items()})
                by_version.update({str(p): int(v) for p, v in data["until_version"].items()})
            except (ValueError, AttributeError, TypeError, KeyError) as exc:
                log.warning("ignored %s: %s", legacy, exc)
        if not self.path.exists():
            return by_time, by_version
        bad = 0
        with self.path.open("r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                self._lines += 1
                try:
                    if len(line) > MAX_LINE:
                        raise ValueError("line too long")
                    entry = json.loads(line)
                    peer = str(entry["peer"])
                    if "until_version" in entry:
                        by_version[peer] = int(entry["until_version"])
                    else:
                        by_time[peer] = float(entry["until_time"])
                except (ValueError, TypeError, KeyError, AttributeError):
                    bad += 1
        if bad:
            log.warning("%s: skipped %d lines that are not bans (a torn last line after a crash is one)", self.path, bad)
        return by_time, by_version

    def record(self, peer_id: str, *, until_time: float | None = None, until_version: int | None = None) -> None:
        """A ban given: written at the next flush."""
        entry: dict[str, object] = {"peer": peer_id}
        if until_version is not None:
            entry["until_version"] = until_version
        else:
            entry["until_time"] = until_time
        self._pending.append(json.dumps(entry) + "\n")

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self, live: Callable[[], Bans]) -> tuple[str, Bans | None]:
        """On the event loop: the lines to append, and the live bans to compact to when it is
        time (a copy, so the worker thread reads nothing the loop changes)."""
        lines, self._pending = "".join(self._pending), []
        self._lines += lines.count("\n")
        current = live()
        n_live = len(current[0]) + len(current[1])
        compact = self._lines >= COMPACT_MIN and self._lines > COMPACT_RATIO * max(1, n_live)
        return lines, ((dict(current[0]), dict(current[1])) if compact else None)

    def write(self, lines: str, compact_to: Bans | None) -> None:
        """In a worker thread: append `lines` and fsync, or rewrite the log with `compact_to`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if compact_to is not None:
            by_time, by_version = compact_to
            now = time.time()
            entries = [{"peer": p, "until_time": t} for p, t in by_time.items() if t > now]
            entries += [{"peer": p, "until_version": v} for p, v in by_version.items()]
            tmp = self.path.with_suffix(".tmp")
            with tmp.open("w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(e) + "\n" for e in entries)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(self.path)
            fsync_dir(self.path.parent)
            self._lines = len(entries)
            self.compactions += 1
        elif lines:
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write(lines)
                fh.flush()
                os.fsync(fh.fileno())
        self.writes += 1

    def flush(self, live: Callable[[], Bans]) -> None:
        """Synchronously (at a stop): what is pending, durable now."""
        lines, compact_to = self.take(live)
        if lines or compact_to is not None:
            self.write(lines, compact_to)

    async def run(self, live: Callable[[], Bans]) -> None:
        """Flush what is pending once per FLUSH_S, in a worker thread. A failed write is logged
        and its lines kept for the next try: the bans hold in memory either way."""
        while True:
            await trio.sleep(FLUSH_S)
            if not self._pending:
                continue
            lines, compact_to = self.take(live)
            try:
                await offload.run_sync(self.write, lines, compact_to)
            except OSError as exc:
                log.error("could not write %s: %s (the bans hold in memory; retried)", self.path, exc)
                self._pending.insert(0, lines)
                self._lines -= lines.count("\n")
