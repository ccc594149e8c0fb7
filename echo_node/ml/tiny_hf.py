"""A tiny but real Hugging Face causal LM directory, built locally for tests and demos.

`build_tiny_model(out_dir)` writes what `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load offline: a ~0.85M-parameter Qwen2 (or Llama) with grouped-query
attention, and a byte-level BPE tokenizer trained here on a corpus generated in code. Nothing is
downloaded, so the `--model PATH` code paths (HF tokenizer, HF forward, GQA K/V repetition, Qwen2's
q/k/v biases, chat templates) can be exercised on any machine.

Invariants:
- Deterministic: the same arguments (and, with warm-up, the same torch thread count) give
  byte-identical `model.safetensors` and `tokenizer.json`. The tokenizer depends only on
  (family, vocab_size), never on `seed`, so models of different seeds share one vocabulary.
  The caller's global torch RNG is left untouched.
- `len(tokenizer) == model.config.vocab_size == vocab_size`: every id the model can sample decodes.
- Digits are always split one per token (as in Llama-3 and Qwen), so "37+05=" tokenizes the same
  whether or not an answer follows: prompt ids + answer ids == ids of prompt + answer.
- Special tokens, and where each family follows its namesake:
  qwen2: eos = pad = `<|endoftext|>`, no bos (Qwen2.5 base);
  llama: bos `<|begin_of_text|>` (added by the tokenizer's post-processor and the chat template),
         eos `<|end_of_text|>`, and a separate pad `<|pad|>`, so the two families cover both the
         pad == eos and the pad != eos conventions.
  Both have `<|im_start|>` / `<|im_end|>` and a ChatML chat template (Qwen's format, no default
  system message). The model's
  config and generation config carry the same ids; eos is the one token generation stops at.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from echo_node.ml.defaults import WarmupConfig
from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import ATTN_IMPLEMENTATION, load_pretrained
from echo_node.ml.rollout import mean_reward
from echo_node.ml.tasks import AdditionTask
from echo_node.ml.tokenizer import HFTokenizerAdapter
from echo_node.ml.warmup import warmup

Family = Literal["qwen2", "llama"]

# Supervised warm-up on addition, pinned here rather than taken from defaults.WARMUP (tuned for
# the embedded char-level Llama): `steps` comes from the caller.
_WARMUP = WarmupConfig(batch_size=64, lr=2e-3, ramp_steps=50)
# Warm-up steps for demos: for the default model (qwen2, seed 0) the sampled reward at T = 1 on
# addition lands mid-range (~0.4), so GRPO has signal to start from and room to improve. The step
# at which warm-up leaves its loss plateau varies with the seed (~150 to over 300 steps), so
# other seeds can land lower or higher (the llama family at seed 0 needs ~300 for ~0.2): measure
# with main().
DEMO_WARMUP_STEPS = 200

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Family -> (bos, eos, pad); bos None means the tokenizer has none.
_SPECIALS: dict[str, tuple[str | None, str, str]] = {
    "qwen2": (None, "<|endoftext|>", "<|endoftext|>"),
    "llama": ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"),
}

# ChatML as Qwen's template renders it, minus its default system message: tools, when given, as
# its system turn lists them (one JSON schema a line inside <tools></tools>, and the Hermes call
# syntax); `bos_token` renders empty for qwen2.
CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The corpus is fixed, independent of the model seed (module docstring).
_CORPUS_SEED = 0
_NAMES = ["Tom", "Anna", "Sam", "Mia", "Ben", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora"]
_HE_SHE = {"Tom": "he", "Sam": "he", "Ben": "he", "Max": "he", "Leo": "he", "Jack": "he"}
_ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stickers", "coins", "cards",
          "oranges", "shells", "stamps", "balloons"]
_GENERIC = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns to add numbers one digit at a time.",
    "Please answer the question and explain your reasoning.",
    "The answer is the sum of the two numbers.",
    "Every morning the children walk to school together.",
    "Water boils at one hundred degrees at sea level.",
    "She read the letter twice before she wrote back.",
    "The weather today is sunny with a light wind from the west.",
    "Reinforcement learning rewards the model for correct answers.",
    "You are a helpful assistant.",
    "Hello! How can I help you today?",
    "Thank you, that was very useful.",
]


def _corpus() -> list[str]:
    """Lines of arithmetic, word problems and generic text, the same on every call."""
    rng = random.Random(_CORPUS_SEED)
    lines: list[str] = []
    for _ in range(3000):
        a, b = rng.randrange(100), rng.randrange(100)
        lines.append(f"{a:02d}+{b:02d}={a + b:03d}")
    for _ in range(1000):
        a, b = rng.randrange(1000), rng.randrange(1000)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {value}")
    for _ in range(2000):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        pronoun = _HE_SHE.get(name, "she")
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        if rng.random() < 0.5:
            lines.append(
                f"{name} has {a} {item} and buys {b} more. "
                f"How many {item} does {pronoun} have? {a + b}"
            )
        else:
            a, b = max(a, b), min(a, b)
            lines.append(
                f"{name} had {a} {item} and gave {b} to a friend. "
                f"How many {item} are left? {a - b}"
            )
    lines.extend(_GENERIC * 20)
    return lines


def build_tokenizer(family: Family, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, specials first (ids 0, 1, ...)."""
    bos, eos, pad = _SPECIALS[family]
    specials = list(dict.fromkeys(t for t in (bos, eos, pad, IM_START, IM_END) if t is not None))
    n_base = len(specials) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= n_base:
        raise ValueError(f"vocab_size must exceed {n_base} (specials + 256 bytes), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    # Digits first, one per token; then GPT-2's byte-level split, without a prefix space so a
    # prompt's first token is the same as mid-text.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the built-in corpus yields {backend.get_vocab_size()} tokens, fewer than vocab_size "
            f"{vocab_size}; ask for a smaller vocabulary"
        )
    if bos is not None:
        # Llama-3's post-processor: `tokenizer(text)` prepends bos; `encode(add_special_tokens=False)`
        # (what HFTokenizerAdapter uses) does not.
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    family: Family, vocab_size: int, *, bos_id: int | None, eos_id: int, pad_id: int
) -> Qwen2Config | LlamaConfig:
    """~0.85M parameters: 4 layers of width 128, 8 query heads of 16 dims over 4 K/V heads (GQA).

    Measured on 2-digit addition: with 4 query heads over 2 K/V heads (same width) the supervised
    warm-up stays on a loss plateau past 400 steps (sampled reward < 0.1); 8 over 4 leaves it
    after ~150 steps, like the embedded Llama without GQA.
    """
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    # Each family's own norm epsilon; Qwen2's q/k/v biases are its default and stay on.
    if family == "qwen2":
        return Qwen2Config(**common, rms_norm_eps=1e-6)
    return LlamaConfig(**common, rms_norm_eps=1e-5)


