"""The learner's trainer: one GRPO update per batch the replay buffer hands out.

Rules:
- An update is all or nothing: once a batch left the buffer, the step, the version bump and
  the ledger entry happen together, shielded from cancellation (a deadline between `take` and
  the step once lost a batch from the ledger; one after the step would leave trained weights
  under the old version number). An interrupt (Ctrl-C) before the step puts the batch back.
- A version is a change of weights. A batch in which no group has reward variance has no
  advantage to train on: it is dropped as `no_signal` and the version stays (no bump, nothing
  published), so peers' rollouts on the current version stay admissible and nobody waits for
  weights that would not differ (docs/architecture.md, "Versions").
- A step that raises drops its batch as `train_error` and training goes on. Admission should
  make that unreachable, so the first is logged with its traceback (a bug here or a check
  missing there), later ones as a count.
- Under torchrun (`dist`), rank 0's trainer drives the sharded update (echo_node/ml/sharded.py)
  and copies the gathered weights into `policy.model` after each one, in the same worker thread:
  everything else reads weights from there, and no two calls into the sharded learner overlap.
- With a journal, each update appends ["step", version, gids] as it happens: a restart redoes
  the journaled steps since its checkpoint on the same groups in the same order (`redo`), and
  the optimizer has no randomness, so it lands on the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import trio

from echo_node import offload
from echo_node.config import RunConfig
from echo_node.learner.journal import Journal
from echo_node.learner.profile import Profile
from echo_node.envs.train import train_group
from echo_node.learner.replay import Group, ReplayBuffer
from echo_node.ml.device import autocast_dtype
from echo_node.ml.grpo import LogprobGaps, PolicyOptimizer, TrainGroup
from echo_node.ml.model import canonical_state, load_state_tensors, owned_copy
from echo_node.ml.sharded import DistInfo, ShardedLearner
from echo_node.policy import Policy
from protocol.drops import DropReason
from protocol.episodes import EpisodeGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self, cfg: RunConfig, policy: Policy, buffer: ReplayBuffer, *, dist: DistInfo | None = None,
        journal: Journal | None = None, profile: Profile | None = None,
    ) -> None:
        """`dist`: this is rank 0 of a torchrun job; the update is sharded over every rank
        (`sharded_learner`), and `policy.model` stays rank 0's unsharded copy of the weights,
        refreshed after every update (publications, checkpoints and spot checks read it)."""
        self.cfg = cfg
        self.policy = policy
        self.buffer = buffer
        self.version = 0
        self.sharded: ShardedLearner | None = None
        self.optimizer: PolicyOptimizer | ShardedLearner
        if dist is None:
            # CUDA: the forward in the rollout dtype under autocast, fp32 master weights.
            autocast = autocast_dtype(policy.rollout_dtype, policy.device)
            self.optimizer = PolicyOptimizer(policy.model, **update_settings(cfg, policy), autocast_dtype=autocast)
        else:
            self.sharded = self.optimizer = sharded_learner(cfg, policy, dist, copy.deepcopy(policy.model))
            # Every rank starts from rank 0's weights, whatever each loaded or initialised.
            self.sharded.load(canonical_state(policy.model))
        self.journal = journal
        # Times each step as stage "train_step" (echo_node/learner/profile.py); None: untimed.
        self.profile = profile
        self.trained_rewards: list[float] = []
        self.train_errors = 0
        # Batches dropped as no_signal (no version made of them).
        self.no_signal_steps = 0
        self.idle_s = 0.0
        self.train_s = 0.0

    @property
    def idle_ratio(self) -> float:
        return self.idle_s / max(1e-9, self.idle_s + self.train_s)

    async def step(self, groups: list[Group], weights: list[float] | None = None) -> dict[str, float] | None:
        """Train on `groups` (taken from the buffer) and bump the version; None if the step
        failed and the batch was dropped. A batch without reward variance is dropped as
        `no_signal` and the version stays (`stats["skipped"]` is 1). Call inside a shielded
        scope (see the rules)."""
        t0 = time.monotonic()
        try:
            batch = [_train_group(g, self.version, w) for g, w in zip(groups, weights or [1.0] * len(groups))]
            optimize = self._optimize if self.profile is None else self.profile.timed("train_step", self._optimize)
            stats: dict[str, float] = await offload.run_sync(optimize, batch)
        except Exception:
            self._failed(groups)
            return None
        except BaseException:
            self.buffer.restore(groups)  # e.g. Ctrl-C: counted as unused, not lost
            raise
        if stats.get("skipped"):
            self.buffer.mark_failed(groups, DropReason.NO_SIGNAL)
            self.no_signal_steps += 1
            return stats
        self._trained(groups, weights=weights)
        self.train_s += time.monotonic() - t0
        return stats

    def audit_gaps(self) -> dict[int, LogprobGaps]:
        """The last step's on-policy log-prob gaps per group (index into its batch), where they
        judge what peers claimed: the weights trained are exactly the published ones (float32
        rollouts, one process, no autocast); else none."""
        opt = self.optimizer
        if not isinstance(opt, PolicyOptimizer) or opt.autocast_dtype is not None or self.policy.rollout_dtype != torch.float32:
            return {}
        return opt.last_gaps

    def _optimize(self, batch: list[TrainGroup]) -> dict[str, float]:
        stats = self.optimizer.step(batch)
        if self.sharded is not None:
            load_state_tensors(self.policy.model, self.sharded.full_state())
        return stats

    def optimizer_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the optimizer (`load_optimizer_state` takes it back), in
        tensors of its own: the next step cannot change what a checkpoint writer reads later."""
        if self.sharded is not None:  # gathered onto rank 0: already a copy
            return {"format": SHARDED_FORMAT, "optimizer": self.sharded.optimizer_state(), "steps": self.sharded.steps}
        assert isinstance(self.optimizer, PolicyOptimizer)  # not sharded: the single-process one
        return {"format": SINGLE_FORMAT, "optimizer": owned_copy(self.optimizer.opt.state_dict()), "steps": self.optimizer.steps}

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        """After `policy.model` took a checkpoint's weights: the optimizer state it kept (and,
        sharded, both pushed to every rank). ValueError for a checkpoint of the other kind."""
        fmt = saved.get("format", SINGLE_FORMAT)  # checkpoints before sharding existed
        mine = SHARDED_FORMAT if self.sharded is not None else SINGLE_FORMAT
        if fmt != mine:
            raise ValueError(
                f"the checkpoint's optimizer state is {fmt!r} and this learner's is {mine!r}: resume a run "
                "with as many learner processes as wrote it (single process vs torchrun)"
            )
        if self.sharded is not None:
            self.sharded.load(canonical_state(self.policy.model), saved["optimizer"])
            self.sharded.optimizer.steps = int(saved["steps"])
        else:
            assert isinstance(self.optimizer, PolicyOptimizer)
            self.optimizer.opt.load_state_dict(saved["optimizer"])
            self.optimizer.steps = int(saved["steps"])

    def close(self) -> None:
        """Release the other ranks (sharded); nothing to do otherwise. Idempotent."""
        if self.sharded is not None and not self.sharded.closed:
            self.sharded.close()

    def redo(self, groups: list[Group], weights: list[float] | None = None) -> dict[str, float]:
        """A journaled step again, after a restart (synchronously; errors propagate)."""
        stats = self._optimize([_train_group(g, self.version, w) for g, w in zip(groups, weights or [1.0] * len(groups))])
        self._trained(groups, journal=False)
        return stats

    def _trained(self, groups: list[Group], *, journal: bool = True, weights: list[float] | None = None) -> None:
        gids = [self.buffer.gid(g) for g in groups] if journal and self.journal is not None else None
        self.buffer.mark_trained(groups)
        self.trained_rewards += [r for g in groups for r in rewards_of(g)]
        self.version += 1
        if gids is not None and self.journal is not None:
            # The loss weights too, where any is below 1: the redo must make the same update.
            weighted = [list(weights)] if weights is not None and any(w != 1.0 for w in weights) else []
            self.journal.append(["step", self.version, gids, *weighted])

    def _failed(self, groups: list[Group]) -> None:
        self.buffer.mark_failed(groups, DropReason.TRAIN_ERROR)
        self.train_errors += 1
        origins = sorted({self.buffer.origin(g) or "?" for g in groups})
        if self.train_errors == 1:
            log.exception("a training step failed; dropped its %d groups (from %s) as train_error", len(groups), ", ".join(origins))
        else:
            log.error("a training step failed again (%d so far); dropped its %d groups", self.train_errors, len(groups))


