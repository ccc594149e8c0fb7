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
4. The re-run (echo_node/envs/verify.py, every episode of the batch at once) with the seed of
   the group's slot: the first 8 bytes of the slot digest of (run, publisher, version, seq,
   index) (protocol/assignment.py), so a peer cannot choose its seeds. A forgery is bad_episode; the environment failing on the
   learner is env_failed, blamed on nobody.

`blame` says whether the publisher earned a strike (the intake's ban ladder): a forgery does,
staleness and the learner's own environment failures do not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from echo_node.envs import EnvSpec
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

_BLAMELESS = frozenset({DropReason.STALE, DropReason.ENV_FAILED, DropReason.WRONG_RUN, DropReason.UNSUPPORTED_SCHEMA})


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
        """Check 4, on a batch `judge` passed: the environment re-run on every episode (as long
        as the environment takes: the learner runs it beside its loop, in a worker thread)."""
        starts = [group_version([e.first_version for e in g.episodes]) for g in batch.groups]
        seeds = [prompt_draw(self.run_id, origin, start or 0, batch.seq, i) for i, start in enumerate(starts)]
        verdicts = verify_groups(self.spec, self.fmt, list(zip(batch.groups, seeds)))
        out: list[TrainGroup] = []
        for i, (g, verdict) in enumerate(zip(batch.groups, verdicts)):
            if verdict.bad is not None:
                return Admission(drop=DropReason.BAD_EPISODE, detail=f"group {i}: {verdict.bad}", batch=batch)
            if verdict.env_failed is not None:
                return Admission(drop=DropReason.ENV_FAILED, detail=f"group {i}: {verdict.env_failed}", batch=batch)
            out.append(train_group(g))
        return Admission(groups=out, batch=batch)
