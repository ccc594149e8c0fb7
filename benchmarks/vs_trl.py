"""TRL's GRPOTrainer (co-located, synchronous) vs echo-node async: wall time to a mean reward r*.

Both sides train the embedded default from the same cached supervised warm-up (tiny Llama, char
tokenizer, 2-digit addition, exact-match reward) with echo-node's RL defaults: temperature 1,
top_p 1, groups of 8, 8 groups (64 completions) per update, lr 1e-4 constant, AdamW without
weight decay, PPO clip 0.2, grad-norm clip 1, at most 4 completion tokens, no KL term.

- TRL: one process on both cores, run once with 1 and once with 2 torch threads (a fresh process
  each); the faster to r* speaks for TRL (`--trl-threads` runs only one). The clock starts when
  `trainer.train()` is called: model, tokenizer, dataset and trainer construction are excluded.
- echo-node: the real swarm as separate processes (bootstrap, learner, rollout peers; one torch
  thread each), async mode, one rollout peer (two on two cores were slower, with staler
  rollouts). By default bootstrap and learner share core 0 and the peer has core 1, as a learner
  and a volunteer would each have their own hardware (measured: 53-54 ms per update, vs 58-61 ms
  with all processes on both cores, `--pinning none`, the demo's way). The clock starts at the
  learner's first accepted rollout: process start-up, imports and joining are excluded.
- Staleness S = 6, the bound within which ECHO-2 stays within ~5% of synchronous training
  (`benchmarks/staleness_parity` shows truncated IS keeping its reward out to S = 8 here), and
  the learner publishes every 4th version (`--publish-every`, K = S - 2, see
  `RLConfig.publish_every`): each publication (snapshot, manifest hashes, announcement, the
  transfer to the peer) is work on the learner's core. Interleaved pairs of swarms, the
  learner's CPU per update from /proc: 35.2-36.5 ms at S = 6, K = 4 against 39.4-39.9 ms at
  S = 4, K = 2; updates to r* 263-358 against 307-346 (3 runs each). Full runs of this
  benchmark read ratios of 2.12, 2.12, 2.13 (median of 3 swarms) and 2.25 (of 5) at S = 6,
  K = 4, and 1.69 and 2.23 at the previous default S = 4, K = 2.
- The async swarm is not deterministic (which rollouts make each update depends on timing): its
  updates to r* ranged 242-394 over runs of the same code and its time per update moves with the
  shared host, so it runs `--echo-runs` times (5) and `echo_s` is the median. TRL's seeded,
  synchronous run gives the same curve every time and runs once per thread count; its seed 0 is
  the fastest to r* of seeds 0-3 (283, 305, 314 and 285 updates), so the single seed does not
  favour echo-node.

r* is reached when the mean sampled reward of the last `--window` updates first reaches
`--target` (TRL: the `reward` it logs per step; echo-node: `reward_mean` of the learner's
`train` records, both over the update's 64 completions). A side that does not get there within
its cap reports the cap and `reached: false`. Prints one JSON object as its last line, with
`trl_s`, `echo_s`, `ratio` = trl_s / echo_s and `target_reward`.

TRL is a benchmark-only dependency; on top of the project's venv it adds packages and changes
none of the installed versions (benchmarks/requirements-trl.txt):

    .venv/bin/pip install -r benchmarks/requirements-trl.txt
    .venv/bin/python -m benchmarks.vs_trl                      # the target scenario, < 10 minutes
    .venv/bin/python -m benchmarks.vs_trl --target 0.8 --cap-trl 300 --cap-echo 300
    .venv/bin/python -m benchmarks.vs_trl --pinning none --peers 2 --trl-threads 1 --echo-runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from itertools import pairwise
from pathlib import Path
from typing import Any

TARGET_REWARD = 0.7
WINDOW = 10
# Worst case with every cap hit: 2 TRL runs + 5 swarms + start-ups (~30 s a TRL process,
# ~20 s a swarm), under 10 minutes. Times to r* seen: TRL 24-42 s, echo-node 9-19 s a run.
CAP_TRL_S = 90.0
CAP_ECHO_S = 45.0
STALENESS = 6
PUBLISH_EVERY = 4
PEERS = 1
PINNING = "split"
ECHO_RUNS = 5
SEED = 0
# The learner's own deadline: the cap plus room for the peers to start and join; the benchmark
# stops the swarm itself as soon as r* is reached or the cap has passed.
ECHO_STARTUP_ALLOWANCE_S = 120.0
POLL_S = 0.1
# Imports, the warm-up (trained once if not cached yet) and trainer construction.
TRL_STARTUP_ALLOWANCE_S = 300.0


# -- shared measurement ------------------------------------------------------------------------


@dataclass(slots=True)
class Curve:
    """Sampled reward per update, with the time of each update since the side's clock started."""

    times: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def add(self, t: float, reward: float) -> None:
        self.times.append(t)
        self.rewards.append(reward)

    def smoothed(self, window: int) -> list[float]:
        """Trailing mean over `window` updates; undefined (absent) until `window` updates exist,
        so two lucky early batches cannot count as reaching r*."""
        r = self.rewards
        return [sum(r[i - window + 1 : i + 1]) / window for i in range(window - 1, len(r))]

    def reach(self, target: float, window: int) -> int | None:
        """Index of the first update at which the trailing mean reaches `target`."""
        for j, value in enumerate(self.smoothed(window)):
            if value >= target:
                return j + window - 1
        return None


