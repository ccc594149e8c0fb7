"""The learner's checkpoints and epoch: what a restart resumes from.

Layout of a run folder:
    epoch                              {"epoch": N}: grows by one at every start of the learner
    checkpoints/v000000000040/         one checkpoint per directory, named by its version
        model.safetensors              the canonical weights (echo_node/ml/model.py)
        optimizer.pt                   the optimizer's state and the RNG states
        state.json                     version, ledger, peer tables, sequence floors, history...
        MANIFEST.json                  every other file's size and SHA-256, written last
    journal/seg-*.wal                  the write-ahead journal (echo_node/learner/journal.py)

Rules:
- Atomic: a checkpoint is written into `checkpoints/.tmp-*`, every file fsynced, the manifest
  last, then the directory is renamed into place and its parent fsynced. A crash at any moment
  leaves either the complete checkpoint or none (a leftover `.tmp-*` is removed at the next start).
- Verified on load: the newest checkpoint whose files match its manifest wins; a truncated or
  corrupt one is reported in one line and the one before it is tried.
- Retention: the newest `keep` checkpoints stay; the journal segments older than the oldest kept
  one's go with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_node.durable import fsync_dir, replace_durable, write_durable

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint that does not match its manifest or cannot be read."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    version: int
    manifest: dict[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.file("state.json").read_text())
        return state


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, run_dir: Path, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = run_dir
        self.directory = run_dir / "checkpoints"
        self.keep = keep

    # -- epoch -----------------------------------------------------------------------------------

    def next_epoch(self) -> int:
        """Read the previous start's epoch, store and return the next one (durably, before the
        learner tells anyone: two starts never share an epoch)."""
        path = self.run_dir / "epoch"
        previous = -1
        if path.exists():
            try:
                previous = int(json.loads(path.read_text())["epoch"])
            except (ValueError, KeyError, TypeError) as exc:
                # Without it epochs could repeat; the checkpoints still know theirs.
                log.warning("could not read %s (%s): taking the epoch from the checkpoints", path, exc)
                previous = max((c.manifest.get("epoch", -1) for c in self.list_valid(quiet=True)), default=-1)
        epoch = previous + 1
        self.run_dir.mkdir(parents=True, exist_ok=True)
        replace_durable(path, json.dumps({"epoch": epoch}).encode())
        return epoch

    # -- writing ---------------------------------------------------------------------------------

    def write(self, version: int, epoch: int, writers: dict[str, Callable[[Path], None]]) -> Checkpoint:
        """Write one checkpoint: `writers[name](path)` writes each file; then the manifest; then
        the rename that makes it visible. Returns it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"v{version:012d}"
        tmp = self.directory / f".tmp-v{version:012d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files: dict[str, dict[str, Any]] = {}
        for name, write in writers.items():
            path = tmp / name
            write(path)
            with path.open("rb+") as fh:
                os.fsync(fh.fileno())
            files[name] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
        manifest = {"format": FORMAT, "version": version, "epoch": epoch, "files": files}
        write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_dir(tmp)
        if final.exists():  # the same version checkpointed again (e.g. at exit): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.directory)
        return Checkpoint(final, version, manifest)

    def retain(self) -> list[Checkpoint]:
        """Delete all but the newest `keep` checkpoints; returns the kept ones, newest first."""
        found = self._dirs()
        for path in found[self.keep :]:
            shutil.rmtree(path, ignore_errors=True)
        kept = []
        for path in found[: self.keep]:
            try:
                kept.append(self._open(path))
            except CheckpointError:
                continue
        return kept

    def clean_partial(self) -> None:
        """Remove checkpoints a crash left half-written."""
        if self.directory.exists():
            for path in self.directory.glob(".tmp-*"):
                shutil.rmtree(path, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------------

    def _dirs(self) -> list[Path]:
        if not self.directory.exists():
            return []
        found = [p for p in self.directory.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()]
        return sorted(found, key=lambda p: int(p.name[1:]), reverse=True)

    def _open(self, path: Path, *, verify: bool = False) -> Checkpoint:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            version = int(manifest["version"])
            files = manifest["files"]
            if manifest.get("format") != FORMAT or not isinstance(files, dict):
                raise CheckpointError(f"{path.name}: unknown manifest format {manifest.get('format')!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path.name}: no readable manifest ({exc})") from None
        if verify:
            for name, expect in files.items():
                file = path / name
                if not file.is_file():
                    raise CheckpointError(f"{path.name}: {name} is missing")
                if file.stat().st_size != expect["size"]:
                    raise CheckpointError(f"{path.name}: {name} is {file.stat().st_size} bytes, the manifest says {expect['size']}")
                if _sha256_file(file) != expect["sha256"]:
                    raise CheckpointError(f"{path.name}: {name} does not match its digest")
        return Checkpoint(path, version, manifest)

    def states(self) -> list[dict[str, Any]]:
        """The state.json of every checkpoint that has a readable one, newest first, without
        verifying the checkpoints' files (cheap: no hashing of model-sized files)."""
        out = []
        for path in self._dirs():
            try:
                out.append(self._open(path).state())
            except (CheckpointError, OSError, ValueError):
                continue
        return out

    def list_valid(self, *, quiet: bool = False) -> list[Checkpoint]:
        out = []
        for path in self._dirs():
            try:
                out.append(self._open(path, verify=True))
            except CheckpointError as exc:
                if not quiet:
                    log.warning("checkpoint %s", exc)
        return out

    def newest_model(self) -> Path:
        """The model file of the newest checkpoint that verifies (`ml.model.load_checkpoint`
        reads it with its version); FileNotFoundError if there is none."""
        for checkpoint in self.list_valid(quiet=True):
            return checkpoint.file("model.safetensors")
        raise FileNotFoundError(f"no checkpoint in {self.directory}")

    def newest(self, load: Callable[[Checkpoint], Any]) -> tuple[Checkpoint, Any] | None:
        """The newest checkpoint that verifies and that `load` accepts (its result alongside);
        each one that does not is reported in one line and the previous one is tried."""
        for path in self._dirs():
            try:
                checkpoint = self._open(path, verify=True)
                return checkpoint, load(checkpoint)
            except CheckpointError as exc:
                log.warning("checkpoint %s; trying the previous one", exc)
            except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                log.warning("checkpoint %s could not be loaded (%s: %s); trying the previous one", path.name, type(exc).__name__, exc)
        return None
