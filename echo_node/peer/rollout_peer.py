"""A rollout peer: joins a run, keeps its weights current, generates, scores and publishes.

Services, each in the peer's nursery:
- `join_run` returns the `Session`: what joining gave the peer (the learner, the run spec, the
  learner's data address, the policy and engine built from the spec). It joins only a pinned
  learner (RUN_ID@PEER_ID), or, without a pin, the only provider of the run that answers a status
  request for it: with several, it joins none and says how to pin one. `rejoin` joins the same
  learner again after it restarted or stopped answering: its address, data port and epoch may
  change, nothing else may (another config is an error, not something to follow).
- `WeightFollower` (echo_node/peer/weight_follower.py): weights from the learner to the engine,
  in pull or async mode.
- `Generator`: samples what the learner asks for per version (flow control), on the prompts and
  seed the run assigns each batch (protocol/assignment.py), scores it, and hands each batch to
  the `RolloutPublisher`.
- `RolloutPublisher`: one signed `RolloutBatch` per generation batch, under the sequence number
  its prompts were assigned for; the last `net.repair_history` (at least the wire's
  REPAIR_KEEP) are kept to answer the learner's gap-repair requests.

In async mode a completion carries the versions of its tokens (weights swap in
mid-generation, AReaL / PipelineRL): the learner judges it by its oldest token against S and
corrects every token by its own behaviour log-prob.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio

from echo_node import offload
from echo_node.config import RunConfig
from echo_node.durable import replace_durable
from echo_node.envs import EnvSpec, peer_env
from echo_node.envs.bounded import ENV_UNAVAILABLE, hung_threads
from echo_node.envs.format import episode_format
from echo_node.envs.peer import PlayedBatch, play_batch
from echo_node.metrics import MetricsWriter
from echo_node.ml.engine import Engine, GenerationCancelled, SwapHook, WeightState
from echo_node.ml.rollout import ScoredGroup, generate_groups
from echo_node.net import rpc
from echo_node.net.discovery import (
    Backoff,
    DialError,
    JoinError,
    PeerAddr,
    Probe,
    check_first_learner_allowed,
    connect_bootstrap,
    find_providers,
    find_sole_learner,
    on_loopback,
)
from echo_node.net.p2p import P2PNode, listen_host, p2p_settings, provider_key
from echo_node.net.transport import TCP, DataNet, Host
from echo_node.peer.weight_follower import REFRESH_ERRORS, WeightFollower
from echo_node.policy import Policy, build_engine, peer_policy
from echo_node.prom import run_exporter
from echo_node.topics import rollouts_topic
from echo_node.weights.broadcast import DataServer
from protocol.assignment import batch_seed, groups_that_fit, prompt_draw
from protocol.envelope import seal
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.episodes import EpisodeBatch
from protocol.identity import Identity
from protocol.limits import MAX_FRAME_BYTES
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
    pack_groups,
    pack_repair_response,
    worst_group_bytes,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# A peer that met the learner's demand for its version waits this long for the next version,
# then samples one more batch anyway: an announcement may have been lost, and a learner short of
# data must never wait on peers that wait on it.
DEMAND_WAIT_S = 3.0
# async: a peer whose weights are too old to make admissible rollouts looks for newer ones this often.
WEIGHTS_POLL_S = 0.05
# A peer whose environment had no free thread for any group of a batch (every thread pinned by
# hung calls, echo_node/envs/bounded.py) plays again after this pause, doubled while it lasts
# up to ENV_BACKOFF_MAX_S: hung calls end on their own time, and a batch tried meanwhile costs
# nothing but its count.
ENV_BACKOFF_S = 1.0
ENV_BACKOFF_MAX_S = 60.0
# A volunteer's status line in the log comes this often.
STATUS_LINE_S = 30.0
# An unpinned peer asks each provider of the run for its status before joining any, within this.
PROBE_S = 10.0
# A learner refuses strangers' status requests past a rate limit (after checking the run id):
# asked again after these pauses, then counted as answering for the run, since it may be the
# learner (an impostor that floods it must not make it look absent).
RATE_LIMITED_RETRIES_S = (0.5, 1.0, 2.0)


@dataclass(slots=True)
class Session:
    """What joining a run gave this peer. `rejoin` updates the learner's address, data address
    and the spec's epoch and current version; the learner's identity and the run's config stay."""

    learner: PeerAddr
    spec: RunSpec
    data_host: str
    data_port: int
    policy: Policy
    engine: Engine
    # The run's environment (its spec's task is an environment id): the peer plays episodes.
    env: EnvSpec | None = None
    # Where the learner said this peer's seqs go on (JoinResponse.seq_from; 0: from its own base).
    seq_from: int = 0


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


