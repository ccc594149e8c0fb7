"""The trained policy as a Hugging Face model directory: what a run leaves for people to use.

`export_pretrained` writes `save_pretrained` output (config, safetensors weights, generation
config, tokenizer) that `AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`
and vLLM load as they are, with no echo-node code.

Rules:
- Weights are written in the run's rollout dtype (what the swarm sampled with; half the bytes of
  the fp32 master weights for a bf16 run), and config.json says so.
- A reader (or a crash) never sees half an export: the directory is written under a temp name
  next to it, then renamed into place (the old one first renamed aside, then deleted).
- The embedded character tokenizer is exported as an equivalent fast tokenizer (one token per
  character, the same ids, bos added by `encode`), so the embedded policy is usable as well.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from echo_node.ml.device import dtype_name
from echo_node.ml.model import canonical_state, cast_state
from echo_node.ml.tokenizer import CharTokenizer, HFTokenizerAdapter
from echo_node.ml.tokenizer import Tokenizer as PolicyTokenizer

_CHAR_SPECIALS = ("<pad>", "<s>", "</s>")


def char_tokenizer_to_hf(tok: CharTokenizer) -> PreTrainedTokenizerFast:
    """A fast tokenizer with `tok`'s ids: specials pad=0, bos=1, eos=2, then one id per character;
    `encode(text)` gives `tok.encode_prompt(text)` and `decode` drops the specials."""
    vocab = {name: i for i, name in enumerate(_CHAR_SPECIALS)}
    vocab.update({ch: i + len(_CHAR_SPECIALS) for i, ch in enumerate(tok.alphabet)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def export_pretrained(
    model: PreTrainedModel,
    tokenizer: PolicyTokenizer,
    out_dir: Path,
    *,
    dtype: torch.dtype,
    meta: dict[str, Any] | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` (cast to `dtype`) and `tokenizer` as a save_pretrained directory at
    `out_dir`, atomically; `meta` (run id, version, ...) goes to `echo_node.json` beside them.
    `state`: the canonical weights to write instead of the model's own (a copy taken earlier);
    the model then gives only its config and class."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Only the canonical tensors (no tied aliases), on the CPU in the rollout dtype: one copy of
    # the weights, never a second model.
    state = cast_state(canonical_state(model) if state is None else state, dtype)
    # save_pretrained draws a progress bar per call: one per checkpoint in a learner's log.
    hf_logging.disable_progress_bar()
    model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    # The config written above says the master weights' dtype; the file holds `dtype`.
    config_path = tmp / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype_name(dtype)
    config.pop("torch_dtype", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    hf = tokenizer.hf if isinstance(tokenizer, HFTokenizerAdapter) else None
    if hf is None and isinstance(tokenizer, CharTokenizer):
        hf = char_tokenizer_to_hf(tokenizer)
    if hf is None:
        raise ValueError(f"cannot export a {type(tokenizer).__name__} as a Hugging Face tokenizer")
    hf.save_pretrained(tmp)
    if meta is not None:
        (tmp / "echo_node.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir
