"""Publishing a version: the manifest, the journal, the data channel, the announcement.

Rule: journal before announce. A version's (digest, size) is journaled and the journal made
durable before any peer can hear of the version, so a version number anyone saw names these
weights for the life of the run, across restarts (echo_node/learner/recovery.py). Then the spot
checker learns the weights (a peer's first rollouts on them may arrive at once), the version
becomes fetchable, and only then is it announced on the versions topic with the demand of the
cycle it opens. A due held-out evaluation starts after the announcement, off the update path.

`Publication` is a service: `run` holds the tasks a publication leaves behind (the up-front
delta, cut after the announcement; the evaluation). A learner driven update by update outside
`Learner.run` (tests) publishes without it: the delta is cut inline, and nothing is evaluated.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from echo_node import offload
from echo_node.config import RunConfig
from echo_node.learner.capacity_controller import CapacityController
from echo_node.learner.evaluation import HeldOutEval
from echo_node.learner.profile import Profile
from echo_node.learner.recovery import RunState
from echo_node.learner.report import RunReport
from echo_node.learner.spot_check import Verifier
from echo_node.learner.weight_publisher import WeightPublisher
from echo_node.net.transport import Host
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import VersionAnnounce
from protocol.weights.manifest import WeightManifest

# The learner's lines: they kept the logger they had in learner.py (an operator's filters and
# the CLI's stderr format, which names the logger, see the same lines as before).
log = logging.getLogger("echo_node.learner.learner")


class Publication:
    def __init__(
        self, cfg: RunConfig, identity: Identity, *, node: Host, topic: str, weights: WeightPublisher, state: RunState,
        flush_journal: Callable[[], Awaitable[None]], verifier: Verifier | None, capacity: CapacityController,
        profile: Profile, report: RunReport, held_out: HeldOutEval | None, ask: Callable[[], int], epoch: Callable[[], int],
    ) -> None:
        """`topic`: the versions topic; `flush_journal`: makes every journaled record durable
        (the learner's, one writer at a time); `ask`: the groups per peer the version about to be
        announced asks for (rule 7 of protocol/capacity.py); `epoch`: this start of the run."""
        self.cfg = cfg
        self.identity = identity
        self.node = node
        self.topic = topic
        self.weights = weights
        self.state = state
        self.flush_journal = flush_journal
        self.verifier = verifier
        self.capacity = capacity
        self.profile = profile
        self.report = report
        self.held_out = held_out
        self.ask = ask
        self.epoch = epoch
        # Groups each peer is asked for per version: decided at each publication, and the same
        # in every status answer until the next one (a peer counts what it sampled against it
        # since the version came out).
        self.demand = 1
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def offer(self, version: int, blob: Any) -> None:
        """Keep `version` servable and spot-checkable without announcing it: a version a resume
        brings back that rollouts may still be admitted on (it was announced before the restart)."""
        self.weights.offer(version, blob)
        if self.verifier is not None:
            self.verifier.remember(version, self.weights.keep(version, blob))

    async def publish(self, version: int, blob: Any) -> None:
        """Make `version` fetchable and announce it: journaled and durable first."""
        epoch = self.epoch()
        self.capacity.published(version, trio.current_time())
        manifest: WeightManifest = await offload.run_sync(self.profile.timed("manifest", self.weights.build), version, blob)
        history = self.state.history
        if history.versions.get(version) != (manifest.weights_sha256, manifest.weights_size):
            history.add(version, manifest.weights_sha256, manifest.weights_size)
            self.state.journal.append(["publish", version, manifest.weights_sha256, manifest.weights_size, epoch])
        await self.flush_journal()
        if self.verifier is not None:  # before a peer can learn of the version
            self.verifier.remember(version, blob)
        # Fetchable in full once `start` returns; the up-front delta is cut after the announcement
        # (inline, before it, without the service running).
        with self.profile.stage("offer"):
            if self._nursery is not None:
                await self._nursery.start(self.weights.publish, version, blob, manifest)
            else:
                await self.weights.publish(version, blob, manifest)
        self.demand = self.ask()
        announce = VersionAnnounce(
            run_id=self.cfg.run_id,
            version=version,
            size=manifest.weights_size,
            sha256=manifest.weights_sha256,
            demand_groups=self.demand,
            epoch=epoch,
        )
        self.report.write({"event": "published", "version": version, "sha256": manifest.weights_sha256.hex(), "epoch": epoch})
        self.capacity.announced(version, trio.current_time(), announce.demand_groups * self.cfg.rl.group_size)
        with self.profile.stage("announce"):
            await self.node.publish(self.topic, seal(announce, self.identity))
        if self.held_out is not None and self._nursery is not None and self.held_out.due(version):
            self.held_out.start()
            self._nursery.start_soon(self._evaluate, version, blob)

    async def _evaluate(self, version: int, blob: Any) -> None:
        """The held-out evaluation of a published version, in a worker thread (the blob stays
        valid while referenced, whatever the store drops meanwhile). A stop does not wait for
        it: the thread works on the evaluation's own model and is abandoned."""
        assert self.held_out is not None
        try:
            result = await offload.run_sync(self.held_out.evaluate, version, blob, abandon_on_cancel=True)
        except Exception as exc:  # the operator's view only: training goes on
            log.warning("held-out evaluation of version %d failed: %s", version, exc)
            return
        finally:
            self.held_out.done()
        self.report.write(result.record())