# The optimizer state's layout in a checkpoint: torch's own state_dict (parameters by index), or
# the sharded learner's full state dict (parameters by name).
SINGLE_FORMAT, SHARDED_FORMAT = "torch", "fsdp-full"


def sharded_learner(cfg: RunConfig, policy: Policy, dist: DistInfo, model: PreTrainedModel) -> ShardedLearner:
    """The run's update sharded over a torchrun job; every rank builds it the same way (rank 0
    in `Trainer`, the others in `echo-node learn` before they follow)."""
    compute = autocast_dtype(policy.rollout_dtype, dist.device)
    return ShardedLearner(model, dist, **update_settings(cfg, policy), compute_dtype=compute)


def update_settings(cfg: RunConfig, policy: Policy) -> dict[str, Any]:
    """The GRPO update's settings: one process and every rank of a sharded one take the same."""
    rl = cfg.rl
    return {
        "lr": rl.lr, "clip_eps": rl.clip_eps, "temperature": cfg.sampling.temperature, "max_grad_norm": rl.max_grad_norm,
        "pad_id": policy.tokenizer.pad_id, "correction": rl.correction, "is_cap": rl.is_cap, "minibatches": rl.minibatches,
    }


def rewards_of(g: Group) -> list[float]:
    return [e.reward for e in g.episodes] if isinstance(g, EpisodeGroup) else [s.reward for s in g.samples]


