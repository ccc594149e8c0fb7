"""A run outlives its learner process: what a checkpoint holds, and how a restart resumes.

A checkpoint (echo_node/learner/checkpoint.py) holds the model, the optimizer's state, the RNG state and
`state.json`: the version, the ledger, the peer tables, the sequence tracker, the recent history
of published versions (number -> digest) and the journal segment that began with it. A restart
loads the newest checkpoint that verifies, then replays the journal (echo_node/learner/journal.py) from
that segment on:

- accepted, rejected and dropped groups rebuild the buffer and the ledger as they were;
- each journaled step is redone on the same groups in the same order (the update has no
  randomness), so the weights come back to where they were when the learner died, and each
  journaled publication is checked against the redone weights' digest;
- what cannot be redone (a group the journal lost, a digest that differs because, say, the
  thread count changed) ends the redo: the groups of later steps stay buffered and are trained
  again, counted once.

Versions never go back: the resumed learner continues at the redone version when that is the
newest version any incarnation published (or an unpublished one above it); otherwise its weights
get a new number, one above the newest published. A version number names one digest for the life
of the run, so a rollout's version tags mean what they meant, and rollouts of a previous
incarnation are admissible under the staleness rule, never retagged.

Resuming with a config that trains differently (model, task, sampling, rl) is refused with the
difference named; net, time budgets, threads, verification and checkpointing may change.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as st_load_file

from echo_node.config import RunConfig, to_dict
from echo_node.durable import replace_durable
from echo_node.learner.checkpoint import Checkpoint, CheckpointStore
from echo_node.learner.intake import JoinRefused, PeerBook, RolloutIntake
from echo_node.learner.journal import Journal, replay_records
from echo_node.learner.replay import ReplayBuffer, group_from_record, group_record
from echo_node.learner.trainer import Trainer
from echo_node.ml.export import export_pretrained
from echo_node.ml.model import canonical_state, load_state_tensors, owned_copy, save_state
from echo_node.policy import Policy
from protocol.drops import DropReason
from protocol.errors import RemoteProtocolError
from protocol.weights.manifest import payload_digest

log = logging.getLogger(__name__)

# Config sections (or keys) a resumed run must share with the run it resumes.
TRAINING_KEYS = ("run_id", "task", "env", "seed", "model", "sampling", "rl")
# The config a run started with, in its folder (`RunState.save_config`).
RUN_CONFIG = "config.json"
# Published versions remembered (number -> digest): far more than any staleness window.
HISTORY_KEEP = 1024


class ResumeRefused(Exception):
    """The run folder holds a run this config cannot continue (not a corrupt checkpoint: those
    fall back to the previous one)."""


@dataclass(slots=True)
class History:
    """Published versions, number -> (digest, size), the newest `HISTORY_KEEP`; and the newest
    number any incarnation published."""

    versions: OrderedDict[int, tuple[bytes, int]] = field(default_factory=OrderedDict)
    last: int = -1

    def add(self, version: int, sha256: bytes, size: int) -> None:
        self.versions[version] = (sha256, size)
        self.versions.move_to_end(version)
        while len(self.versions) > HISTORY_KEEP:
            self.versions.popitem(last=False)
        self.last = max(self.last, version)

    def published(self, version: int) -> bool:
        """Whether a rollout may name `version`: it was published, or it is older than what is
        remembered (then the staleness rule refuses it anyway). Before the first publication
        there is nothing to check against (and no peer can hold any version)."""
        if not self.versions:
            return True
        return version in self.versions or version < next(iter(self.versions))

    def to_json(self) -> list[list[Any]]:
        return [[v, sha.hex(), size] for v, (sha, size) in self.versions.items()]

    def restore(self, rows: list[list[Any]], last: int) -> None:
        """Become the history `to_json` wrote (in place: the intake holds `published`)."""
        self.versions.clear()
        self.last = -1
        for v, sha, size in rows:
            self.add(int(v), bytes.fromhex(sha), int(size))
        self.last = max(self.last, last)


@dataclass(slots=True)
class Resumed:
    """What a restart found and did."""

    checkpoint: int | None  # the checkpoint's version (None: none was usable)
    version: int  # the version the learner goes on from
    records: int = 0  # journal records replayed
    redone: int = 0  # steps redone
    diverged: str | None = None  # why the redo stopped early
    # Weights of redone versions whose digest matched what was published (still served).
    blobs: dict[int, bytes] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "version": self.version, "records": self.records, "redone": self.redone,
                "diverged": self.diverged, "seconds": round(self.seconds, 3)}


def config_difference(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The training-relevant keys whose values differ, as 'key: saved -> current'. A key the
    saved config lacks (written before the option existed) counts as its default; `task` as a
    bare name is the table of that built-in task; where the model computes may change."""
    out: list[str] = []
    if isinstance(saved.get("task"), str):
        saved = {**saved, "task": {"name": saved["task"]}}
    saved = _with_defaults(to_dict(RunConfig()), saved)

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(a.keys() | b.keys()):
                walk(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        elif a != b:
            out.append(f"{prefix}: {a!r} -> {b!r}")

    for key in TRAINING_KEYS:
        walk(saved.get(key), current.get(key), key)
    return [line for line in out if line.split(":", 1)[0] not in MAY_CHANGE]


# Training keys a resume may change: they decide where the arithmetic runs (or how long the
# learner waits for its environment), not what it is.
MAY_CHANGE = frozenset({"model.device", "env.step_timeout_s"})


def _with_defaults(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for key, value in saved.items():
        out[key] = _with_defaults(defaults[key], value) if isinstance(value, dict) and isinstance(defaults.get(key), dict) else value
    return out


@dataclass(frozen=True, slots=True)
class PreparedCheckpoint:
    """A checkpoint's state taken at one instant (`RunState.prepare`), to be written later."""

    version: int
    writers: dict[str, Callable[[Path], None]]
    weights: dict[str, torch.Tensor]  # the canonical weights, copied


@dataclass(frozen=True, slots=True)
class RunParts:
    """The parts of a learner that its checkpoints save and a resume restores."""

    cfg: RunConfig
    policy: Policy
    peers: PeerBook
    buffer: ReplayBuffer
    intake: RolloutIntake
    trainer: Trainer


class RunState:
    """Writes a learner's checkpoints and resumes it from them; owns the run's epoch (the
    number of this start, `start_epoch`)."""

    def __init__(self, parts: RunParts, journal: Journal, history: History) -> None:
        """`journal`: the one the parts append to; `history`: the published versions,
        restored in place by a resume."""
        self.parts = parts
        cfg = parts.cfg
        self.epoch = 0
        self.store = CheckpointStore(cfg.run_dir, keep=cfg.checkpoint.keep)
        self.journal = journal
        self.history = history
        self.checkpoints_written = 0
        self.checkpoint_s = 0.0

    def start_epoch(self) -> int:
        """Number this start of the run (one more than any start before, on disk)."""
        self.epoch = self.store.next_epoch()
        return self.epoch

    # -- writing ---------------------------------------------------------------------------------

    def prepare(self) -> PreparedCheckpoint:
        """Snapshot the state and rotate the journal, at one instant (synchronously, with no
        journal write in flight): returns the version and the file writers for
        `CheckpointStore.write`. The writers hold copies of the weights and the optimizer state
        (memory copies, ~1 s per 10 GB), so they may run in a worker thread while the learner
        goes on training; a checkpoint costs the update path only those copies."""
        parts = self.parts
        buffer = parts.buffer
        segment = self.journal.rotate([["carry", gid, origin, *group_record(g)] for gid, origin, g in buffer.live()])
        peers = parts.peers
        state = {
            "version": parts.trainer.version,
            "epoch": self.epoch,
            "journal_segment": segment,
            "next_gid": buffer.next_gid,
            "ledger": buffer.ledger.as_dict(),
            "trained_groups": dict(buffer.trained_groups),
            "history": self.history.to_json(),
            "last_published": self.history.last,
            "peers": {
                "joined": list(peers.joined),
                "accepted": dict(peers.accepted),
                "batches": dict(peers.batches),
                "penalties": dict(peers.penalties),
                "banned": dict(peers.banned),
                "banned_until_version": dict(peers.banned_until_version),
            },
            "tracker": parts.intake.tracker.snapshot(),
            "lost_messages": parts.intake.lost_messages,
            "trainer": {
                "train_errors": parts.trainer.train_errors, "train_s": parts.trainer.train_s, "idle_s": parts.trainer.idle_s,
            },
            "config": to_dict(parts.cfg),
            "wall": time.time(),
        }
        trainer = parts.trainer
        version = trainer.version
        weights = owned_copy(canonical_state(parts.policy.model))
        optimizer = {
            **trainer.optimizer_state(),
            "torch_rng": torch.get_rng_state(),
            "rewards": torch.tensor(trainer.trained_rewards, dtype=torch.float64),
        }

        def write_model(path: Path) -> None:
            save_state(weights, path, version)

        def write_optimizer(path: Path) -> None:
            torch.save(optimizer, path)

        def write_state(path: Path) -> None:
            path.write_text(json.dumps(state, sort_keys=True))

        writers: dict[str, Callable[[Path], None]] = {"model.safetensors": write_model, "optimizer.pt": write_optimizer, "state.json": write_state}
        return PreparedCheckpoint(version, writers, weights)

    def write(self, prepared: PreparedCheckpoint) -> None:
        """Write a prepared checkpoint (and the export, of the same weights), apply the retention
        rule (old journal segments go with the checkpoints that needed them)."""
        t0 = time.monotonic()
        self.store.write(prepared.version, self.epoch, prepared.writers)
        if self.parts.cfg.checkpoint.export:
            self.export(prepared.version, prepared.weights)
        kept = self.store.retain()
        if kept:
            try:
                self.journal.delete_before(min(int(c.state()["journal_segment"]) for c in kept))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("kept every journal segment: a retained checkpoint's state is unreadable (%s)", exc)
        self.checkpoints_written += 1
        self.checkpoint_s += time.monotonic() - t0

    def export(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """The policy as a save_pretrained directory, runs/<id>/model/ (ml/export.py), of the
        weights a checkpoint prepared (never the live model, which may be stepping meanwhile)."""
        parts = self.parts
        meta = {"run_id": parts.cfg.run_id, "version": version, "epoch": self.epoch, "task": parts.policy.task.task_id}
        try:
            export_pretrained(parts.policy.model, parts.policy.tokenizer, parts.cfg.run_dir / "model",
                              dtype=parts.policy.rollout_dtype, meta=meta, state=weights)
        except (OSError, ValueError) as exc:  # the checkpoint itself is written: say so, go on training
            log.warning("could not export the model to %s: %s", parts.cfg.run_dir / "model", exc)

    def checkpoint_now(self) -> None:
        """Flush, snapshot and write synchronously (at exit)."""
        self.journal.flush()
        self.write(self.prepare())

    # -- resuming --------------------------------------------------------------------------------

    def last_published(self) -> int:
        """The newest version number any incarnation published (-1: none), from the checkpoints
        and the whole journal, without loading anything (`--fresh` continues above it)."""
        last = -1
        for state in self.store.states():
            try:
                last = max(last, int(state.get("last_published", -1)))
            except (ValueError, TypeError):
                continue
        for record in replay_records(self.journal.directory, 0):
            if record[0] == "publish":
                last = max(last, int(record[1]))
        return last

    def members(self) -> list[str]:
        """The peers the run's earlier incarnations admitted: the newest checkpoint's table and
        the joins journaled after it, without loading anything (`--fresh` keeps them members)."""
        states = self.store.states()
        joined: dict[str, None] = {}
        if states:
            peers = states[0].get("peers")
            listed = peers.get("joined", []) if isinstance(peers, dict) else []
            joined.update((p, None) for p in listed if isinstance(p, str))
        for record in replay_records(self.journal.directory, 0):
            if record[0] == "join" and len(record) > 1 and isinstance(record[1], str):
                joined[record[1]] = None
        return list(joined)

    def rejoin(self, peers: Iterable[str]) -> None:
        """Make peers that had joined an earlier incarnation members again: their rollouts in
        flight across the restart are judged as rollouts (stale, most of them: counted drops),
        not refused as `not_joined`. A refusal costs their sender GossipSub score, and a few in
        a row silenced an honest peer's rollouts at the gossip layer for minutes. Each re-joins
        anyway when it sees the new epoch."""
        for peer in peers:
            try:
                self.parts.peers.join(peer, 0.0)
            except JoinRefused:
                pass

    def resume(self) -> Resumed | None:
        """Load the newest usable checkpoint and replay the journal; None if the folder holds no
        run yet. ResumeRefused if its config trains differently."""
        t0 = time.monotonic()
        self.store.clean_partial()
        segments = self.journal.segments()
        states = self.store.states()
        # An incompatible config is refused before anything is loaded: the newest checkpoint's,
        # or before the first checkpoint, the one the run started with (`save_config`).
        saved = states[0].get("config") if states else self._started_config()
        if isinstance(saved, dict):
            diff = config_difference(saved, to_dict(self.parts.cfg))
            if diff:
                raise ResumeRefused(
                    f"run {self.parts.cfg.run_id!r} in {self.parts.cfg.run_dir} was trained with another config ("
                    + "; ".join(diff[:5]) + "): use the run's config to resume it, or --fresh to start over"
                )
        found = self.store.newest(self._parse)
        if found is None and not segments:
            return None
        first_segment = 0
        if found is None:
            log.warning("no usable checkpoint in %s: replaying the journal from the run's start", self.store.directory)
            resumed = Resumed(checkpoint=None, version=0)
        else:
            checkpoint, parsed = found
            first_segment = self._apply(parsed)
            resumed = Resumed(checkpoint=checkpoint.version, version=checkpoint.version)
        self._replay(resumed, first_segment)
        self._continue(resumed)
        resumed.seconds = time.monotonic() - t0
        return resumed

    def save_config(self) -> None:
        """Keep the config a run starts with (RUN_CONFIG in its folder): a restart before the
        first checkpoint is held to it as a later one is to the checkpoint's."""
        path = self.parts.cfg.run_dir / RUN_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_durable(path, json.dumps(to_dict(self.parts.cfg), sort_keys=True).encode())

    def _started_config(self) -> Any:
        try:
            return json.loads((self.parts.cfg.run_dir / RUN_CONFIG).read_text())
        except (OSError, ValueError):
            return None  # a run started before the file existed, or none: nothing to hold it to

    def _parse(self, checkpoint: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """Read everything a checkpoint holds, changing nothing (a bad file falls back whole)."""
        tensors = st_load_file(str(checkpoint.file("model.safetensors")))
        extra = torch.load(checkpoint.file("optimizer.pt"), weights_only=True)
        state = checkpoint.state()
        for key in ("version", "journal_segment", "next_gid", "ledger", "history", "peers", "tracker"):
            if key not in state:
                raise ValueError(f"state.json has no {key!r}")
        return tensors, extra, state

    def _apply(self, parsed: tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]) -> int:
        tensors, extra, state = parsed
        parts = self.parts
        load_state_tensors(parts.policy.model, tensors)  # strict: a checkpoint of another model fails here
        parts.trainer.load_optimizer_state(extra)
        torch.set_rng_state(extra["torch_rng"])
        parts.trainer.trained_rewards = [float(r) for r in extra["rewards"].tolist()]
        parts.trainer.version = int(state["version"])
        t = state.get("trainer", {})
        parts.trainer.train_errors = int(t.get("train_errors", 0))
        parts.trainer.train_s = float(t.get("train_s", 0.0))
        parts.trainer.idle_s = float(t.get("idle_s", 0.0))
        buffer = parts.buffer
        buffer.next_gid = int(state["next_gid"])
        ledger = state["ledger"]
        buffer.ledger.received = int(ledger["received"])
        buffer.ledger.trained = int(ledger["trained"])
        buffer.ledger.dropped.update({str(k): int(v) for k, v in ledger["dropped"].items()})
        buffer.trained_groups.update({str(k): int(v) for k, v in state.get("trained_groups", {}).items()})
        self.history.restore(state["history"], int(state.get("last_published", -1)))
        peers, p = parts.peers, state["peers"]
        peers.accepted.update(p.get("accepted", {}))
        peers.batches.update(p.get("batches", {}))
        peers.penalties.update(p.get("penalties", {}))
        peers.banned.update({k: float(v) for k, v in p.get("banned", {}).items() if float(v) > time.time()})
        peers.banned_until_version.update({k: int(v) for k, v in p.get("banned_until_version", {}).items()})
        self.rejoin(p.get("joined", []))
        parts.intake.tracker.restore(state["tracker"])
        parts.intake.lost_messages = int(state.get("lost_messages", 0))
        return int(state["journal_segment"])

    def _replay(self, resumed: Resumed, first_segment: int) -> None:
        buffer = self.parts.buffer
        journal, buffer.journal = buffer.journal, None  # replaying is not news to journal
        try:
            self._replay_records(resumed, first_segment)
        finally:
            buffer.journal = journal

    def _replay_records(self, resumed: Resumed, first_segment: int) -> None:
        for outer in replay_records(self.journal.directory, first_segment):
            # A transaction's records are durable together (one frame) or not at all.
            inner = outer[1] if outer[0] == "tx" and len(outer) == 2 and isinstance(outer[1], list) else [outer]
            for record in inner:
                resumed.records += 1
                try:
                    self._replay_one(resumed, record)
                except (ValueError, TypeError, IndexError, KeyError, RemoteProtocolError) as exc:
                    # Not redone past here (a later restart's record may bring the redo back in step).
                    log.warning("journal: record %d (%r) unusable (%s)", resumed.records, record[:1], exc)
                    resumed.diverged = resumed.diverged or f"journal record {resumed.records} unusable"

    def _replay_one(self, resumed: Resumed, record: list[Any]) -> None:
        buffer, tracker = self.parts.buffer, self.parts.intake.tracker
        kind = record[0]
        if kind in ("admit", "carry"):
            group = group_from_record(record[3:])
            buffer.replay_admit(int(record[1]), group, str(record[2]), received=kind == "admit")
        elif kind == "reject":
            buffer.replay_reject(str(record[1]), int(record[2]))
        elif kind == "rejects":
            for reason, rollouts in dict(record[1]).items():
                buffer.replay_reject(str(reason), int(rollouts))
        elif kind == "drop":
            buffer.replay_drop(str(record[1]), [int(g) for g in record[2]])
        elif kind == "seen":
            tracker.observe(str(record[1]), int(record[2]))
        elif kind == "join":
            self.rejoin([str(record[1])])
        elif kind == "excuse":
            tracker.excuse_next_gap(str(record[1]))
        elif kind == "step":
            self._redo(resumed, int(record[1]), [int(g) for g in record[2]], [float(w) for w in record[3]] if len(record) > 3 else None)
        elif kind == "publish":
            self._republish(resumed, int(record[1]), bytes(record[2]), int(record[3]))
        elif kind == "resume":
            self._resumed_at(resumed, int(record[1]), bytes(record[3]))
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def _redo(self, resumed: Resumed, version: int, gids: list[int], weights: list[float] | None = None) -> None:
        trainer = self.parts.trainer
        if resumed.diverged is not None:
            return  # the groups stay buffered: trained again, counted once
        if version != trainer.version + 1:
            resumed.diverged = f"the journal's step to version {version} follows version {trainer.version}"
            return
        groups = self.parts.buffer.take_gids(gids)
        if groups is None:
            resumed.diverged = f"the step to version {version} names groups the journal lost"
            return
        try:
            trainer.redo(groups, weights)
        except Exception as exc:  # the same batch failed the same way then: train_error
            self.parts.buffer.mark_failed(groups, DropReason.TRAIN_ERROR)
            resumed.diverged = f"redoing the step to version {version} failed: {exc}"
            return
        resumed.redone += 1
        resumed.version = trainer.version

    def _republish(self, resumed: Resumed, version: int, sha256: bytes, size: int) -> None:
        self.history.add(version, sha256, size)
        if resumed.diverged is not None or version != self.parts.trainer.version:
            return
        blob = self.parts.policy.publication()
        if payload_digest(blob) != sha256:
            resumed.diverged = f"version {version} redone to another digest than was published"
            return
        resumed.blobs[version] = blob

    def _resumed_at(self, resumed: Resumed, version: int, sha256: bytes) -> None:
        """An earlier restart went on from `version` with weights of digest `sha256`. Replaying
        the same prefix got it to the same weights (then its own steps are redone from here,
        even past a redo that stopped early then and now), or not (then none of them are)."""
        if payload_digest(self.parts.policy.publication()) != sha256:
            resumed.diverged = resumed.diverged or f"the restart at version {version} held other weights"
            return
        if resumed.diverged is not None:
            log.info("journal: the restart at version %d went on from here (%s)", version, resumed.diverged)
        resumed.diverged = None
        self.parts.trainer.version = resumed.version = version

    def _continue(self, resumed: Resumed) -> None:
        """Choose the version the learner goes on from: never a number published with another
        digest than the weights it holds now."""
        trainer = self.parts.trainer
        v = trainer.version
        if v in self.history.versions and v not in resumed.blobs:  # e.g. the checkpoint's own version
            blob = self.parts.policy.publication()
            if payload_digest(blob) == self.history.versions[v][0]:
                resumed.blobs[v] = blob
        if v < self.history.last or (v == self.history.last and v not in resumed.blobs):
            trainer.version = self.history.last + 1
        resumed.version = trainer.version
        resumed.blobs = {k: b for k, b in resumed.blobs.items() if k >= trainer.version - self.parts.cfg.rl.staleness}
