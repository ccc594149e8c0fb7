"""The policy a role works with: model, tokenizer and task, built from config or from a run spec.

The learner builds it from its config (embedded tiny Llama, or `--model PATH`), warms the
embedded model up once (cached), and describes it in the run spec. A rollout peer rebuilds the
same model from that description; the weights always come from the learner afterwards, so a
peer never trusts its own initialisation.

Rules:
- The learner's model holds fp32 master weights on its device; what it publishes is cast to the
  run's rollout dtype (`Policy.publication`), and peers run their model in that dtype. So a bf16
  run moves half the bytes of an fp32 one and the learner's optimizer never sees bf16 rounding.
- A Hugging Face model travels as a fingerprint: architecture, a hash of its config (dtype and
  load-time keys left out), the rollout dtype, and a hash of the tokenizer. A peer needs the same
  local model directory (`--model PATH`); any mismatch is refused in one line at join instead of
  silently sampling from another network or tokenizing otherwise.
- A task travels as its id. Built-in tasks are rebuilt from the registry by name; a dataset task
  is built from the peer's *own* config (its dataset file, its reward functions) and must have
  the same id: nothing a learner sends ever names a module for a peer to import.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from echo_node.config import RunConfig, TaskConfig
from echo_node.envs import is_env_id
from echo_node.ml import defaults
from echo_node.ml.device import DTYPES, dtype_name, resolve_device, resolve_dtype
from echo_node.ml.engine import Engine, TorchEngine
from echo_node.ml.model import (
    build_model,
    canonical_state,
    load_pretrained,
    state_layout,
    state_to_bytes,
    tiny_llama_config,
    write_state,
)
from echo_node.ml.tasks import TASKS, Task, build_task
from echo_node.ml.tokenizer import CharTokenizer, HFTokenizerAdapter, Tokenizer, load_tokenizer
from echo_node.ml.warmup import warmup

log = logging.getLogger(__name__)

B = TypeVar("B")  # a writable buffer

# Config keys that say how a model was loaded, not what it computes.
_LOAD_KEYS = frozenset({"dtype", "torch_dtype", "_name_or_path", "transformers_version", "_attn_implementation_autoset", "attn_implementation", "_attn_implementation"})


@dataclass(slots=True)
class Policy:
    model: PreTrainedModel
    tokenizer: Tokenizer
    task: Task
    model_spec: dict[str, Any]
    tokenizer_spec: dict[str, Any]
    # What engines sample in and publications carry; the model itself may be fp32 (a learner).
    rollout_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def publication(self) -> bytes:
        """The weights as the swarm gets them: the canonical state in the rollout dtype."""
        return state_to_bytes(self.model, dtype=self.rollout_dtype)

    def publication_into(self, alloc: Callable[[int], B]) -> B:
        """The same bytes as `publication`, written straight into `alloc(size)` (e.g. a version's
        file, mapped): each tensor cast into its place, no whole-model copy on the way."""
        state = canonical_state(self.model)
        layout = state_layout(state, self.rollout_dtype)
        out = alloc(layout.size)
        write_state(state, layout, out)
        return out


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    # Inter-op threads default to the core count; one process per core wants one.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process; the first value stays


def config_fingerprint(config: Any) -> str:
    """SHA-256 of an HF config's architecture keys (not how it was loaded)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _LOAD_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def learner_policy(cfg: RunConfig) -> Policy:
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    task = build_task(cfg.task)
    if cfg.model.path is not None:
        # fp32 master weights whatever the rollout dtype (see the module rules).
        model, tokenizer = load_pretrained(cfg.model.path, dtype=torch.float32, device=device, chat=task.chat)
        spec = {
            "kind": "hf",
            "architecture": type(model).__name__,
            "config_sha256": config_fingerprint(model.config),
            "dtype": dtype_name(dtype),
        }
        return Policy(model, tokenizer, task, spec, tokenizer.to_dict(), dtype, device)
    if task.name != "addition" or task.chat:
        raise ValueError(
            f"the embedded model speaks only the addition task (its tokenizer has 13 characters); "
            f"task {task.name!r} needs a real model: --model PATH"
        )
    char_tokenizer = CharTokenizer()
    arch = tiny_llama_config(char_tokenizer.vocab_size)
    tiny = build_model(arch, seed=cfg.model.seed)
    if cfg.warmup.enabled:
        result = warmup(tiny, char_tokenizer, task, config=defaults.WARMUP, cache_dir=cfg.warmup.cache_dir)
        how = "loaded from cache" if result.cache_hit else f"trained in {result.seconds:.1f}s"
        log.info("supervised warm-up %s (%s)", how, result.cache_path)
    tiny.to(device)  # type: ignore[arg-type]  # transformers wraps Module.to in functools.wraps: mypy sees the unbound function
    spec = {"kind": "embedded", **arch, "dtype": dtype_name(dtype)}
    return Policy(tiny, char_tokenizer, task, spec, char_tokenizer.to_dict(), dtype, device)


