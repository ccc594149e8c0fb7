"""The learner's held-out evaluation: greedy accuracy of a published version on a fixed set of
the task's prompts.

Rules:
- Off the training path. It runs in a worker thread on its own copy of the model, loaded from a
  published version's weights (the bytes the swarm samples from), never on the weights the
  optimizer is changing; a version due while the last evaluation still runs is skipped, not
  queued, so evaluation can fall behind training but never hold it up.
- Fixed prompts: `prompts` prompts drawn once from the task with `EVAL_SEED`, the same for every
  version and every start of the run, so the numbers of one run (and of two runs of the same
  task) compare. They are fixed, not removed from what rollouts sample: on a small prompt space
  (two-digit addition has 10,000) training sees them too.
- Greedy (temperature 0), one completion per prompt, the run's `max_new_tokens`: the score is
  the mean of the task's reward, which for exact-match tasks is accuracy.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from echo_node.ml.engine import TorchEngine
from echo_node.ml.rollout import generate_groups
from echo_node.policy import Policy

log = logging.getLogger(__name__)

# The evaluation's prompts are drawn with this seed (not the run's: the set stays the same
# whatever seed a run trains with).
EVAL_SEED = 20_240_917


@dataclass(frozen=True, slots=True)
class EvalResult:
    version: int
    accuracy: float
    prompts: int
    seconds: float

    def record(self) -> dict[str, Any]:
        """The `eval` record of metrics.jsonl."""
        return {"event": "eval", "version": self.version, "eval_accuracy": round(self.accuracy, 4),
                "eval_prompts": self.prompts, "eval_s": round(self.seconds, 3)}


class HeldOutEval:
    """Greedy accuracy on a fixed prompt set, one version at a time (see the module rules)."""

    def __init__(self, policy: Policy, *, prompts: int, max_new_tokens: int, every: int) -> None:
        if prompts < 1 or every < 1:
            raise ValueError(f"an evaluation needs prompts >= 1 and every >= 1, got {prompts} and {every}")
        self.policy = policy
        self.every = every
        self.max_new_tokens = max_new_tokens
        self.prompts = policy.task.sample_prompts(prompts, random.Random(EVAL_SEED))
        self.last: EvalResult | None = None
        self.skipped = 0  # versions due while an evaluation ran
        self._busy = False
        self._next = 0  # the next version due
        self._engine: TorchEngine | None = None
        self._lock = threading.Lock()  # one evaluation's engine at a time

    def due(self, version: int) -> bool:
        """`version` should be evaluated: the first published version at or past each multiple
        of `every` (with rl.publish_every > 1 not every version is published). One due while an
        evaluation still runs is counted in `skipped` and not evaluated."""
        if version < self._next:
            return False
        self._next = (version // self.every + 1) * self.every
        if self._busy:
            self.skipped += 1
            return False
        return True

    def start(self) -> None:
        self._busy = True

    def done(self) -> None:
        self._busy = False

    def evaluate(self, version: int, weights: Any) -> EvalResult:
        """Load `weights` (a published version's payload) into the evaluation's own model and
        score the prompt set greedily; a worker thread's job."""
        t0 = time.monotonic()
        with self._lock:
            engine = self._engine_for()
            # A version store hands out mappings: viewed, not copied (TorchEngine takes buffers).
            engine.load_weights(memoryview(weights), version)
            groups = generate_groups(
                engine, self.policy.tokenizer, self.policy.task, self.prompts, group_size=1, temperature=0.0,
                max_new_tokens=self.max_new_tokens,
            )
        accuracy = sum(g.rewards[0] for g in groups) / len(groups)
        result = EvalResult(version, accuracy, len(groups), time.monotonic() - t0)
        self.last = result
        return result

    def _engine_for(self) -> TorchEngine:
        """The evaluation's model: a copy of the policy's model in the rollout dtype, on its
        device (one more model's memory there). Its values are overwritten by every version
        loaded, so a copy taken while training changes the original is fine."""
        if self._engine is None:
            model = copy.deepcopy(self.policy.model)
            torch.nn.Module.to(model, dtype=self.policy.rollout_dtype)  # in place
            model.requires_grad_(False)
            for p in model.parameters():
                p.grad = None  # the copy never trains
            tok = self.policy.tokenizer
            self._engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)
        return self._engine


def evaluator(policy: Policy, *, prompts: int, max_new_tokens: int, every: int) -> HeldOutEval | None:
    """The run's evaluation, or None when turned off (`every` or `prompts` 0)."""
    if every <= 0 or prompts <= 0:
        return None
    return HeldOutEval(policy, prompts=prompts, max_new_tokens=max_new_tokens, every=every)
