"""A rollout peer: joins a run, keeps its weights current, generates, scores and publishes.

Sync modes (Echo):
- pull: before every generation batch the peer asks the learner for its newest version and
  refreshes if it is behind, so each batch is sampled from the learner's current policy.
- async: the peer generates continuously; new versions announced on the versions topic (or seen
  in a periodic status check, in case gossip lost one) are fetched in the background, and a
  version that verified is swapped into the engine at its next decoding step, mid-generation
  (interruptible generation, AReaL / PipelineRL): a completion then carries the versions of its
  tokens, and the learner judges it by its oldest token against S and corrects every token by
  its own behaviour log-prob.

The groups of each generation batch are published as one signed `RolloutBatch` (or a few, if
they do not fit one gossip frame) with a per-publisher sequence number; the last
`net.repair_history` of them are kept to answer the learner's gap-repair requests.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from echo_node.broadcast import FULL, LINK_ERRORS, DataServer, Served, Unavailable, open_version, receive_version
from echo_node.config import RunConfig
from echo_node.metrics import MetricsWriter
from echo_node.ml.engine import TorchEngine
from echo_node.ml.rollout import ScoredGroup, generate_groups
from echo_node.net import rpc
from echo_node.net.discovery import Backoff, DialError, JoinError, PeerAddr, connect_bootstrap, find_providers
from echo_node.net.p2p import P2PNode, listen_host, p2p_settings, provider_key
from echo_node.policy import Policy, peer_policy
from echo_node.topics import rollouts_topic, versions_topic
from protocol.delta import decode_delta
from protocol.envelope import open_envelope, seal
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity
from protocol.manifest import payload_digest
from protocol.messages import (
    JoinRequest,
    JoinResponse,
    RepairRequest,
    RepairResponse,
    RolloutBatch,
    RolloutGroup,
    RunSpec,
    Sample,
    StatusRequest,
    StatusResponse,
    VersionAnnounce,
    pack_groups,
    pack_repair_response,
)

log = logging.getLogger(__name__)

# A version that does not arrive (and verify) within this is abandoned and asked for again.
FETCH_TIMEOUT_S = 60.0
# What a failed weight fetch looks like; the peer retries after a pause (by then a newer version
# may be the target: "unavailable" means the learner already stopped serving this one).
REFRESH_ERRORS = (*LINK_ERRORS, trio.TooSlowError, rpc.RequestFailed, RemoteProtocolError, Unavailable)
# After the learner said it has no delta for a version, ask only for full snapshots this long.
DELTA_BACKOFF_VERSIONS = 20
# Status checks double as a liveness probe of the learner in async mode.
STATUS_INTERVAL_S = 5.0
# A peer that met the learner's demand for its version waits this long for the next version,
# then samples one more batch anyway: an announcement may have been lost, and a learner short of
# data must never wait on peers that wait on it.
DEMAND_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class Target:
    version: int
    size: int
    sha256: bytes
    demand_groups: int


def rollout_group(g: ScoredGroup, *, group_id: str) -> RolloutGroup:
    """The wire record of one scored group: per-token log-probs and version tags as sampled."""
    return RolloutGroup(
        group_id=group_id,
        prompt_ids=tuple(g.prompt_ids),
        samples=tuple(
            Sample(
                completion_ids=tuple(gen.completion_ids),
                # An engine's float32 log-prob of a near-certain token can round to +1e-8.
                behaviour_logprobs=tuple(min(0.0, lp) for lp in gen.logprobs),
                token_versions=tuple(gen.token_versions),
                reward=float(r),
            )
            for gen, r in zip(g.generations, g.rewards)
        ),
    )


class RolloutPeer:
    def __init__(self, cfg: RunConfig, identity: Identity, *, model_path: str | None = None) -> None:
        self.cfg = cfg
        self.identity = identity
        self.model_path = model_path
        self.node = P2PNode(identity, p2p_settings(cfg.net))
        self.data = DataServer(
            identity, cfg.run_id, bind_host=listen_host(cfg.net.listen), advertise_host=self.node.advertise_host, port=cfg.net.data_port
        )
        self.data.ban_s = cfg.net.ban_s
        self.served = Served(self.data, cfg.net.keep_versions)
        self._nursery: trio.Nursery | None = None
        # The newest verified weights this peer holds (running or about to be swapped in), as
        # bytes: the base a delta applies to.
        self._blob: bytes | memoryview | None = None
        self._blob_version = -1
        # Verified weights waiting for the engine; taken by the generation thread between two
        # decoding steps (async) or before a batch, hence the lock.
        self._pending: tuple[bytes | memoryview, int] | None = None
        self._pending_lock = threading.Lock()
        self.swaps_mid_generation = 0
        self._delta_from = 0
        self.deltas_used = 0
        # Start from the wall clock in ms, not 0: a restarted peer keeps its key (and peer id), and
        # the learner would take a fresh count from 0 for duplicates of messages it has seen.
        self.seq = time.time_ns() // 1_000_000
        self.history: OrderedDict[int, bytes] = OrderedDict()
        self.published_groups = 0
        self.unsendable_groups = 0  # too big for a gossip frame even alone: dropped, logged
        self.rng = random.Random(int.from_bytes(hashlib.sha256(identity.public_key).digest()[:8], "big") ^ cfg.seed)
        self.spec: RunSpec | None = None
        self.policy: Policy | None = None
        self.engine: TorchEngine | None = None
        self.learner: PeerAddr | None = None
        self._join: JoinResponse | None = None
        self._newest: Target | None = None
        # Set and replaced by `_offer` on every newer version, so any number of tasks (the
        # background fetcher, the generation loop) can wait on the one current event.
        self._new_version = trio.Event()
        # Flow control: groups sampled on the engine's current version, and the learner's ask.
        self._produced = 0
        self._produced_version = -1
        self._demand = cfg.rollout.groups_per_batch
        self._last_contact = 0.0
        self.first_publish_s: float | None = None
        self._t0 = time.monotonic()
        # Whether the learner hands this peer out as a relay (it could dial our data port back).
        self.reachable: bool | None = None
        # runs/<run id>/peers/<peer id>.jsonl: when each version went live here, and the like.
        self.metrics: MetricsWriter | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._t0 = time.monotonic()
        try:
            await self._run(task_status)
        finally:
            if self.metrics is not None:
                self.metrics.close()

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.node.run)
            await nursery.start(self.data.run)
            await self._join_run()
            # Written only once joined: a join that fails leaves nothing behind.
            self.metrics = MetricsWriter(self.cfg.run_dir / "peers" / f"{self.node.peer_id}.jsonl")
            self.metrics.write({"event": "joined", "wall": time.time(), "peer": self.node.peer_id,
                                "addrs": self.node.addrs, "data": f"{self.data.host}:{self.data.port}"})
            assert self.spec is not None
            self.node.set_stream_handler(rpc.REPAIR, self._serve_repair)
            await self.node.subscribe(versions_topic(self.cfg.run_id), self._validate_announce)
            await self._refresh()  # the initial weights, before the first token is sampled
            task_status.started()
            nursery.start_soon(self._follow_announcements)
            if self.spec.sync_mode == "async":
                nursery.start_soon(self._poll_status)
                nursery.start_soon(self._fetch_newest)
            await self._generate_forever()

    # -- joining ---------------------------------------------------------------------------------

    async def _join_run(self) -> None:
        net = self.cfg.net
        backoff = Backoff(net.backoff_initial_s, net.backoff_max_s)
        deadline = trio.current_time() + net.join_deadline_s
        await connect_bootstrap(self.node, net.bootstrap, deadline_s=net.join_deadline_s, backoff=backoff)
        remaining = max(0.0, deadline - trio.current_time())
        pin = net.learner
        candidates = await find_providers(
            self.node, provider_key(self.cfg.run_id), what=f"learner for run {self.cfg.run_id!r}", deadline_s=remaining,
            backoff=backoff, pin=pin,
        )
        # Anyone can announce a run id: without a pin, every record is tried, and a learner is
        # taken only if its join response (on a stream authenticated to its peer id) is for
        # this run and names itself as the run's learner.
        failures: list[str] = []
        for learner in candidates:
            try:
                join = await self._join_learner(learner)
            except (JoinError, rpc.RequestFailed, RemoteProtocolError, trio.TooSlowError) as exc:
                log.info("learner candidate %s refused: %s", learner.peer_id, exc)
                failures.append(f"{learner.peer_id}: {exc}")
                continue
            break
        else:
            raise JoinError(f"no learner of run {self.cfg.run_id!r} took this peer: " + "; ".join(failures))
        self.learner = learner
        self._join = join
        self.spec = join.spec
        self.policy = await trio.to_thread.run_sync(
            peer_policy, dict(join.spec.model), dict(join.spec.tokenizer), join.spec.task, self.model_path
        )
        self.engine = TorchEngine(self.policy.model, eos_id=self.policy.tokenizer.eos_id, pad_id=self.policy.tokenizer.pad_id)
        self.engine.version = -1
        log.info(
            "joined run %s (mode %s, S=%d) via learner %s (%s; %d provider record(s) found)", self.cfg.run_id,
            self.spec.sync_mode, self.spec.staleness, learner.peer_id, "pinned" if pin else "not pinned", len(candidates),
        )

    async def _join_learner(self, learner: PeerAddr) -> JoinResponse:
        try:
            await self.node.connect(learner)
        except DialError as exc:
            raise JoinError(f"the learner of run {self.cfg.run_id!r} is unreachable: {exc}") from None
        with trio.fail_after(30):
            join = await rpc.call(
                self.node,
                learner.peer_id,
                rpc.JOIN,
                JoinRequest(run_id=self.cfg.run_id, peer_id=self.node.peer_id, data_host=self.data.host, data_port=self.data.port),
                JoinResponse,
            )
        if join.spec.run_id != self.cfg.run_id or join.spec.learner_peer_id != learner.peer_id:
            raise JoinError(f"learner {learner.peer_id} answered with a spec for another run or learner")
        return join

    # -- weights ---------------------------------------------------------------------------------

    async def _status(self) -> Target:
        assert self.learner is not None
        with trio.fail_after(15):
            status = await rpc.call(
                self.node, self.learner.peer_id, rpc.STATUS, StatusRequest(run_id=self.cfg.run_id), StatusResponse
            )
        self._last_contact = trio.current_time()
        target = Target(status.version, status.weights_size, status.weights_sha256, status.demand_groups)
        self._offer(target)
        return target

    async def _refresh(self, target: Target | None = None) -> None:
        """Bring the engine to `target` (default: the learner's newest version) before the next
        batch: pull mode's on-policy refresh, and the initial weights."""
        assert self.engine is not None
        target = target or await self._status()
        if target.version > self._blob_version:
            await self._fetch(target)
        await trio.to_thread.run_sync(self._load_pending)

    async def _fetch(self, target: Target) -> None:
        """Fetch and verify `target`, then leave it for the engine to take (`_take_pending`)."""
        t0 = time.monotonic()
        with trio.fail_after(FETCH_TIMEOUT_S):
            blob: bytes | memoryview | None = await self._fetch_delta(target)
            delta = blob is not None
            if blob is None:
                blob = await self._nursery_start(target, FULL)
        self._hand_over(blob, target.version)
        if self.metrics is not None:
            self.metrics.write({"event": "installed", "version": target.version, "wall": time.time(), "bytes": target.size,
                                "fetch_s": round(time.monotonic() - t0, 4), "delta": delta})

    def _hand_over(self, blob: bytes | memoryview, version: int) -> None:
        """Verified weights become the delta base and wait for the engine (`_take_pending`)."""
        self._blob, self._blob_version = blob, version
        with self._pending_lock:
            self._pending = (blob, version)
        log.debug("version %d verified", version)

    def _take_pending(self) -> tuple[bytes | memoryview, int] | None:
        """The engine's swap hook (runs in the generation thread): newer verified weights, once."""
        assert self.engine is not None
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None or pending[1] <= self.engine.version:
            return None
        return pending

    def _load_pending(self) -> None:
        """Swap in waiting weights between batches. The version goes live only with every piece
        verified, and the load happens in the thread that generates, so no forward pass ever
        sees half-loaded weights."""
        assert self.engine is not None
        pending = self._take_pending()
        if pending is not None:
            self.engine.load_weights(*pending)

    async def _fetch_delta(self, target: Target) -> bytes | None:
        """The new weights via a delta against the newest ones we hold, if the learner offers one."""
        base = self._blob_version
        behind = target.version - base
        # The learner keeps (and cuts deltas against) its last keep_versions versions.
        if self._blob is None or not 0 < behind < self.cfg.net.keep_versions or target.version < self._delta_from:
            return None
        try:
            delta = await self._nursery_start(target, base)
        except Unavailable:
            # Deltas do not pay now (fp32 weights early in training) or our base is too old;
            # either way full snapshots for a while, and no round trip per version to learn it.
            self._delta_from = target.version + DELTA_BACKOFF_VERSIONS
            return None
        blob = await trio.to_thread.run_sync(partial(decode_delta, delta, self._blob, max_size=target.size))
        if await trio.to_thread.run_sync(payload_digest, blob) != target.sha256:
            raise RemoteProtocolError(f"delta for version {target.version} decodes to the wrong weights")
        self.deltas_used += 1
        return blob

    async def _nursery_start(self, target: Target, base: int) -> memoryview:
        assert self._nursery is not None
        payload: memoryview = await self._nursery.start(self._serve_version, target, base)
        return payload

    async def _serve_version(
        self, target: Target, base: int, *, task_status: trio.TaskStatus[memoryview] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Fetch `target` (full, or a delta on `base`) from the swarm, then keep relaying it
        until it is K versions old."""
        assert self._join is not None and self.learner is not None
        # The handshake runs outside the links' nursery, so its errors (Unavailable, a bad
        # manifest) reach the caller as themselves, not wrapped in an exception group.
        manifest, stream = await open_version(
            self.data,
            learner_id=self.learner.peer_id,
            host=self._join.data_host,
            port=self._join.data_port,
            version=target.version,
            base=base,
            weights_sha256=target.sha256,
        )
        served = False
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as links:
                    payload, receiver = await receive_version(self.data, links, manifest, stream, learner_id=self.learner.peer_id)
                    self._note_reachability(receiver.reachable)
                    self.served.add(target.version, scope)
                    served = True
                    task_status.started(payload)
                    await trio.sleep_forever()
        finally:
            if not served:  # abandoned before it verified: stop routing peers to it
                self.data.unregister(target.version)

    def _note_reachability(self, reachable: bool) -> None:
        """Tell the volunteer, once per change, whether other peers can fetch weights from it."""
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if self.metrics is not None:
            self.metrics.write({"event": "reachability", "relay": reachable, "wall": time.time()})
        if reachable:
            log.info("the learner reached this peer's data port %s:%d: other peers fetch weights from it", self.data.host, self.data.port)
        else:
            log.warning(
                "the learner could not dial this peer's data port %s:%d back: it downloads and contributes, but relays "
                "only over links it opens itself (behind a NAT, forward TCP port %d and pass --advertise-host "
                "PUBLIC_ADDRESS --data-port %d to help the swarm)", self.data.host, self.data.port, self.data.port, self.data.port,
            )

    def _validate_announce(self, forwarder: str, origin: str, data: bytes) -> bool:
        assert self.spec is not None
        try:
            msg, _ = open_envelope(data, expected_kind=VersionAnnounce, expected_sender=self.spec.learner_peer_id)
        except RemoteProtocolError as exc:
            log.warning("ignored a version announcement from %s: %s", origin, exc)
            return False
        return msg.run_id == self.cfg.run_id

    def _offer(self, target: Target) -> None:
        if self._newest is None or target.version >= self._newest.version:
            self._demand = target.demand_groups
        if self._newest is None or target.version > self._newest.version:
            self._newest = target
            self._new_version.set()
            self._new_version = trio.Event()

    async def _follow_announcements(self) -> None:
        async for item in self.node.messages(versions_topic(self.cfg.run_id)):
            msg, _ = open_envelope(item.data, expected_kind=VersionAnnounce)
            self._offer(Target(msg.version, msg.size, msg.sha256, msg.demand_groups))

    async def _poll_status(self) -> None:
        while True:
            await trio.sleep(STATUS_INTERVAL_S)
            try:
                self._offer(await self._status())
            except Exception as exc:
                log.warning("status check with the learner failed: %s", exc)
                self._check_learner_alive()

    def _check_learner_alive(self) -> None:
        if trio.current_time() - self._last_contact > self.cfg.net.join_deadline_s:
            raise JoinError(f"lost the learner: no answer for {self.cfg.net.join_deadline_s:g}s")

    # -- generation ------------------------------------------------------------------------------

    async def _generate_forever(self) -> None:
        assert self.spec is not None and self.policy is not None and self.engine is not None
        while True:
            if self.spec.sync_mode == "pull":
                try:
                    await self._refresh()  # Echo's sequential pull: newest weights, every batch
                except REFRESH_ERRORS as exc:
                    await self._refresh_failed(exc)
                    continue
            else:
                await trio.to_thread.run_sync(self._load_pending)
            self._track_version()
            left = self._demand - self._produced
            if left <= 0:
                await self._wait_for_version()
                continue
            prompts = self.policy.task.sample_prompts(min(left, self.cfg.rollout.groups_per_batch), self.rng)
            version = self.engine.version
            groups = await trio.to_thread.run_sync(self._generate, prompts)
            if self.engine.version != version:
                self.swaps_mid_generation += 1
            self._track_version()  # a batch that ended on new weights counts toward the new version
            self._produced += len(groups)
            await self._publish(groups)

    def _track_version(self) -> None:
        """The learner's demand is per version: the count starts over when a newer version is
        announced (async samples on while fetching it) or loaded."""
        assert self.engine is not None
        current = max(self.engine.version, -1 if self._newest is None else self._newest.version)
        if current != self._produced_version:
            self._produced_version, self._produced = current, 0

    async def _fetch_newest(self) -> None:
        """async mode: fetch every newer version as it is announced, while generation goes on."""
        while True:
            if self._newest is None or self._newest.version <= self._blob_version:
                await self._new_version.wait()
                continue
            try:
                await self._fetch(self._newest)
            except REFRESH_ERRORS as exc:
                await self._refresh_failed(exc)

    async def _refresh_failed(self, exc: BaseException) -> None:
        log.warning("weight refresh failed: %s; retrying", exc)
        self._check_learner_alive()
        await trio.sleep(1.0)

    async def _wait_for_version(self) -> None:
        """The learner's demand for this version is met: wait for the next one to be announced.

        async: the peer then samples at once, on the weights it has, while the new ones are
        fetched; they are swapped in mid-batch when they verify (waiting for them instead left
        the learner idle 5% of the time once its step got fast). pull: the loop's refresh
        fetches them before the next batch.
        """
        assert self.engine is not None
        ready = self._new_version
        if self._newest is not None and self._newest.version > self._produced_version:
            return
        with trio.move_on_after(DEMAND_WAIT_S) as waited:
            await ready.wait()
        if waited.cancelled_caught:
            self._produced = max(0, self._demand - self.cfg.rollout.groups_per_batch)

    def _generate(self, prompts: list[str]) -> list[ScoredGroup]:
        assert self.spec is not None and self.policy is not None and self.engine is not None
        s = self.spec.sampling
        return generate_groups(
            self.engine,
            self.policy.tokenizer,
            self.policy.task,
            prompts,
            group_size=self.spec.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=self.rng.getrandbits(31),
            swap=self._take_pending if self.spec.sync_mode == "async" else None,
            max_new_tokens=s.max_new_tokens,  # the learner refuses longer completions
        )

    async def _publish(self, scored: list[ScoredGroup]) -> None:
        """One generation batch's groups as few signed gossip messages as fit (one, on the
        default task), each kept for gap repair under its seq."""
        tag = f"{self.node.peer_id[-8:]}-{self.seq}"
        groups = [rollout_group(g, group_id=f"{tag}.{i}") for i, g in enumerate(scored)]
        for chunk in pack_groups(groups):
            batch = RolloutBatch(run_id=self.cfg.run_id, peer_id=self.node.peer_id, seq=self.seq, groups=chunk)
            try:
                envelope = seal(batch, self.identity)
            except LocalProtocolError as exc:
                # Only a lone group can overflow a frame (pack_groups keeps batches well under
                # one): drop it, counted and logged, without using up a seq the learner would
                # then ask for in vain.
                self.unsendable_groups += len(chunk)
                log.warning("dropped %d rollout group(s) too big for one gossip message: %s", len(chunk), exc)
                continue
            self.history[self.seq] = envelope
            while len(self.history) > self.cfg.net.repair_history:
                self.history.popitem(last=False)
            self.seq += 1
            await self.node.publish(rollouts_topic(self.cfg.run_id), envelope)
            self.published_groups += len(chunk)
        if self.first_publish_s is None and self.published_groups:
            self.first_publish_s = time.monotonic() - self._t0
            log.info("first rollouts published %.2fs after start", self.first_publish_s)

    # -- gap repair ------------------------------------------------------------------------------

    async def _serve_repair(self, stream: Any) -> None:
        with trio.move_on_after(30):
            await rpc.serve_one(stream, self._on_repair, on_bad=lambda p, e: log.warning("bad repair request from %s: %s", p, e))

    async def _on_repair(self, request: Any, remote: str) -> RepairResponse:
        if not isinstance(request, RepairRequest) or request.run_id != self.cfg.run_id:
            raise RemoteProtocolError("not a repair request for this run")
        found = [self.history[s] for s in request.seqs if s in self.history]
        unavailable = [s for s in request.seqs if s not in self.history]
        return pack_repair_response(found, unavailable=unavailable)

