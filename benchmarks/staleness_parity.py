"""Does async pay in reward? Pull vs async at staleness S = 1, 4, 8, with and without correction.

Every run trains the same warmed policy (the embedded tiny Llama on 2-digit addition) with the
learner's own `PolicyOptimizer` on rollouts from the real `TorchEngine`, for the same number of
trained samples. What differs is only *which* weights sampled each batch:
- pull: the learner's current version (on-policy, what `--mode pull` guarantees);
- async S: the version S updates old — the oldest the replay buffer admits at bound S, so this is
  the worst case the bound allows, not the average a live swarm sees (there, most rollouts are
  0-2 versions old; see `staleness_hist` in a run's metrics.jsonl).
The network is left out on purpose: it changes *when* a rollout arrives, and this measures what
its age does to learning. Correction "tis" is truncated importance sampling, "none" trains on
stale tokens as if on-policy (echo_node/ml/grpo.py).

Score: the mean sampled reward (T = 1) of the learner's final policy on a fixed set of held-out
prompts, averaged over seeds; curves of the same every `--eval-every` updates go to the PNG.
Runs are spread over one worker process per core, each pinned, one torch thread.

    .venv/bin/python -m benchmarks.staleness_parity            # target scenario, 3 seeds
    .venv/bin/python -m benchmarks.staleness_parity --updates 60 --seeds 1   # a quick look

Last stdout line: one JSON object with `reward_pull`, `reward_async` ({"tis": {S: r}, "none":
{S: r}}), `seeds`, `ratio_s4_tis_vs_pull`, `tis_beats_none_at_s8` and the settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STALENESS = (1, 4, 8)
CORRECTIONS = ("tis", "none")


@dataclass(frozen=True, slots=True)
class Job:
    mode: str  # "pull" or "async"
    staleness: int
    correction: str
    seed: int
    updates: int
    eval_every: int
    eval_prompts: int

    @property
    def key(self) -> str:
        return "pull" if self.mode == "pull" else f"async/{self.correction}/S{self.staleness}"


_CORE: int | None = None


def _init_worker(cores: Any) -> None:
    """Pin each pool worker to its own core (the queue hands them out in start order)."""
    global _CORE
    _CORE = cores.get()
    os.sched_setaffinity(0, {_CORE})


def run_job(job: Job) -> dict[str, Any]:
    # Imported here: the parent only plans and plots, the workers pay for torch.
    import torch

    from echo_node.config import RunConfig
    from echo_node.ml import defaults
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import PolicyOptimizer
    from echo_node.ml.model import build_model, canonical_state, load_state_tensors
    from echo_node.ml.rollout import generate_groups, mean_reward
    from echo_node.policy import learner_policy, set_threads

    set_threads(1)
    policy = learner_policy(RunConfig(run_id="parity"))  # the warmed policy (cached warm-up)
    rl = defaults.RL
    torch.manual_seed(job.seed)
    learner = policy.model
    sampler = build_model({k: v for k, v in policy.model_spec.items() if k != "kind"})
    tok, task = policy.tokenizer, policy.task
    engine = TorchEngine(sampler, eos_id=tok.eos_id, pad_id=tok.pad_id)
    eval_engine = TorchEngine(learner, eos_id=tok.eos_id, pad_id=tok.pad_id)
    opt = PolicyOptimizer(
        learner, lr=rl.lr, clip_eps=rl.clip_eps, temperature=rl.temperature, max_grad_norm=rl.max_grad_norm,
        pad_id=tok.pad_id, correction=job.correction,  # type: ignore[arg-type]
    )
    rng = random.Random(job.seed)
    eval_set = task.sample_prompts(job.eval_prompts, random.Random(10_000))  # same for every run

    def evaluate() -> float:
        return mean_reward(eval_engine, tok, task, eval_set, temperature=rl.temperature, seed=20_000)

    lag = 0 if job.mode == "pull" else job.staleness
    # snapshots[0] is the version `lag` updates old: the weights this batch is sampled from.
    snapshots: deque[dict[str, torch.Tensor]] = deque(maxlen=lag + 1)
    curve: list[tuple[int, float]] = [(0, evaluate())]
    trained = 0
    started = time.monotonic()
    for update in range(1, job.updates + 1):
        snapshots.append({k: v.clone() for k, v in canonical_state(learner).items()})
        load_state_tensors(sampler, snapshots[0])
        prompts = task.sample_prompts(rl.groups_per_step, rng)
        groups = generate_groups(
            engine, tok, task, prompts, group_size=rl.group_size, temperature=rl.temperature,
            seed=rng.getrandbits(31),
        )
        opt.step([g.to_train_group() for g in groups])
        trained += sum(len(g.rewards) for g in groups)
        if update % job.eval_every == 0 or update == job.updates:
            curve.append((trained, evaluate()))
    return {"key": job.key, "seed": job.seed, "final": curve[-1][1], "curve": curve, "trained": trained,
            "seconds": round(time.monotonic() - started, 1), "core": _CORE}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    keys = sorted({r["key"] for r in results}, key=lambda k: (k != "pull", k))
    for key in keys:
        runs = [r["curve"] for r in results if r["key"] == key]
        xs = [x for x, _ in runs[0]]
        ys = [statistics.fmean(run[i][1] for run in runs) for i in range(len(xs))]
        style = "-" if key == "pull" or "/tis/" in key else "--"
        ax.plot(xs, ys, style, linewidth=2 if key == "pull" else 1.3, label=key)
    ax.set_xlabel("trained samples")
    ax.set_ylabel("held-out mean sampled reward (T=1)")
    ax.set_title(f"pull vs async (worst-case staleness S), mean of {len({r['seed'] for r in results})} seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--updates", type=int, default=250, help="updates per run (x 64 trained samples)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-prompts", type=int, default=1024)
    p.add_argument("--out", type=Path, default=Path("runs/staleness_parity"))
    p.add_argument("--cores", default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    a = p.parse_args(argv)
    cores = [int(c) for c in a.cores.split(",")]
    jobs = [
        Job(mode, s, c, seed, a.updates, a.eval_every, a.eval_prompts)
        for seed in range(a.seeds)
        for mode, s, c in [("pull", 0, "tis")] + [("async", s, c) for s in STALENESS for c in CORRECTIONS]
    ]
    a.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    for c in cores:
        queue.put(c)
    results: list[dict[str, Any]] = []
    with ctx.Pool(len(cores), initializer=_init_worker, initargs=(queue,)) as pool:
        for r in pool.imap_unordered(run_job, jobs):
            results.append(r)
            print(f"[{len(results)}/{len(jobs)}] {r['key']} seed {r['seed']}: final reward {r['final']:.3f} "
                  f"({r['seconds']}s, core {r['core']})", file=sys.stderr, flush=True)

    def mean_final(key: str) -> float:
        return round(statistics.fmean(r["final"] for r in results if r["key"] == key), 4)

    start_reward = round(statistics.fmean(r["curve"][0][1] for r in results), 4)
    pull = mean_final("pull")
    asynchronous = {c: {str(s): mean_final(f"async/{c}/S{s}") for s in STALENESS} for c in CORRECTIONS}
    png = a.out / "staleness_parity.png"
    plot(results, png)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({
        "reward_pull": pull,
        "reward_async": asynchronous,
        "reward_start": start_reward,
        "seeds": a.seeds,
        "updates": a.updates,
        "trained_samples": results[0]["trained"],
        "ratio_s4_tis_vs_pull": round(asynchronous["tis"]["4"] / pull, 4),
        "tis_beats_none_at_s8": asynchronous["tis"]["8"] > asynchronous["none"]["8"],
        "staleness_model": "every batch sampled by the policy exactly S updates old (worst case)",
        "png": str(png),
        "wall_s": round(time.monotonic() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
