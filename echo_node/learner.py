"""The learner: owns a run, consumes rollouts, trains with GRPO, publishes numbered versions.

Dataflow: gossip (rollouts topic) -> validator (signature, run id, version sanity) ->
sequence tracker (duplicates, gaps -> repair requests) -> replay buffer (staleness rule) ->
trainer (one GRPO update per `groups_per_step` groups) -> new version on the data channel and a
signed announcement on the versions topic.

Invariant (see replay.py): each received rollout is trained or dropped with a reason, exactly
once; the final ledger is written to `summary.json`. Bad input from a peer is a log line, a
dropped-rollout count and a penalty against that peer, never a crash.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections import Counter, OrderedDict
from functools import partial
from typing import Any, TextIO

import trio

from echo_node.broadcast import FULL, DataServer, ProbeFailed, Served, Source, base_of, probe
from echo_node.config import RunConfig, to_dict
from echo_node.metrics import MetricsWriter, first_last_mean, plot_rewards, plot_run, read_metrics
from echo_node.ml.grpo import PolicyOptimizer, TrainGroup
from echo_node.ml.model import save_checkpoint, state_to_bytes
from echo_node.net import rpc
from echo_node.net.discovery import Backoff, connect_bootstrap
from echo_node.net.p2p import P2PNode, listen_host, p2p_settings, provider_key
from echo_node.policy import Policy
from echo_node.intake import JoinRefused, PeerBook, RolloutIntake
from echo_node.replay import ReplayBuffer
from echo_node.topics import rollouts_topic, versions_topic
from protocol.addresses import is_loopback, unroutable_reason
from protocol.delta import encode_delta, estimate_delta_ratio
from protocol.envelope import seal
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.manifest import WeightManifest, build_manifest, choose_piece_size
from protocol.messages import (
    JoinRequest,
    JoinResponse,
    RolloutGroup,
    RunSpec,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    VersionAnnounce,
)
from protocol.admission import RunBounds
from protocol.drops import DropReason
from protocol.limits import MAX_PROMPT_TOKENS

log = logging.getLogger(__name__)

# A version is also offered as a lossless delta against the previous one when that saves at
# least this share of the bytes (bf16 weights after an RL step: ~97%; fp32: ~55%, not worth
# the learner's encode time). After a delta that did not pay, try again this many versions on,
# doubling the wait after each miss up to the cap; a delta that pays resets it. A delta is only
# cut when a sampled estimate says it may pay: on the default model the estimate takes 5.6 ms,
# the cut 79 ms on a quiet core (0.2-0.3 s next to training, py-spy), and retries every 50
# versions of full cuts were ~6 % of the learner's core on a run whose deltas never pay. The
# estimate errs high by a few % of the size, hence the slack.
DELTA_MIN_SAVING = 0.7
DELTA_RETRY_VERSIONS = 50
DELTA_RETRY_MAX_VERSIONS = 3200
DELTA_ESTIMATE_SLACK = 0.05
# Ask for this much more than one update consumes, so that jitter or a lost message never
# leaves the learner waiting; the excess is what the staleness rule drops.
DEMAND_SLACK = 1.5
# A joining peer's data address must answer a dial-back within this to be handed out as a relay
# (behind a NAT that drops inbound connections nothing answers at all); probes run this many at
# once, so a burst of joins cannot make the learner open sockets without bound.
PROBE_TIMEOUT_S = 5.0
PROBES_AT_ONCE = 8
# Joins whose dial-back waits for a slot: beyond this a joiner is not probed (so not a relay)
# until it joins again, and a flood of joins cannot queue tasks without bound.
MAX_PENDING_PROBES = 256
# Pieces of a version this small are 256 KiB, not 64: each piece costs ~1-2 ms of request,
# framing and hashing on loopback, and a rollout peer fetched the 3.4 MB default model in 96 ms
# with 64 KiB pieces, 46 ms with 256 KiB (it fetches every version in async mode). Big versions
# keep 64 KiB pieces: there the WAN pipeline fill (peers x piece / rate) is what counts.
SMALL_VERSION_BYTES = 16 << 20
SMALL_VERSION_PIECE = 256 << 10


def piece_size_for(payload_size: int) -> int:
    if payload_size <= SMALL_VERSION_BYTES:
        return choose_piece_size(payload_size, SMALL_VERSION_PIECE)
    return choose_piece_size(payload_size)


class Learner:
    def __init__(self, cfg: RunConfig, identity: Identity, policy: Policy, *, stdout: TextIO = sys.stdout) -> None:
        self.cfg = cfg
        self.identity = identity
        self.policy = policy
        self.stdout = stdout
        self.version = 0
        # The newest version peers can fetch: every rl.publish_every-th one.
        self.published = 0
        # Tables the intake owns, also read here (demand, relays, the summary).
        self.peers = PeerBook(max_peers=cfg.net.max_peers, ban_after=cfg.net.ban_after, ban_s=cfg.net.ban_s)
        self.buffer = ReplayBuffer(
            mode=cfg.rl.mode, staleness=cfg.rl.staleness, capacity_groups=cfg.rl.buffer_groups,
            capacity_bytes=cfg.rl.buffer_bytes, max_share=cfg.rl.max_peer_share,
        )
        self.rollouts_topic = rollouts_topic(cfg.run_id)
        self.versions_topic = versions_topic(cfg.run_id)
        self.intake = RolloutIntake(
            run_bounds(cfg, policy), self.buffer, self.peers, version=lambda: self.version, topic=self.rollouts_topic,
            bans_path=cfg.run_dir / "bans.json", on_first_accept=self._first_accept,
        )
        self.node = P2PNode(identity, p2p_settings(cfg.net, app_score=self.peers.score))
        self.intake.node = self.node
        self.data = DataServer(
            identity, cfg.run_id, bind_host=listen_host(cfg.net.listen), advertise_host=self.node.advertise_host, port=cfg.net.data_port
        )
        self.data.ban_s = cfg.net.ban_s
        # A peer the data channel caught misbehaving is also charged here: its rollouts and
        # joins are refused once it runs out of strikes.
        self.data.on_ban = lambda peer, why: self.intake.penalize(peer, f"data channel: {why}")
        self.served = Served(self.data, cfg.net.keep_versions)
        self.sources: dict[tuple[int, int], Source] = {}
        self.bytes_served = 0
        self.deltas_offered = 0
        # The weights of every version still served, oldest first: the bases deltas are cut
        # against (a peer that skipped versions names the newest one it holds).
        self._blobs: OrderedDict[int, bytes] = OrderedDict()
        self._no_delta: set[tuple[int, int]] = set()
        self._building: dict[tuple[int, int], trio.Event] = {}
        self._next_delta_try = 1
        self._delta_retry = DELTA_RETRY_VERSIONS
        self.data.resolve = self._delta_on_demand
        self.optimizer = PolicyOptimizer(
            policy.model,
            lr=cfg.rl.lr,
            clip_eps=cfg.rl.clip_eps,
            temperature=cfg.sampling.temperature,
            max_grad_norm=cfg.rl.max_grad_norm,
            pad_id=policy.tokenizer.pad_id,
            correction=cfg.rl.correction,
            is_cap=cfg.rl.is_cap,
            minibatches=cfg.rl.minibatches,
        )
        self.trained_rewards: list[float] = []
        self.train_errors = 0
        self.idle_s = 0.0
        self.train_s = 0.0
        self._started = 0.0
        self.metrics: MetricsWriter | None = None
        self._nursery: trio.Nursery | None = None
        self._probes = trio.CapacityLimiter(PROBES_AT_ONCE)
        self._probing: set[str] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Serve and train until the configured time or version budget is spent."""
        self._started = time.monotonic()
        self.metrics = MetricsWriter(self.cfg.run_dir / "metrics.jsonl")
        self._offer_version(0, state_to_bytes(self.policy.model))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.node.run)
                await nursery.start(self.data.run)
                if self.cfg.net.bootstrap:
                    await connect_bootstrap(
                        self.node,
                        self.cfg.net.bootstrap,
                        deadline_s=self.cfg.net.join_deadline_s,
                        backoff=Backoff(self.cfg.net.backoff_initial_s, self.cfg.net.backoff_max_s),
                    )
                self.node.set_stream_handler(rpc.JOIN, self._serve_join)
                self.node.set_stream_handler(rpc.STATUS, self._serve(self._on_status))
                await self.node.subscribe(self.rollouts_topic, self.intake.validate)
                await self.node.provide(provider_key(self.cfg.run_id))
                self._say({"event": "ready", "peer_id": self.node.peer_id, "addrs": self.node.addrs, "version": 0})
                nursery.start_soon(self.intake.consume, self.node.messages(self.rollouts_topic))
                nursery.start_soon(self.intake.repair_loop, self.cfg.net.repair_interval_s)
                nursery.start_soon(self._provide_loop)
                await self._train_loop()
                nursery.cancel_scope.cancel()
        finally:
            summary = self._finish()
        return summary

    def _say(self, record: dict[str, Any]) -> None:
        self.stdout.write(json.dumps(record) + "\n")
        self.stdout.flush()

    # -- request handlers ----------------------------------------------------------------------

    def _serve(self, handler: rpc.Handler) -> Any:
        async def on_stream(stream: Any) -> None:
            with trio.move_on_after(30):
                await rpc.serve_one(stream, handler, on_bad=self._bad_request)

        return on_stream

    async def _serve_join(self, stream: Any) -> None:
        # The join handler also needs where the connection came from (a dial-back candidate).
        observed = getattr(stream, "remote_host", None)
        await self._serve(partial(self._on_join, observed=observed))(stream)

    def spec(self) -> RunSpec:
        s = self.cfg.sampling
        return RunSpec(
            run_id=self.cfg.run_id,
            model=self.policy.model_spec,
            tokenizer=self.policy.tokenizer_spec,
            task=self.cfg.task,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens),
            sync_mode=self.cfg.rl.mode,
            staleness=self.cfg.rl.staleness,
            group_size=self.cfg.rl.group_size,
            current_version=self.published,
            learner_peer_id=self.node.peer_id,
        )

    async def _on_join(self, request: Any, remote: str, *, observed: str | None = None) -> JoinResponse:
        if not isinstance(request, JoinRequest):
            raise RemoteProtocolError(f"join stream carried a {type(request).__name__}")
        self._check_run(request.run_id)
        if request.peer_id != remote:
            raise RemoteProtocolError(f"join request names {request.peer_id}, but the stream is from {remote}")
        try:
            self.peers.join(remote, trio.current_time())
        except JoinRefused as exc:
            raise rpc.RequestRefused(exc.code, str(exc)) from None
        log.info("peer %s joined (%d peers)", remote, len(self.peers.joined))
        self._schedule_probe(remote, self._probe_candidates(request, observed))
        return JoinResponse(spec=self.spec(), data_host=self.data.host, data_port=self.data.port)

    def _probe_candidates(self, request: JoinRequest, observed: str | None) -> list[tuple[str, int]]:
        """Where to dial a joiner back: the address it names, then its data port at the address
        its connection came from (a 1:1 NAT or a port forward keeps the port). Never loopback
        unless the learner is on loopback too, and never the learner's own data address."""
        hosts = [request.data_host] + ([observed] if observed and observed != request.data_host else [])
        local = is_loopback(self.data.host)
        return [
            (h, request.data_port) for h in hosts
            if unroutable_reason(h) is None and (local or not is_loopback(h)) and (h, request.data_port) != (self.data.host, self.data.port)
        ]

    def _schedule_probe(self, peer_id: str, candidates: list[tuple[str, int]]) -> None:
        if self._nursery is None or peer_id in self._probing:
            return
        if len(self._probing) >= MAX_PENDING_PROBES:
            self._verdict(peer_id, None, f"not probed: {MAX_PENDING_PROBES} dial-backs already pending")
            return
        self._probing.add(peer_id)
        self._nursery.start_soon(self._probe, peer_id, candidates)

    async def _probe(self, peer_id: str, candidates: list[tuple[str, int]]) -> None:
        """Decide whether `peer_id` is handed out as a relay: only a data address that answered
        a dial-back as that peer is."""
        failures = []
        try:
            async with self._probes:
                for host, port in candidates:
                    with trio.move_on_after(PROBE_TIMEOUT_S):
                        try:
                            await probe(self.identity, self.cfg.run_id, peer_id, host, port)
                        except ProbeFailed as exc:
                            failures.append(str(exc))
                            continue
                        self._verdict(peer_id, (host, port), "")
                        return
                    failures.append(f"{host}:{port}: no answer within {PROBE_TIMEOUT_S:g}s")
            self._verdict(peer_id, None, "; ".join(failures) or "it named no address this learner may dial")
        finally:
            self._probing.discard(peer_id)

    def _verdict(self, peer_id: str, relay: tuple[str, int] | None, why: str) -> None:
        """Record whether `peer_id` is a relay (at `relay`) or not (and `why`); logged and written."""
        if relay is not None:
            self.peers.relays[peer_id] = relay
            self.peers.unreachable.pop(peer_id, None)
            log.info("peer %s is reachable at %s:%d: handed out as a relay", peer_id, *relay)
            self._write({"event": "reachability", "peer": peer_id, "relay": True, "addr": "%s:%d" % relay})
            return
        why = why[:500]  # it quotes what the peer's address answered
        self.peers.relays.pop(peer_id, None)
        self.peers.unreachable[peer_id] = why
        log.info("peer %s is not reachable from outside (%s): it downloads and contributes, but is not a relay", peer_id, why)
        self._write({"event": "reachability", "peer": peer_id, "relay": False, "why": why})

    def _write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write({**record, "wall": round(time.time(), 4)})

    async def _on_status(self, request: Any, remote: str) -> StatusResponse:
        if not isinstance(request, StatusRequest):
            raise RemoteProtocolError(f"status stream carried a {type(request).__name__}")
        self._check_run(request.run_id)
        self.peers.touch(remote, trio.current_time())
        manifest = self.sources[(self.published, FULL)].store.manifest
        return StatusResponse(
            run_id=self.cfg.run_id,
            version=self.published,
            weights_size=manifest.weights_size,
            weights_sha256=manifest.weights_sha256,
            demand_groups=self.demand_groups(),
        )

    def demand_groups(self) -> int:
        return self.intake.demand_groups(self.cfg.rl.groups_per_step * self.cfg.rl.publish_every, DEMAND_SLACK)

    def _check_run(self, run_id: str) -> None:
        if run_id != self.cfg.run_id:
            raise rpc.RequestRefused("wrong_run", f"this learner serves run {self.cfg.run_id!r}, not {run_id!r}")

    def _bad_request(self, peer_id: str, exc: Exception) -> None:
        log.warning("bad request from %s: %s", peer_id, exc)
        self.intake.penalize(peer_id, f"bad request: {exc}")

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
        while self.buffer.count_admissible(self.version) < need:
            await self.intake.arrived.wait()
            self.intake.arrived = trio.Event()

    async def _train_loop(self) -> None:
        with trio.move_on_at(self._deadline()):
            while self.cfg.max_versions is None or self.version < self.cfg.max_versions:
                t0 = time.monotonic()
                await self._wait_for_batch()
                t1 = time.monotonic()
                groups = self.buffer.take(self.cfg.rl.groups_per_step, self.version)
                # One update is all or nothing: a deadline arriving between `take` and the step
                # once lost a whole batch from the ledger, and one arriving after the step would
                # leave trained weights under the old version number.
                with trio.CancelScope(shield=True):
                    try:
                        stats = await trio.to_thread.run_sync(self.optimizer.step, [_train_group(g) for g in groups])
                    except Exception:
                        self._train_failed(groups)
                        continue
                    except BaseException:
                        self.buffer.restore(groups)  # e.g. Ctrl-C: counted as unused, not lost
                        raise
                    self.buffer.mark_trained(groups)
                    self.trained_rewards += [s.reward for g in groups for s in g.samples]
                    self.version += 1
                    due = self.version % self.cfg.rl.publish_every == 0
                    blob = await trio.to_thread.run_sync(state_to_bytes, self.policy.model) if due else None
                    t2 = time.monotonic()
                    self.idle_s += t1 - t0
                    self.train_s += t2 - t1
                    if blob is not None:
                        await self._publish_version(blob)
                    # Anything that just fell out of the staleness window is counted now, not at exit.
                    self.buffer.evict_stale(self.version)
                    self._record_step(groups, stats, wait_s=t1 - t0, train_s=t2 - t1)
                if self.version % self.cfg.checkpoint.every_versions == 0:
                    await trio.to_thread.run_sync(self._checkpoint)

    def _train_failed(self, groups: list[RolloutGroup]) -> None:
        """A step raised on this batch: drop it (`train_error`) and go on. Admission should make
        this unreachable, so the first one is logged with its traceback (it is a bug here or a
        check missing there), later ones as a count."""
        self.buffer.mark_failed(groups, DropReason.TRAIN_ERROR)
        self.train_errors += 1
        origins = sorted({self.buffer.origin(g) or "?" for g in groups})
        if self.train_errors == 1:
            log.exception("a training step failed; dropped its %d groups (from %s) as train_error", len(groups), ", ".join(origins))
        else:
            log.error("a training step failed again (%d so far); dropped its %d groups", self.train_errors, len(groups))
        self._write({"event": "train_error", "version": self.version, "groups": len(groups), "origins": origins})

    def _offer_version(self, version: int, blob: bytes) -> Source:
        """Make `version` fetchable: a signed manifest and a broadcast source on the data server."""
        manifest = build_manifest(run_id=self.cfg.run_id, version=version, payload=blob, piece_size=piece_size_for(len(blob)))
        source = self._offer(manifest, blob)
        self.served.add(version)
        self._blobs[version] = blob
        for old in [v for v in self._blobs if v not in self.served]:
            del self._blobs[old]
        for key in [k for k in self.sources if k[0] not in self.served]:
            self.bytes_served += self.sources.pop(key).stats.bytes_up
        self._no_delta = {k for k in self._no_delta if k[0] in self.served}
        return source

    def _offer(self, manifest: WeightManifest, payload: bytes) -> Source:
        source = Source(self.identity, manifest, seal(manifest, self.identity), payload, self.peers.joined, self.peers.relays)
        base = base_of(manifest)
        self.sources[(manifest.version, base)] = source
        self.data.register(manifest.version, source, base=base)
        return source

    async def _offer_delta(self, version: int, base: int) -> Source | None:
        """Offer `version` as a delta against `base` if both are kept and the delta pays."""
        blob, previous = self._blobs.get(version), self._blobs.get(base)
        if blob is None or previous is None or len(previous) != len(blob) or (version, base) in self._no_delta:
            return None
        if await trio.to_thread.run_sync(estimate_delta_ratio, blob, previous) > 1 - DELTA_MIN_SAVING + DELTA_ESTIMATE_SLACK:
            self._no_delta.add((version, base))
            return None
        delta = await trio.to_thread.run_sync(encode_delta, blob, previous)
        if len(delta) > (1 - DELTA_MIN_SAVING) * len(blob) or version not in self.served:
            self._no_delta.add((version, base))
            return None
        full = self.sources[(version, FULL)].store.manifest
        manifest = build_manifest(
            run_id=self.cfg.run_id, version=version, payload=delta, codec="xor-zstd", base_version=base,
            weights_size=full.weights_size, weights_sha256=full.weights_sha256, piece_size=piece_size_for(len(delta)),
        )
        self.deltas_offered += 1
        return self._offer(manifest, delta)

    async def _delta_on_demand(self, version: int, base: int) -> Source | None:
        """The data server's resolver: a peer asked for `version` against an older `base` than
        the one offered up front. Cut once, then served to every peer that asks (and relayed)."""
        key = (version, base)
        if key in self.sources:
            return self.sources[key]
        if self.version < self._next_delta_try:
            return None  # deltas do not pay now (see _offer_new_version): no encode per request
        building = self._building.get(key)
        if building is not None:
            await building.wait()
            return self.sources.get(key)
        self._building[key] = trio.Event()
        try:
            return await self._offer_delta(version, base)
        finally:
            self._building.pop(key).set()

    async def _publish_version(self, blob: bytes) -> None:
        manifest = await self._offer_new_version(blob)
        announce = VersionAnnounce(
            run_id=self.cfg.run_id,
            version=self.version,
            size=manifest.weights_size,
            sha256=manifest.weights_sha256,
            demand_groups=self.demand_groups(),
        )
        await self.node.publish(self.versions_topic, seal(announce, self.identity))

    async def _offer_new_version(self, blob: bytes) -> WeightManifest:
        """Publish the current version (`blob` is its weights), full and (up front, when it pays)
        as a delta against the previously published one, which most peers hold. Returns the full
        snapshot's manifest."""
        previous = self.published
        manifest = self._offer_version(self.version, blob).store.manifest
        self.published = self.version
        if self.version >= self._next_delta_try:
            if await self._offer_delta(self.version, previous) is None:
                # Deltas do not pay now (early training moves every weight; fp32 never pays):
                # stop cutting them a while, longer after each miss.
                self._next_delta_try = self.version + self._delta_retry
                self._delta_retry = min(2 * self._delta_retry, DELTA_RETRY_MAX_VERSIONS)
            else:
                self._delta_retry = DELTA_RETRY_VERSIONS
        return manifest

    def learner_bytes_up(self) -> int:
        return self.bytes_served + sum(s.stats.bytes_up for s in self.sources.values())

    def _record_step(self, groups: list[RolloutGroup], stats: dict[str, float], *, wait_s: float, train_s: float) -> None:
        # Trained on version - 1 (self.version is already the one the update produced).
        staleness = [self.version - 1 - g.min_version for g in groups]
        hist: Counter[int] = Counter()
        for g in groups:
            for sample in g.samples:
                hist.update(self.version - 1 - v for v in sample.token_versions)
        ledger = self.buffer.ledger
        assert self.metrics is not None
        self.metrics.write(
            {
                "event": "train",
                "t": round(time.monotonic() - self._started, 3),
                # Wall-clock time, so a benchmark can line a publication up with peers' installs.
                "wall": round(time.time(), 4),
                "version": self.version,
                "published": self.published,
                "reward_mean": stats.get("reward_mean", 0.0),
                "loss": stats.get("loss", 0.0),
                "groups": len(groups),
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
                "wait_s": round(wait_s, 4),
                "train_s": round(train_s, 4),
                "idle_ratio": self.idle_s / max(1e-9, self.idle_s + self.train_s),
                "received": ledger.received,
                "trained": ledger.trained,
                "dropped": dict(ledger.dropped),
                "buffered": self.buffer.buffered_rollouts,
                "peers": len(self.peers.joined),
                "learner_bytes_up": self.learner_bytes_up(),
                "deltas_offered": self.deltas_offered,
                "lost_messages": self.intake.lost_messages,
                **{k: v for k, v in stats.items() if k not in ("reward_mean", "loss")},
            }
        )

    def _checkpoint(self) -> None:
        save_checkpoint(self.policy.model, self.cfg.run_dir / "checkpoint.safetensors", self.version)

    def _finish(self) -> dict[str, Any]:
        assert self.metrics is not None
        self.buffer.close()
        self.buffer.check()
        self._checkpoint()
        first, last = first_last_mean(self.trained_rewards)
        ledger = self.buffer.ledger
        summary = {
            "run_id": self.cfg.run_id,
            "mode": self.cfg.rl.mode,
            "staleness": self.cfg.rl.staleness,
            "versions": self.version,
            "rollouts_received": ledger.received,
            "rollouts_accepted": ledger.trained,
            "rollouts_dropped": dict(sorted(ledger.dropped.items())),
            "reward_first": first,
            "reward_last": last,
            "rollout_peers": len(self.peers.joined),
            "learner_idle_ratio": self.idle_s / max(1e-9, self.idle_s + self.train_s),
            "penalties": dict(self.peers.penalties),
            "peers": {
                p: {"accepted": self.peers.accepted[p], "relay": p in self.peers.relays, "unreachable": self.peers.unreachable.get(p)}
                for p in sorted(self.peers.joined)
            },
            "lost_messages": self.intake.lost_messages,
            "train_errors": self.train_errors,
            "banned": sorted(self.peers.banned),
            "learner_bytes_up": self.learner_bytes_up(),
            "wall_s": round(time.monotonic() - self._started, 2) if self._started else 0.0,
            "config": to_dict(self.cfg),
        }
        self.metrics.write({"event": "summary", **{k: v for k, v in summary.items() if k != "config"}})
        self.metrics.close()
        (self.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        records = read_metrics(self.metrics.path)
        title = f"{self.cfg.run_id} ({self.cfg.rl.mode})"
        plot_rewards(records, self.cfg.run_dir / "reward.png", title=title)
        plot_run(records, self.cfg.run_dir, title=title)
        return summary


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


def _train_group(g: RolloutGroup) -> TrainGroup:
    return TrainGroup(
        prompt_ids=list(g.prompt_ids),
        completions=[list(s.completion_ids) for s in g.samples],
        behaviour_logprobs=[list(s.behaviour_logprobs) for s in g.samples],
        rewards=[s.reward for s in g.samples],
    )

