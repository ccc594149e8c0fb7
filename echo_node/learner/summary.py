"""What the learner says about its run: the records it builds from its parts' figures.

`Figures` owns the reporting half of the learner: the per-update `train` record, the progress
line and its `progress` record (echo_node/learner/progress.py), the operator's snapshot
(Prometheus, `echo-node status`) and `summary.json` at the end, with the verification figures
they share. It also owns the few figures only the reports need: when this incarnation started
and at which version, the last update's staleness, a wait for rollouts in progress.

Rules:
- It reads the parts it is built with and changes none of them: the learner trains, journals,
  checkpoints and flushes; `Figures` only counts and writes records to the `RunReport`
  (echo_node/learner/report.py), which writes metrics.jsonl, summary.json and the plots.
- Every part is given to the constructor; nothing is wired in afterwards. What changes while
  the run goes (the start, a wait, the resume's outcome) is told to it by a method call.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

from echo_node.config import RunConfig, to_dict
from echo_node.learner.capacity_controller import CapacityController
from echo_node.learner.evaluation import HeldOutEval
from echo_node.learner.intake import PeerBook, RolloutIntake
from echo_node.learner.profile import Profile
from echo_node.learner.progress import Progress, Totals
from echo_node.learner.recovery import Resumed, RunState
from echo_node.learner.replay import Group, ReplayBuffer
from echo_node.learner.report import RunReport
from echo_node.learner.spot_check import Verifier
from echo_node.learner.trainer import Trainer, staleness
from echo_node.learner.weight_publisher import WeightPublisher
from echo_node.metrics import first_last_update_rewards, json_safe, read_metrics
from echo_node.net.transport import Host
from echo_node.policy import Policy

# Its lines are the learner's: they kept the logger they had in learner.py, so that an operator's
# filters and the CLI's stderr format (which names the logger) see the same lines as before.
log = logging.getLogger("echo_node.learner.learner")


@dataclass(kw_only=True, eq=False)
class Figures:
    """The learner's records for its operator, built from the parts it is given (module rules)."""

    cfg: RunConfig
    policy: Policy
    task: str  # what the run trains (`Learner.task_id`)
    peers: PeerBook
    buffer: ReplayBuffer
    intake: RolloutIntake
    trainer: Trainer
    capacity: CapacityController
    weights: WeightPublisher
    node: Host
    rollouts_topic: str  # the topic whose gossip drops the summary counts
    state: RunState
    verifier: Verifier | None
    profile: Profile
    held_out: HeldOutEval | None
    report: RunReport
    io_errors: Counter[str]  # the learner's failed journal and checkpoint writes, counted there as they happen
    progress: Progress | None = field(default=None, init=False)
    _started: float = field(default=0.0, init=False)
    _first_version: int = field(default=0, init=False)
    _last_staleness: float = field(default=0.0, init=False)
    # Monotonic start of the wait for rollouts in progress.
    _wait_started: float | None = field(default=None, init=False)

    def start(self, started: float, first_version: int) -> None:
        """`Learner.run` began at monotonic `started` and goes on from `first_version` (where
        this incarnation began: updates/s counts from here). Not called for a learner driven
        update by update outside `run`: its wall figures are 0, a train record's `t` the
        monotonic clock's."""
        self._started = started
        self._first_version = first_version

    def waiting(self, since: float | None) -> None:
        """The learner waits for rollouts since monotonic `since` (None: it does not): the
        progress line counts a wait in progress as idle."""
        self._wait_started = since

    def _wall(self) -> float:
        """Seconds since `start` (0 before it, and for a learner driven outside `run`)."""
        return time.monotonic() - self._started if self._started else 0.0

    def totals(self) -> Totals:
        ledger, now = self.buffer.ledger, time.monotonic()
        waiting = now - self._wait_started if self._wait_started is not None else 0.0
        return Totals(t=now, version=self.trainer.version, accepted=ledger.trained, dropped=dict(ledger.dropped),
                      idle_s=self.trainer.idle_s + waiting, bytes_up=self.weights.bytes_up())

    async def progress_loop(self) -> None:
        """The progress line every `report.progress_s` (echo_node/learner/progress.py), also a record."""
        self.progress = Progress(self.totals())
        while True:
            await trio.sleep(self.cfg.report.progress_s)
            cap = self.capacity.snapshot()
            last = self.held_out.last if self.held_out is not None else None
            line, record = self.progress.tick(
                self.totals(), eval_version=None if last is None else last.version,
                eval_accuracy=None if last is None else round(last.accuracy, 4),
                active=cap.get("active_peers"), standby=cap.get("standby_peers"))
            log.info("%s", line)
            self.report.write(record)

    def record_step(self, groups: list[Group], stats: dict[str, float], *, wait_s: float, train_s: float) -> None:
        ledger = self.buffer.ledger
        ages = staleness(groups, self.trainer.version - 1)
        self._last_staleness = float(ages["staleness_mean"])
        if self.progress is not None:
            self.progress.trained(stats.get("reward_mean"), self._last_staleness)
        self.report.write(
            {
                "event": "train",
                "t": round(time.monotonic() - self._started, 3),
                # Wall-clock time, so a benchmark can line a publication up with peers' installs.
                "wall": round(time.time(), 4),
                "version": self.trainer.version,
                "epoch": self.state.epoch,
                "published": self.weights.published,
                "reward_mean": stats.get("reward_mean", 0.0),
                "loss": stats.get("loss", 0.0),
                "groups": len(groups),
                # Trained on version - 1 (the trainer's version is already the one the update produced).
                **ages,
                "wait_s": round(wait_s, 4),
                "train_s": round(train_s, 4),
                "idle_ratio": self.trainer.idle_ratio,
                "received": ledger.received,
                "trained": ledger.trained,
                "dropped": dict(ledger.dropped),
                "buffered": self.buffer.buffered_rollouts,
                "peers": len(self.peers.joined),
                "learner_bytes_up": self.weights.bytes_up(),
                "deltas_offered": self.weights.deltas_offered,
                "lost_messages": self.intake.lost_messages,
                "verify": self.verify_record(),
                **{k: v for k, v in stats.items() if k not in ("reward_mean", "loss")},
            }
        )

    def snapshot(self) -> dict[str, Any]:
        """The operator's view, once a second (Prometheus, `echo-node status`)."""
        ledger = self.buffer.ledger
        wall = self._wall()
        return {
            "version": self.trainer.version,
            "published_version": self.weights.published,
            "epoch": self.state.epoch,
            # This incarnation's updates over its own wall time (a resumed run's earlier versions
            # were trained by another process).
            "steps_per_s": (self.trainer.version - self._first_version) / wall if wall > 0 else 0.0,
            "learner_idle": self.trainer.idle_ratio,
            "staleness_mean": self._last_staleness,
            "rollouts_received": ledger.received,
            "rollouts_accepted": ledger.trained,
            "rollouts_buffered": self.buffer.buffered_rollouts,
            "drops": dict(ledger.dropped),
            "bans": len(self.peers.banned_peers()),
            "joined_peers": len(self.peers.joined),
            "bytes_up": self.weights.bytes_up(),
            **{k: v for k, v in self.capacity.snapshot().items() if v is not None},
        }

    def finish(self, resumed: Resumed | None) -> dict[str, Any]:
        """The summary (`resumed`: what this start resumed, None for a run started anew), written
        through the report (`RunReport.finish`); called once the learner's stop has made its
        state durable, so the checkpoint and journal figures are final."""
        # By version, from the train records (metrics.jsonl keeps them across restarts).
        first, last = first_last_update_rewards(read_metrics(self.report.path))
        ledger = self.buffer.ledger
        summary = {
            "run_id": self.cfg.run_id,
            "mode": self.cfg.rl.mode,
            "staleness": self.cfg.rl.staleness,
            "versions": self.trainer.version,
            "rollouts_received": ledger.received,
            "rollouts_accepted": ledger.trained,
            "rollouts_dropped": dict(sorted(ledger.dropped.items())),
            # Accepted and not trained yet: kept for the next start (under the staleness rule).
            "rollouts_buffered": self.buffer.buffered_rollouts,
            "epoch": self.state.epoch,
            "resumed": resumed.to_dict() if resumed is not None else None,
            # What was trained and where; `export` is the save_pretrained directory (if written).
            "model": self.policy.model_spec.get("architecture", "embedded"),
            "task": self.task,
            "dtype": str(self.policy.rollout_dtype).removeprefix("torch."),
            "device": str(self.policy.device) if self.trainer.sharded is None
            else f"{self.trainer.sharded.info.world} ranks on {self.trainer.sharded.info.device.type}",
            "export": str(self.cfg.run_dir / "model") if self.cfg.checkpoint.export else None,
            "checkpoints": {"written": self.state.checkpoints_written, "seconds": round(self.state.checkpoint_s, 3),
                            "journal_bytes": self.state.journal.bytes_written, "journal_flushes": self.state.journal.flushes},
            "reward_first": first,
            "reward_last": last,
            # The newest held-out evaluation (echo_node/learner/evaluation.py), or None.
            "eval_last": None if self.held_out is None or self.held_out.last is None else self.held_out.last.record(),
            "rollout_peers": len(self.peers.joined),
            "learner_idle_ratio": self.trainer.idle_ratio,
            "penalties": dict(self.peers.penalties),
            "peers": {
                p: {"accepted": self.peers.accepted[p], "relay": p in self.peers.relays, "unreachable": self.peers.unreachable.get(p)}
                for p in sorted(self.peers.joined)
            },
            # Groups trained per publisher, banned ones included.
            "trained_groups": dict(sorted(self.buffer.trained_groups.items())),
            "lost_messages": self.intake.lost_messages,
            # Rollout messages py-libp2p dropped before the validator (never opened, so not in
            # the rollout ledger), by reason.
            "gossip_dropped": dict(self.node.gossip_drops.get(self.rollouts_topic, {})),
            "train_errors": self.trainer.train_errors,
            # Batches without reward variance: dropped as no_signal, no version made of them.
            "no_signal_steps": self.trainer.no_signal_steps,
            # Journal and checkpoint writes that failed (journal writes are retried; see
            # learner.py's IO_RETRY_DELAYS_S).
            "io_errors": dict(self.io_errors),
            # The learner's checks of peers' claims: per check, batches passed and failed; what
            # the spot checks covered; their cost against training's.
            "verification": self.verification(),
            # Wall and CPU seconds per stage of the learner's work, and their shares.
            "profile": self.profile.to_dict(
                extra_cpu={"spot_checks": self.verifier.stats.spot_s} if self.verifier is not None else None),
            "banned": sorted(self.peers.banned_peers()),
            "learner_bytes_up": self.weights.bytes_up(),
            "wall_s": round(self._wall(), 2),
            "config": to_dict(self.cfg),
        }
        # JSON has no NaN: a figure that is not a number (nothing trained yet) is null, with why.
        nulls: dict[str, str] = {}
        summary = json_safe(summary, reasons=nulls)
        if nulls:
            why = "no update was trained" if not self.trainer.trained_rewards else "not a number"
            summary["null_reasons"] = {key: f"{what}: {why}" for key, what in nulls.items()}
        self.report.finish(summary)
        return summary

    def verify_record(self) -> dict[str, Any] | None:
        """The train record's cumulative verification counts (metrics.plot_run draws them)."""
        if self.verifier is None:
            return None
        st = self.verifier.stats
        return {
            "failed": dict(st.failed),
            "banned": len(self.peers.banned_peers()),
            "spot_rate": round(st.groups_spot_checked / max(1, st.groups_seen), 4),
            "share": round((st.claims_s + st.spot_s) / max(1e-9, self.trainer.train_s), 4),
        }

    def verification(self) -> dict[str, Any]:
        if self.verifier is None:
            return {"enabled": False}
        stats = self.verifier.stats.to_dict()
        seconds = float(stats["seconds"])  # type: ignore[arg-type]
        wall = self._wall()
        return {
            "enabled": True, **stats,
            "share_of_train_time": round(seconds / max(1e-9, self.trainer.train_s), 4),
            "share_of_learner_time": round(seconds / max(1e-9, wall), 4),
        }