def side_result(curve: Curve, target: float, window: int, cap_s: float) -> dict[str, Any]:
    idx = curve.reach(target, window)
    smooth = curve.smoothed(window)
    return {
        "reached": idx is not None,
        "seconds": round(curve.times[idx], 3) if idx is not None else cap_s,
        "updates_to_target": idx + 1 if idx is not None else None,
        "updates": len(curve.rewards),
        "elapsed_s": round(curve.times[-1], 3) if curve.times else 0.0,
        "reward_first_window": round(sum(curve.rewards[:window]) / window, 4) if len(curve.rewards) >= window else None,
        "reward_last_window": round(smooth[-1], 4) if smooth else None,
        "reward_best_window": round(max(smooth), 4) if smooth else None,
    }


# -- TRL side (runs in its own process: `--trl-worker`) ----------------------------------------


def char_hf_tokenizer(alphabet: str) -> Any:
    """A transformers tokenizer with CharTokenizer's ids: pad 0, bos 1, eos 2, then one per char.

    TRL tokenizes prompts with special tokens on, so the post-processor prepends bos exactly as
    `CharTokenizer.encode_prompt` does; with them off it encodes like `CharTokenizer.encode`.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    from echo_node.ml.tokenizer import CharTokenizer

    specials = {"<pad>": CharTokenizer.pad_id, "<s>": CharTokenizer.bos_id, "</s>": CharTokenizer.eos_id}
    vocab = {**specials, **{ch: i + len(specials) for i, ch in enumerate(alphabet)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    # One token per character, spaces included (the alphabet has one).
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", specials["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def check_tokenizer(hf: Any, char: Any, task: Any, n: int = 500) -> None:
    """Refuse to benchmark unless the HF tokenizer encodes and decodes exactly like ours."""
    import random

    if hf.encode(char.alphabet, add_special_tokens=False) != char.encode(char.alphabet):
        raise RuntimeError("HF tokenizer does not give one id per character of the alphabet")
    for prompt in task.sample_prompts(n, random.Random(SEED)):
        answer = task.answer(prompt)
        got = [hf(text=[prompt])["input_ids"][0], hf.encode(answer, add_special_tokens=False)]
        want = [char.encode_prompt(prompt), char.encode(answer)]
        if got != want:
            raise RuntimeError(f"HF tokenizer disagrees with CharTokenizer on {prompt!r}: {got} != {want}")
        ids = [*char.encode(answer), char.eos_id, char.pad_id]
        if hf.decode(ids, skip_special_tokens=True) != char.decode(ids):
            raise RuntimeError(f"HF tokenizer decodes {ids} differently from CharTokenizer")


def trl_config(output_dir: str, *, max_steps: int) -> Any:
    """GRPOConfig matching echo-node's RL defaults, one update per 64 fresh completions."""
    from trl import GRPOConfig

    from echo_node.config import RunConfig

    cfg = RunConfig()
    rl, sampling = cfg.rl, cfg.sampling
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=rl.group_size * rl.groups_per_step,
        num_generations=rl.group_size,
        # One generation batch per optimizer step, used once: on-policy like TRL's default loop.
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        learning_rate=rl.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=rl.max_grad_norm,
        epsilon=rl.clip_eps,
        beta=0.0,
        # echo-node's loss is a token mean over the update and its advantages are group-scaled.
        loss_type="dapo",
        scale_rewards="group",
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        max_completion_length=sampling.max_new_tokens,
        # TRL defaults to bf16 and gradient checkpointing; echo-node trains in float32 without.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=max_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        seed=SEED,
    )


