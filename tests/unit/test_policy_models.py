"""Models, dtypes and devices: what a learner publishes and what a joining peer accepts.

The learner keeps fp32 master weights and publishes in the rollout dtype; a peer rebuilds the
run's model in that dtype and refuses, in one line, a model directory, tokenizer or dtype that
is not the run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from echo_node.config import RunConfig, load_config
from echo_node.ml.device import autocast_dtype, resolve_device, resolve_dtype
from echo_node.ml.engine import TorchEngine
from echo_node.ml.tiny_hf import build_tiny_model
from echo_node.policy import learner_policy, peer_policy


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": build_tiny_model(root / "qwen2", family="qwen2"),
        "qwen2_seed1": build_tiny_model(root / "qwen2-seed1", family="qwen2", seed=1),
        "qwen2_small_vocab": build_tiny_model(root / "qwen2-small", family="qwen2", vocab_size=384),
        "llama": build_tiny_model(root / "llama", family="llama"),
    }


def _cfg(tmp_path: Path, **overrides: object) -> RunConfig:
    return load_config(None, runs_dir=str(tmp_path), warmup__cache_dir=str(tmp_path / "cache"), **overrides)


def test_device_and_dtype_selection_on_a_cpu_machine() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CPU rules are the ones under test")
    cpu = resolve_device("auto")
    assert cpu == torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert autocast_dtype(torch.bfloat16, torch.device("cuda:0")) == torch.bfloat16
    assert autocast_dtype(torch.bfloat16, cpu) is None  # CPU learners compute in fp32
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="model.device"):
        load_config(None, model__device="tpu")


def test_learner_keeps_fp32_master_weights_and_publishes_bf16(tmp_path: Path, models: dict[str, Path]) -> None:
    policy = learner_policy(_cfg(tmp_path, model__path=str(models["qwen2"]), model__dtype="bfloat16"))
    assert next(policy.model.parameters()).dtype == torch.float32
    assert policy.model_spec["dtype"] == "bfloat16" and policy.model_spec["architecture"] == "Qwen2ForCausalLM"
    blob = policy.publication()
    tensors = st_load(blob)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    fp32 = sum(p.numel() * 4 for p in policy.model.parameters())
    assert len(blob) < 0.55 * fp32  # half the bytes (tied embeddings counted once either way)
    # The embedded model publishes in the run's dtype as well.
    embedded = learner_policy(_cfg(tmp_path, model__dtype="bfloat16", warmup__enabled=False))
    assert {t.dtype for t in st_load(embedded.publication()).values()} == {torch.bfloat16}


def test_peer_rebuilds_the_run_model_in_its_dtype_and_generates(tmp_path: Path, models: dict[str, Path]) -> None:
    learner = learner_policy(_cfg(tmp_path, model__path=str(models["qwen2"]), model__dtype="bfloat16"))
    peer = peer_policy(learner.model_spec, learner.tokenizer_spec, learner.task.task_id, _cfg(tmp_path, model__path=str(models["qwen2"])))
    assert next(peer.model.parameters()).dtype == torch.bfloat16
    engine = TorchEngine(peer.model, eos_id=peer.tokenizer.eos_id, pad_id=peer.tokenizer.pad_id)
    engine.load_weights(learner.publication(), 1)  # strict on names, shapes and dtypes
    gens = engine.generate([peer.tokenizer.encode_prompt("12+34=")] * 2, max_new_tokens=4, temperature=1.0, seed=0)
    assert all(g.token_versions == [1] * len(g.completion_ids) for g in gens)


@pytest.mark.parametrize(
    ("peer_model", "overrides", "message"),
    [
        ("qwen2_small_vocab", {}, "not the run's model: its config differs"),
        ("llama", {}, "not the run's model: architecture LlamaForCausalLM"),
        ("qwen2", {"model__dtype": "float32"}, "the run samples in bfloat16, this peer's model.dtype is float32"),
        (None, {}, "pass --model PATH"),
    ],
)
def test_peer_refuses_what_is_not_the_runs_model(
    tmp_path: Path, models: dict[str, Path], peer_model: str | None, overrides: dict[str, str], message: str
) -> None:
    learner = learner_policy(_cfg(tmp_path, model__path=str(models["qwen2"]), model__dtype="bfloat16"))
    path = None if peer_model is None else str(models[peer_model])
    with pytest.raises(ValueError, match=message):
        peer_policy(learner.model_spec, learner.tokenizer_spec, learner.task.task_id, _cfg(tmp_path, model__path=path, **overrides))


def test_same_architecture_other_weights_is_accepted(tmp_path: Path, models: dict[str, Path]) -> None:
    """Weights always come from the learner: a peer's own initialisation does not matter."""
    learner = learner_policy(_cfg(tmp_path, model__path=str(models["qwen2"])))
    peer = peer_policy(learner.model_spec, learner.tokenizer_spec, learner.task.task_id, _cfg(tmp_path, model__path=str(models["qwen2_seed1"])))
    TorchEngine(peer.model, eos_id=peer.tokenizer.eos_id, pad_id=peer.tokenizer.pad_id).load_weights(learner.publication(), 0)


