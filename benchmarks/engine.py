"""TorchEngine against transformers' `generate`: tokens/s at batch 64, embedded or a local model.

The embedded tiny Llama (fresh seeded weights; nothing is downloaded) and its char tokenizer, or
with `--model DIR` a local Hugging Face model (e.g. `echo-node tiny-model DIR`: a Qwen2 runs
the engine's HF-forward path, a Llama its lean path) in `--dtype` on `--device`; the
default task's prompts, sampled with the run config's defaults (temperature, top_p,
max_new_tokens). Two batch shapes: the rollout peer's (each prompt repeated `group_size` times in
a row, as `generate_groups` batches a GRPO group; the headline keys) and all-distinct prompts
(keys prefixed `distinct_`), where prefilling each prompt once gains nothing. Pinned to one core
with one torch thread, as a rollout peer runs. All samplers are timed in rotation and each
reports the median of its trials: the machine is shared and drifts, so only ratios measured
within one run mean anything. Also checks that greedy outputs are token for token identical.
Prints one JSON object as its last line.

    .venv/bin/python -m benchmarks.engine
    .venv/bin/python -m benchmarks.engine --batch 8 --repeats 21
    .venv/bin/python -m benchmarks.engine --model DIR --dtype bfloat16 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from echo_node.config import SamplingConfig
    from echo_node.ml.engine import TorchEngine

Sampler = Callable[[], list[list[int]]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="rows per generate call")
    parser.add_argument("--repeats", type=int, default=15, help="timed trials per sampler")
    parser.add_argument("--calls", type=int, default=20, help="generate calls per trial")
    parser.add_argument(
        "--group-size", type=int, default=None,
        help="rows per prompt in the headline shape (default: the run config's GRPO group size)",
    )
    parser.add_argument("--core", type=int, default=None, help="CPU to pin to (default: the last allowed)")
    parser.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face model (default: the embedded one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the run config's")
    return parser.parse_args()


class Shape:
    """One batch shape: the prompts, and an engine sampler and an HF sampler over them."""

    def __init__(
        self, prompts: list[list[int]], engine: TorchEngine, sampling: SamplingConfig, *, eos: int, pad: int
    ) -> None:
        import torch

        self.prompts, self.engine, self.sampling = prompts, engine, sampling
        self.eos, self.pad = eos, pad
        self.width = max(map(len, prompts))
        device = engine.device
        self.ids = torch.tensor([[pad] * (self.width - len(p)) + p for p in prompts], device=device)
        self.mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def engine_rows(self, temperature: float) -> list[list[int]]:
        gens = self.engine.generate(
            self.prompts, max_new_tokens=self.sampling.max_new_tokens, temperature=temperature,
            top_p=self.sampling.top_p,
        )
        return [g.completion_ids for g in gens]

    def hf_rows(self, do_sample: bool) -> list[list[int]]:
        s = self.sampling
        kwargs: dict[str, Any] = (
            # top_k=0: the engine samples the whole tempered distribution; HF's default is top-50.
            {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": 0}
            if do_sample
            else {"do_sample": False}
        )
        out = self.engine.model.generate(
            self.ids, attention_mask=self.mask, max_new_tokens=s.max_new_tokens,
            pad_token_id=self.pad, eos_token_id=self.eos, **kwargs,
        )
        # Cut each row at eos inclusive, as the engine reports completions.
        rows = out[:, self.width :].tolist()
        return [r[: r.index(self.eos) + 1] if self.eos in r else r for r in rows]

    def greedy_identical(self) -> bool:
        return self.engine_rows(0.0) == self.hf_rows(False)

    def samplers(self) -> tuple[Sampler, Sampler]:
        return (lambda: self.engine_rows(self.sampling.temperature)), (lambda: self.hf_rows(True))


def tokens_per_s(sample: Sampler, calls: int) -> float:
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(calls):
        tokens += sum(map(len, sample()))
    return tokens / (time.perf_counter() - t0)


def summary(prefix: str, engine_tok_s: list[float], hf_tok_s: list[float]) -> dict[str, float]:
    e, h = statistics.median(engine_tok_s), statistics.median(hf_tok_s)
    pairs = [a / b for a, b in zip(engine_tok_s, hf_tok_s)]
    return {
        f"{prefix}engine_tok_s": round(e, 1),
        f"{prefix}hf_tok_s": round(h, 1),
        f"{prefix}ratio": round(e / h, 3),
        f"{prefix}pair_ratio_median": round(statistics.median(pairs), 3),
        f"{prefix}pair_ratio_min": round(min(pairs), 3),
        f"{prefix}pair_ratio_max": round(max(pairs), 3),
    }


def main() -> None:
    # Arguments first, torch after: `--help` should not pay for importing torch.
    args = parse_args()
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})

    import torch

    from echo_node.config import RunConfig, SamplingConfig
    from echo_node.ml.device import DTYPES
    from echo_node.ml.engine import TorchEngine, _LlamaStepper
    from echo_node.ml.model import build_model, load_pretrained, tiny_llama_config
    from echo_node.ml.tasks import get_task
    from echo_node.ml.tokenizer import CharTokenizer, Tokenizer
    from echo_node.policy import set_threads

    set_threads(1)
    cfg = RunConfig()
    if args.max_new_tokens is not None:
        cfg.sampling = SamplingConfig(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, max_new_tokens=args.max_new_tokens)
    dtype = DTYPES[args.dtype]
    tokenizer: Tokenizer
    if args.model is None:
        tokenizer = CharTokenizer()
        model = build_model(tiny_llama_config(tokenizer.vocab_size), seed=cfg.model.seed).to(args.device, dtype)
    else:
        model, tokenizer = load_pretrained(args.model, dtype=dtype, device=args.device)
    engine = TorchEngine(model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    task = get_task(cfg.task.name)
    group = args.group_size if args.group_size is not None else cfg.rl.group_size
    texts = task.sample_prompts(args.batch, random.Random(cfg.seed))

    def shape(group_size: int) -> Shape:
        prompts = [tokenizer.encode_prompt(p) for p in texts for _ in range(group_size)][: args.batch]
        return Shape(prompts, engine, cfg.sampling, eos=tokenizer.eos_id, pad=tokenizer.pad_id)

    shapes = {"": shape(group)}
    if group != 1:
        shapes["distinct_"] = shape(1)
    identical = {prefix: s.greedy_identical() for prefix, s in shapes.items()}

    samplers = [(prefix, side, fn) for prefix, s in shapes.items() for side, fn in zip(("engine", "hf"), s.samplers())]
    times: dict[tuple[str, str], list[float]] = {(prefix, side): [] for prefix, side, _ in samplers}
    with torch.inference_mode():
        for _, _, fn in samplers:
            tokens_per_s(fn, 2)  # warm-up: first-call allocations, lazy imports
        for i in range(args.repeats):
            # Rotate who goes first, so a slow drift in machine load favours no one.
            k = i % len(samplers)
            for prefix, side, fn in samplers[k:] + samplers[:k]:
                times[prefix, side].append(tokens_per_s(fn, args.calls))

    result: dict[str, Any] = {}
    for prefix, s in shapes.items():
        result |= summary(prefix, times[prefix, "engine"], times[prefix, "hf"])
        result[f"{prefix}unique_prompts"] = len(set(map(tuple, s.prompts)))
    result |= {
        "greedy_identical": all(identical.values()),
        "batch": args.batch,
        "group_size": group,
        "repeats": args.repeats,
        "calls_per_trial": args.calls,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "temperature": cfg.sampling.temperature,
        "top_p": cfg.sampling.top_p,
        "prompt_len": shapes[""].width,
        "fast_path": isinstance(engine._stepper, _LlamaStepper),
        "model": args.model or "embedded",
        "architecture": type(model).__name__,
        "dtype": args.dtype,
        "device": str(engine.device),
        "core": core,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    sys.exit(0 if result["greedy_identical"] else 1)


if __name__ == "__main__":
    main()
