"""A rollout peer's side of weight sync: learn of new versions, fetch and verify them, hand
them to the engine.

Sync modes (Echo):
- pull: before every generation batch the peer asks the learner for its newest version and
  refreshes if it is behind (`refresh`), so each batch is sampled from the current policy.
- async: new versions announced on the versions topic (or seen in a periodic status check, in
  case gossip lost one) are fetched in the background (`fetch_newest`), and a version that
  verified is swapped into the engine at its next decoding step (`take_pending`, the engine's
  swap hook), mid-generation.

Rules: a version goes live only with every piece verified against the learner's signed manifest
and the whole payload against the announced digest; a delta is asked for when the peer holds a
base the learner still keeps, and waited for at most as long as the last full snapshot took to
fetch (the learner may still be cutting it); after the learner said it has none, or was slower,
only full snapshots for `DELTA_BACKOFF_VERSIONS` versions. Each fetched version is served to
other peers (relayed) until it is `keep_versions` old.

Memory (docs/architecture.md, "Memory per parameter"): no weights are held as Python bytes.
A payload is assembled, piece by piece as each verifies, in a mapping of the `payloads` store;
a delta decodes into a mapping of the `decoded` store; the engine copies the weights out of the
mapping through zero-copy views. With a run folder these mappings are files
(runs/<id>/peers/<peer>.versions) whose pages are released once the version verified and again
once the engine loaded it, and at the start of every download, so what is kept costs page
cache, not this process's memory; relaying reads them back from the cache. A store holds what
is relayed (`keep_versions` payloads) and the newest verified weights (the delta base), each
the size of the learner's signed manifest; everything else is unlinked.

Learner restarts: every announcement and status answer names the learner's epoch. An older
epoch's is ignored; a newer epoch is followed at once (the peer re-joins it, and fetches its
newest version even if the number is not above the peer's newest); within an epoch a version
number announced with another digest than before is refused. A learner that stops answering is
looked for again (`reconnect`: the DHT, the same peer id, a new address maybe) with backoff for
`net.learner_outage_s`; the peer keeps its weights and keeps generating meanwhile.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from echo_node import offload
from echo_node.config import RunConfig
from echo_node.metrics import MetricsWriter
from echo_node.net import rpc
from echo_node.net.discovery import Backoff, JoinError
from echo_node.net.transport import Host, PeerAddr
from echo_node.topics import versions_topic
from echo_node.weights.broadcast import FULL, LINK_ERRORS, DataServer, Served
from echo_node.weights.fetch import Download, Unavailable, open_version, receive_version
from echo_node.weights.store import VersionStore
from protocol.envelope import open_envelope
from protocol.errors import RemoteProtocolError
from protocol.messages import RunEnded, RunSpec, StatusRequest, StatusResponse, VersionAnnounce
from protocol.weights.delta import decode_delta
from protocol.weights.manifest import payload_digest

log = logging.getLogger(__name__)

# A version that does not arrive (and verify) within this is abandoned and asked for again; one
# that gains no piece for STALL_ABANDON_S (its sources died or stopped sending) sooner.
FETCH_TIMEOUT_S = 60.0
STALL_ABANDON_S = 10.0


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside `group` that is not itself a group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class TransferAbandoned(Exception):
    """A weight download stopped making progress, or a newer epoch made it moot."""


# What a failed weight fetch looks like; the peer retries after a pause (by then a newer version
# may be the target: "unavailable" means the learner already stopped serving this one).
REFRESH_ERRORS = (*LINK_ERRORS, trio.TooSlowError, rpc.RequestFailed, RemoteProtocolError, Unavailable, TransferAbandoned)
# After the learner said it has no delta for a version, or was slower to deliver one than a
# full snapshot takes to fetch, ask only for full snapshots this long.
DELTA_BACKOFF_VERSIONS = 20
# The shortest wait for a delta (a fast link's full fetch is no measure of a handshake).
DELTA_WAIT_MIN_S = 5.0
# Status checks double as a liveness probe of the learner in async mode. Announcements are
# best effort and least reliable right after a (re)join (py-libp2p is still settling its gossip
# streams: a restarted peer's first ~30 s of announcements were seen to go missing in the soak),
# so for JOINED_FAST_S after one the status is asked every STATUS_FAST_S.
STATUS_INTERVAL_S = 5.0
STATUS_FAST_S = 1.0
JOINED_FAST_S = 30.0
# Version digests remembered per epoch (to refuse a number announced with another digest).
DIGESTS_KEPT = 256
# A failure this soon after the learner last answered is not taken for an outage.
CONTACT_FRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class Target:
    version: int
    size: int
    sha256: bytes
    demand_groups: int
    epoch: int


class Engine(Protocol):
    version: int

    def load_weights(self, blob: bytes | memoryview, version: int) -> None: ...


class Joined(Protocol):
    """What the follower needs of a peer's session: whom to ask, where its data channel is."""

    @property
    def learner(self) -> PeerAddr: ...

    @property
    def data_host(self) -> str: ...

    @property
    def data_port(self) -> int: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def spec(self) -> RunSpec: ...


