"""The policy a role works with: model, tokenizer and task, built from config or from a run spec.

The learner builds it from its config (embedded tiny Llama, or `--model PATH`), warms the
embedded model up once (cached), and describes it in the run spec. A rollout peer rebuilds the
same architecture from that description; the weights always come from the learner afterwards,
so a peer never trusts its own initialisation. An `hf` model travels as a fingerprint of its
config: the peer needs the same local model directory (`--model PATH`), and a mismatch is a
clear error instead of silently sampling from a different network.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from echo_node.config import RunConfig
from echo_node.ml import defaults
from echo_node.ml.model import build_model, load_pretrained, tiny_llama_config
from echo_node.ml.tasks import Task, get_task
from echo_node.ml.tokenizer import CharTokenizer, Tokenizer, load_tokenizer
from echo_node.ml.warmup import warmup

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Policy:
    model: PreTrainedModel
    tokenizer: Tokenizer
    task: Task
    model_spec: dict[str, Any]
    tokenizer_spec: dict[str, Any]


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    # Inter-op threads default to the core count; one process per core wants one.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process; the first value stays


def _fingerprint(config: Any) -> str:
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def learner_policy(cfg: RunConfig) -> Policy:
    task = get_task(cfg.task)
    if cfg.model.path is not None:
        model, tokenizer = load_pretrained(cfg.model.path)
        spec = {"kind": "hf", "config_sha256": _fingerprint(model.config)}
        return Policy(model, tokenizer, task, spec, {"kind": "hf"})
    char_tokenizer = CharTokenizer()
    arch = tiny_llama_config(char_tokenizer.vocab_size)
    tiny = build_model(arch, seed=cfg.model.seed)
    if cfg.warmup.enabled:
        result = warmup(tiny, char_tokenizer, task, config=defaults.WARMUP, cache_dir=cfg.warmup.cache_dir)
        how = "loaded from cache" if result.cache_hit else f"trained in {result.seconds:.1f}s"
        log.info("supervised warm-up %s (%s)", how, result.cache_path)
    return Policy(tiny, char_tokenizer, task, {"kind": "embedded", **arch}, char_tokenizer.to_dict())


def peer_policy(model_spec: dict[str, Any], tokenizer_spec: dict[str, Any], task: str, model_path: str | None) -> Policy:
    kind = model_spec.get("kind")
    if kind == "embedded":
        arch = {k: v for k, v in model_spec.items() if k != "kind"}
        return Policy(build_model(arch), load_tokenizer(tokenizer_spec), get_task(task), model_spec, tokenizer_spec)
    if kind == "hf":
        if model_path is None:
            raise ValueError("this run trains a Hugging Face model: pass --model PATH to the same local model")
        model, tokenizer = load_pretrained(model_path)
        if _fingerprint(model.config) != model_spec.get("config_sha256"):
            raise ValueError(f"the model at {model_path} has a different config from the run's model")
        return Policy(model, tokenizer, get_task(task), model_spec, tokenizer_spec)
    raise ValueError(f"run spec names an unknown model kind {kind!r}; upgrade echo-node")
