"""The learner's side of weight sync: each published version becomes a signed manifest and a
broadcast source on the data channel, full and, when it pays, as a delta.

Rules:
- Every published version is offered full, and announced as soon as it is. It is also offered
  as a delta against the previously published version (which most peers hold) when that saves
  at least `DELTA_MIN_SAVING` of the bytes, cut after the announcement (`publish`); a peer that
  skipped versions asks for a delta against the newest one it holds, cut on demand once and
  then served to (and relayed among) every peer that asks.
- A delta is cut only when a sampled estimate (`estimate_delta_ratio`) says it may pay; after a
  miss, none is tried for `DELTA_RETRY_VERSIONS` versions, doubling after each further miss up
  to `DELTA_RETRY_MAX_VERSIONS`; a delta that pays resets the wait. (bf16 weights after an RL
  step make deltas of a few % of the size; fp32 weights never pay: see benchmarks/results.)
- The last `keep_versions` versions stay served; older sources are dropped with their bytes.
- A version's weights live in the `VersionStore` (a mapped file per version in the run folder
  once `open_store` names it), written there by the snapshot itself; pieces are served and
  deltas cut from those mappings, and each version's pages are released from memory once its
  publication is done. Each (version, base) delta is encoded at most once, the up-front one
  included.
- Pieces: `SMALL_VERSION_PIECE` for versions up to `SMALL_VERSION_BYTES` (per-piece costs
  dominate small versions), the protocol's default above (the WAN pipeline fill dominates).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import trio

from echo_node import offload
from echo_node.learner.profile import Profile
from echo_node.weights.broadcast import FULL, DataServer, Served, Source, base_of
from echo_node.weights.delta_encoder import encode_delta, worker_count
from echo_node.weights.mesh import PeerOverlay, SeedSource
from echo_node.weights.store import VersionStore
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.weights.delta import estimate_delta_ratio
from protocol.weights.manifest import WeightManifest, build_manifest, choose_piece_size

DELTA_MIN_SAVING = 0.7
DELTA_RETRY_VERSIONS = 50
DELTA_RETRY_MAX_VERSIONS = 3200
# The sampled estimate errs high by a few % of the size.
DELTA_ESTIMATE_SLACK = 0.05
SMALL_VERSION_BYTES = 16 << 20
SMALL_VERSION_PIECE = 256 << 10


def piece_size_for(payload_size: int) -> int:
    if payload_size <= SMALL_VERSION_BYTES:
        return choose_piece_size(payload_size, SMALL_VERSION_PIECE)
    return choose_piece_size(payload_size)


class WeightPublisher:
    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        members: Container[str],
        relays: Mapping[str, tuple[str, int]],
        keep_versions: int,
        data_server: Callable[..., DataServer],
        profile: Profile | None = None,
        overlay: PeerOverlay | None = None,
    ) -> None:
        """`data_server` builds the learner's data server, given `resolve=`: the publisher
        answers the deltas peers ask for that it has not cut yet (`delta_on_demand`). Delta
        encodes are timed as `profile`'s `delta_encode` stage. `overlay`: the run's
        bounded-degree overlay; a version goes out on it when `overlay.use_mesh()` says so at
        its publication (without one, every version is pushed over the full mesh)."""
        self.identity = identity
        self.run_id = run_id
        self.profile = profile or Profile()
        self.data = data_server(resolve=self.delta_on_demand)
        # Live tables of the learner (joined peers, proven data addresses), by reference.
        self.members = members
        self.relays = relays
        self.overlay = overlay
        self.served = Served(self.data, keep_versions)
        self.sources: dict[tuple[int, int], Source | SeedSource] = {}
        # The newest version peers can fetch.
        self.published = 0
        self._clock = 0.0  # the last reading of trio's clock (`_now`)
        self.bytes_served = 0
        self.deltas_offered = 0
        # Deltas encoded (offered or not): one per (version, base) at most.
        self.deltas_encoded = 0
        # The weights of every version still served: the bases deltas are cut against (a peer
        # that skipped versions names the newest one it holds). In memory until `open_store`.
        self.store = VersionStore(None)
        self._no_delta: set[tuple[int, int]] = set()
        self._building: dict[tuple[int, int], trio.Event] = {}
        self._next_delta_try = 1
        self._delta_retry = DELTA_RETRY_VERSIONS
        self._cutting = False

    def open_store(self, directory: Path) -> None:
        """Keep versions as files in `directory` from now on (before the first version)."""
        self.store = VersionStore(directory)

    def snapshot(self, version: int, write: Callable[[Callable[[int], Any]], Any]) -> Any:
        """`version`'s weights, written by `write` (e.g. `Policy.publication_into`) straight
        into the store: the buffer to publish (a worker thread's job)."""
        return write(partial(self.store.create, version))

    def keep(self, version: int, blob: Any) -> Any:
        """`version`'s buffer in the store, `blob` copied there unless it is that buffer already."""
        return blob if self.store.get(version) is blob else self.store.put(version, blob)

    def build(self, version: int, blob: Any) -> WeightManifest:
        """The full snapshot's manifest of `version` (hashes every piece, in threads: a worker
        thread's job)."""
        return build_manifest(run_id=self.run_id, version=version, payload=blob, piece_size=piece_size_for(len(blob)),
                              workers=worker_count())

    def offer(self, version: int, blob: Any, manifest: WeightManifest | None = None) -> Source | SeedSource:
        """Make `version` fetchable in full: a signed manifest (`build`'s, if not given) and a
        broadcast source. `blob` is `snapshot`'s buffer, or bytes (copied into the store)."""
        blob = self.keep(version, blob)
        manifest = manifest or self.build(version, blob)
        source = self._offer(manifest, blob)
        self.served.add(version)
        for old in [v for v in self.store.versions() if v not in self.served]:
            self.store.drop(old)
        for key in [k for k in self.sources if k[0] not in self.served]:
            self.bytes_served += self.sources.pop(key).stats.bytes_up
        self._no_delta = {k for k in self._no_delta if k[0] in self.served}
        return source

    async def publish(
        self, version: int, blob: Any, manifest: WeightManifest | None = None,
        *, task_status: trio.TaskStatus[WeightManifest] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Offer `version` (`blob` is its weights) in full, report the full snapshot's manifest
        (the version is fetchable then: `nursery.start` returns and the learner announces it),
        then cut the up-front delta against the previously published version when it may pay.

        The announcement never waits for that cut: it is as long as reading both versions
        through zstd (~20 s for 135M fp32 parameters on a CPU core), longer than a full fetch
        on a fast link, and a peer that asks for the delta meanwhile waits for this one encode
        (`delta_on_demand`). One up-front cut runs at a time; a version published while one
        runs gets none up front (a peer that wants it asks, and it is cut on demand)."""
        previous = self.published
        key = (version, previous)
        up_front = version >= self._next_delta_try and key not in self._building and not self._cutting
        # Claimed before the version is registered: a peer that asks for this very delta while
        # it is being cut waits for this encode (`delta_on_demand`) instead of starting another.
        if up_front:
            self._building[key] = trio.Event()
            self._cutting = True
        try:
            full = self.offer(version, blob, manifest).store.manifest
            self.published = version
            task_status.started(full)
            if up_front:
                if await self._offer_delta(version, previous) is None:
                    self._next_delta_try = version + self._delta_retry
                    self._delta_retry = min(2 * self._delta_retry, DELTA_RETRY_MAX_VERSIONS)
                else:
                    self._delta_retry = DELTA_RETRY_VERSIONS
        finally:
            if up_front:
                self._cutting = False
                self._building.pop(key).set()
            self.store.release(version, previous)

    def manifest(self, version: int) -> WeightManifest:
        """The full snapshot's manifest of a served version."""
        return self.sources[(version, FULL)].store.manifest

    def bytes_up(self) -> int:
        return self.bytes_served + sum(s.stats.bytes_up for s in self.sources.values())

    async def delta_on_demand(self, version: int, base: int) -> Source | SeedSource | None:
        """The data server's resolver: a peer asked for `version` against an older `base` than
        the one offered up front. Cut once, then served to every peer that asks (and relayed)."""
        key = (version, base)
        if key in self.sources:
            return self.sources[key]
        if self.published < self._next_delta_try:
            return None  # deltas do not pay now: no encode per request
        building = self._building.get(key)
        if building is not None:
            await building.wait()
            return self.sources.get(key)
        self._building[key] = trio.Event()
        try:
            return await self._offer_delta(version, base)
        finally:
            self._building.pop(key).set()
            self.store.release(version, base)

    def _now(self) -> float:
        """Trio's clock, which times the overlay's members; `offer` may also be called before
        the run starts (a first version published while setting up), when no member can have
        been placed yet: the overlay is then timed at the last clock reading (0 before any)."""
        try:
            self._clock = trio.current_time()
        except RuntimeError:
            pass
        return self._clock

    def _offer(self, manifest: WeightManifest, payload: Any) -> Source | SeedSource:
        """A source for (version, base): on the overlay when it says so (a delta of a version
        goes the way its full snapshot went, so a version has one swarm shape)."""
        sealed = seal(manifest, self.identity)
        full = self.sources.get((manifest.version, FULL))
        if full is None:
            mesh = self.overlay is not None and self.overlay.use_mesh()
            if mesh and self.overlay is not None:
                self.overlay.between_versions(self._now())
        else:
            mesh = isinstance(full, SeedSource)
        source: Source | SeedSource
        if mesh and self.overlay is not None:
            source = SeedSource(self.identity, manifest, sealed, payload, self.overlay)
        else:
            source = Source(self.identity, manifest, sealed, payload, self.members, self.relays)
        base = base_of(manifest)
        self.sources[(manifest.version, base)] = source
        self.data.register(manifest.version, source, base=base)
        return source

    async def _offer_delta(self, version: int, base: int) -> Source | SeedSource | None:
        """Offer `version` as a delta against `base` if both are kept and the delta pays."""
        blob, previous = self.store.get(version), self.store.get(base)
        if blob is None or previous is None or len(previous) != len(blob) or (version, base) in self._no_delta:
            return None
        if await offload.run_sync(estimate_delta_ratio, memoryview(blob), memoryview(previous)) > 1 - DELTA_MIN_SAVING + DELTA_ESTIMATE_SLACK:
            self._no_delta.add((version, base))
            return None
        self.deltas_encoded += 1
        # The encode stops at its next chunk when the learner stops (nothing waits for it then).
        delta = await offload.run_sync(
            partial(self.profile.timed("delta_encode", encode_delta), memoryview(blob), memoryview(previous),
                    check=offload.check_cancelled))
        if len(delta) > (1 - DELTA_MIN_SAVING) * len(blob) or version not in self.served:
            self._no_delta.add((version, base))
            return None
        full = self.manifest(version)
        manifest = build_manifest(
            run_id=self.run_id, version=version, payload=delta, codec="xor-zstd", base_version=base,
            weights_size=full.weights_size, weights_sha256=full.weights_sha256, piece_size=piece_size_for(len(delta)),
            workers=worker_count(),
        )
        self.deltas_offered += 1
        return self._offer(manifest, delta)