def token_versions(g: Group) -> list[tuple[int, ...]]:
    """Per rollout, the versions of the tokens the model sampled (an episode's model turns)."""
    if isinstance(g, EpisodeGroup):
        return [tuple(v for t in e.model_turns for v in t.versions) for e in g.episodes]
    return [s.token_versions for s in g.samples]


def _train_group(g: Group, version: int, weight: float = 1.0) -> TrainGroup:
    if isinstance(g, EpisodeGroup):  # environment tokens masked out of the loss (echo_node/envs/train.py)
        return dataclasses.replace(train_group(g), weight=weight)
    return TrainGroup(
        weight=weight,
        prompt_ids=list(g.prompt_ids),
        completions=[list(s.completion_ids) for s in g.samples],
        behaviour_logprobs=[list(s.behaviour_logprobs) for s in g.samples],
        rewards=[s.reward for s in g.samples],
        on_policy=[[v == version for v in s.token_versions] for s in g.samples],
    )


def staleness(groups: list[Group], trained_on: int) -> dict[str, Any]:
    """How old a batch was when version `trained_on` trained on it: per group by its oldest
    token, a histogram over every token, and how many rollouts are partial (`spanning`: their
    sampled tokens carry more than one version, a weight swap landed inside the completion or
    between an episode's turns)."""
    per_group = [trained_on - g.min_version for g in groups]
    hist: dict[int, int] = {}
    spanning = 0
    for g in groups:
        for versions in token_versions(g):
            spanning += len(set(versions)) > 1
            for v in versions:
                hist[trained_on - v] = hist.get(trained_on - v, 0) + 1
    return {
        "staleness_mean": sum(per_group) / len(per_group),
        "staleness_max": max(per_group),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "spanning": spanning,
    }