def peer_task(task_id: str, own: TaskConfig, *, chat: bool = False) -> Task:
    """The run's task as this peer builds it (see the module rules); `chat`: the run's prompts
    go through the chat template (its tokenizer spec says so)."""
    if is_env_id(task_id):
        # A run of episodes has no task of its own: the peer plays the environment the id names
        # (echo_node/envs: `peer_env` checks it); the policy carries the default task, unused.
        return build_task(TaskConfig(chat=chat))
    name = task_id.split("@", 1)[0]
    if own.dataset is None and name in TASKS:
        task = build_task(TaskConfig(name=name, chat=chat))
    else:
        task = build_task(own)
    if task.task_id != task_id:
        raise ValueError(
            f"this run's task is {task_id!r}, this peer's task config gives {task.task_id!r}: "
            "use the run's task table (dataset file, prompt, rewards) in --config"
        )
    return task


def peer_policy(model_spec: dict[str, Any], tokenizer_spec: dict[str, Any], task_id: str, cfg: RunConfig) -> Policy:
    """The policy a joining peer runs for a run spec's model, tokenizer and task; ValueError,
    in one line with the remedy, when this peer cannot run it as the learner does."""
    # With vLLM the engine holds the GPU's copy; the policy's model is only checked against the
    # run's fingerprint, in host memory.
    device = torch.device("cpu") if cfg.rollout.engine == "vllm" else resolve_device(cfg.model.device)
    run_dtype = model_spec.get("dtype", "float32")
    if run_dtype not in DTYPES:
        raise ValueError(f"the run samples in {run_dtype!r}, which this echo-node does not know; upgrade echo-node")
    if cfg.model.dtype not in ("auto", run_dtype):
        raise ValueError(f"the run samples in {run_dtype}, this peer's model.dtype is {cfg.model.dtype}: set it to auto or {run_dtype}")
    dtype = DTYPES[run_dtype]
    task = peer_task(task_id, cfg.task, chat=bool(tokenizer_spec.get("chat")))
    kind = model_spec.get("kind")
    if kind == "embedded":
        arch = {k: v for k, v in model_spec.items() if k not in ("kind", "dtype")}
        model = build_model(arch).to(device=device, dtype=dtype)  # type: ignore[call-arg]  # (as in load_pretrained)
        return Policy(model, load_tokenizer(tokenizer_spec), task, model_spec, tokenizer_spec, dtype, device)
    if kind == "hf":
        path = cfg.model.path
        if path is None:
            raise ValueError(f"this run trains a {model_spec.get('architecture', 'Hugging Face')} model: pass --model PATH to the same local model")
        model, tokenizer = load_pretrained(path, dtype=dtype, device=device, chat=bool(tokenizer_spec.get("chat")))
        mismatch = _model_mismatch(model_spec, tokenizer_spec, model, tokenizer)
        if mismatch:
            raise ValueError(f"the model at {path} is not the run's model: {mismatch}")
        return Policy(model, tokenizer, task, model_spec, tokenizer_spec, dtype, device)
    raise ValueError(f"run spec names an unknown model kind {kind!r}; upgrade echo-node")


def _model_mismatch(spec: dict[str, Any], tokenizer_spec: dict[str, Any], model: PreTrainedModel, tokenizer: HFTokenizerAdapter) -> str | None:
    arch = type(model).__name__
    if spec.get("architecture") != arch:
        return f"architecture {arch}, the run's is {spec.get('architecture')}"
    if spec.get("config_sha256") != config_fingerprint(model.config):
        return "its config differs from the run's (another size or variant of the model)"
    if tokenizer_spec.get("sha256") != tokenizer.fingerprint():
        return "its tokenizer differs from the run's (vocabulary, special tokens or chat template)"
    return None


def build_engine(policy: Policy, cfg: RunConfig) -> Engine:
    """The rollout engine `rollout.engine` names, over this peer's policy."""
    tok = policy.tokenizer
    if cfg.rollout.engine == "vllm":
        from echo_node.ml.vllm_engine import VLLMEngine, check_vllm_available

        check_vllm_available()
        if cfg.model.path is None:
            raise ValueError("--engine vllm needs --model PATH (vLLM loads a Hugging Face model directory)")
        return VLLMEngine(cfg.model.path, dtype=dtype_name(policy.rollout_dtype), eos_id=tok.eos_id, pad_id=tok.pad_id, seed=cfg.seed)
    return TorchEngine(policy.model, eos_id=tok.eos_id, pad_id=tok.pad_id)