def _reward_log(target: float | None, window: int, cap_s: float) -> Any:
    """A TrainerCallback that records the sampled reward TRL logs per step and stops training at
    r* or at the cap. Built here because transformers is imported only in the worker."""
    from transformers import TrainerCallback

    class RewardLog(TrainerCallback):
        def __init__(self) -> None:
            self.curve = Curve()
            self.t0 = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            t = time.perf_counter() - self.t0
            self.curve.add(t, float(logs["reward"]))
            if t >= cap_s or (target is not None and self.curve.reach(target, window) is not None):
                control.should_training_stop = True

    return RewardLog()


def _trainer(policy: Any, hf_tok: Any, *, max_steps: int, out: str) -> Any:
    import random

    from datasets import Dataset
    from trl import GRPOTrainer

    task = policy.task

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return list(task.reward(list(prompts), list(completions)))

    # Enough distinct prompts that a run rarely repeats one; built here, no download.
    prompts = task.sample_prompts(20_000, random.Random(SEED))
    return GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=trl_config(out, max_steps=max_steps),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=hf_tok,
    )


def trl_worker(args: argparse.Namespace) -> None:
    """One TRL measurement in this process; prints its result as one JSON line."""
    import torch

    # Inter-op threads can be set only once per process, and one is what every echo-node process uses.
    torch.set_num_interop_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    from echo_node.config import RunConfig
    from echo_node.ml.tokenizer import CharTokenizer
    from echo_node.policy import learner_policy

    policy = learner_policy(RunConfig())  # the embedded model with the cached warm-up, as the learner loads it
    if not isinstance(policy.tokenizer, CharTokenizer):
        raise RuntimeError("vs_trl compares on the embedded default, whose tokenizer is CharTokenizer")
    hf_tok = char_hf_tokenizer(policy.tokenizer.alphabet)
    check_tokenizer(hf_tok, policy.tokenizer, policy.task)
    threads = int(args.trl_threads)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="vs-trl-out-") as out:  # TRL wants one; nothing is saved
        trainer = _trainer(policy, hf_tok, max_steps=1_000_000, out=out)
        log = _reward_log(args.target, args.window, args.cap_trl)
        trainer.add_callback(log)
        log.t0 = time.perf_counter()  # the clock starts at train(): construction above is excluded
        trainer.train()
    curve = log.curve
    steps = [b - a for a, b in pairwise(curve.times)]
    result = side_result(curve, args.target, args.window, args.cap_trl)
    result.update(
        threads=threads,
        median_step_s=round(statistics.median(steps), 4) if steps else None,
        curve=_thin(curve),
    )
    print(json.dumps(result))


