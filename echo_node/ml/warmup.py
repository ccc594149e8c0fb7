"""Supervised warm-up before RL, cached on disk.

GRPO needs some reward signal to start from: from a ~0-reward policy every group is all-zero,
advantages vanish and RL stalls or collapses (docs/platform.md). A short teacher-forced phase on
(prompt, answer) pairs lifts the sampled reward to a middle value first.

Invariants:
- Deterministic given (initial weights, task, tokenizer, config) on one torch thread: the data
  comes from `random.Random(config.seed)` and CPU kernels are deterministic single-threaded.
- The cache key hashes everything the result depends on — the initial weights' bytes, the model
  config, the tokenizer spec, the task name, the warm-up config and torch major.minor — so a
  changed input never loads a stale cache, and an unchanged one loads instantly.
- The cache file is written to a temp name and `os.replace`d: a crash or a concurrent writer can
  never leave a torn file under the final name. This is the module's only I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from echo_node.ml.defaults import WARMUP, WarmupConfig
from echo_node.ml.model import canonical_state, load_state_tensors, state_to_bytes
from echo_node.ml.tasks import Task
from echo_node.ml.tokenizer import Tokenizer

_FORMAT = 1  # bump when the warm-up procedure changes, to invalidate old caches


@dataclass(frozen=True, slots=True)
class WarmupResult:
    cache_path: Path
    cache_hit: bool
    steps: int
    seconds: float
    final_loss: float


def cache_key(model: torch.nn.Module, tokenizer: Tokenizer, task: Task, config: WarmupConfig) -> str:
    h = hashlib.sha256()
    h.update(state_to_bytes(model))
    model_config = getattr(model, "config", None)
    spec = {
        "format": _FORMAT,
        "arch": model_config.to_diff_dict() if model_config is not None else None,
        "tokenizer": tokenizer.to_dict(),
        "task": task.name,
        "warmup": dataclasses.asdict(config),
        "torch": ".".join(torch.__version__.split(".")[:2]),
    }
    h.update(json.dumps(spec, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def supervised_batch(
    tokenizer: Tokenizer, pairs: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) right-padded; labels are -100 except on the answer tokens and eos."""
    rows = [(tokenizer.encode_prompt(p), tokenizer.encode(a) + [tokenizer.eos_id]) for p, a in pairs]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    return ids, labels


def _train(
    model: torch.nn.Module, tokenizer: Tokenizer, task: Task, config: WarmupConfig
) -> float:
    rng = random.Random(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    # Linear ramp, then constant: without a ramp the tiny Llama stalls on a loss plateau for
    # hundreds of steps; a decay to 0 would make the end point depend on the total step count.
    ramp = max(config.ramp_steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / ramp))
    model.train()
    loss_value = float("nan")
    for _ in range(config.steps):
        ids, labels = supervised_batch(tokenizer, task.supervised_pairs(config.batch_size, rng))
        logits = model(input_ids=ids, use_cache=False).logits
        # Shift: the logits at position t predict the token at t + 1.
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def warmup(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    task: Task,
    *,
    config: WarmupConfig = WARMUP,
    cache_dir: Path | None,
) -> WarmupResult:
    """Warm `model` up in place (or load the cached result); `cache_dir=None` disables the cache.

    Steps, not seconds, bound the phase: a wall-clock budget would make the result (and the
    cache) depend on machine load.
    """
    key = cache_key(model, tokenizer, task, config)
    path = Path(cache_dir or ".") / f"warmup-{task.name}-{key}.safetensors"
    if cache_dir is not None and path.exists():
        with safe_open(str(path), framework="pt") as f:
            final_loss = float((f.metadata() or {}).get("final_loss", "nan"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        load_state_tensors(model, tensors)
        return WarmupResult(path, True, config.steps, 0.0, final_loss)
    t0 = time.perf_counter()
    final_loss = _train(model, tokenizer, task, config)
    seconds = time.perf_counter() - t0
    if cache_dir is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in canonical_state(model).items()}
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(st_save(tensors, metadata={"final_loss": repr(final_loss)}))
        os.replace(tmp, path)
    return WarmupResult(path, False, config.steps, seconds, final_loss)
