"""The learner's gate for episode batches: what a signed `EpisodeBatch` must pass before its
groups are trained on, as a pure decision the intake acts on (ban, count, buffer).

Checks, cheapest first; the first failure decides the whole batch (one forged group means the
publisher lies, as for rollout batches):
1. The envelope opens as an EpisodeBatch signed by its claimed publisher, for this run
   (malformed, bad_signature, wrong_sender, wrong_run).
2. Every group has the run's group size (bad_group), token ids in the vocabulary
   (out_of_vocab), and episodes within the run's budgets (too_long).
3. Versions: no token newer than the learner's current version (future_version: a forged
   per-turn version) or of a version it never published (unpublished_version); the group
   began on one version, the tag of every episode's first token (bad_episode otherwise),
   which the staleness rule judges (stale: no blame).
4. The episodes against the runner's rules and, for a deterministic environment, the re-run
   (echo_node/envs/verify.py, every episode of the batch at once) with the seed of the group's
   slot: the first 8 bytes of the slot digest of (run, publisher, seq, index)
   (protocol/assignment.py), so a peer cannot choose its seeds. A forgery in any group is
   bad_episode. The environment failing on the learner is env_failed (raised or malformed),
   env_timeout or env_unavailable (no free environment thread), blamed on nobody. An
   untrusted-only environment is not re-run (it may answer the same actions differently): its
   episodes pass on checks 1 to 3 and the runner's rules on their tokens, and the run's
   allowlist (`net.allow_peers`) vouches for the rest.

`blame` says whether the publisher earned a strike (the intake's ban ladder): a forgery does,
staleness and the learner's own environment failures do not.

`RerunCooldown` bounds what one publisher's batches can cost the learner in re-runs the
environment fails: the publisher chose the actions the re-run plays, so it can choose ones on
which the environment hangs, and the re-run holds the learner's intake.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from echo_node.envs import EnvSpec
from echo_node.envs.bounded import ENV_ERROR, ENV_TIMEOUT, ENV_UNAVAILABLE, free_env_threads
from echo_node.envs.format import EpisodeFormat
from echo_node.envs.train import train_group
from echo_node.envs.verify import verify_groups
from echo_node.ml.grpo import TrainGroup
from protocol.assignment import group_version, prompt_draw
from protocol.drops import DropReason
from protocol.envelope import open_envelope
from protocol.episodes import EpisodeBatch, check_budgets
from protocol.errors import RemoteProtocolError
from protocol.staleness import admissible

_ENV_DROPS = {ENV_ERROR: DropReason.ENV_FAILED, ENV_TIMEOUT: DropReason.ENV_TIMEOUT, ENV_UNAVAILABLE: DropReason.ENV_UNAVAILABLE}
_BLAMELESS = frozenset({DropReason.STALE, DropReason.WRONG_RUN, DropReason.UNSUPPORTED_SCHEMA, *_ENV_DROPS.values()})
# The longest cooldown of a publisher whose re-runs keep failing in the environment; a streak of
# them is forgotten once this long has passed since its cooldown ended.
COOLDOWN_MAX_S = 600.0


@dataclass(frozen=True, slots=True)
class Admission:
    """Either `groups` to train (drop None) or why the batch is dropped and whether to blame."""

    groups: list[TrainGroup] = field(default_factory=list)
    drop: DropReason | None = None
    detail: str = ""
    batch: EpisodeBatch | None = None

    @property
    def blame(self) -> bool:
        return self.drop is not None and self.drop not in _BLAMELESS


@dataclass(slots=True)
class EpisodeGate:
    spec: EnvSpec
    fmt: EpisodeFormat
    run_id: str
    group_size: int
    vocab_size: int
    staleness: int
    mode: str = "async"

    def check(self, frame: bytes, origin: str, *, current_version: int) -> Admission:
        """Every check, 1 to 4, on one signed frame from `origin`."""
        try:
            batch, _ = open_envelope(frame, expected_kind=EpisodeBatch, expected_sender=origin)
        except RemoteProtocolError as exc:
            return Admission(drop=exc.reason, detail=str(exc))
        assert isinstance(batch, EpisodeBatch)
        return self.judge(batch, current_version=current_version) or self.rerun(batch, origin)

    def judge(
        self, batch: EpisodeBatch, *, current_version: int, published: Callable[[int], bool] | None = None
    ) -> Admission | None:
        """Checks 2 and 3 (cheap: the gossip validator runs them): None if they pass.
        `published(v)`: whether the learner published version v (no token can have been sampled
        from one it did not: `unpublished_version`)."""
        if batch.run_id != self.run_id:
            return Admission(drop=DropReason.WRONG_RUN, detail=batch.run_id, batch=batch)
        starts: list[int] = []
        for i, g in enumerate(batch.groups):
            where = f"group {i}: "
            if len(g.episodes) != self.group_size:
                return Admission(drop=DropReason.BAD_GROUP, detail=f"{where}{len(g.episodes)} episodes, the run's groups have {self.group_size}", batch=batch)
            ids = [t for e in g.episodes for turn in e.turns for t in turn.token_ids] + list(g.prompt_ids)
            if max(ids) >= self.vocab_size:
                return Admission(drop=DropReason.OUT_OF_VOCAB, detail=f"{where}token id {max(ids)}", batch=batch)
            for e in g.episodes:
                over = check_budgets(e, self.spec.budgets)
                if over is not None:
                    return Admission(drop=DropReason.TOO_LONG, detail=where + over, batch=batch)
            if g.max_version > current_version:
                return Admission(drop=DropReason.FUTURE_VERSION, detail=f"{where}version {g.max_version} > {current_version}", batch=batch)
            if published is not None:
                unpublished = sorted({v for e in g.episodes for t in e.model_turns for v in t.versions if not published(v)})
                if unpublished:
                    return Admission(drop=DropReason.UNPUBLISHED_VERSION, detail=f"{where}version {unpublished[0]}", batch=batch)
            start = group_version([e.first_version for e in g.episodes])
            if start is None:
                return Admission(drop=DropReason.BAD_EPISODE, detail=f"{where}its episodes begin on different versions", batch=batch)
            starts.append(start)
        for start in starts:
            why = admissible(start, current_version, self.staleness, self.mode)
            if why is not None:
                return Admission(drop=why, detail=f"began on version {start}", batch=batch)
        return None

    def rerun(self, batch: EpisodeBatch, origin: str) -> Admission:
        """Check 4, on a batch `judge` passed (as long as the environment takes, at most
        `rerun_bound_s`: the learner runs it beside its loop, in a worker thread). Environment
        calls left hung are charged to `origin`."""
        if self.spec.deterministic and free_env_threads() < batch.num_samples:
            return Admission(drop=DropReason.ENV_UNAVAILABLE, detail="every environment thread is taken (hung calls)", batch=batch)
        seeds = [prompt_draw(self.run_id, origin, batch.seq, i) for i in range(len(batch.groups))]
        verdicts = verify_groups(self.spec, self.fmt, list(zip(batch.groups, seeds)), owner=origin)
        bad = next(((i, v.bad) for i, v in enumerate(verdicts) if v.bad is not None), None)
        if bad is not None:
            return Admission(drop=DropReason.BAD_EPISODE, detail=f"group {bad[0]}: {bad[1]}", batch=batch)
        for i, verdict in enumerate(verdicts):
            if verdict.env_failed is not None:
                drop = _ENV_DROPS.get(verdict.env_failed, DropReason.ENV_FAILED)
                return Admission(drop=drop, detail=f"group {i}: {verdict.env_failed}", batch=batch)
        return Admission(groups=[train_group(g) for g in batch.groups], batch=batch)

    @property
    def rerun_bound_s(self) -> float:
        """The longest a re-run takes: a reset and `max_turns` steps, each bounded."""
        return self.spec.step_timeout_s * (1 + self.spec.budgets.max_turns) if self.spec.deterministic else 0.0


@dataclass(slots=True)
class RerunCooldown:
    """Which publishers' episode batches the learner re-runs now (pure; `now` in seconds).

    A publisher whose batch's re-run failed in the environment (env_failed, env_timeout) is not
    re-run again for a cooldown: `base_s` (the re-run's bound) after its first such failure,
    doubling with each consecutive one, at most COOLDOWN_MAX_S; a re-run that completes (passed,
    or judged) ends the streak. Nor is it re-run while any environment call its re-runs left
    hung is still running. Its batches meanwhile are dropped as env_unavailable, without blame
    (an honest peer's batch can meet a slow environment too). So the intake's time lost to one
    publisher's failing re-runs is at most one bound per cooldown, a share that halves with
    each failure in a row, and the threads it can leave hung are those of one batch.
    """

    base_s: float
    _streak: dict[str, int] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)

    def refuses(self, origin: str, now: float, *, hung: int) -> bool:
        """Whether `origin`'s batch is dropped unplayed (`hung`: its calls still hung)."""
        return hung > 0 or now < self._until.get(origin, -math.inf)

    def record(self, origin: str, drop: DropReason | None, now: float) -> float | None:
        """A re-run of `origin`'s batch ended with `drop`: the cooldown it starts (None: none)."""
        for peer in [p for p, until in self._until.items() if until + COOLDOWN_MAX_S < now]:
            del self._until[peer], self._streak[peer]
        if drop in (DropReason.ENV_FAILED, DropReason.ENV_TIMEOUT):
            k = self._streak[origin] = self._streak.get(origin, 0) + 1
            cooldown = min(COOLDOWN_MAX_S, self.base_s * 2.0 ** min(k - 1, 32))
            self._until[origin] = now + cooldown
            return cooldown
        if drop is not DropReason.ENV_UNAVAILABLE:
            self._streak.pop(origin, None)
            self._until.pop(origin, None)
        return None