def run_trl_worker(args: argparse.Namespace, threads: int, log_dir: Path) -> dict[str, Any]:
    """One TRL run in a fresh process (torch's inter-op threads can be set once per process)."""
    cmd = [
        sys.executable, os.path.abspath(__file__), "--trl-worker",
        "--target", str(args.target), "--window", str(args.window),
        "--cap-trl", str(args.cap_trl), "--trl-threads", str(threads),
    ]
    log_path = log_dir / f"trl-{threads}t.log"
    with log_path.open("wb") as log:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=log, timeout=args.cap_trl + TRL_STARTUP_ALLOWANCE_S, check=False
        )
    lines = proc.stdout.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the TRL worker exited with {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def trl_thread_counts(args: argparse.Namespace) -> list[int]:
    return [1, 2] if args.trl_threads == "both" else [int(args.trl_threads)]


def best_trl(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """TRL's run per thread count asked for; the best speaks for TRL.

    Timed runs rather than a short calibration: under load from other processes a 2-thread step
    stalls for seconds at a time (every op waits for the busier core), which a few timed steps
    miss and a whole run does not.
    """
    best = min(runs, key=lambda n: (runs[n]["seconds"], -(runs[n]["reward_best_window"] or 0.0)))
    return {**runs[best], "runs_by_threads": {str(n): {k: v for k, v in r.items() if k != "curve"} for n, r in runs.items()}}


# -- echo-node side ----------------------------------------------------------------------------


class MetricsTail:
    """Reads the learner's metrics.jsonl incrementally and maps its clock onto ours.

    `train` records carry `t`, seconds since the learner's run() began (its monotonic clock);
    `first_accept` carries wall time. The learner's start on our wall clock is at most
    (when we saw a record) - t; the smallest such bound over all records is within one poll of it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.start_wall = float("inf")
        self.first_accept_wall: float | None = None
        self.train: list[dict[str, Any]] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        # Taken after the read, so every record read was written before it: seen - t is an
        # upper bound on the learner's start, never an underestimate.
        seen = time.time()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            record = json.loads(line)
            if record.get("event") == "first_accept" and self.first_accept_wall is None:
                self.first_accept_wall = float(record["wall"])
            elif record.get("event") == "train":
                self.start_wall = min(self.start_wall, seen - float(record["t"]))
                self.train.append(record)

    def curve(self) -> Curve:
        """Rewards per update, timed from the first accepted rollout."""
        curve = Curve()
        if self.first_accept_wall is None or not self.train:
            return curve
        t_accept = self.first_accept_wall - self.start_wall
        for r in self.train:
            curve.add(float(r["t"]) - t_accept, float(r["reward_mean"]))
        return curve


def run_echo(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from benchmarks.swarm import metrics_path, start_learner, start_peer
    from echo_node.demo import Swarm

    run_id = "vs-trl"
    root.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(root)
    tail = MetricsTail(metrics_path(root, run_id))
    try:
        learner_args = [
            "--threads", "1", "--mode", "async", "--staleness", str(args.staleness),
            "--publish-every", str(args.publish_every),
            "--seconds", str(args.cap_echo + ECHO_STARTUP_ALLOWANCE_S),
        ]
        learner_cpus, peer_cpus = ({0}, {1}) if args.pinning == "split" else ({0, 1}, {0, 1})
        common, learner = start_learner(swarm, root, run_id, learner_args, cpus=learner_cpus)
        for i in range(args.peers):
            start_peer(swarm, root, common, i, cpus=peer_cpus, args=["--threads", "1"])
        give_up = time.monotonic() + ECHO_STARTUP_ALLOWANCE_S
        while learner.proc.poll() is None:
            tail.poll()
            if tail.first_accept_wall is None:
                if time.monotonic() > give_up:
                    raise RuntimeError(f"no rollout accepted within {ECHO_STARTUP_ALLOWANCE_S:g}s; see {root / 'logs'}")
            else:
                curve = tail.curve()
                if curve.reach(args.target, args.window) is not None:
                    break
                if time.time() - tail.first_accept_wall >= args.cap_echo:
                    break
            time.sleep(POLL_S)
        tail.poll()
    finally:
        swarm.stop_all()
    curve = tail.curve()
    # Records written after the cap (between our last poll and the stop) are not the cap's.
    while curve.times and curve.times[-1] > args.cap_echo:
        curve.times.pop()
        curve.rewards.pop()
    result = side_result(curve, args.target, args.window, args.cap_echo)
    timed = tail.train[: len(curve.times)]
    last = timed[-1] if timed else {}
    result.update(
        peers=args.peers,
        staleness=args.staleness,
        publish_every=args.publish_every,
        versions=last.get("version"),
        rollouts_trained=last.get("trained"),
        rollouts_dropped=last.get("dropped"),
        staleness_mean=round(sum(r["staleness_mean"] for r in timed) / len(timed), 3) if timed else None,
        ms_per_update=round(1000 * curve.times[-1] / len(curve.times), 1) if curve.times else None,
        learner_wait_share=wait_share(timed),
        startup_to_first_accept_s=round(tail.first_accept_wall - tail.start_wall, 2) if tail.first_accept_wall and tail.train else None,
        curve=_thin(curve),
    )
    return result


def wait_share(records: list[dict[str, Any]]) -> float | None:
    """Share of the timed window the learner spent waiting for rollouts: the waits before its
    2nd to last update over the time from its 1st update to its last. The 1st update's wait
    holds the peers' start-up and joining, which the clock leaves out (the learner's own
    `idle_ratio` counts it)."""
    if len(records) < 2:
        return None
    span = float(records[-1]["t"]) - float(records[0]["t"])
    return round(sum(float(r["wait_s"]) for r in records[1:]) / span, 4) if span > 0 else None


# -- orchestration -----------------------------------------------------------------------------


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time to r* (the lower one of an even count), with every run's
    time and updates to r* beside it. A run that missed r* counts its cap, so it sorts last."""
    ranked = sorted(runs, key=lambda r: r["seconds"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["seconds_by_run"] = [r["seconds"] for r in runs]
    median["updates_to_target_by_run"] = [r["updates_to_target"] for r in runs]
    median["ms_per_update_by_run"] = [r["ms_per_update"] for r in runs]
    median["learner_wait_share_by_run"] = [r["learner_wait_share"] for r in runs]
    median["reached_by_run"] = [r["reached"] for r in runs]
    return median


def _thin(curve: Curve, points: int = 20) -> list[list[float]]:
    """A few (t, trailing mean) points of the curve, enough to see its shape in the JSON."""
    smooth = curve.smoothed(WINDOW)
    if not smooth:
        return []
    stride = max(1, len(smooth) // points)
    idx = list(range(0, len(smooth), stride))
    if idx[-1] != len(smooth) - 1:
        idx.append(len(smooth) - 1)
    return [[round(curve.times[i + WINDOW - 1], 2), round(smooth[i], 3)] for i in idx]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("trl", "transformers", "torch", "accelerate", "datasets", "echo-node"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--target", type=float, default=TARGET_REWARD, help="r*: trailing mean sampled reward to reach")
    p.add_argument("--window", type=int, default=WINDOW, help="updates in the trailing mean")
    p.add_argument("--cap-trl", type=float, default=CAP_TRL_S, help="seconds TRL may train")
    p.add_argument("--cap-echo", type=float, default=CAP_ECHO_S, help="seconds echo-node may train after its first accepted rollout")
    p.add_argument("--trl-threads", choices=["both", "1", "2"], default="both", help="TRL's torch threads; both: run each, keep the faster")
    p.add_argument("--peers", type=int, default=PEERS, help="echo-node rollout peers, all on core 1")
    p.add_argument(
        "--pinning", choices=["split", "none"], default=PINNING,
        help="echo-node: split = bootstrap and learner on core 0, peers on core 1; none = both cores for all (the demo's way)",
    )
    p.add_argument("--staleness", type=int, default=STALENESS, help="echo-node async staleness bound S")
    p.add_argument("--publish-every", type=int, default=PUBLISH_EVERY, help="echo-node's learner publishes every K-th version")
    p.add_argument("--echo-runs", type=int, default=ECHO_RUNS, help="echo-node swarms to run; echo_s is their median")
    p.add_argument("--skip-trl", action="store_true", help="measure echo-node only (ratio null)")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep logs and the swarm's run folder in DIR")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.window < 1 or not 0 < args.target <= 1:
        p.error("--window must be >= 1 and --target in (0, 1]")
    if args.echo_runs < 1:
        p.error("--echo-runs must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trl_worker:
        trl_worker(args)
        return 0
    if (os.cpu_count() or 1) < 2:
        print("vs_trl: needs 2 cores (learner on core 0, rollout peers on core 1)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        root = Path(tmp) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
        # TRL and echo-node runs alternate, so a drift of the shared machine's speed over the
        # minutes of the benchmark weighs on both sides alike (TRL's own time to the same 283
        # steps moved 22-27 s between runs).
        counts = [] if args.skip_trl else trl_thread_counts(args)
        trl_runs: dict[int, dict[str, Any]] = {}
        runs: list[dict[str, Any]] = []
        for i in range(max(len(counts), args.echo_runs)):
            if i < len(counts):
                print(f"vs_trl: TRL GRPOTrainer, {counts[i]} thread(s) ...", file=sys.stderr, flush=True)
                trl_runs[counts[i]] = r = run_trl_worker(args, counts[i], root)
                print(f"vs_trl: TRL {counts[i]} thread(s): reached={r['reached']} in {r['seconds']}s", file=sys.stderr, flush=True)
            if i < args.echo_runs:
                print(f"vs_trl: echo-node swarm {i + 1}/{args.echo_runs} ...", file=sys.stderr, flush=True)
                runs.append(run_echo(args, root / f"echo-{i}"))
                print(f"vs_trl: echo-node reached={runs[-1]['reached']} in {runs[-1]['seconds']}s", file=sys.stderr, flush=True)
        trl = best_trl(trl_runs) if trl_runs else None
        echo = median_run(runs)
    trl_s = trl["seconds"] if trl is not None else None
    echo_s = echo["seconds"]
    result = {
        "trl_s": trl_s,
        "echo_s": echo_s,
        "ratio": round(trl_s / echo_s, 3) if trl_s is not None and echo_s > 0 else None,
        "target_reward": args.target,
        "window": args.window,
        "trl_reached": trl["reached"] if trl is not None else None,
        "echo_reached": echo["reached"],
        "trl": trl,
        "echo": echo,
        "settings": {
            "seed": SEED,
            "cap_trl_s": args.cap_trl,
            "cap_echo_s": args.cap_echo,
            "trl_threads": args.trl_threads,
            "echo_mode": "async",
            "echo_threads_per_process": 1,
            "echo_pinning": args.pinning,
            "echo_runs": args.echo_runs,
        },
        "versions": _versions(),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the swarm's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