class WeightFollower:
    def __init__(
        self, cfg: RunConfig, node: Host, data: DataServer, session: Joined, *, metrics: MetricsWriter | None = None,
        rejoin: Callable[[], Awaitable[None]] | None = None, versions_dir: Path | None = None, device: str = "",
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.data = data
        self.session = session
        self.engine = session.engine
        self.metrics = metrics
        self.served = Served(data, cfg.net.keep_versions)
        self._nursery: trio.Nursery | None = None
        # Received payloads (full or delta; relayed while served) and weights decoded from a
        # delta, as mappings (module docstring); files under `versions_dir` if given.
        self.payloads = VersionStore(versions_dir, suffix=".payload")
        self.decoded = VersionStore(versions_dir, suffix=".weights")
        # The newest verified weights this peer holds (running or about to be swapped in): the
        # base a delta applies to; `_blob_map` is the store mapping they are a view of.
        self._blob: bytes | memoryview | None = None
        self._blob_map: mmap.mmap | None = None
        self._blob_version = -1
        self._blob_sha: bytes | None = None
        self._blob_epoch = -1
        # The learner's epoch this peer follows, and the digests its versions were announced with.
        self.epoch = session.spec.epoch
        self._digests: OrderedDict[int, bytes] = OrderedDict()
        # Announcements taken note of in the current epoch (status answers not counted): shows
        # that the versions topic reaches this peer, in its `installed` records.
        self.announced = 0
        # Joins the learner again (its address and data port may have changed); None: cannot.
        self._rejoin = rejoin
        self._reconnecting = trio.Lock()
        self.reconnects = 0
        self.rejoin_wanted = trio.Event()
        self._joined_epoch = self.epoch
        self._joined_at = 0.0
        # Set when a newer epoch's version has a number not above the engine's: swap it anyway.
        self._epoch_reset = False
        # The download in flight (its target and cancel scope) and its receiver's progress:
        # (receiver, pieces missing, when that last changed).
        self._fetching: tuple[Target, trio.CancelScope] | None = None
        # How the last download went (handshake to verified; its pieces by how they came), for
        # the `installed` record.
        self._download: dict[str, object] = {}
        self._progress: tuple[Download, int, float] | None = None
        # Weight bytes sent to other peers: by receivers done relaying, and by those still at it.
        self._relayed_done = 0
        self._received_done = 0
        self._relaying: set[Download] = set()
        self._abandoned = ""
        # Verified weights waiting for the engine; taken by the generation thread between two
        # decoding steps (async) or before a batch, hence the lock.
        self._pending: tuple[bytes | memoryview, int] | None = None
        self._pending_lock = threading.Lock()
        # A version handed over whose pages are to be released once the engine runs it.
        self._release_after: int | None = None
        self._delta_from = 0
        self.deltas_used = 0
        # How long this peer's last full snapshot took to fetch (0: none yet).
        self._full_fetch_s = 0.0
        # The learner's capacity controller's word on this peer (its last status answer): False
        # means stand by, keep following weights, generate nothing. `active_changed` wakes a
        # generator waiting on standby.
        self.active = True
        self.active_changed = trio.Event()
        # Set when a version was verified and handed over: the next heartbeat goes at once.
        self._installed = trio.Event()
        # The device this peer's engine runs on, for the heartbeat.
        self.device = device
        # The newest version the learner told of, and its demand (groups per version).
        self.newest: Target | None = None
        self.demand = cfg.rollout.groups_per_batch
        # Set and replaced by `offer` on every newer version, so any number of tasks (the
        # background fetcher, the generation loop) can wait on the one current event.
        self.new_version = trio.Event()
        self._last_contact = 0.0
        # Whether the learner hands this peer out as a relay (it could dial our data port back).
        self.reachable: bool | None = None
        # The learner's word that its run ended (RunEnded on the versions topic), and an event
        # set (and replaced) each time one is taken (rollout_peer.py acts on it).
        self.ended: RunEnded | None = None
        self.run_ended = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The initial weights (before the first token is sampled), then follow the learner."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.node.subscribe(versions_topic(self.cfg.run_id), self._validate_announce)
            self._last_contact = self._joined_at = trio.current_time()
            nursery.start_soon(self._watch_transfers)
            while True:  # the learner may be restarting right now: its weights, once it is back
                try:
                    await self.refresh()
                    break
                except REFRESH_ERRORS as exc:
                    await self.refresh_failed(exc)
            task_status.started()
            nursery.start_soon(self._follow_announcements)
            nursery.start_soon(self._rejoin_on_new_epoch)
            if self.session.spec.sync_mode == "async":
                nursery.start_soon(self._poll_status)
                nursery.start_soon(self._fetch_newest)

    async def status(self) -> Target:
        with trio.fail_after(15):
            # The status poll is this peer's heartbeat: what it has installed, costs and runs on.
            heartbeat = StatusRequest(
                run_id=self.cfg.run_id, installed_version=self.installed_version,
                price_per_hour=float(self.cfg.rollout.price_per_hour), engine=self.cfg.rollout.engine, device=self.device,
            )
            status = await rpc.call(self.node, self.session.learner.peer_id, rpc.STATUS, heartbeat, StatusResponse)
        self._last_contact = trio.current_time()
        active = self.activated_by(status)
        if active != self.active:
            self.active = active
            log.info("the learner %s this peer", "activated" if active else "put on standby")
            self.active_changed.set()
            self.active_changed = trio.Event()
        target = Target(status.version, status.weights_size, status.weights_sha256, status.demand_groups, status.epoch)
        self.offer(target)
        return target

    async def refresh(self, target: Target | None = None) -> None:
        """Bring the engine to `target` (default: the learner's newest version) before the next
        batch: pull mode's on-policy refresh, and the initial weights."""
        target = target or await self.status()
        if self.needs(target):
            await self._fetch(target)
        await offload.run_sync(self.load_pending)

    def needs(self, target: Target) -> bool:
        """Whether this peer should move to `target`: a newer version, or a newer epoch's
        version whatever its number. A newer number for the weights it already holds (a
        publication whose bits did not change) is moved to without a transfer (`_fetch`), so
        the peer's rollouts carry the number the learner counts staleness by."""
        return target.version > self._blob_version or target.epoch > self._blob_epoch

    async def _fetch(self, target: Target) -> None:
        """Fetch and verify `target`, then leave it for the engine to take (`take_pending`).
        Nothing is handed over unless the whole version verified: an abandoned download leaves
        the engine on the weights it has."""
        t0 = time.monotonic()
        if self._blob is not None and target.sha256 == self._blob_sha:
            self._renumber(target)
            return
        self.release_pages()  # what relaying or the last install mapped in: back to the page cache
        self._download = {}
        got: tuple[memoryview, mmap.mmap] | None = None
        delta = False
        with trio.fail_after(FETCH_TIMEOUT_S), trio.CancelScope() as scope:
            self._fetching, self._progress = (target, scope), None
            try:
                got = await self._fetch_delta(target)
                delta = got is not None
                if got is None:
                    t_full = time.monotonic()
                    got = await self._nursery_start(target, FULL)
                    self._full_fetch_s = time.monotonic() - t_full
            finally:
                self._fetching = self._progress = None
        if got is None:
            raise TransferAbandoned(f"version {target.version}: {self._abandoned}")
        self._hand_over(got[0], target.version, got[1])
        self.release_pages()
        self._blob_sha, self._blob_epoch = target.sha256, target.epoch
        if self.metrics is not None:
            self.metrics.write({"event": "installed", "version": target.version, "wall": time.time(), "bytes": target.size,
                                "fetch_s": round(time.monotonic() - t0, 4), "delta": delta, "sha256": target.sha256.hex(),
                                "epoch": target.epoch, "announced": self.announced, "relayed_bytes": self.bytes_relayed(),
                                **self._download})

    def _renumber(self, target: Target) -> None:
        """`target` names the weights this peer holds (verified by their digest): they go on
        under its number and epoch, nothing fetched."""
        assert self._blob is not None
        self._hand_over(self._blob, target.version, self._blob_map)
        self._blob_epoch = target.epoch
        if self.metrics is not None:
            self.metrics.write({"event": "installed", "version": target.version, "wall": time.time(), "bytes": 0,
                                "fetch_s": 0.0, "delta": False, "renumbered": True, "sha256": target.sha256.hex(),
                                "epoch": target.epoch, "announced": self.announced, "relayed_bytes": self.bytes_relayed()})

    def _hand_over(self, blob: bytes | memoryview, version: int, blob_map: mmap.mmap | None = None) -> None:
        """Verified weights become the delta base and wait for the engine (`take_pending`)."""
        self._blob, self._blob_map, self._blob_version = blob, blob_map, version
        self._installed.set()
        with self._pending_lock:
            self._pending = (blob, version)
        self._release_after = version
        self._prune()
        log.debug("version %d verified", version)

    def _prune(self) -> None:
        """Unlink what is neither relayed (a payload of a served version) nor the delta base."""
        fetching = None if self._fetching is None else self._fetching[0].version
        for store in (self.payloads, self.decoded):
            for v in store.versions():
                buf = store.get(v)
                if buf is not self._blob_map and v != fetching and not (store is self.payloads and v in self.served):
                    store.drop(v)

    def release_pages(self) -> None:
        """Hand the pages of every stored mapping back to the page cache (file-backed stores;
        any thread: a mapping read or written meanwhile maps them again)."""
        self.payloads.release_all()
        self.decoded.release_all()
        if self._blob_map is not None:  # replaced in its store by a newer epoch's same number
            self.payloads.release_buffer(self._blob_map)

    def _release_if_loaded(self) -> None:
        """Once the engine runs the version handed over last, release its pages (it copied them)."""
        version = self._release_after
        if version is not None and self.engine.version >= version:
            self._release_after = None
            self.release_pages()

    def take_pending(self) -> tuple[bytes | memoryview, int] | None:
        """The engine's swap hook (runs in the generation thread): newer verified weights, once."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
            reset, self._epoch_reset = self._epoch_reset, False
        if pending is None or (pending[1] <= self.engine.version and not reset):
            return None
        return pending

    def load_pending(self) -> None:
        """Swap in waiting weights between batches. The version goes live only with every piece
        verified, and the load happens in the thread that generates, so no forward pass ever
        sees half-loaded weights."""
        pending = self.take_pending()
        if pending is not None:
            self.engine.load_weights(*pending)
            self._release_if_loaded()

    async def _fetch_delta(self, target: Target) -> tuple[memoryview, mmap.mmap] | None:
        """The new weights via a delta against the newest ones we hold, if the learner offers
        one: decoded into a new mapping of the `decoded` store, which is returned with a view."""
        base = self._blob_version
        behind = target.version - base
        # The learner keeps (and cuts deltas against) its last keep_versions versions; a new
        # epoch's learner holds only what it redid, so the first version of an epoch comes full.
        # A delta decodes to the size of its base: a version of another size comes full.
        if (self._blob is None or not 0 < behind < self.cfg.net.keep_versions or target.version < self._delta_from
                or target.epoch != self._blob_epoch or len(self._blob) != target.size):
            return None
        # A delta is worth waiting for (the learner may still be cutting it) only as long as a
        # full snapshot takes this peer to fetch.
        delta: memoryview | None = None
        with trio.move_on_after(max(DELTA_WAIT_MIN_S, self._full_fetch_s or FETCH_TIMEOUT_S)) as waited:
            try:
                delta, _ = await self._nursery_start(target, base)
            except Unavailable:
                pass
        if delta is None:
            # Unavailable: deltas do not pay now (fp32 weights early in training) or our base is
            # too old; or slower than a full snapshot here. Either way full snapshots for a while,
            # and no round trip per version to learn it again.
            if waited.cancelled_caught:
                log.info("the delta for version %d took longer than a full snapshot does here (%.1fs): full snapshots "
                         "for the next %d versions", target.version, self._full_fetch_s, DELTA_BACKOFF_VERSIONS)
            self._delta_from = target.version + DELTA_BACKOFF_VERSIONS
            return None
        out = self.decoded.create(target.version, target.size)
        base_blob = self._blob  # not None: checked above
        try:
            def decode() -> memoryview:  # (a partial hides which overload of decode_delta applies)
                return decode_delta(delta, base_blob, max_size=target.size, out=memoryview(out))

            blob = await offload.run_sync(decode)
            if await offload.run_sync(payload_digest, blob) != target.sha256:
                raise RemoteProtocolError(f"delta for version {target.version} decodes to the wrong weights")
        except BaseException:
            if self.decoded.get(target.version) is out:
                self.decoded.drop(target.version)
            raise
        self.deltas_used += 1
        return blob, out

    async def _nursery_start(self, target: Target, base: int) -> tuple[memoryview, mmap.mmap]:
        assert self._nursery is not None
        got: tuple[memoryview, mmap.mmap] = await self._nursery.start(self._serve_version, target, base)
        return got

    async def _serve_version(
        self, target: Target, base: int, *, task_status: trio.TaskStatus[tuple[memoryview, mmap.mmap]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Fetch `target` (full, or a delta on `base`) from the swarm, then keep relaying it
        until it is K versions old."""
        # The handshake runs outside the links' nursery, so its errors (Unavailable, a bad
        # manifest) reach the caller as themselves, not wrapped in an exception group.
        t0 = time.monotonic()
        manifest, stream = await open_version(
            self.data,
            learner_id=self.session.learner.peer_id,
            host=self.session.data_host,
            port=self.session.data_port,
            version=target.version,
            base=base,
            weights_sha256=target.sha256,
        )
        served = False
        receivers: list[Download] = []
        # Assembled in place, in a mapping the size of the signed manifest's payload.
        try:
            buf = self.payloads.create(target.version, manifest.payload_size)
        except BaseException:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise

        def started(receiver: Download) -> None:
            receivers.append(receiver)
            self._relaying.add(receiver)
            self._watch(receiver)

        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as links:
                    payload, receiver = await receive_version(
                        self.data, links, manifest, stream, learner_id=self.session.learner.peer_id, on_start=started,
                        into=buf,
                    )
                    self._note_reachability(receiver.reachable)
                    self._download = {"receive_s": round(time.monotonic() - t0, 4), "pieces": dict(receiver.stats.pieces),
                                      "asked_more": receiver.stats.asked_more}
                    self.served.add(target.version, scope)
                    served = True
                    self._prune()  # the version no longer served: its payload goes
                    task_status.started((payload, buf))
                    await trio.sleep_forever()
        except BaseExceptionGroup as group:
            # The download runs in the links' nursery, which wraps its errors; before the
            # version is served they are the fetch's own (the learner hung up, a bad frame) and
            # reach the caller as themselves, to be retried like any failed refresh.
            matched, rest = group.split(REFRESH_ERRORS)
            if served or rest is not None or matched is None:
                raise
            raise _first_leaf(matched) from None
        finally:
            for receiver in receivers:
                self._relaying.discard(receiver)
                self._relayed_done += receiver.stats.bytes_up
                self._received_done += receiver.stats.bytes_down
            if not served:  # abandoned before it verified: stop routing peers to it
                self.data.unregister(target.version)
                if self.payloads.get(target.version) is buf:
                    self.payloads.drop(target.version)

    @property
    def installed_version(self) -> int:
        """The newest version this peer holds verified (-1: none yet)."""
        return max(-1, self._blob_version)

    def bytes_relayed(self) -> int:
        """Weight bytes this peer has sent to other peers (relaying), over the session."""
        return self._relayed_done + sum(r.stats.bytes_up for r in self._relaying)

    def bytes_received(self) -> int:
        """Weight bytes this peer has received (from the learner and other peers), over the session."""
        return self._received_done + sum(r.stats.bytes_down for r in self._relaying)

    def _watch(self, receiver: Download) -> None:
        self._progress = (receiver, receiver.missing, trio.current_time())

    def _abandon(self, why: str) -> None:
        if self._fetching is not None:
            self._abandoned = why
            self._fetching[1].cancel()

    async def _watch_transfers(self) -> None:
        """Abandon a download that gained no piece for STALL_ABANDON_S (it is asked for again,
        from whoever serves it then)."""
        while True:
            await trio.sleep(1.0)
            self._release_if_loaded()  # async mode: the engine took the weights between two steps
            if self._progress is None:
                continue
            receiver, missing, since = self._progress
            now = trio.current_time()
            if receiver.missing != missing:
                self._progress = (receiver, receiver.missing, now)
            elif now - since > STALL_ABANDON_S:
                log.warning("abandoned the download of version %d: no piece for %.0fs", receiver.manifest.version, now - since)
                self._abandon(f"no piece for {now - since:.0f}s")

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
        """The versions topic carries the learner's VersionAnnounce and RunEnded, signed by the
        learner this peer joined, for its run; anything else is refused (and not forwarded)."""
        try:
            msg, _ = open_envelope(data, expected_sender=self.session.learner.peer_id)
        except RemoteProtocolError as exc:
            log.warning("ignored a message on the versions topic from %s: %s", origin, exc)
            return False
        return isinstance(msg, (VersionAnnounce, RunEnded)) and msg.run_id == self.cfg.run_id

    def activated_by(self, status: StatusResponse) -> bool:
        """Whether a status answer has this peer generate: the learner says active, and not in
        an epoch that announced its end (only a newer one, a restart, activates it again)."""
        return status.active and (self.ended is None or status.epoch > self.ended.epoch)

    def end(self, msg: RunEnded) -> bool:
        """Take note of the learner's end of run; False if it is an older epoch's (replayed or
        late), or the same word again (the learner says it more than once, for late joiners).
        "stopped": generate nothing (no learner would receive it) until a newer epoch's status
        answer activates this peer again."""
        if msg.epoch < self.epoch or msg == self.ended:
            return False
        self.ended = msg
        if msg.reason == "stopped" and self.active:
            self.active = False
            self.active_changed.set()
            self.active_changed = trio.Event()
        self.run_ended.set()
        self.run_ended = trio.Event()
        return True

    def offer(self, target: Target) -> bool:
        """Take note of a version the learner told of (announcement or status answer); False if
        it is refused (an older epoch's, or a number seen with another digest)."""
        if target.epoch < self.epoch:
            return False  # a previous incarnation's, replayed or late
        if target.epoch > self.epoch:
            log.info("the learner restarted (epoch %d -> %d, at version %d): following it", self.epoch, target.epoch, target.version)
            self.epoch = target.epoch
            self._digests.clear()
            self.announced = 0
            if self._fetching is not None and self._fetching[0].epoch < target.epoch:
                self._abandon(f"the learner restarted (epoch {target.epoch})")
            if self.newest is not None and target.version <= self.newest.version:
                # The new epoch did not go on from the old numbers (its history was lost):
                # its versions are the ones to follow now, whatever their numbers.
                self.newest = None
                with self._pending_lock:
                    self._epoch_reset = True
            self.rejoin_wanted.set()
        known = self._digests.get(target.version)
        if known is not None and known != target.sha256:
            log.warning("refused version %d of epoch %d: announced before with another digest", target.version, target.epoch)
            return False
        self._digests[target.version] = target.sha256
        while len(self._digests) > DIGESTS_KEPT:
            self._digests.popitem(last=False)
        if self.newest is None or target.version >= self.newest.version:
            self.demand = target.demand_groups
        if self.newest is None or target.version > self.newest.version:
            self.newest = target
            self.new_version.set()
            self.new_version = trio.Event()
        return True

    async def _follow_announcements(self) -> None:
        async for item in self.node.messages(versions_topic(self.cfg.run_id)):
            msg, _ = open_envelope(item.data)
            if isinstance(msg, RunEnded):
                self.end(msg)
            elif isinstance(msg, VersionAnnounce):
                if self.offer(Target(msg.version, msg.size, msg.sha256, msg.demand_groups, msg.epoch)):
                    self.announced += 1

    async def _poll_status(self) -> None:
        while True:
            # A fresh install is told at once (the learner times its broadcasts by these
            # heartbeats: waiting out the interval would add up to STATUS_INTERVAL_S to each).
            with trio.move_on_after(self.status_interval()):
                await self._installed.wait()
            self._installed = trio.Event()
            try:
                await self.status()
            except Exception as exc:
                log.warning("status check with the learner failed: %s", exc)
                await self.reconnect()

    def status_interval(self) -> float:
        fresh = trio.current_time() - self._joined_at < JOINED_FAST_S
        return STATUS_FAST_S if fresh else STATUS_INTERVAL_S

    async def _rejoin_on_new_epoch(self) -> None:
        """A restarted learner may serve its data channel elsewhere and forgot who joined:
        join it again when a newer epoch shows up."""
        while True:
            await self.rejoin_wanted.wait()
            self.rejoin_wanted = trio.Event()
            if self._joined_epoch < self.epoch:
                await self.reconnect(force=True)

    async def reconnect(self, *, force: bool = False) -> None:
        """The learner did not answer (or restarted): join it again, looking it up on the DHT
        with backoff, for `net.learner_outage_s`; then JoinError. Meanwhile the peer keeps its
        weights and goes on generating."""
        async with self._reconnecting:
            if not force and trio.current_time() - self._last_contact < CONTACT_FRESH_S:
                return  # it answered just now (another task reconnected meanwhile)
            if force and self._joined_epoch >= self.epoch:
                return  # joined this epoch meanwhile
            if self._rejoin is None:
                self.check_learner_alive()
                return
            if not force:
                try:  # a failed fetch or one lost answer is not an outage: is it still there?
                    with trio.fail_after(10):
                        await self.status()
                    return
                except Exception:
                    pass
            outage = self.cfg.net.learner_outage_s
            deadline = self._last_contact + outage
            delays = Backoff(self.cfg.net.backoff_initial_s, max(self.cfg.net.backoff_max_s, 10.0)).delays()
            while True:
                try:
                    with trio.fail_after(60):
                        await self._rejoin()
                        await self.status()
                    self.reconnects += 1
                    self._joined_epoch = self.epoch
                    self._joined_at = trio.current_time()
                    if self.metrics is not None:
                        self.metrics.write({"event": "rejoined", "epoch": self.epoch, "wall": time.time()})
                    log.info("rejoined the learner (epoch %d)", self.epoch)
                    return
                except ValueError:
                    raise  # the run changed (rollout_peer.rejoin): not something to wait out
                except Exception as exc:  # py-libp2p raises its own errors for a peer that is gone
                    if trio.current_time() > deadline:
                        raise JoinError(f"lost the learner: no answer for {outage:g}s ({exc})") from None
                    delay = next(delays)
                    log.info("the learner is not reachable (%s); looking for it again in %.1fs", exc, delay)
                    await trio.sleep(delay)

    def check_learner_alive(self) -> None:
        if trio.current_time() - self._last_contact > self.cfg.net.learner_outage_s:
            raise JoinError(f"lost the learner: no answer for {self.cfg.net.learner_outage_s:g}s")

    async def _fetch_newest(self) -> None:
        """async mode: fetch every newer version as it is announced, while generation goes on."""
        while True:
            if self.newest is None or not self.needs(self.newest):
                await self.new_version.wait()
                continue
            try:
                await self._fetch(self.newest)
            except REFRESH_ERRORS as exc:
                await self.refresh_failed(exc)

    async def refresh_failed(self, exc: BaseException) -> None:
        log.warning("weight refresh failed (%s: %s); retrying", type(exc).__name__, exc)
        await self.reconnect()
        await trio.sleep(1.0)
