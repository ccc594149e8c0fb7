"""The learner's GRPO step on one process vs sharded over two (FSDP2, CPU, gloo), and what a
publication gathers.

The same batches for both: `--batches` distinct GRPO batches of `--groups` addition prompts x
`--group-size` completions sampled by `TorchEngine` from the embedded model (real, on-policy
behaviour log-probs; random rewards so that every group is used), stepped through in turn for
`--steps` updates at the learner's default lr. One rank: `PolicyOptimizer(fast_path=False)` in
this process, pinned to the first core (the forward the sharded learner must use; `step_s_1rank_lean`
is the single-process learner's own lean forward, for scale). Two ranks: `ShardedLearner` under
torchrun, rank r pinned to core r, one torch thread each. Times are medians over the steps after
`WARMUP` (the machine is shared and drifts: only ratios within one run mean anything).

Reported: `max_param_diff` between the two after all steps, against `tolerance` = lr / 10 (AdamW
divides each gradient by its running RMS plus 1e-8, so float rounding in gradients of ~1e-8
shows in the update at up to ~1 % of lr: see tests/unit/test_sharded.py); per-update wall time
on each side (rank 0's, which includes waiting for rank 1); `gather_bytes`, the size of the
full state `full_state()` gathers to rank 0 for a publication, and `gather_s`, its median time;
`shard_bytes_per_rank`, the float32 parameters one rank holds. Prints one JSON object as its
last line (and writes it to --out).

    .venv/bin/python -m benchmarks.fsdp --out benchmarks/results/fsdp.json
    .venv/bin/python -m benchmarks.fsdp --steps 40 --batches 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

WARMUP = 3
GATHERS = 7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="updates on each side")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, stepped through in turn")
    parser.add_argument("--groups", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    # Internal: one rank of the two-rank run, started by torchrun from the main run.
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=str, default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def make_batches(args: argparse.Namespace) -> list[list[Any]]:
    """`args.batches` GRPO batches sampled from the seed-`args.seed` model."""
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import TrainGroup
    from echo_node.ml.model import build_model, tiny_llama_config
    from echo_node.ml.tasks import AdditionTask
    from echo_node.ml.tokenizer import CharTokenizer

    tok, task = CharTokenizer(), AdditionTask()
    model = build_model(tiny_llama_config(tok.vocab_size), seed=args.seed)
    engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rng = random.Random(args.seed)
    batches = []
    for b in range(args.batches):
        texts = task.sample_prompts(args.groups, rng)
        prompts = [tok.encode_prompt(t) for t in texts for _ in range(args.group_size)]
        gens = engine.generate(prompts, max_new_tokens=task.max_new_tokens, temperature=1.0, seed=args.seed + b)
        groups = []
        for g in range(args.groups):
            rows = gens[g * args.group_size : (g + 1) * args.group_size]
            # A fresh model's reward is ~always 0; random rewards keep every group in the loss.
            rewards = [float(rng.random() < 0.5) for _ in rows]
            rewards[0], rewards[1] = 1.0, 0.0
            groups.append(TrainGroup(prompts[g * args.group_size], [r.completion_ids for r in rows],
                                     [r.logprobs for r in rows], rewards))
        batches.append(groups)
    return batches


def _model(args: argparse.Namespace) -> Any:
    from echo_node.ml.model import build_model, tiny_llama_config
    from echo_node.ml.tokenizer import CharTokenizer

    return build_model(tiny_llama_config(CharTokenizer().vocab_size), seed=args.seed)


def _lr() -> float:
    from echo_node.ml.defaults import RL

    return RL.lr


def single(args: argparse.Namespace, batches: list[list[Any]], *, fast_path: bool | None) -> tuple[list[float], Any]:
    """Step times and final canonical state of the one-process learner."""
    from echo_node.ml.grpo import PolicyOptimizer
    from echo_node.ml.model import canonical_state
    from echo_node.ml.tokenizer import CharTokenizer

    model = _model(args)
    opt = PolicyOptimizer(model, lr=_lr(), pad_id=CharTokenizer().pad_id, fast_path=fast_path)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        opt.step(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return times, {k: v.clone() for k, v in canonical_state(model).items()}


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: rank 0 drives the steps and the gathers and saves what it timed."""
    rank = int(os.environ["RANK"])
    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from echo_node.ml.sharded import ShardedLearner, init_from_env
    from echo_node.ml.tokenizer import CharTokenizer

    _one_thread()
    info = init_from_env()
    assert info is not None
    batches = torch.load(args.worker / "batches.pt", weights_only=False)
    learner = ShardedLearner(_model(args), info, lr=_lr(), pad_id=CharTokenizer().pad_id)
    if info.rank != 0:
        learner.follow()
        dist.destroy_process_group()
        return
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        learner.step(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    gathers, state = [], {}
    for _ in range(GATHERS):
        t0 = time.perf_counter()
        state = learner.full_state()
        gathers.append(time.perf_counter() - t0)
    shard_bytes = sum(cast(DTensor, p).to_local().nbytes for p in learner.model.parameters())
    learner.close()
    seen = {"times": times, "gathers": gathers, "state": state, "shard_bytes": shard_bytes}
    torch.save(seen, args.worker / "rank0.pt")
    dist.destroy_process_group()


def _one_thread() -> None:
    """One intra-op and one inter-op torch thread, as the learner runs: a process per core."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one per rank")
    os.sched_setaffinity(0, {cores[0]})
    import torch

    _one_thread()
    batches = make_batches(args)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batches, Path(tmp) / "batches.pt")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), "-m", "benchmarks.fsdp", "--worker", tmp,
            "--cores", ",".join(map(str, cores[:2])), "--steps", str(args.steps), "--seed", str(args.seed),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[1])
        sharded = torch.load(Path(tmp) / "rank0.pt", weights_only=False)
    times_1, state_1 = single(args, batches, fast_path=False)
    times_lean, _ = single(args, batches, fast_path=None)
    state_2 = sharded["state"]
    assert list(state_1) == list(state_2)
    max_diff = max(float((state_1[k] - state_2[k]).abs().max()) for k in state_1)
    tolerance = _lr() / 10

    def med(ts: list[float]) -> float:
        return round(statistics.median(ts[WARMUP:] if len(ts) > WARMUP else ts), 5)

    report = {
        "benchmark": "fsdp",
        "torch": torch.__version__,
        "model_params": sum(t.numel() for t in state_1.values()),
        "batch": {
            "groups": args.groups,
            "group_size": args.group_size,
            "rows": args.groups * args.group_size,
            "mean_completion_tokens": round(statistics.mean(
                len(c) for b in batches for g in b for c in g.completions), 2),
        },
        "batches": args.batches,
        "steps": args.steps,
        "lr": _lr(),
        "max_param_diff": max_diff,
        "tolerance": tolerance,
        "params_equal": max_diff <= tolerance,
        "step_s_1rank": med(times_1),
        "step_s_1rank_lean": med(times_lean),
        "step_s_2ranks": med(sharded["times"]),
        "gather_bytes": sum(t.numel() * t.element_size() for t in state_2.values()),
        "gather_s": round(statistics.median(sharded["gathers"]), 5),
        "shard_bytes_per_rank": sharded["shard_bytes"],
        "cores": cores[:2],
        # The machine is shared: how busy it was (runnable processes per core, 1-minute mean).
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    line = json.dumps(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(line)


if __name__ == "__main__":
    main()
