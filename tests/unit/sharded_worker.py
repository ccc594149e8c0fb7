"""One rank of `test_sharded.py`'s two-rank learner, launched by the test under torchrun.

Every rank builds the same model and runs the same scenarios (`SCENARIOS`, on the batches of
`batches`, then one bfloat16-compute step as "bf16"); rank 0 drives each `ShardedLearner`, rank
1 follows, and rank 0 saves what it saw (gathered states, stats, the errors it was meant to
raise) to `argv[1]` for the test to compare with a single-process `PolicyOptimizer` on the same
batches.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.unit.sharded_worker OUT.pt
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from transformers import LlamaForCausalLM

from echo_node.ml.grpo import PolicyOptimizer, TrainGroup
from echo_node.ml.model import build_model, canonical_state, tiny_llama_config
from echo_node.ml.sharded import ShardedLearner, init_from_env
from echo_node.ml.tokenizer import CharTokenizer

VOCAB = CharTokenizer().vocab_size
PAD = CharTokenizer().pad_id
# The learner's default (echo_node.ml.defaults.RL.lr).
LR = 1e-4
# Per scenario: PolicyOptimizer / ShardedLearner arguments, as both sides build them.
SCENARIOS: dict[str, dict[str, Any]] = {
    "tis": {"correction": "tis", "minibatches": 1},
    # Three minibatches of a 5-row batch: the last has one row, so rank 1's share is empty.
    "decoupled": {"correction": "decoupled", "minibatches": 3},
}


def model() -> LlamaForCausalLM:
    return build_model(tiny_llama_config(VOCAB), seed=0)


def _group(rng: random.Random, lengths: list[int], rewards: list[float]) -> TrainGroup:
    """A group with random prompt and tokens and made-up behaviour log-probs (off-policy: the
    importance weights vary and some are truncated)."""
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 6))]
    completions = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]
    behaviour = [[-rng.uniform(1.5, 4.0) for _ in c] for c in completions]
    on_policy = [[rng.random() < 0.5 for _ in c] for c in completions]
    return TrainGroup(prompt, completions, behaviour, rewards, on_policy=on_policy)


def batches() -> dict[str, list[list[TrainGroup]]]:
    """Each scenario's batches, the same on every call."""
    rng = random.Random(0)
    g = _group
    return {
        # Nine used rows (rank 0 takes five, rank 1 four), an all-equal group left out, a group
        # of varying rewards and an empty completion; then an all-equal batch (skipped on every
        # rank); then a batch whose second half (rank 1's share) has no token at all.
        "tis": [
            [g(rng, [4, 1, 6], [1.0, 0.0, 1.0]), g(rng, [2, 5], [0.0, 1.0]), g(rng, [3, 3, 3, 3], [1.0] * 4),
             g(rng, [3, 3, 0, 2], [0.5, 0.2, 0.9, 0.1])],
            [g(rng, [5, 2, 7], [0.0, 1.0, 0.3]), g(rng, [1, 4], [1.0, 0.0]), g(rng, [6, 2, 2], [0.0, 0.0, 1.0])],
            [g(rng, [2, 2], [1.0, 1.0])],
            [g(rng, [3, 6], [1.0, 0.0]), g(rng, [0, 0], [1.0, 0.0])],
        ],
        "decoupled": [
            [g(rng, [3, 5], [1.0, 0.0]), g(rng, [2, 4, 6], [0.0, 1.0, 1.0])],
            [g(rng, [4, 4], [0.0, 0.0]), g(rng, [7, 1, 3], [1.0, 0.0, 0.5]), g(rng, [2, 2], [0.0, 1.0])],
            [g(rng, [5, 3, 1], [0.2, 0.7, 0.4]), g(rng, [6, 2], [1.0, 0.0])],
        ],
    }


def zero_token_batch() -> list[TrainGroup]:
    """Used (rewards differ) but without a token: every minibatch has no gradient, and the step
    fails on every rank at the same point, as it does on one process."""
    return [TrainGroup([1, 5], [[], []], [[], []], [1.0, 0.0])]


def out_of_vocab_batch() -> list[TrainGroup]:
    return [TrainGroup([1, 5], [[VOCAB], [3]], [[-1.0], [-1.0]], [1.0, 0.0])]


def _error(call: Any) -> str:
    """The error `call()` raised, as "Type: message" ("" if it returned)."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def single_process_checkpoint(name: str, first: list[TrainGroup]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The weights and AdamW state of a single-process learner after its first step, as a
    checkpoint would hold them (the optimizer's keyed by parameter name)."""
    ref = model()
    opt = PolicyOptimizer(ref, lr=LR, pad_id=PAD, fast_path=False, **SCENARIOS[name])
    opt.step(first)
    return dict(canonical_state(ref)), get_optimizer_state_dict(ref, opt.opt)


def drive(learner: ShardedLearner, name: str) -> dict[str, Any]:
    """Rank 0: the steps, states along the way, a reload and the same steps again, a reload from
    a single-process checkpoint and the same steps again, two batches that must fail cleanly,
    then close."""
    steps = batches()[name]
    seen: dict[str, Any] = {"initial": learner.full_state()}
    seen["bad_batch"] = _error(lambda: learner.step(out_of_vocab_batch()))
    seen["stats"] = [learner.step(steps[0])]
    seen["after_first"], first_opt = learner.full_state(), learner.optimizer_state()
    seen["stats"] += [learner.step(b) for b in steps[1:]]
    seen["final"] = learner.full_state()
    seen["failed_step"] = _error(lambda: learner.step(zero_token_batch()))
    learner.load(seen["after_first"], first_opt)
    seen["reloaded"] = learner.full_state()
    for b in steps[1:]:
        learner.step(b)
    seen["final_again"] = learner.full_state()
    learner.load(*single_process_checkpoint(name, steps[0]))
    for b in steps[1:]:
        learner.step(b)
    seen["final_from_single"] = learner.full_state()
    learner.close()
    return seen


def drive_mixed(learner: ShardedLearner, steps: list[list[TrainGroup]]) -> dict[str, Any]:
    """Rank 0, bfloat16 compute: the weights before and after one step."""
    seen = {"initial": learner.full_state(), "stats": [learner.step(steps[0])], "final": learner.full_state()}
    learner.close()
    return seen


def main() -> None:
    torch.set_num_threads(1)
    info = init_from_env()
    assert info is not None and info.world == 2, "run under torchrun with two processes"
    seen: dict[str, Any] = {}
    for name, kwargs in SCENARIOS.items():
        learner = ShardedLearner(model(), info, lr=LR, pad_id=PAD, **kwargs)
        if info.rank == 0:
            seen[name] = drive(learner, name)
        else:
            learner.follow()
    learner = ShardedLearner(model(), info, lr=LR, pad_id=PAD, compute_dtype=torch.bfloat16)
    if info.rank == 0:
        seen["bf16"] = drive_mixed(learner, batches()["tis"])
    else:
        learner.follow()
    if info.rank == 0:
        torch.save(seen, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
