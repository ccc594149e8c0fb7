"""A real Hugging Face model end to end: the tiny Qwen2 (`echo-node tiny-model`) trained by a
learner and two rollout peers, as separate processes on loopback, with bf16 weights on the wire.

What must hold: the run trains the model it was given (the summary names it and the dtype),
every peer installs bf16 publications (half the fp32 bytes), held-out accuracy improves, and the
save_pretrained export reloads with plain transformers and generates what the learner's
weights generate. A peer whose model directory differs from the run's is refused at join in
one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo_node.metrics import read_metrics
from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import cast_state, canonical_state
from echo_node.ml.tiny_hf import DEMO_WARMUP_STEPS, build_tiny_model
from tests.factories import reward_gain
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

# Judged over a number of versions, not a time window (a loaded machine may give a window few
# versions); DEADLINE_S only bounds a stuck run.
VERSIONS = 24
DEADLINE_S = 900
RG_VERSIONS = 3
RG_DEADLINE_S = 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", warmup_steps=DEMO_WARMUP_STEPS)


def test_tiny_qwen2_trains_in_a_swarm_with_bf16_on_the_wire(cluster: Cluster, tiny_model: Path, tmp_path: Path) -> None:
    run = "real-bf16"
    model_args = ("--model", str(tiny_model), "--dtype", "bfloat16")
    cluster.start_bootstrap()
    # Held-out evaluations every 6 versions: one due while the last still runs is skipped, so a
    # loaded machine still gets v0's and a later one.
    (tmp_path / "learner.toml").write_text("[report]\neval_every = 6\n")
    learner, _ = cluster.start_learner(
        run, *model_args, "--max-versions", str(VERSIONS), "--seconds", str(DEADLINE_S), "--mode", "async",
        "--config", str(tmp_path / "learner.toml"),
    )
    peers = [cluster.start_peer(f"peer{i}", run, "--model", str(tiny_model)) for i in range(2)]
    # A peer with another model (same architecture and tokenizer, another size) is refused.
    other = build_tiny_model(tmp_path / "other", family="qwen2", vocab_size=384)
    wrong = cluster.start_peer("wrong", run, "--model", str(other))
    assert wrong.proc.wait(timeout=180) != 0
    log = (cluster.swarm.run_dir / "logs" / "wrong.log").read_text()
    assert "is not the run's model" in log, log[-2000:]

    assert learner.proc.wait(timeout=DEADLINE_S + 120) == 0
    for p in peers:
        cluster.swarm.stop(p)
    summary = json.loads((cluster.run_dir(run) / "summary.json").read_text())
    assert (summary["model"], summary["dtype"]) == ("Qwen2ForCausalLM", "bfloat16")
    assert summary["versions"] == VERSIONS, f"{summary['versions']} versions within {DEADLINE_S} s"
    # Learning is judged on the held-out evaluation (greedy, 64 fixed prompts, v0 and the last): the
    # warmed-up model's sampled reward rises within the first few versions and then plateaus, so
    # the first quarter's mean holds the rise and the quarters' difference is noise (a fresh-clone
    # run got -0.05 while held-out accuracy went from 0.58 to 0.94).
    records = read_metrics(cluster.run_dir(run) / "metrics.jsonl")
    evals = [r for r in records if r.get("event") == "eval"]
    assert len(evals) >= 2 and evals[0]["version"] == 0, evals
    gain = evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"]
    train_gain = reward_gain([r for r in records if r.get("event") == "train"])
    assert gain > 0, (gain, evals, train_gain)

    # Every install is a bf16 blob: half the bytes of the model's fp32 parameters (+ headers).
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    param_bytes = sum(t.numel() * 2 for t in canonical_state(fp32).values())
    installs = [r for path in (cluster.run_dir(run) / "peers").glob("*.jsonl") for r in read_metrics(path) if r.get("event") == "installed"]
    assert len(installs) >= 2
    assert all(param_bytes <= r["bytes"] < param_bytes + 64 * 1024 for r in installs)

    # The export is the final checkpoint's weights in bf16, loadable by plain transformers.
    export = cluster.run_dir(run) / "model"
    meta = json.loads((export / "echo_node.json").read_text())
    assert meta["version"] == summary["versions"]
    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert loaded.dtype == torch.bfloat16 and type(loaded).__name__ == "Qwen2ForCausalLM"
    ckpt = sorted((cluster.run_dir(run) / "checkpoints").glob("v*"))[-1] / "model.safetensors"
    from safetensors.torch import load_file

    master = load_file(ckpt)
    exported = canonical_state(loaded)
    assert all(torch.equal(exported[k], v) for k, v in cast_state(master, torch.bfloat16).items())
    prompts = [tokenizer.encode(p) for p in ("12+34=", "70+05=")]
    engine = TorchEngine(loaded, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    greedy = [g.completion_ids for g in engine.generate(prompts, max_new_tokens=4, temperature=0.0)]
    hf = loaded.generate(torch.tensor(prompts[:1]), max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)[0, len(prompts[0]):].tolist()
    assert hf[: len(greedy[0])] == greedy[0]


def test_a_reasoning_gym_task_runs_through_a_swarm(cluster: Cluster, tiny_model: Path) -> None:
    """A reasoning-gym task by name (`[task] name = "rg:chain_sum"`, echo_node/envs/rgym.py) end to
    end: the learner poses its rows as the run's prompts, a peer generates and scores them with
    the task's own scorer, and the learner's checks (the reward recomputed from the row, spot
    checks of log-probs and sampling) pass every honest batch."""
    pytest.importorskip("reasoning_gym")
    run = "real-rg"
    cluster.start_bootstrap()
    # A few versions, not a time window: on a loaded machine a 30 s window ended before the peer's
    # first batch was in; the deadline only bounds a stuck run.
    learner, _ = cluster.start_learner(run, "--model", str(tiny_model), "--task", "rg:chain_sum", "--mode", "async",
                                       "--max-versions", str(RG_VERSIONS), "--seconds", str(RG_DEADLINE_S))
    cluster.start_peer("peer0", run, "--model", str(tiny_model), "--task", "rg:chain_sum")
    assert learner.proc.wait(timeout=RG_DEADLINE_S + 120) == 0
    summary = json.loads((cluster.run_dir(run) / "summary.json").read_text())
    assert str(summary["task"]).startswith("rg:chain_sum@"), summary["task"]
    assert summary["rollouts_received"] > 0, summary
    # Nothing refused: what is dropped had no reward variance (a tiny model on a new task), went
    # stale, waited while the newcomer's first batches were checked (overload, no strike: gap
    # repair asks for it again), found the checker out of room on a loaded machine (unchecked,
    # nobody's strike), or was buffered at the stop.
    blameless = {"no_signal", "stale", "overload", "unchecked", "unused_at_exit"}
    assert set(summary["rollouts_dropped"]) <= blameless, summary["rollouts_dropped"]
    assert summary["banned"] == [] and summary["penalties"] == {}
    verification = summary["verification"]
    assert all(c["fail"] == 0 for c in verification["checks"].values()), verification
