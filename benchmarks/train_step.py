"""The learner's GRPO step on the embedded default: lean Llama training forward vs HF's forward.

One `PolicyOptimizer.step` = the learner's update for one policy version: 8 addition prompts x 8
completions of up to `max_new_tokens` tokens, sampled by `TorchEngine` (so the behaviour
log-probs are real and on-policy), with the run config's defaults. Pinned to one core with one
torch thread, as the learner runs. Each path gets its own copy of the same weights and its own
optimizer; the two are timed alternately and each reports the median of its trials (the machine
is shared and drifts, so only the ratio within one run means anything). Also reports the largest
log-prob difference between the paths on the batch. Prints one JSON object as its last line.

    .venv/bin/python -m benchmarks.train_step
    .venv/bin/python -m benchmarks.train_step --repeats 41
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31, help="timed steps per path")
    parser.add_argument("--groups", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import torch

    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import PolicyOptimizer, TrainGroup, sequence_logprobs
    from echo_node.ml.model import build_model, tiny_llama_config
    from echo_node.ml.tasks import AdditionTask
    from echo_node.ml.tokenizer import CharTokenizer
    from echo_node.policy import set_threads

    set_threads(1)  # as the learner runs (intra- and inter-op)
    tok, task = CharTokenizer(), AdditionTask()
    model = build_model(tiny_llama_config(tok.vocab_size), seed=args.seed)
    texts = task.sample_prompts(args.groups, random.Random(args.seed))
    prompts = [tok.encode_prompt(t) for t in texts for _ in range(args.group_size)]
    engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    gens = engine.generate(prompts, max_new_tokens=task.max_new_tokens, temperature=1.0, seed=args.seed)
    groups = []
    rng = random.Random(args.seed)
    for g in range(args.groups):
        rows = gens[g * args.group_size : (g + 1) * args.group_size]
        # A fresh model's reward is ~always 0; random rewards keep every group in the loss.
        rewards = [float(rng.random() < 0.5) for _ in rows]
        rewards[0], rewards[1] = 1.0, 0.0
        groups.append(TrainGroup(prompts[g * args.group_size], [r.completion_ids for r in rows],
                                 [r.logprobs for r in rows], rewards))

    comps = [r.completion_ids for r in gens]
    with torch.no_grad():
        lean_lp, mask = sequence_logprobs(model, prompts, comps, tok.pad_id, fast_path=True)
        hf_lp, _ = sequence_logprobs(model, prompts, comps, tok.pad_id, fast_path=False)
    max_diff = float((lean_lp - hf_lp).abs().max())

    opts = {
        name: PolicyOptimizer(copy.deepcopy(model), lr=1e-4, pad_id=tok.pad_id, fast_path=fast)
        for name, fast in (("lean", True), ("hf", False))
    }
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(3):  # warm-up: allocator, first-call dispatch
        for opt in opts.values():
            opt.step(groups)
    for _ in range(args.repeats):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step(groups)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(json.dumps({
        "rows": len(prompts),
        "tokens": int(mask.sum()),
        "repeats": args.repeats,
        "lean_step_ms": round(med["lean"] * 1e3, 2),
        "hf_step_ms": round(med["hf"] * 1e3, 2),
        "speedup": round(med["hf"] / med["lean"], 3),
        "max_abs_logprob_diff": max_diff,
    }))


if __name__ == "__main__":
    main()
