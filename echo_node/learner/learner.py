"""The learner: owns a run, consumes rollouts, trains with GRPO, publishes numbered versions.

Dataflow: gossip (rollouts topic) -> intake (signature, the run's admission rules, sequence
tracker: duplicates, gaps -> repair requests) -> replay buffer (staleness rule) -> trainer (one
GRPO update per `groups_per_step` groups) -> weight publisher (the new version on the data
channel) and a signed announcement on the versions topic.

Invariant (see replay.py): each received rollout is trained or dropped with a reason, exactly
once, across restarts too; the ledger is written to `summary.json` at every stop. Bad input from
a peer is a log line, a dropped-rollout count and a penalty against that peer, never a crash.

Durability (echo_node/learner/recovery.py): every start is a new epoch; a run folder that holds a run is
resumed from its newest checkpoint and write-ahead journal, and the version numbering goes on,
never back. The journal is flushed before a version is announced (and at least every
`checkpoint.journal_flush_s`), a checkpoint is written every `checkpoint.every_versions`
versions (no sooner than `checkpoint.min_interval_s` after the last) and at a stop.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, TypedDict

import torch
import trio

from echo_node import offload
from echo_node.config import RunConfig, VerifyConfig, to_dict
from echo_node.envs import load_env
from echo_node.envs.format import episode_format
from echo_node.envs.gate import EpisodeGate
from echo_node.learner.capacity_controller import CapacityController
from echo_node.learner.door import Door
from echo_node.learner.evaluation import HeldOutEval, evaluator
from echo_node.learner.intake import PeerBook, RolloutIntake
from echo_node.learner.journal import Journal, StorageFailed
from echo_node.learner.profile import Profile
from echo_node.learner.publication import Publication
from echo_node.learner.recovery import History, PreparedCheckpoint, Resumed, ResumeRefused, RunParts, RunState
from echo_node.learner.replay import Group, ReplayBuffer, step_weights
from echo_node.learner.report import RunReport
from echo_node.learner.spot_check import Verifier
from echo_node.learner.summary import Figures
from echo_node.learner.tracking import open_tracker
from echo_node.learner.trainer import Trainer
from echo_node.learner.weight_publisher import WeightPublisher
from echo_node.ml.sharded import DistInfo
from echo_node.net.discovery import Backoff, connect_bootstrap
from echo_node.net.p2p import P2PNode, listen_host, p2p_settings, provider_key
from echo_node.net.transport import TCP, DataNet, Host
from echo_node.policy import Policy
from echo_node.prom import run_exporter
from echo_node.topics import rollouts_topic, versions_topic
from echo_node.weights.broadcast import DataServer
from echo_node.weights.mesh import PeerOverlay
from protocol.admission import RunBounds
from protocol.capacity import groups_to_ask
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.limits import MAX_PROMPT_TOKENS
from protocol.messages import (
    RunEnded,
    RunEndReason,
    RunSpec,
    SamplingParams,
)
from protocol.weights.manifest import payload_digest

log = logging.getLogger(__name__)

# The capacity controller measures peers' throughput this often (it decides on its own tick).
CAPACITY_MEASURE_S = 1.0


# The end of a run is announced within END_ANNOUNCE_S (a stop never waits longer for it): END_REPEATS
# times, END_DRAIN_S apart, and the host stays up END_DRAIN_S after the last so that the message
# leaves its queues. A publish pushes to the subscribers the learner knows at that moment; a
# peer that subscribed later gets the word only through a heartbeat's lazy gossip, which offers
# it to a few sampled peers. A repeat pushes it to every subscriber, so a peer that joined in the
# last moments stops instead of looking for the learner for `net.learner_outage_s`. A peer takes
# the first and ignores the rest (same epoch, same word).
END_ANNOUNCE_S = 3.0
END_DRAIN_S = 0.5
END_REPEATS = 3

# A journal write that fails (a full disk, descriptors gone for a moment) is retried after each
# of these delays before the learner gives up and stops: ~15 s for an operator's alert to fire.
IO_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


class Ready(TypedDict):
    """What `Learner.run` reports once ready; the CLI prints it as the learner's first stdout
    line (JSON), which the demo, the tests and the benchmarks wait for."""

    event: str  # "ready"
    peer_id: str
    addrs: list[str]
    version: int  # the version this start goes on from (the one peers fetch first)
    epoch: int


class Learner:
    """Composes the run's services in one nursery: `RolloutIntake` (who may publish, admission,
    gap repair), `Door` (joins, status answers, dial-back probes), `Trainer` (GRPO updates),
    `Publication` (a version out: journal before announce) over `WeightPublisher` (versions on
    the data channel), `Figures` (the train and progress records, the operator's snapshot, the
    summary), `RunReport` (metrics, summary, plots); and keeps the start, the train loop, the
    checkpoints and the end-of-run announcement."""

    # What runs the updates; benchmarks/paced.py gives a learner a slower one (the extension
    # point `RolloutPeer.generator_class` is for a peer).
    trainer_class: type[Trainer] = Trainer

    def __init__(
        self, cfg: RunConfig, identity: Identity, policy: Policy, *, fresh: bool = False,
        dist: DistInfo | None = None, host: Host | None = None, data_net: DataNet = TCP,
    ) -> None:
        """`dist`: this process is rank 0 of a torchrun job and the update is sharded over its
        ranks (echo_node/ml/sharded.py); the other ranks run `follow_learner`. `host` and
        `data_net`: the network (echo_node/net/transport.py; default: a libp2p host and TCP)."""
        self.cfg = cfg
        # `fresh`: start the run over even if its folder holds one (the old state is moved aside;
        # version numbers still go on from the newest one published, so that no old rollout can
        # pass for a new version's).
        self.fresh = fresh
        self.resumed: Resumed | None = None
        self.identity = identity
        self.policy = policy
        # Each part gets what it depends on when it is built, in this order: nothing is wired in
        # afterwards. The write-ahead journal every part appends to, and the published versions.
        journal = Journal(cfg.run_dir / "journal", max_segment_bytes=cfg.checkpoint.max_journal_bytes)
        history = History()
        # Tables the intake owns, also read here (demand, relays, the summary).
        self.peers = PeerBook(
            max_peers=cfg.net.max_peers, ban_after=cfg.net.ban_after, ban_s=cfg.net.ban_s, version=lambda: self.version
        )
        self.buffer = ReplayBuffer(
            mode=cfg.rl.mode, staleness=cfg.rl.staleness, capacity_groups=cfg.rl.buffer_groups,
            capacity_bytes=cfg.rl.buffer_bytes, max_share=cfg.verify.max_peer_share, journal=journal,
        )
        self.rollouts_topic = rollouts_topic(cfg.run_id)
        self.versions_topic = versions_topic(cfg.run_id)
        # Which peers generate, and κ with rl.publish_auto (echo_node/learner/capacity_controller.py).
        rl = cfg.rl
        auto = rl.publish_auto and rl.mode == "async"
        self.capacity = CapacityController(
            cfg.capacity, rollouts_per_update=rl.groups_per_step * rl.group_size, staleness=rl.staleness,
            kappa=max(1, rl.staleness - 1) if auto else rl.publish_every, auto_kappa=auto, pipelined=rl.mode == "async",
        )
        # A run with an environment ([env]): peers publish episodes, and every one is re-run
        # here (echo_node/envs/gate.py). Its spec's task is the environment's id.
        self.env = load_env(cfg) if cfg.env.name is not None else None
        episodes = None if self.env is None else EpisodeGate(
            spec=self.env, fmt=episode_format(policy.tokenizer), run_id=cfg.run_id, group_size=cfg.rl.group_size,
            vocab_size=int(policy.model.config.vocab_size), staleness=cfg.rl.staleness, mode=cfg.rl.mode,
        )
        # Spot checks need the weights of every version a rollout can still be admitted on.
        self.verifier = Verifier(
            cfg.verify, run_id=cfg.run_id, tokenizer=policy.tokenizer, task=policy.task, model=policy.model,
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, keep_versions=cfg.rl.staleness + 2,
            rollout_dtype=policy.rollout_dtype, check_dtype=check_dtype(cfg.verify, policy),
            engine_of=self.capacity.engine_of,
        ) if cfg.verify.enabled else None
        self.node: Host = host or P2PNode(identity, p2p_settings(cfg.net, app_score=self.peers.score))
        self.intake = RolloutIntake(
            run_bounds(cfg, policy), self.buffer, self.peers, version=lambda: self.version, topic=self.rollouts_topic,
            bans_path=cfg.run_dir / "bans.log", on_first_accept=self._first_accept, verify=self.verifier,
            on_accept=lambda peer, version, n: self.capacity.accepted(peer, version, n, trio.current_time()),
            on_caught=lambda record: self._write({"event": "caught", "version": self.version, **record}),
            ban_versions=cfg.verify.ban_versions, node=self.node, journal=journal, published=history.published,
            episodes=episodes,
        )
        # Where the learner's time goes, per stage (echo_node/learner/profile.py): in the summary.
        self.profile = Profile()
        # Every rl.publish_every-th version becomes fetchable (weights.published), from the data
        # server the publisher builds (it resolves the deltas peers ask for). A peer the data
        # channel caught sending a bad frame or piece, or asking without reading, is banned from
        # the run at once (no honest peer does either), rollouts and joins alike.
        self.weights = WeightPublisher(
            identity, cfg.run_id, members=self.peers.joined, relays=self.peers.relays, keep_versions=cfg.net.keep_versions,
            profile=self.profile, overlay=PeerOverlay(
                self.peers.joined, self.peers.relays, mode=cfg.weights.exchange, degree=cfg.weights.degree,
                source_degree=cfg.weights.source_degree, source_rotate=cfg.weights.source_rotate,
                settle_s=cfg.weights.settle_s, rotate_share=cfg.weights.rotate_share,
            ),
            data_server=partial(
                DataServer, identity, cfg.run_id, bind_host=listen_host(cfg.net.listen),
                advertise_host=self.node.advertise_host, port=cfg.net.data_port, ban_s=cfg.net.ban_s,
                on_ban=lambda peer, why: self.intake.ban(peer, f"data channel: {why}"), net=data_net,
            ),
        )
        self.data = self.weights.data
        self.trainer = self.trainer_class(cfg, policy, self.buffer, dist=dist, journal=journal, profile=self.profile)
        # Checkpoints, the journal and the history of published versions.
        self.state = RunState(
            RunParts(cfg=cfg, policy=policy, peers=self.peers, buffer=self.buffer, intake=self.intake, trainer=self.trainer),
            journal, history,
        )
        self._journal_lock = trio.Lock()
        # Writes of the journal and checkpoints that failed (retried, or skipped for checkpoints).
        self.io_errors: Counter[str] = Counter()
        self.report = RunReport(cfg.run_dir, f"{cfg.run_id} ({cfg.rl.mode})")
        self._nursery: trio.Nursery | None = None
        self._checkpoint_written = trio.Event()  # set while no checkpoint is being written
        self._checkpoint_written.set()
        # The version and trio time of the last checkpoint taken (from a start: where it went on from).
        self._checkpointed = (0, 0.0)
        # Joins and status answers, and the dial-backs that pick relays (echo_node/learner/door.py).
        self.door = Door(
            cfg, identity, peers=self.peers, intake=self.intake, journal=journal, capacity=self.capacity,
            weights=self.weights, data=self.data, node=self.node, report=self.report, spec=self.spec,
            epoch=lambda: self.epoch, demand_groups=self.demand_groups,
        )
        # The operator's view while the run goes (echo_node/learner/progress.py, echo_node/learner/evaluation.py).
        # The held-out evaluation scores `[task]` prompts: a run of episodes trains on none.
        rep = cfg.report
        self.held_out: HeldOutEval | None = evaluator(policy, prompts=rep.eval_prompts if self.env is None else 0,
                                                       every=rep.eval_every, max_new_tokens=cfg.sampling.max_new_tokens)
        # Versions out, journal before announce (echo_node/learner/publication.py).
        self.publication = Publication(
            cfg, identity, node=self.node, topic=self.versions_topic, weights=self.weights, state=self.state,
            flush_journal=self._flush_journal, verifier=self.verifier, capacity=self.capacity, profile=self.profile,
            report=self.report, held_out=self.held_out, ask=self._ask, epoch=lambda: self.epoch,
        )
        # The train and progress records, the operator's snapshot and the summary (echo_node/learner/summary.py).
        self.figures = Figures(
            cfg=cfg, policy=policy, task=self.task_id, peers=self.peers, buffer=self.buffer, intake=self.intake,
            trainer=self.trainer, capacity=self.capacity, weights=self.weights, node=self.node,
            rollouts_topic=self.rollouts_topic, state=self.state, verifier=self.verifier, profile=self.profile,
            held_out=self.held_out, report=self.report, io_errors=self.io_errors,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[Ready] = trio.TASK_STATUS_IGNORED) -> dict[str, Any]:
        """Resume (or start) the run, then serve and train until the configured time or version
        budget is spent or the task is cancelled; the summary and a checkpoint are written either way.
        Ready (`task_status.started`, a `Ready`) once peers can find the run, join it and fetch
        its current version."""
        started = time.monotonic()
        blob = self._start()
        self.figures.start(started, self.version)  # where this incarnation began (updates/s counts from here)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                # The host outlives a stop's cancellation until the end of the run is announced.
                node_scope = trio.CancelScope(shield=True)
                await nursery.start(self._node_until, node_scope)
                reason: RunEndReason = "stopped"
                try:
                    await self._serve_and_train(nursery, blob, task_status)
                    reason = "finished"
                finally:
                    with trio.CancelScope(shield=True):
                        await self._announce_end(reason)
                    node_scope.cancel()
                nursery.cancel_scope.cancel()
        finally:
            summary = self._finish()
        return summary

    async def _node_until(self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await self.node.run(task_status=task_status)

    async def _announce_end(self, reason: RunEndReason) -> None:
        """Tell the peers the run ended (RunEnded on the versions topic): "finished" when its
        budget is spent, "stopped" otherwise (a signal, an error: a restart resumes it). Gossip
        is best effort, so it is said END_REPEATS times (late joiners); a peer that misses all
        of them finds the learner gone and looks for it as after any outage. Bounded: a stop
        waits at most END_ANNOUNCE_S for it."""
        ended = RunEnded(run_id=self.cfg.run_id, epoch=self.epoch, version=self.weights.published, reason=reason)
        sealed = seal(ended, self.identity)
        with trio.move_on_after(END_ANNOUNCE_S):
            try:
                for _ in range(END_REPEATS):
                    await self.node.publish(self.versions_topic, sealed)
                    await trio.sleep(END_DRAIN_S)  # py-libp2p sends from queues: let them drain before the host closes
            except Exception as exc:  # the host is already going: the peers will find it gone
                log.warning("could not announce the end of the run: %s", exc)
                return
        log.info("told the peers the run %s (version %d, epoch %d)", reason, ended.version, self.epoch)
        self._write({"event": "run_ended", "reason": reason, "version": ended.version, "epoch": self.epoch})

    async def _serve_and_train(self, nursery: trio.Nursery, blob: Any, task_status: trio.TaskStatus[Ready]) -> None:
        """Serve the run and train from `blob` (the version this start goes on from) until the
        budget is spent (returns) or the learner is cancelled; the host runs already."""
        await nursery.start(self.data.run)
        nursery.start_soon(self._flush_loop)
        if self.intake.ban_log is not None:
            nursery.start_soon(self.intake.ban_log.run, self.peers.live_bans)
        await nursery.start(self.publication.run)
        # The version this start goes on from, before anyone can join or ask.
        await self._publish_version(blob)
        if self.cfg.net.bootstrap:
            await connect_bootstrap(
                self.node,
                self.cfg.net.bootstrap,
                deadline_s=self.cfg.net.join_deadline_s,
                backoff=Backoff(self.cfg.net.backoff_initial_s, self.cfg.net.backoff_max_s),
            )
        await nursery.start(self.door.run)
        await self.node.subscribe(self.rollouts_topic, self.profile.timed("intake_validate", self.intake.validate),
                                  on_overflow=self.intake.overflowed,
                                  admit=self.intake.queue_admits)
        await self.node.provide(provider_key(self.cfg.run_id))
        task_status.started(
            Ready(event="ready", peer_id=self.node.peer_id, addrs=self.node.addrs, version=self.version, epoch=self.epoch)
        )
        nursery.start_soon(self.intake.consume, self.node.messages(self.rollouts_topic))
        nursery.start_soon(self.intake.repair_loop, self.cfg.net.repair_interval_s)
        nursery.start_soon(self._provide_loop)
        nursery.start_soon(self._capacity_loop)
        if self.cfg.report.progress_s > 0:
            nursery.start_soon(self.figures.progress_loop)
        if self.cfg.net.metrics_port is not None:
            net = self.cfg.net
            await nursery.start(run_exporter, "learner", self.cfg.run_id, net.metrics_host, net.metrics_port, self.figures.snapshot)
        await self._train_loop()

    def _start(self) -> bytes:
        """A new epoch, the run resumed from its folder (or started over), the start journaled:
        returns the weights of the version this start goes on from."""
        run_dir = self.cfg.run_dir
        floor = 0
        members: list[str] = []
        if self.fresh:
            # Above S of everything published before: a rollout of the old weights, still on its
            # way from a peer, is then stale here (a counted drop), never trained as if the new
            # weights had made it, nor a spot-check failure of the peer that sent it.
            floor = self.state.last_published() + 1 + self.cfg.rl.staleness
            members = self.state.members()
            self._archive(run_dir)
        self.state.start_epoch()
        rep = self.cfg.report
        self.report.open(open_tracker(rep.report_to, run_dir / "tracking", run_id=self.cfg.run_id, config=to_dict(self.cfg),
                                      wandb_mode=rep.wandb_mode))
        try:
            self.resumed = None if self.fresh else self.state.resume()
        except ResumeRefused as exc:
            raise ValueError(str(exc)) from None
        if self.resumed is None:
            self.trainer.version = floor
            self.state.history.last = floor - 1
            self.state.rejoin(members)  # they stay members, as the bans stay (`_archive`)
            self.state.save_config()
        self.weights.open_store(run_dir / "versions")
        blob = self.resumed.blobs.pop(self.version, None) if self.resumed is not None else None
        if blob is not None:  # snapshotted and checked against its published digest by the resume
            digest = self.state.history.versions[self.version][0]
            blob = self.weights.keep(self.version, blob)
        else:
            blob = self.weights.snapshot(self.version, self.policy.publication_into)
            digest = payload_digest(blob)
        # First in this start's journal: where it goes on from (a later restart replaying this
        # journal checks that it got to the same weights).
        self.state.journal.append(["resume", self.version, self.epoch, digest])
        self.buffer.evict_stale(self.version)
        self.state.journal.flush()
        if self.resumed is not None:
            # Peers went on publishing while no learner listened: the gaps that left are not
            # theirs, and what was owed before may since have left their histories.
            self.intake.tracker.excuse_next_gap()
            self.intake.tracker.forgive_owed()
            for version, old in sorted(self.resumed.blobs.items()):
                if version < self.version:  # still admissible: served, and spot-checkable
                    self.publication.offer(version, old)
            self.resumed.blobs.clear()  # kept in the version store from here on
            r = self.resumed
            log.info(
                "resumed run %s at version %d (epoch %d): checkpoint %s, %d journal records, %d steps redone in %.1fs%s",
                self.cfg.run_id, self.version, self.epoch, r.checkpoint, r.records, r.redone, r.seconds,
                f"; redo stopped early: {r.diverged}" if r.diverged else "",
            )
        last = self.resumed.checkpoint if self.resumed is not None else None
        self._checkpointed = (self.version if last is None else last, trio.current_time())
        self._write({"event": "start", "epoch": self.epoch, "version": self.version, "fresh": self.fresh,
                     "resumed": self.resumed.to_dict() if self.resumed is not None else None,
                     "buffered": self.buffer.buffered_rollouts})
        return blob

    def _archive(self, run_dir: Path) -> None:
        """--fresh: move the previous run's state aside (kept, not deleted). The epoch stays, and
        so do the bans: they are about peers, not about what was trained."""
        names = ("checkpoints", "journal", "summary.json", "metrics.jsonl", *sorted(p.name for p in run_dir.glob("*.png")))
        present = [n for n in names if (run_dir / n).exists()]
        if not present:
            return
        dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        self.state.journal.close()
        for name in present:
            shutil.move(str(run_dir / name), str(dest / name))
        self.state.journal.index = 0
        log.info("started run %s over: its previous state is in %s", self.cfg.run_id, dest)

    async def _flush_journal(self) -> None:
        """Make every journaled record durable (one writer at a time, in order). A write that
        fails is retried with backoff (the journal cut back what landed of it); one that still
        fails stops the learner cleanly (`StorageFailed`): nothing unjournaled may be announced."""
        async with self._journal_lock:
            data = self.state.journal.take_pending()
            delays = iter(IO_RETRY_DELAYS_S)
            while True:
                try:
                    await offload.run_sync(self.profile.timed("journal_write", self.state.journal.write), data)
                    return
                except OSError as exc:
                    self.io_errors["journal"] += 1
                    delay = next(delays, None)
                    if delay is None:
                        raise StorageFailed(f"could not write the journal in {self.state.journal.directory}: {exc}") from None
                    log.warning("writing the journal failed (%s); retrying in %gs", exc, delay)
                    await trio.sleep(delay)

    async def _flush_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.checkpoint.journal_flush_s)
            if self.state.journal.pending:
                await self._flush_journal()

    async def _checkpoint(self) -> None:
        """Take a checkpoint's state now and write it in a worker thread while training goes on:
        the update path pays for the copies of the weights and optimizer state and the journal's
        rotation (at one instant, with no journal write in flight), not for the files. One write
        at a time: a checkpoint due while the last one is still being written waits for it, so
        one is written every `every_versions` versions whatever the disk's speed."""
        assert self._nursery is not None, "checkpoints are written by a task of Learner.run's nursery"
        await self._checkpoint_written.wait()
        async with self._journal_lock:
            try:
                prepared = self.state.prepare()
            except OSError as exc:  # the journal's rotation
                self._checkpoint_failed(self.version, exc)
                return
        self._checkpointed = (prepared.version, trio.current_time())
        self._checkpoint_written = trio.Event()
        self._nursery.start_soon(self._write_checkpoint, prepared, self._checkpoint_written)

    async def _write_checkpoint(self, prepared: PreparedCheckpoint, done: trio.Event) -> None:
        """A checkpoint that cannot be written costs only time at the next restart: the journal
        segments since the last good one are kept, and the next due checkpoint tries again. A
        stop waits for a write in flight (a worker thread is not abandoned)."""
        try:
            await offload.run_sync(self.profile.timed("checkpoint_write", self.state.write), prepared)
        except OSError as exc:
            self._checkpoint_failed(prepared.version, exc)
        finally:
            done.set()

    def _checkpoint_failed(self, version: int, exc: OSError) -> None:
        self.io_errors["checkpoint"] += 1
        log.error("could not write the checkpoint of version %d (%s): a restart replays the journal since the last one", version, exc)

    # -- what peers are told -------------------------------------------------------------------

    @property
    def task_id(self) -> str:
        """What the run trains: its task's id, or its environment's (a run of episodes)."""
        return self.policy.task.task_id if self.env is None else self.env.env_id

    def spec(self) -> RunSpec:
        s = self.cfg.sampling
        return RunSpec(
            run_id=self.cfg.run_id,
            model=self.policy.model_spec,
            tokenizer=self.policy.tokenizer_spec,
            task=self.task_id,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens),
            sync_mode=self.cfg.rl.mode,
            staleness=self.cfg.rl.staleness,
            group_size=self.cfg.rl.group_size,
            current_version=self.weights.published,
            learner_peer_id=self.node.peer_id,
            epoch=self.epoch,
        )

    def _write(self, record: dict[str, Any]) -> None:
        self.report.write(record)

    def demand_groups(self) -> int:
        return self.publication.demand

    def _ask(self) -> int:
        """Groups per peer for the version being published (protocol/capacity.py, rule 7): what
        the learner trains until the next publication plus one update's worth in reserve, less
        what it holds, split among the peers that deliver; at least one (the wire's floor)."""
        rl = self.cfg.rl
        need = groups_to_ask(mode=rl.mode, groups_per_step=rl.groups_per_step, kappa=self.capacity.kappa,
                             buffered=self.buffer.count_admissible(self.version))
        return self.intake.demand_groups(need, 1.0)

    def _first_accept(self, peer_id: str) -> None:
        # Wall-clock time, so a benchmark can compare it with when it started the peer.
        self._write({"event": "first_accept", "peer": peer_id, "version": self.version})

    async def _provide_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.net.provide_interval_s)
            try:
                await self.node.provide(provider_key(self.cfg.run_id))
            except Exception as exc:
                log.warning("re-announcing the run on the DHT failed: %s", exc)

    # -- training ------------------------------------------------------------------------------

    def _deadline(self) -> float:
        # trio's clock, not time.monotonic(): move_on_at reads trio.current_time().
        return trio.current_time() + self.cfg.seconds if self.cfg.seconds is not None else math.inf

    async def _wait_for_batch(self) -> None:
        need = self.cfg.rl.groups_per_step
        # A long wait wakes the peers on standby (echo_node/learner/capacity_controller.py).
        self.capacity.waiting(trio.current_time())
        try:
            while self.buffer.count_admissible(self.version) < need:
                await self.intake.next_arrival()
        finally:
            self.capacity.working(trio.current_time())

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def epoch(self) -> int:
        """This start of the run (RunSpec.epoch): 0 until the run starts, then `RunState`'s."""
        return self.state.epoch

    async def _train_loop(self) -> None:
        with trio.move_on_at(self._deadline()):
            while self.cfg.max_versions is None or self.version < self.cfg.max_versions:
                t0 = time.monotonic()
                self.figures.waiting(t0)
                await self._wait_for_batch()
                self.figures.waiting(None)
                wait_s = time.monotonic() - t0
                self.trainer.idle_s += wait_s
                await self.update(wait_s=wait_s)

    async def update(self, *, wait_s: float = 0.0) -> None:
        """One update on the freshest admissible groups: train, publish the version when due,
        count what fell out of the staleness window, checkpoint when due."""
        trainer = self.trainer
        t1 = time.monotonic()
        profile = self.profile
        with profile.stage("take"):
            unproven = self._unproven
            share = self.cfg.verify.unproven_share
            rl = self.cfg.rl
            groups = self.buffer.take(rl.groups_per_step, self.version, unproven=unproven, unproven_share=share,
                                      unproven_groups=self.cfg.verify.unproven_groups, clean=self._clean,
                                      rescue=math.floor(rl.rescue_share * rl.groups_per_step))
            origins, trained_on = [self.buffer.origin(g) for g in groups], self.version
            weights = step_weights([unproven(o) for o in origins], self.cfg.rl.groups_per_step, share)
        with trio.CancelScope(shield=True):  # all or nothing (trainer.py)
            stats = await trainer.step(groups, weights)
            if stats is None:
                self._write({"event": "train_error", "version": self.version, "groups": len(groups),
                             "origins": sorted({self.buffer.origin(g) or "?" for g in groups})})
                return
            with profile.stage("audit"):
                self._audit(groups, origins, trained_on)
            if stats.get("skipped"):  # no reward variance: no new version (trainer.py)
                self._write({"event": "no_signal", "version": self.version, "groups": len(groups),
                             "reward_mean": stats.get("reward_mean", 0.0), "wait_s": round(wait_s, 4),
                             "dropped": dict(self.buffer.ledger.dropped)})
                return
            due = self.version % self.capacity.kappa == 0
            t2 = time.monotonic()
            blob = await offload.run_sync(
                profile.timed("snapshot", self.weights.snapshot), self.version, self.policy.publication_into) if due else None
            t3 = time.monotonic()
            trainer.train_s += t3 - t2  # the snapshot is the learner's work too
            if blob is not None:
                await self._publish_version(blob)
            # Anything that just fell out of the staleness window is counted now, not at exit.
            with profile.stage("bookkeeping"):
                self.buffer.evict_stale(self.version)
                self.capacity.step(t3 - t1)
            with profile.stage("metrics"):
                self.figures.record_step(groups, stats, wait_s=wait_s, train_s=t3 - t1)
        if self._checkpoint_due():
            with profile.stage("checkpoint"):
                await self._checkpoint()

    def _unproven(self, origin: str) -> bool:
        """Whether `origin`'s groups are weighted as an unproven publisher's (echo_node/learner/replay.py)."""
        return self.verifier is not None and not self.verifier.proven(origin)

    def _clean(self, origin: str) -> bool:
        """Whether `origin` owes, skipped and disowned none of its seqs: an unproven publisher
        fills a step past `verify.unproven_groups` only then (echo_node/learner/replay.py)."""
        tracker = self.intake.tracker
        return tracker.skips(origin)[0] == 0 and tracker.disowned(origin) == 0 and tracker.owed(origin) == 0

    def _checkpoint_due(self) -> bool:
        journal, cfg = self.state.journal, self.cfg.checkpoint
        if journal.segment_bytes > journal.max_segment_bytes:
            return True
        return (self.version - self._checkpointed[0] >= cfg.every_versions
                and trio.current_time() - self._checkpointed[1] >= cfg.min_interval_s)

    def _audit(self, groups: list[Group], origins: list[str], trained_on: int) -> None:
        """The step's own forward re-checked the claimed log-probs of every token sampled on the
        weights it trained (echo_node/learner/spot_check.py, audits of training): a group off the envelope
        gets its publisher caught as a spot check would."""
        gaps = self.trainer.audit_gaps()
        if self.verifier is None or not gaps:
            return
        for index, g in gaps.items():
            origin = origins[index]
            if not origin or self.peers.is_banned(origin):
                continue
            failure = self.verifier.audit(origin, trained_on, groups[index].group_id, g.tokens, g.total, g.largest)
            if failure is not None:
                self.intake.catch(origin, failure)

    async def _capacity_loop(self) -> None:
        """Measure the peers every second; record each capacity decision, and say when the
        active set changes (a normal event, once per tick at most)."""
        while True:
            await trio.sleep(CAPACITY_MEASURE_S)
            with self.profile.stage("capacity"):
                record = self.capacity.tick(trio.current_time(), self.peers.joined)
            if record is None:
                continue
            self._write({**record, "version": self.version})
            if record["changed"]:
                target = "no target (no pool is enough)" if record["target"] is None else f"a target of {record['target']:.1f}"
                log.info(
                    "capacity: %d active, %d standby, %.1f rollouts/s for %s, %.2f/h (%s)",
                    len(record["active"]), len(record["standby"]), record["mu_active"], target,
                    record["cost_per_hour"], record["reason"],
                )

    async def _publish_version(self, blob: Any) -> None:
        """Publish the current version (echo_node/learner/publication.py: journaled and durable
        before it is announced)."""
        await self.publication.publish(self.version, blob)

    def _finish(self) -> dict[str, Any]:
        """The stop: the ledger checked, the final checkpoint, the journal closed and the bans on
        disk; then the summary (echo_node/learner/summary.py), written with those figures final."""
        self.buffer.check()
        try:  # what is still buffered stays in the journal: the next start takes it back
            self.state.checkpoint_now()
        except OSError as exc:
            log.error("could not write the final checkpoint (%s): a restart resumes from the previous one and the journal", exc)
        self.state.journal.close()
        if self.intake.ban_log is not None:
            try:
                self.intake.ban_log.flush(self.peers.live_bans)
            except OSError as exc:
                log.error("could not write %s (%s): bans given since its last write are forgotten at a restart",
                          self.intake.ban_log.path, exc)
        return self.figures.finish(self.resumed)