def test_tokenizer_mismatch_is_refused(tmp_path: Path, models: dict[str, Path]) -> None:
    learner = learner_policy(_cfg(tmp_path, model__path=str(models["qwen2"])))
    forged = {**learner.tokenizer_spec, "sha256": "0" * 64}
    with pytest.raises(ValueError, match="its tokenizer differs"):
        peer_policy(learner.model_spec, forged, learner.task.task_id, _cfg(tmp_path, model__path=str(models["qwen2"])))


def test_a_path_that_is_not_a_model_directory_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local Hugging Face model directory"):
        learner_policy(_cfg(tmp_path, model__path=str(tmp_path / "nowhere")))


def test_embedded_model_refuses_a_task_it_cannot_speak(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a real model"):
        learner_policy(_cfg(tmp_path, task="math", warmup__enabled=False))


@pytest.mark.parametrize(
    ("model_spec", "tokenizer_spec", "task_id", "message"),
    [
        # A learner's spec names a task by id; a module path in it is compared, never imported.
        ({"kind": "embedded"}, {"kind": "char", "alphabet": "0123456789+= "}, "tests.unit.evil_reward_module:boom",
         "this run's task is"),
        ({"kind": "embedded", "dtype": "float64"}, {"kind": "char", "alphabet": "0123456789+= "}, "addition", "does not know"),
        ({"kind": "pickle"}, {"kind": "char", "alphabet": "0123456789+= "}, "addition", "unknown model kind"),
        ({"kind": "hf", "dtype": "bfloat16"}, {"kind": "hf", "sha256": "0" * 64}, "addition", "pass --model PATH"),
        ({"kind": "hf", "dtype": "bfloat16"}, {"kind": "hf", "sha256": "0" * 64, "chat": True}, "addition", "no chat form"),
    ],
)
def test_a_hostile_run_spec_is_refused_without_running_anything(
    tmp_path: Path, model_spec: dict[str, object], tokenizer_spec: dict[str, object], task_id: str, message: str
) -> None:
    import sys

    with pytest.raises(ValueError, match=message):
        peer_policy(model_spec, tokenizer_spec, task_id, _cfg(tmp_path))
    assert "tests.unit.evil_reward_module" not in sys.modules


def test_chat_prompts_of_a_dataset_task_pass_the_learners_claim_checks(tmp_path: Path, models: dict[str, Path]) -> None:
    """The built-in math task with chat prompts on the tiny Qwen2: a peer's honest batch (the
    rollout path a peer runs) passes every claim check, and its rewards are scored on the task's
    prompt, not on the chat template's text around it."""
    from echo_node.config import VerifyConfig
    from echo_node.learner.spot_check import Verifier
    from echo_node.ml.rollout import generate_groups
    from echo_node.peer.rollout_peer import rollout_group
    from protocol import RolloutBatch
    from protocol.assignment import prompt_draw
    from tests.factories import ALICE

    cfg = _cfg(tmp_path, model__path=str(models["qwen2"]), task={"name": "math", "chat": True})
    learner = learner_policy(cfg)
    assert learner.tokenizer_spec["chat"] is True and learner.task.task_id.startswith("math@")
    peer = peer_policy(learner.model_spec, learner.tokenizer_spec, learner.task.task_id, _cfg(tmp_path, model__path=str(models["qwen2"])))
    assert peer.task.task_id == learner.task.task_id
    prompts = [peer.task.prompt_for(prompt_draw("default", ALICE.peer_id, 7, i)) for i in range(2)]
    ids = peer.tokenizer.encode_prompt(prompts[0])
    assert peer.tokenizer.decode(ids) != prompts[0]  # the template's text is around it
    engine = TorchEngine(peer.model, eos_id=peer.tokenizer.eos_id, pad_id=peer.tokenizer.pad_id)
    groups = generate_groups(engine, peer.tokenizer, peer.task, prompts, group_size=2, temperature=1.0, seed=0, max_new_tokens=8)
    batch = RolloutBatch(
        run_id="default", peer_id=ALICE.peer_id, seq=7,
        groups=tuple(rollout_group(g, group_id=f"g{i}") for i, g in enumerate(groups)),
    )
    check = Verifier(VerifyConfig(logprobs=False), run_id="default", tokenizer=learner.tokenizer, task=learner.task,
                     model=learner.model, temperature=1.0, keep_versions=4)
    assert check.claims(batch) is None