def build_tiny_model(
    out_dir: Path,
    *,
    family: Family = "qwen2",
    seed: int = 0,
    vocab_size: int = 512,
    warmup_steps: int = 0,
) -> Path:
    """Build, optionally warm up on addition, and save a tiny model + tokenizer into `out_dir`."""
    if family not in _SPECIALS:
        raise ValueError(f"unknown family {family!r}; expected one of {list(_SPECIALS)}")
    tokenizer = build_tokenizer(family, vocab_size)
    bos_id, eos_id, pad_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    config = tiny_config(family, vocab_size, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    config._attn_implementation = ATTN_IMPLEMENTATION
    # fork_rng: HF initializes from the global RNG; seeding it in place would silently reseed
    # whatever the caller was doing.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = Qwen2ForCausalLM(config) if isinstance(config, Qwen2Config) else LlamaForCausalLM(config)
    model.float()
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    if warmup_steps > 0:
        adapter = HFTokenizerAdapter(tokenizer)
        warm = dataclasses.replace(_WARMUP, steps=warmup_steps, seed=seed)
        warmup(model, adapter, AdditionTask(), config=warm, cache_dir=None)
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sampled_addition_reward(
    model_dir: Path, *, n_prompts: int = 512, temperature: float = 1.0, seed: int = 0
) -> float:
    """Mean reward of one sampled completion per addition prompt, for the model in `model_dir`."""
    model, tokenizer = load_pretrained(str(model_dir))
    engine = TorchEngine(model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    task = AdditionTask()
    prompts = task.sample_prompts(n_prompts, random.Random(seed))
    return mean_reward(engine, tokenizer, task, prompts, temperature=temperature, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m echo_node.ml.tiny_hf", description="Build a tiny local HF causal LM."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=get_args(Family), default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=0, help=f"demos use {DEMO_WARMUP_STEPS}")
    args = parser.parse_args(argv)
    # The project pins torch threads explicitly; one thread also keeps warm-up deterministic.
    torch.set_num_threads(1)
    # The one line below is the report; save_pretrained's shard progress bar would only clutter it.
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    out = build_tiny_model(args.out_dir, family=args.family, seed=args.seed, warmup_steps=args.warmup_steps)
    seconds = time.perf_counter() - t0
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    line = f"{out}: {args.family}, {n_params:,} parameters"
    if args.warmup_steps > 0:
        reward = sampled_addition_reward(out)
        line += f", {args.warmup_steps} warm-up steps, sampled addition reward {reward:.3f} (T=1, 512 prompts)"
    line += f", built in {seconds:.1f} s"
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