async def join_run(cfg: RunConfig, node: Host, data: DataServer) -> Session:
    """Find the run's learner, join it, and build the policy its spec describes."""
    net = cfg.net
    pin = net.learner
    first_learner = pin is None and net.insecure_first_learner
    if first_learner:
        check_first_learner_allowed(net.bootstrap)
    backoff = Backoff(net.backoff_initial_s, net.backoff_max_s)
    deadline = trio.current_time() + net.join_deadline_s
    await connect_bootstrap(node, net.bootstrap, deadline_s=net.join_deadline_s, backoff=backoff)
    delays = backoff.delays()
    while True:
        left = max(0.0, deadline - trio.current_time())
        if pin is None and not first_learner:
            # Nothing is joined before exactly one provider answers for the run (discovery.py).
            probe = partial(_probe_learner, cfg, node)
            candidates = [await find_sole_learner(node, provider_key(cfg.run_id), run_id=cfg.run_id, deadline_s=left, probe=probe, backoff=backoff)]
        else:
            candidates = await find_providers(
                node, provider_key(cfg.run_id), what=f"learner for run {cfg.run_id!r}", deadline_s=left, backoff=backoff, pin=pin,
            )
        # A learner is taken only if its join response (on a stream authenticated to its peer
        # id) is for this run and names itself as the run's learner.
        failures: list[str] = []
        for learner in candidates:
            if first_learner and not on_loopback(learner):
                failures.append(f"{learner.peer_id}: not on loopback (--insecure-first-learner joins loopback learners only)")
                continue
            try:
                join = await _join_learner(cfg, node, data, learner)
            except (JoinError, rpc.RequestFailed, RemoteProtocolError, trio.TooSlowError) as exc:
                log.info("learner candidate %s refused: %s", learner.peer_id, exc)
                failures.append(f"{learner.peer_id}: {exc}")
                continue
            break
        else:
            # A record may name a learner that restarted elsewhere since: its new record comes
            # with its start. Looked up again until the deadline.
            delay = next(delays)
            if trio.current_time() + delay >= deadline:
                raise JoinError(f"no learner of run {cfg.run_id!r} took this peer: " + "; ".join(failures))
            await trio.sleep(delay)
            continue
        break
    if pin is None:
        log.warning("joined run %s without a pin: to join only this learner next time, pass --run-id %s@%s",
                    cfg.run_id, cfg.run_id, learner.peer_id)
    policy = await offload.run_sync(peer_policy, dict(join.spec.model), dict(join.spec.tokenizer), join.spec.task, cfg)
    env = await offload.run_sync(peer_env, join.spec.task, cfg)
    if cfg.rollout.engine == "vllm":
        from echo_node.ml.vllm_engine import check_sampling

        # Refused at join, in one line, rather than on every batch (vllm_engine.py says why).
        s = join.spec.sampling
        check_sampling([[0]], max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
    engine = await offload.run_sync(build_engine, policy, cfg)
    engine.version = -1
    spec = join.spec
    log.info(
        "joined run %s (mode %s, S=%d) via learner %s (%s)", cfg.run_id, spec.sync_mode, spec.staleness, learner.peer_id,
        "pinned" if pin else "the first that answered: --insecure-first-learner" if first_learner else "the only one that answered",
    )
    return Session(learner, spec, join.data_host, join.data_port, policy, engine, env, seq_from=join.seq_from)


# What a restarted learner's spec may differ in from the one a peer joined.
SPEC_MAY_CHANGE = frozenset({"current_version", "epoch"})


def spec_changes(old: RunSpec, new: RunSpec) -> list[str]:
    """The fields a restarted learner's spec changed that a joined peer cannot follow."""
    names = [f.name for f in dataclasses.fields(RunSpec)]
    return [n for n, a, b in zip(names, old.to_wire(), new.to_wire()) if a != b and n not in SPEC_MAY_CHANGE]


async def rejoin(cfg: RunConfig, node: Host, data: DataServer, session: Session) -> None:
    """Find the session's learner again (the DHT, pinned to its peer id) and join it; the
    session takes its new addresses. JoinError while it cannot be found or refuses; ValueError
    if it now runs another config (this peer cannot follow that)."""
    net = cfg.net
    found = await find_providers(
        node, provider_key(cfg.run_id), what=f"learner {session.learner.peer_id}", deadline_s=min(30.0, net.join_deadline_s),
        backoff=Backoff(net.backoff_initial_s, net.backoff_max_s), pin=session.learner.peer_id,
    )
    try:
        join = await _join_learner(cfg, node, data, found[0])
    except JoinError:
        raise
    except Exception as exc:  # whatever the way there failed (py-libp2p's own errors too): not now
        raise JoinError(f"the learner did not take this peer again: {type(exc).__name__}: {exc}") from None
    changed = spec_changes(session.spec, join.spec)
    if changed:
        raise ValueError(f"the run's learner restarted with another config ({', '.join(changed)} changed): restart this peer to follow it")
    session.learner, session.spec = found[0], join.spec
    session.data_host, session.data_port, session.seq_from = join.data_host, join.data_port, join.seq_from


async def _probe_learner(cfg: RunConfig, node: Host, candidate: PeerAddr) -> Probe:
    """Whether `candidate` answers as the run's learner, asked without joining it: a status
    request from a peer that has not joined is no heartbeat and registers nothing (learner.py),
    and the stream is authenticated to the candidate's peer id, so an answer for this run is that
    peer's own claim."""
    try:
        with trio.fail_after(PROBE_S):
            await node.connect(candidate)
            return await _ask_status(cfg, node, candidate.peer_id)
    except trio.TooSlowError:
        return Probe(answers=False, why=f"no status answer within {PROBE_S:g}s")
    except Exception as exc:  # unreachable or bad bytes (py-libp2p's own errors too): no learner here
        return Probe(answers=False, why=f"{type(exc).__name__}: {exc}")


async def _ask_status(cfg: RunConfig, node: Host, peer_id: str) -> Probe:
    pauses = iter(RATE_LIMITED_RETRIES_S)
    while True:
        try:
            status = await rpc.call(node, peer_id, rpc.STATUS, StatusRequest(run_id=cfg.run_id), StatusResponse)
        except rpc.RequestFailed as exc:
            pause = next(pauses, None)
            if not str(exc).startswith("rate_limited:"):
                return Probe(answers=False, why=str(exc))
            if pause is None:
                return Probe(answers=True, why=str(exc))
            await trio.sleep(pause)
            continue
        if status.run_id != cfg.run_id:
            return Probe(answers=False, why=f"it answered for run {status.run_id!r}")
        return Probe(answers=True)


async def _join_learner(cfg: RunConfig, node: Host, data: DataServer, learner: PeerAddr) -> JoinResponse:
    try:
        await node.connect(learner)
    except DialError as exc:
        raise JoinError(f"the learner of run {cfg.run_id!r} is unreachable: {exc}") from None
    with trio.fail_after(30):
        join = await rpc.call(
            node,
            learner.peer_id,
            rpc.JOIN,
            JoinRequest(run_id=cfg.run_id, peer_id=node.peer_id, data_host=data.host, data_port=data.port),
            JoinResponse,
        )
    if join.spec.run_id != cfg.run_id or join.spec.learner_peer_id != learner.peer_id:
        raise JoinError(f"learner {learner.peer_id} answered with a spec for another run or learner")
    return join


class Generator:
    """Samples what the learner asks for, per version, and publishes it.

    Flow control: the learner asks each peer for `demand` groups per published version; the
    count of groups sampled starts over when a newer version is announced or loaded. Demand met,
    the peer waits for the next version, at most DEMAND_WAIT_S, then samples one more batch.
    """

    def __init__(self, cfg: RunConfig, session: Session, follower: WeightFollower, publisher: RolloutPublisher) -> None:
        self.cfg = cfg
        self.session = session
        self.spec = session.spec
        self.engine = session.engine
        self.follower = follower
        self.publisher = publisher
        # Groups sampled on the engine's current version.
        self.produced = 0
        self.produced_version = -1
        self.swaps_mid_generation = 0
        self.batches_abandoned = 0  # stopped mid-generation (a signal), never published
        self.waits_for_weights = 0  # batches not begun on weights the learner can no longer admit
        # Batches stopped or left unpublished because the learner announced a version past the
        # staleness bound of the weights they began on (`doomed`), and their groups.
        self.batches_doomed = 0
        self.groups_doomed = 0
        # Groups of episode batches the environment ended (env_error, env_timeout,
        # env_unavailable), by reason.
        self.env_dropped: Counter[str] = Counter()
        # The pause before the next batch while the environment has no free thread (0: it has).
        self.env_backoff_s = 0.0
        # Set when the batch being generated is to be abandoned (`stoppably`).
        self._stop: threading.Event | None = None

    async def run(self) -> None:
        follower = self.follower
        while True:
            if self.spec.sync_mode == "pull":
                try:
                    await follower.refresh()  # Echo's sequential pull: newest weights, every batch
                except REFRESH_ERRORS as exc:
                    await follower.refresh_failed(exc)
                    continue
            else:
                await offload.run_sync(follower.load_pending)
            self.track_version()
            if not follower.active:  # standby (the learner's capacity controller): follow, do not sample
                await follower.active_changed.wait()
                continue
            left = follower.demand - self.produced
            if left <= 0:
                await self.wait_for_version()
                continue
            if self.weights_too_old():  # what it would sample now is stale before it is sent
                self.waits_for_weights += 1
                await trio.sleep(WEIGHTS_POLL_S)
                continue
            version, seq = self.engine.version, self.publisher.seq
            if self.session.env is not None:
                await self.play(version, seq, min(left, self.cfg.rollout.groups_per_batch))
                continue
            prompts = self.assigned_prompts(seq, min(left, self.cfg.rollout.groups_per_batch))
            seed = batch_seed(self.spec.run_id, self.publisher.identity.peer_id, seq)
            groups = await self.stoppably(partial(self._generate, prompts, seed), len(prompts))
            if self.engine.version != version:
                self.swaps_mid_generation += 1
            self.track_version()  # a batch that ended on new weights counts toward the new version
            rebased = seq != self.publisher.seq
            if groups is None or self.doomed(version) or rebased:
                self.discard(version, len(prompts), rebased=rebased)
                continue
            self.produced += len(groups)
            await self.publisher.publish(groups, seq=seq)

    async def play(self, version: int, seq: int, groups: int) -> None:
        """One batch of episodes (a run with an environment), each group's seed its slot's
        draw (echo_node/envs/peer.py), published like a rollout batch under `seq`."""
        played = await self.stoppably(partial(self._play, seq, groups), groups)
        if self.engine.version != version:
            self.swaps_mid_generation += 1
        self.track_version()
        rebased = seq != self.publisher.seq
        if played is None or self.doomed(version) or rebased:
            self.discard(version, groups, rebased=rebased)
            return
        for reason, n in played.dropped.items():
            self.env_dropped[reason] += n
        if played.dropped and self.publisher.metrics is not None:
            self.publisher.metrics.write({"event": "env_dropped", "groups": dict(played.dropped), "seq": seq, "wall": time.time()})
        if played.batch is None or played.frame is None:
            # Every group failed in the environment: counted, and nothing is sent (the seq is
            # not used, so the learner sees no gap). The same seq on the same version draws the
            # same seeds, so the next try waits for a new version (DEMAND_WAIT_S at most), or
            # backs off while the environment has no free thread.
            if set(played.dropped) == {ENV_UNAVAILABLE}:
                await self.env_unavailable()
                return
            log.info("no group of a batch survived its environment: %s", dict(played.dropped))
            self.env_available()
            await self.wait_for_version()
            return
        self.env_available()
        self.produced += len(played.batch.groups)
        await self.publisher.publish_episodes(played.batch, played.frame, seq=seq)

    async def env_unavailable(self) -> None:
        """Every group of a batch found no environment thread: stop playing for a while, the
        pause doubling while it lasts (ENV_BACKOFF_S .. ENV_BACKOFF_MAX_S), one WARNING a
        spell. The peer keeps running: it follows weights and answers repairs meanwhile."""
        if not self.env_backoff_s:
            log.warning("every environment thread of this peer is taken by hung calls (%d): playing no episodes until "
                        "they end (trying again after %gs, then less often)", hung_threads(), ENV_BACKOFF_S)
        self.env_backoff_s = min(ENV_BACKOFF_MAX_S, 2 * self.env_backoff_s or ENV_BACKOFF_S)
        await trio.sleep(self.env_backoff_s)

    def env_available(self) -> None:
        """A batch found environment threads: the back-off (if any) is over."""
        if self.env_backoff_s:
            log.info("environment threads are free again: playing episodes")
        self.env_backoff_s = 0.0

    def assigned_prompts(self, seq: int, wanted: int) -> list[str]:
        """The prompts of the batch to be published under `seq` (protocol/assignment.py), as
        many as are wanted and always fit one message."""
        task, tokenizer = self.session.policy.task, self.session.policy.tokenizer
        peer = self.publisher.identity.peer_id
        prompts = [task.prompt_for(prompt_draw(self.spec.run_id, peer, seq, i)) for i in range(wanted)]
        longest = max(len(tokenizer.encode_prompt(p)) for p in prompts)
        worst = worst_group_bytes(group_size=self.spec.group_size, prompt_tokens=longest, max_new_tokens=self.spec.sampling.max_new_tokens)
        return prompts[: groups_that_fit(worst)]

    def weights_too_old(self) -> bool:
        """Whether a batch begun now would be `doomed` from its start: the peer waits for newer
        weights (being fetched) instead of wasting them."""
        return self.doomed(self.engine.version)

    def doomed(self, began: int) -> bool:
        """Whether a batch begun on version `began` cannot be admitted however it ends. Read from
        the generation thread between decoding steps too.
        - Any mode: `began` is above the newest version the learner announced. Only a learner
          that restarted without its history (its new epoch numbers versions from below) does
          that, and to it those tokens name versions it never published: `future_version`, a
          ban of this peer. So weights of a lost history are never sampled from or sent.
        - async: a rollout is judged by its oldest token, and the learner's version is at least
          the newest it announced, so weights older than that minus S make only stale rollouts."""
        newest = self.follower.newest
        if newest is None:
            return False
        if began > newest.version:
            return True
        return self.spec.sync_mode == "async" and began < newest.version - self.spec.staleness

    def discard(self, began: int, groups: int, *, rebased: bool = False) -> None:
        """A doomed batch is not sent (the learner would drop it as stale, or ban this peer for a
        version it never announced), nor one begun for a seq a join has since moved this
        publisher off (`rebased`: RolloutPublisher.rebase): counted here, in the peer's
        metrics. Its seq is not used, so the learner sees no gap."""
        self.batches_doomed += 1
        self.groups_doomed += groups
        newest = self.follower.newest
        reason = "rebased" if rebased else "unannounced" if newest is not None and began > newest.version else "stale"
        log.debug("discarded a batch of %d groups begun on version %d (%s): the learner announced %s", groups, began,
                  reason, None if newest is None else newest.version)
        if self.publisher.metrics is not None:
            self.publisher.metrics.write({"event": "discarded", "reason": reason, "groups": groups, "version": began,
                                          "newest": None if newest is None else newest.version, "wall": time.time()})

    def track_version(self) -> None:
        """The learner's demand is per version: the count starts over when a newer version is
        announced (async samples on while fetching it) or loaded."""
        newest = self.follower.newest
        current = max(self.engine.version, -1 if newest is None else newest.version)
        if current != self.produced_version:
            self.produced_version, self.produced = current, 0

    async def wait_for_version(self) -> None:
        """The learner's demand for this version is met: wait for the next one to be announced.

        async: the peer then samples at once, on the weights it has, while the new ones are
        fetched; they are swapped in mid-batch when they verify (waiting for them instead idled
        the learner). pull: the loop's refresh fetches them before the next batch.
        """
        follower = self.follower
        ready = follower.new_version
        if follower.newest is not None and follower.newest.version > self.produced_version:
            return
        with trio.move_on_after(DEMAND_WAIT_S) as waited:
            await ready.wait()
        if waited.cancelled_caught:
            self.produced = max(0, follower.demand - self.cfg.rollout.groups_per_batch)

    async def stoppably(self, work: Callable[[], T], groups: int) -> T | None:
        """`work` (`_generate` or `_play` of a batch of `groups` groups) in a worker thread that a
        cancellation (SIGTERM, SIGINT) stops at the next decoding step instead of after the whole
        batch: with a real model on a busy CPU a batch takes tens of seconds, and a peer asked to
        stop must go in a few. An abandoned batch is counted and never published (its tokens
        were not all sampled). None: the batch became `doomed` and was stopped between two
        decoding steps."""
        stop = self._stop = threading.Event()

        async def stop_when_cancelled(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                stop.set()

        async with trio.open_nursery() as nursery:
            await nursery.start(stop_when_cancelled)
            try:
                # Not abandoned on cancel: the thread holds the engine, and the process must not
                # exit (or start another batch) while it still runs; it ends at the next step.
                return await offload.run_sync(work)
            except DoomedBatch:
                return None
            except GenerationCancelled:
                self.batches_abandoned += 1
                log.info("stopping: abandoned a batch of %d groups mid-generation (not published; %d so far)",
                         groups, self.batches_abandoned)
                await trio.lowlevel.checkpoint()  # the cancellation that set `stop` is raised here
                raise  # `stop` is set only by a cancellation, so this is not reached
            finally:
                nursery.cancel_scope.cancel()

    def _swap_hook(self) -> SwapHook | None:
        """The engine's hook before each decoding step of a batch begun now: stop, or new
        weights (async)."""
        stop = self._stop
        take = self.follower.take_pending if self.spec.sync_mode == "async" else None
        began = self.engine.version

        def between_steps() -> tuple[WeightState, int] | None:
            if stop is not None and stop.is_set():
                raise GenerationCancelled
            if self.doomed(began):
                raise DoomedBatch
            return None if take is None else take()

        # vLLM generates in chunks when given a hook; a pull batch on a GPU is short enough to
        # finish, so it gets none (its async hook still stops it between chunks).
        return take if stop is None or (take is None and self.cfg.rollout.engine == "vllm") else between_steps

    def _play(self, seq: int, groups: int) -> PlayedBatch:
        """One batch of episodes, in a worker thread."""
        assert self.session.env is not None
        s = self.spec.sampling
        return play_batch(
            self.engine, episode_format(self.session.policy.tokenizer), self.session.env, run_id=self.spec.run_id,
            identity=self.publisher.identity, seq=seq, groups=groups, group_size=self.spec.group_size,
            temperature=s.temperature, top_p=s.top_p, swap=self._swap_hook(),
        )

    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        """One batch, in a worker thread (subclasses in benchmarks/attackers.py wrap it)."""
        s = self.spec.sampling
        policy = self.session.policy
        swap = self._swap_hook()
        return generate_groups(
            self.engine,
            policy.tokenizer,
            policy.task,
            prompts,
            group_size=self.spec.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=seed,
            swap=swap,
            max_new_tokens=s.max_new_tokens,  # the learner refuses longer completions
        )


class DoomedBatch(GenerationCancelled):
    """Raised by the engine's hook: the batch is `Generator.doomed`, stop sampling it."""


# Sequence numbers reserved on disk at a time (one small durable write per this many batches).
SEQ_BLOCK = 1 << 16


class SeqReservation:
    """A publisher never reuses a sequence number the learner may have seen, across its restarts
    too: a restarted peer keeps its key (and peer id), and the learner would take reused numbers
    for duplicates of messages it has seen. Once joined, a publisher the learner knows goes on at
    the seq the learner names (`RolloutPublisher.rebase`); until then, and for a learner that
    never saw it, numbers are reserved in blocks in a file next to the peer's metrics, and the
    first one after a start is the larger of the wall clock in ms and the reservation's end (the
    clock alone fails when it steps back)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            reserved = int(path.read_text().strip())
        except (OSError, ValueError):
            reserved = 0
        self.first = max(time.time_ns() // 1_000_000, reserved)
        self.until = self.first
        self.reserve(self.first)

    def reserve(self, seq: int) -> None:
        """Make sure `seq` is reserved before it is used."""
        if seq < self.until:
            return
        self.until = seq + SEQ_BLOCK
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_durable(self.path, str(self.until).encode())
        except OSError as exc:  # the clock still makes reuse unlikely: worth a warning, not a stop
            log.warning("could not reserve sequence numbers in %s: %s", self.path, exc)


class RolloutPublisher:
    """Signs and gossips rollout batches, one seq each, and answers gap repair from its history."""

    def __init__(self, cfg: RunConfig, identity: Identity, node: Host, *, metrics: MetricsWriter | None = None) -> None:
        self.cfg = cfg
        self.identity = identity
        self.node = node
        self.reservation = SeqReservation(cfg.run_dir / "peers" / f"{identity.peer_id}.seq")
        self.seq = self.reservation.first
        # The lowest seq this process numbers from: below it, a seq missing from the history may
        # be an earlier process's, which this one cannot vouch for either way (`_on_repair`).
        self.numbered_from = self.seq
        self.metrics = metrics
        self.history: OrderedDict[int, bytes] = OrderedDict()
        self.published_groups = 0
        self.published_rollouts = 0
        self.unsendable_groups = 0  # too big for a gossip frame even alone: dropped, logged
        self.first_publish_s: float | None = None
        self._t0 = time.monotonic()

    def rebase(self, seq: int) -> None:
        """Go on at `seq`, the one the learner named at a join (JoinResponse.seq_from; 0: keep
        this publisher's own numbering): right after the highest seq it saw from this peer, so
        whatever this peer published above that, the learner never had. A batch begun for
        another seq is not sent (Generator.discard)."""
        if seq <= 0 or seq == self.seq:
            return
        log.info("the learner saw this peer's seqs up to %d: going on at %d (was at %d)", seq - 1, seq, self.seq)
        for old in [s for s in self.history if s >= seq]:  # what the learner never had: new batches take their seqs
            del self.history[old]
        # From `seq` on this process numbers its batches; what it published below that is still its own.
        self.numbered_from = seq if self.published_groups == 0 else min(self.numbered_from, seq)
        self.seq = seq
        self.reservation.reserve(seq)

    async def publish(self, scored: list[ScoredGroup], *, seq: int) -> None:
        """One generation batch's groups as one signed gossip message under `seq` (the seq its
        prompts were assigned for: the next one), kept for gap repair."""
        tag = f"{self.identity.peer_id[-8:]}-{seq}"
        await self.publish_groups(tuple(rollout_group(g, group_id=f"{tag}.{i}") for i, g in enumerate(scored)), seq=seq)

    async def publish_groups(self, groups: tuple[RolloutGroup, ...], *, seq: int) -> None:
        if seq != self.seq:
            raise LocalProtocolError(f"batch sampled for seq {seq}, but the next seq is {self.seq}")
        try:
            if len(pack_groups(groups)) != 1:
                raise LocalProtocolError(f"{len(groups)} groups do not fit one rollout batch")
            envelope = seal(RolloutBatch(run_id=self.cfg.run_id, peer_id=self.identity.peer_id, seq=seq, groups=groups), self.identity)
        except LocalProtocolError as exc:
            # The generator plans batches to fit (Generator.assigned_prompts), so only a group
            # too big for a frame even alone gets here: dropped, counted and logged, without
            # using up a seq the learner would then ask for in vain.
            self.unsendable_groups += len(groups)
            log.warning("dropped %d rollout group(s) that do not fit one gossip message: %s", len(groups), exc)
            return
        await self._send(envelope, seq=seq, groups=len(groups), rollouts=sum(len(g.samples) for g in groups))

    async def publish_episodes(self, batch: EpisodeBatch, envelope: bytes, *, seq: int) -> None:
        """A batch of episodes, sealed by `play_batch` under `seq` (the next one), kept for gap
        repair like a rollout batch."""
        if seq != self.seq or batch.seq != seq:
            raise LocalProtocolError(f"episodes played for seq {batch.seq}, but the next seq is {self.seq}")
        if len(envelope) > MAX_FRAME_BYTES:
            # The budgets ([env]) bound an episode; a batch of many long ones may still not fit.
            self.unsendable_groups += len(batch.groups)
            log.warning("dropped %d episode group(s) that do not fit one gossip message (%d bytes)", len(batch.groups), len(envelope))
            return
        await self._send(envelope, seq=seq, groups=len(batch.groups), rollouts=batch.num_samples)

    async def _send(self, envelope: bytes, *, seq: int, groups: int, rollouts: int) -> None:
        self.history[seq] = envelope
        while len(self.history) > self.cfg.net.repair_history:
            self.history.popitem(last=False)
        self.seq += 1
        self.reservation.reserve(self.seq)
        await self.node.publish(rollouts_topic(self.cfg.run_id), envelope)
        self.published_groups += groups
        self.published_rollouts += rollouts
        if self.metrics is not None:
            self.metrics.write({"event": "published", "seq": seq, "groups": groups, "rollouts": rollouts, "wall": time.time()})
        if self.first_publish_s is None and self.published_groups:
            self.first_publish_s = time.monotonic() - self._t0
            log.info("first rollouts published %.2fs after start", self.first_publish_s)

    async def serve_repair(self, stream: Any, *, learner: str) -> None:
        """Answer one repair request, from the run's learner only: a response can be ~1000x
        the request, so anyone else asking would turn this peer into an amplifier."""
        with trio.move_on_after(30):
            await rpc.serve_one(
                stream, partial(self._on_repair, learner=learner),
                on_bad=lambda p, e: log.warning("bad repair request from %s: %s", p, e),
            )

    async def _on_repair(self, request: Any, remote: str, *, learner: str) -> RepairResponse:
        if remote != learner:
            raise rpc.RequestRefused("not_learner", "repair is served to the run's learner only")
        if not isinstance(request, RepairRequest) or request.run_id != self.cfg.run_id:
            raise RemoteProtocolError("not a repair request for this run")
        if request.peer_id != self.identity.peer_id:
            raise RemoteProtocolError(f"repair request for publisher {request.peer_id}, not this one")
        found = [self.history[s] for s in request.seqs if s in self.history]
        # Seqs from before this process started are neither: it cannot tell which of them it
        # published, and "unavailable" would say it never did (wire.md § 8). Left out, they are
        # given up as lost in the restart, within the learner's skip allowance.
        unavailable = [s for s in request.seqs if s not in self.history and s >= self.numbered_from]
        return pack_repair_response(found, unavailable=unavailable)


class RolloutPeer:
    """A volunteer's node: joins a run, then runs a `JoinedPeer`, built whole once joined."""

    # What samples and what publishes; the attack benchmarks swap in their own (benchmarks/attackers.py).
    generator_class: type[Generator] = Generator
    publisher_class: type[RolloutPublisher] = RolloutPublisher

    def __init__(self, cfg: RunConfig, identity: Identity, *, host: Host | None = None, data_net: DataNet = TCP) -> None:
        """`host` and `data_net`: the network (echo_node/net/transport.py; default: a libp2p host and TCP)."""
        self.cfg = cfg
        self.identity = identity
        self.node: Host = host or P2PNode(identity, p2p_settings(cfg.net))
        self.data = DataServer(
            identity, cfg.run_id, bind_host=listen_host(cfg.net.listen), advertise_host=self.node.advertise_host,
            port=cfg.net.data_port, ban_s=cfg.net.ban_s, net=data_net,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join, then follow, generate and publish until the run finishes (returns) or the task
        is cancelled; ready (`task_status.started`) once the first weights are installed."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.node.run)
            await nursery.start(self.data.run)
            session = await join_run(self.cfg, self.node, self.data)
            # Written only once joined: a join that fails leaves nothing behind.
            metrics = MetricsWriter(self.cfg.run_dir / "peers" / f"{self.node.peer_id}.jsonl")
            try:
                metrics.write({"event": "joined", "wall": time.time(), "peer": self.node.peer_id,
                               "addrs": self.node.addrs, "data": f"{self.data.host}:{self.data.port}"})
                joined = JoinedPeer(
                    self.cfg, self.identity, self.node, self.data, session, metrics,
                    publisher_class=self.publisher_class, generator_class=self.generator_class,
                )
                await joined.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # the run finished: the host and data server go too
            finally:
                metrics.close()


class JoinedPeer:
    """A rollout peer in a run, built once `join_run` returned: its publisher, weight follower
    and generator, its operator's view (status line, Prometheus snapshot), and the end of the run."""

    def __init__(
        self, cfg: RunConfig, identity: Identity, node: Host, data: DataServer, session: Session, metrics: MetricsWriter,
        *, publisher_class: type[RolloutPublisher] = RolloutPublisher, generator_class: type[Generator] = Generator,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.data = data
        self.session = session
        self.metrics = metrics
        self.publisher = publisher_class(cfg, identity, node, metrics=metrics)
        self.publisher.rebase(session.seq_from)
        self.follower = WeightFollower(
            cfg, node, data, session, metrics=metrics, rejoin=self.rejoin,
            versions_dir=cfg.run_dir / "peers" / f"{node.peer_id}.versions",
            device="cuda" if cfg.rollout.engine == "vllm" else str(session.policy.device),
        )
        self.generator = generator_class(cfg, session, self.follower, self.publisher)

    async def rejoin(self) -> None:
        """Join the session's learner again (`rejoin`) and go on at the seq it names."""
        await rejoin(self.cfg, self.node, self.data, self.session)
        self.publisher.rebase(self.session.seq_from)

    def snapshot(self) -> dict[str, Any]:
        """What this peer's operator sees (its Prometheus endpoint, its status line)."""
        f = self.follower
        return {
            "installed_version": f.installed_version,
            "rollouts_published": self.publisher.published_rollouts,
            "bytes_up": f.bytes_relayed(),
            "bytes_down": f.bytes_received(),
            "active": 1 if f.active else 0,
            "price_per_hour": self.cfg.rollout.price_per_hour,
            # Episode groups its environment ended (env_error, env_timeout, env_unavailable: in the metrics by reason).
            "episode_groups_dropped": sum(self.generator.env_dropped.values()),
        }

    async def _status_line(self) -> None:
        """A volunteer's view in the log, every STATUS_LINE_S: what it runs and what it gave."""
        while True:
            await trio.sleep(STATUS_LINE_S)
            s = self.snapshot()
            log.info(
                "version %d installed · %d rollouts published · %.1f MB up, %.1f MB down · %s",
                s["installed_version"], s["rollouts_published"], s["bytes_up"] / 1e6, s["bytes_down"] / 1e6,
                "active" if s["active"] else "standby (the learner has enough peers; following weights)",
            )

    async def _until_run_ends(self, scope: trio.CancelScope) -> None:
        """The learner said its run ended (RunEnded): "finished", leave with a summary line (the
        process exits 0); "stopped", wait for a restart (the follower stands this peer by and
        looks for the learner for net.learner_outage_s)."""
        follower, metrics = self.follower, self.metrics
        t0 = time.monotonic()
        while True:
            await follower.run_ended.wait()
            end = follower.ended
            assert end is not None
            if end.reason == "stopped":
                log.info("the learner stopped run %s at version %d: generating nothing, waiting up to %gs for it to come back",
                         end.run_id, end.version, self.cfg.net.learner_outage_s)
                metrics.write({"event": "run_stopped", "version": end.version, "epoch": end.epoch, "wall": time.time()})
                continue
            s = self.snapshot()
            log.info(
                "run %s finished at version %d: this peer published %d rollouts in %.0fs (version %d installed, "
                "%.1f MB down, %.1f MB up); leaving", end.run_id, end.version, s["rollouts_published"],
                time.monotonic() - t0, s["installed_version"], s["bytes_down"] / 1e6, s["bytes_up"] / 1e6,
            )
            metrics.write({"event": "run_finished", "version": end.version, "epoch": end.epoch, "wall": time.time(),
                           "rollouts_published": s["rollouts_published"]})
            scope.cancel()
            return

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve repairs, follow the weights, generate and publish until the run finishes
        (returns) or the task is cancelled; ready once the first weights are installed."""
        async with trio.open_nursery() as nursery:
            self.node.set_stream_handler(rpc.REPAIR, partial(self.publisher.serve_repair, learner=self.session.learner.peer_id))
            await nursery.start(self.follower.run)  # the initial weights, before the first token
            task_status.started()
            nursery.start_soon(self._status_line)
            nursery.start_soon(self._until_run_ends, nursery.cancel_scope)
            if self.cfg.net.metrics_port is not None:
                net = self.cfg.net
                await nursery.start(run_exporter, "peer", self.cfg.run_id, net.metrics_host, net.metrics_port, self.snapshot)
            await self.generator.run()

