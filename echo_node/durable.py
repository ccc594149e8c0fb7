"""Files that survive a crash: fsync the data, then the directory entry (POSIX keeps them apart).

Both roles write such files: the learner its journal, checkpoints and bans (echo_node/learner/),
a rollout peer the seq it has reserved (echo_node/peer/rollout_peer.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (POSIX: the directory entry is separate)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (the caller renames or fsyncs the directory)."""
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