def check_dtype(cfg: VerifyConfig, policy: Policy) -> torch.dtype:
    """The dtype spot checks recompute log-probs in: `verify.check_dtype`, "auto" being float32
    on a CPU (bf16 is emulated there and would round on both sides of the comparison) and the
    rollout dtype on a GPU."""
    if cfg.check_dtype == "float32" or (cfg.check_dtype == "auto" and policy.device.type == "cpu"):
        return torch.float32
    return policy.rollout_dtype


def run_bounds(cfg: RunConfig, policy: Policy) -> RunBounds:
    """What this run's rollouts can hold: ids the model embeds, as many new tokens as the run
    samples, prompts that fit the context next to them, rewards in the task's range."""
    context = int(getattr(policy.model.config, "max_position_embeddings", MAX_PROMPT_TOKENS) or MAX_PROMPT_TOKENS)
    low, high = policy.task.reward_range
    return RunBounds(
        run_id=cfg.run_id,
        group_size=cfg.rl.group_size,
        vocab_size=int(policy.model.config.vocab_size),
        max_new_tokens=cfg.sampling.max_new_tokens,
        max_prompt_tokens=max(1, min(MAX_PROMPT_TOKENS, context - cfg.sampling.max_new_tokens)),
        reward_low=low,
        reward_high=high,
    )
