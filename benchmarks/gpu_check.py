"""Everything that needs a CUDA GPU, as one script: run it wherever one is available.

1. `engine`: the torch engine in bf16 on CUDA against transformers' `generate` on the tiny real
   model (`benchmarks.engine --model DIR --dtype bfloat16 --device cuda`), greedy outputs
   identical; the same for vLLM (`VLLMEngine`) when it is installed.
2. `learner_step`: the GRPO step on CUDA, fp32 master weights under bf16 autocast, against the
   same step on the CPU: seconds per step, and how far the parameters land apart after k steps.
3. `swarm`: bootstrap, a learner and one rollout peer, both on the GPU (`--device cuda`, bf16 on
   the wire), as separate processes for `--seconds`: versions, reward first/last, installs.
4. `gpu_tests`: `pytest -m gpu` (the vLLM engine's tests).

Every section reports its own error instead of stopping the others. One JSON object as the last
line. Builds its tiny model in a temp directory (nothing is downloaded).

    python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --seconds 60 --steps 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def section(name: str, fn: Callable[[], dict[str, Any]], out: dict[str, Any]) -> None:
    t0 = time.monotonic()
    try:
        out[name] = fn()
    except Exception as exc:  # one broken section must not hide the others' results
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    out[name]["seconds"] = round(time.monotonic() - t0, 1)
    print(f"gpu_check: {name} done in {out[name]['seconds']}s", file=sys.stderr, flush=True)


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError(f"no JSON line in: {text[-1000:]}")


def engine_check(model_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.engine", "--model", str(model_dir), "--dtype", "bfloat16", "--device", "cuda",
           "--max-new-tokens", "32", "--repeats", "5", "--calls", "5", "--core", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = {"torch": last_json(done.stdout) if done.returncode in (0, 1) else {"error": done.stderr[-2000:]}}
    try:
        import vllm  # noqa: F401
    except ImportError:
        result["vllm"] = "not installed"
        return result
    result["vllm"] = vllm_tokens_per_s(model_dir)
    return result


def vllm_tokens_per_s(model_dir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine = VLLMEngine(str(model_dir), dtype="bfloat16", eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts = [tok.encode(f"{a:02d}+{b:02d}=") for a, b in zip(range(10, 74), range(30, 94))]
    t0 = time.perf_counter()
    gens = engine.generate(prompts, max_new_tokens=32, temperature=1.0, top_p=1.0, seed=0)
    seconds = time.perf_counter() - t0
    greedy = [g.completion_ids for g in engine.generate(prompts[:8], max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)]
    # transformers wraps Module.cuda/.to in functools.wraps: mypy sees the unbound functions.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True).cuda()  # type: ignore[call-arg]
    reference = TorchEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    torch_greedy = [g.completion_ids for g in reference.generate(prompts[:8], max_new_tokens=8, temperature=0.0)]
    return {
        "tokens_per_s": round(sum(len(g.completion_ids) for g in gens) / seconds, 1),
        "greedy_equal_to_torch_engine": greedy == torch_greedy,
        "greedy_rows_equal": sum(a == b for a, b in zip(greedy, torch_greedy)),
    }


def learner_step(model_dir: Path, steps: int) -> dict[str, Any]:
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from echo_node.ml.grpo import PolicyOptimizer, TrainGroup

    rng = random.Random(0)
    groups = [
        TrainGroup(
            prompt_ids=[rng.randrange(3, 300) for _ in range(8)],
            completions=[[rng.randrange(3, 300) for _ in range(rng.randrange(4, 32))] for _ in range(8)],
            behaviour_logprobs=[],
            rewards=[float(rng.random() < 0.5) for _ in range(8)],
        )
        for _ in range(8)
    ]
    for g in groups:
        g.behaviour_logprobs = [[-1.0] * len(c) for c in g.completions]
        g.rewards[0], g.rewards[1] = 0.0, 1.0  # never an all-equal group
    out: dict[str, Any] = {}
    params: dict[str, list[torch.Tensor]] = {}
    for device, autocast in (("cpu", None), ("cuda", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).to(device)  # type: ignore[arg-type]
        opt = PolicyOptimizer(model, lr=1e-4, autocast_dtype=autocast)
        opt.step(groups)  # warm-up: kernels, allocator
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step(groups)
        if device == "cuda":
            torch.cuda.synchronize()
        out[f"step_s_{device}"] = round((time.perf_counter() - t0) / steps, 5)
        params[device] = [p.detach().float().cpu() for p in model.parameters()]
    out["max_param_diff_cuda_bf16_vs_cpu_fp32"] = max(float((a - b).abs().max()) for a, b in zip(params["cpu"], params["cuda"]))
    out["steps"] = steps + 1
    return out


def swarm(model_dir: Path, seconds: float) -> dict[str, Any]:
    from benchmarks.swarm import metrics_path, start_learner, start_peer
    from echo_node.demo import Swarm
    from echo_node.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="echo-gpu-") as tmp:
        root = Path(tmp)
        run_id = "gpu-check"
        s = Swarm(root / "runs" / run_id)
        gpu = ["--model", str(model_dir), "--device", "cuda", "--dtype", "bfloat16"]
        try:
            common, learner = start_learner(s, root, run_id, ["--seconds", str(seconds), *gpu], cpus={0, 1})
            peer = start_peer(s, root, common, 0, cpus={2, 3}, args=gpu)
            learner.proc.wait(timeout=seconds + 300)
            s.stop(peer)
        finally:
            s.stop_all()
        summary = json.loads((root / "runs" / run_id / "summary.json").read_text())
        installs = [r for p in (root / "runs" / run_id / "peers").glob("*.jsonl") for r in read_metrics(p) if r.get("event") == "installed"]
        published = [r for r in read_metrics(metrics_path(root, run_id)) if r.get("event") == "published"]
        return {
            "versions": summary["versions"],
            "published": len(published),
            "reward_first": summary["reward_first"],
            "reward_last": summary["reward_last"],
            "dtype": summary.get("dtype"),
            "device": summary.get("device"),
            "installs": len(installs),
            "install_bytes": installs[-1]["bytes"] if installs else None,
            "rollouts_accepted": summary["rollouts_accepted"],
            "rollouts_dropped": summary["rollouts_dropped"],
        }


def gpu_tests() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/gpu"], capture_output=True, text=True, timeout=900)
    return {"returncode": done.returncode, "tail": done.stdout[-3000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="swarm training time")
    p.add_argument("--steps", type=int, default=10, help="timed learner steps per device")
    p.add_argument("--skip", action="append", default=[], choices=["engine", "learner_step", "swarm", "gpu_tests"])
    args = p.parse_args(argv)
    import torch

    out: dict[str, Any] = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not torch.cuda.is_available():
        print(json.dumps({**out, "error": "no CUDA device: nothing to check here"}))
        return 1
    out["gpu"] = torch.cuda.get_device_name(0)
    from echo_node.ml.tiny_hf import DEMO_WARMUP_STEPS, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="echo-tiny-") as tmp:
        # Warmed up, so the swarm's reward has a signal to start from.
        model_dir = build_tiny_model(Path(tmp) / "qwen2", family="qwen2", warmup_steps=DEMO_WARMUP_STEPS)
        checks: dict[str, Callable[[], dict[str, Any]]] = {
            "engine": lambda: engine_check(model_dir),
            "learner_step": lambda: learner_step(model_dir, args.steps),
            "swarm": lambda: swarm(model_dir, args.seconds),
            "gpu_tests": gpu_tests,
        }
        for name, fn in checks.items():
            if name not in args.skip:
                section(name, fn, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
