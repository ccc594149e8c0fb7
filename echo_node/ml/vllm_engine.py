"""vLLM as the rollout engine: the `Engine` seam (echo_node/ml/engine.py) over `vllm.LLM` on a GPU.

What it guarantees, against TorchEngine and the seam's conventions (engine.py's docstring); the
vLLM source each claim rests on is named (read in vLLM's recent V1-engine source, not pinned to a
release, so re-check on a version bump):

- Log-probs. The engine runs with `logprobs_mode="processed_logprobs"` and every request asks for
  `logprobs=0` (the sampled token's only). "Processed" is taken after temperature *and* top-k /
  top-p: the V1 sampler divides the float32 logits by T, masks them with top-k/top-p, and returns
  log_softmax of the masked logits (vllm/v1/sample/sampler.py `Sampler.sample`,
  vllm/v1/sample/ops/topk_topp_sampler.py `forward_native`; the engine-args doc of
  `--logprobs-mode`: "after applying all processors, including temperature and top_k/top_p").
  With top_p == 1 (top_k, min_p and the penalties stay at their neutral defaults here) that is
  exactly log_softmax(logits / T)[token], the seam's convention and what the learner recomputes;
  greedy (T == 0) reports log_softmax(logits), the T = 1 log-probs, as TorchEngine does. With
  top_p < 1 vLLM reports the *truncated* log-prob, log p_T(token) - log(mass of the nucleus),
  which the learner does not recompute, and no mode gives the untruncated one at a sane cost
  (processed_logits are -inf outside the nucleus, raw_* are taken before the temperature, and
  the whole vocabulary per token is V floats). So `generate` refuses top_p < 1: a peer fails
  loudly instead of publishing log-probs the learner's spot check would rightly reject. vLLM also
  raises 0 < T < 0.01 to 0.01 with only a log line (vllm/sampling_params.py `__post_init__`), so
  those temperatures are refused too.
- Stop at eos inclusive. No tokenizer runs (`skip_tokenizer_init`) and the model's generation
  config is not read (`generation_config="vllm"`), so the only stop token is the one passed,
  `stop_token_ids=[eos_id]` (an eos list in generation_config.json would add stop tokens
  TorchEngine does not have). A stop token stays in `CompletionOutput.token_ids`
  (vllm/v1/engine/detokenizer.py appends it back; vllm/v1/core/sched/utils.py `check_stop`
  ends the request after appending it). `completion_from_vllm` cuts at the first eos anyway.
- Version tags. A vLLM request cannot be paused between two decode steps from outside, so a call
  runs in chunks of `chunk_tokens` tokens: every unfinished row is continued as a new request
  (its prompt + its tokens so far) and the `swap` hook is called between chunks, never before the
  first, in the calling thread. Every token of a chunk is tagged with the version loaded when the
  chunk started and was sampled from exactly those weights given its whole prefix: weights change
  only between `LLM.generate` calls, and loading weights resets vLLM's prefix cache (a block's
  hash covers its parent's hash, its token ids and LoRA / multimodal / salt keys, never the
  weights: vllm/v1/core/kv_cache_utils.py `hash_block_tokens`), so a chunk after a swap
  re-prefills every row's prefix with the new weights. That is TorchEngine's guarantee (token i tagged v was sampled from pi_v
  given its prefix) at a coarser grain: a swap takes effect up to `chunk_tokens` - 1 tokens later
  than TorchEngine's per-step hook would take it. Without the prefix cache a continuation would
  re-prefill its whole prefix; with it, only the tail past the last full cached block. A call
  without a hook runs as one chunk.
- Weight swap. `load_weights` checks the state against the model directory's checkpoint before
  anything reaches vLLM: the same names (our canonical state's are the ones `save_pretrained`
  writes) and shapes, so a state that does not fit leaves the engine as it was. It then sends the
  tensors, cast to the engine's dtype, to vLLM's worker through a `worker_extension_cls` mixin
  (vLLM's mechanism for RL weight updates: examples/offline_inference/rlhf_utils.py; the mixin is
  injected by vllm/v1/worker/worker_base.py), which calls the model's own
  `load_weights(iterable of (HF name, tensor))` (vLLM's loaders fold q/k/v and gate/up into its
  fused parameters in place, and skip `lm_head.` when the embeddings are tied, the head then
  being the embedding module: vllm/model_executor/models/qwen2.py, llama.py) and checks, as vLLM's
  own loader does (model_loader/default_loader.py), that every parameter was written. The
  tensors travel as safetensors bytes through `collective_rpc` (msgpack carries bytes natively, no
  pickling: vllm/v1/serial_utils.py), in pieces under msgpack's 4 GiB limit.
- Determinism. With a seed, every request gets its own seed derived from (seed, chunk, row), so a
  call is reproducible up to vLLM's numerics (its kernels are not batch-invariant by default);
  it never draws TorchEngine's samples for the same seed (another RNG and sampling algorithm).
- Not thread-safe, like TorchEngine: `load_weights` and `generate` belong to one thread (the
  swap hook runs in it).

Never run against vLLM where this was written (no GPU, vLLM not installable). On the CPU
(tests/unit/test_vllm_engine.py): the pure parts (weight mapping, checkpoint checks, output
conversion, the chunk loop, also with TorchEngine as the per-chunk sampler), the worker mixin
against a fake worker, and `VLLMEngine`'s glue against a fake `vllm` module, which checks our
side of the calls only. Whether vLLM honours them is for tests/gpu/test_vllm_gpu.py, on a CUDA
machine with vLLM installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from torch import Tensor

from echo_node.ml.device import DTYPES
from echo_node.ml.engine import Generation, SwapHook, WeightState
from echo_node.ml.model import cast_state, tensors_to_bytes

# Tokens per chunk when a swap hook is given: a swap waits at most this many - 1 tokens, and each
# chunk boundary costs one scheduling round and a re-prefill of at most one KV block per row.
DEFAULT_CHUNK_TOKENS = 64
# vLLM raises a temperature in (0, this) to this (vllm/sampling_params.py `_MAX_TEMP`).
VLLM_MIN_TEMPERATURE = 1e-2
# One `collective_rpc` message carries at most this many tensor bytes (msgpack's bin type tops out
# at 4 GiB; a single larger tensor still goes alone and fails there, loudly).
_PIECE_BYTES = 1 << 30
# Checkpoint tensors vLLM's loaders skip and our canonical state never holds (older checkpoints
# saved rotary tables; transformers keeps them non-persistent now).
_SKIPPED_CHECKPOINT_KEYS = ("rotary_emb.inv_freq",)
_TIED_HEAD = "lm_head.weight"


def check_vllm_available() -> None:
    """Raise a one-line RuntimeError (the caller prints it) unless `--engine vllm` can run here."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--engine vllm needs vLLM: pip install 'echo-node[vllm]'")
    if not torch.cuda.is_available():
        raise RuntimeError("--engine vllm needs a CUDA GPU; use --engine torch on CPU")


# ---------------------------------------------------------------------------------------------
# Weights: our canonical state -> what vLLM's `model.load_weights` takes.


def vllm_weight_items(tensors: Mapping[str, Tensor], *, tied: bool, dtype: torch.dtype) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs for vLLM's `model.load_weights`: HF names as they are (vLLM's loaders
    map them onto its fused parameters), on the CPU with floating tensors cast to the engine's
    `dtype` (vLLM would cast on copy anyway; casting first halves what travels for an fp32 state),
    and, for tied embeddings, no `lm_head.weight`: our canonical state never has it and vLLM
    skips `lm_head.` for tied models, so a full state_dict's alias is dropped, not shipped."""
    kept = {name: t for name, t in tensors.items() if not (tied and name == _TIED_HEAD)}
    return list(cast_state(kept, dtype).items())


def checkpoint_shapes(model_dir: Path, *, tied: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a state for this model must carry, read from the safetensors
    headers `save_pretrained` wrote (`model.safetensors`, or the shards its index names).

    Rule: those names are the canonical state's (model.py: both drop tied aliases); keys vLLM's
    loaders skip (`rotary_emb.inv_freq`) and, for tied embeddings, `lm_head.weight` are left out.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{model_dir}: no model.safetensors (or index); VLLMEngine checks states against it")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                if any(skip in key for skip in _SKIPPED_CHECKPOINT_KEYS) or (tied and key == _TIED_HEAD):
                    continue
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_state_fits(items: Sequence[tuple[str, Tensor]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError unless `items` holds exactly the `expected` names with their shapes, so a state
    that does not fit is refused before any of it reaches vLLM (no half-loaded model)."""
    names = {name for name, _ in items}
    missing, extra = sorted(expected.keys() - names), sorted(names - expected.keys())
    if missing or extra:
        raise ValueError(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in items:
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name}: got shape {tuple(t.shape)}, the model has {expected[name]}")


def weight_pieces(items: Sequence[tuple[str, Tensor]], *, max_bytes: int = _PIECE_BYTES) -> list[bytes]:
    """`items` as safetensors blobs of at most `max_bytes` tensor bytes each (one message each),
    in order; a tensor larger than `max_bytes` goes alone."""
    pieces: list[bytes] = []
    group: dict[str, Tensor] = {}
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > max_bytes:
            pieces.append(tensors_to_bytes(group))
            group, size = {}, 0
        group[name] = t
        size += nbytes
    if group:
        pieces.append(tensors_to_bytes(group))
    return pieces


class VLLMWorkerExtension:
    """Mixed into vLLM's GPU worker (`LLM(worker_extension_cls=...)`), in the engine-core process;
    its methods are called by name through `LLM.collective_rpc`. vLLM refuses an extension whose
    attribute names clash with the worker's, hence the `echo_` prefix.

    A load is begin, pieces, end: the set of parameters written accumulates over the pieces and
    `echo_weights_end` returns the ones never written (vLLM's own loader makes the same check)."""

    def echo_weights_begin(self) -> None:
        self._echo_written: set[str] | None = set()

    def echo_weights_piece(self, blob: bytes) -> None:
        model = cast(Any, self).model_runner.model
        written = model.load_weights(weights=list(st_load(bytes(blob)).items()))
        # A model whose loader does not report what it wrote (None) cannot be checked.
        self._echo_written = None if written is None or self._echo_written is None else self._echo_written | written

    def echo_weights_end(self) -> list[str]:
        model = cast(Any, self).model_runner.model
        if self._echo_written is None:
            return []
        return sorted({name for name, _ in model.named_parameters()} - self._echo_written)


# ---------------------------------------------------------------------------------------------
# Outputs: vLLM's per-request result -> our (tokens, log-probs).


def completion_from_vllm(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None, *, eos_id: int
) -> tuple[list[int], list[float]]:
    """The sampled tokens and their log-probs, up to and including the first eos.

    `logprobs` is vLLM's `CompletionOutput.logprobs`: per position a dict token id -> Logprob (an
    object with `.logprob`) that holds at least the sampled token (`logprobs=0` asks for it only).
    A missing dict, a position without the sampled token or a non-finite value is a RuntimeError:
    a rollout with a made-up log-prob must never be published.
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (the request must set SamplingParams.logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens but {len(logprobs)} log-prob entries")
    ids: list[int] = []
    lps: list[float] = []
    for pos, (token, entry) in enumerate(zip(token_ids, logprobs)):
        token = int(token)
        if token not in entry:
            raise RuntimeError(f"vLLM's log-probs at position {pos} lack the sampled token {token}")
        lp = float(entry[token].logprob)
        if not math.isfinite(lp):
            raise RuntimeError(f"vLLM's log-prob of token {token} at position {pos} is {lp}")
        ids.append(token)
        lps.append(lp)
        if token == eos_id:
            break
    return ids, lps


# ---------------------------------------------------------------------------------------------
# The chunk loop (pure: vLLM enters only through `sample`).


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    """One row's continuation: its prompt + its tokens so far, and its own seed (None: unseeded)."""

    context: list[int]
    seed: int | None


# (requests, max_tokens) -> per request (tokens, log-probs): at most max_tokens tokens, ending at
# the first eos if there is one; fewer than max_tokens without eos means the row cannot go on
# (vLLM ran into the model's context length).
ChunkSampler = Callable[[list[ChunkRequest], int], list[tuple[list[int], list[float]]]]


class Swappable(Protocol):
    """What the chunk loop needs of an engine besides sampling: `Engine`'s weight half."""

    version: int

    def load_weights(self, state: WeightState, version: int) -> None: ...


def row_seed(seed: int, chunk: int, row: int) -> int:
    """A 63-bit seed for (call seed, chunk, row): distinct streams for every request of a call,
    the same ones for the same call."""
    digest = hashlib.blake2b(f"{seed}/{chunk}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_chunks(
    engine: Swappable,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    chunk_tokens: int,
    eos_id: int,
    seed: int | None,
    sample: ChunkSampler,
    swap: SwapHook | None,
) -> list[Generation]:
    """Generate in chunks of `chunk_tokens`, calling `swap` between chunks (module docstring).

    Rules: before every chunk but the first the hook may hand over weights, loaded into `engine`
    at once; every token of a chunk is tagged with `engine.version` as it stood when the chunk's
    sampling began; a row leaves the loop at eos, at `max_new_tokens`, or when `sample` returns
    fewer tokens than asked for. Rows still open after a chunk all hold the same number of tokens,
    so every chunk asks all of them for the same count.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    gens = [Generation(completion_ids=[], logprobs=[], token_versions=[]) for _ in prompts]
    open_rows = list(range(len(prompts)))
    produced = 0
    chunk = 0
    while open_rows and produced < max_new_tokens:
        if chunk > 0 and swap is not None:
            update = swap()
            if update is not None:
                engine.load_weights(*update)
        version = engine.version
        budget = min(chunk_tokens, max_new_tokens - produced)
        requests = [
            ChunkRequest(prompts[r] + gens[r].completion_ids, None if seed is None else row_seed(seed, chunk, r))
            for r in open_rows
        ]
        completions = sample(requests, budget)
        if len(completions) != len(requests):
            raise RuntimeError(f"the sampler answered {len(completions)} of {len(requests)} requests")
        still_open = []
        for r, (ids, lps) in zip(open_rows, completions):
            if len(ids) != len(lps) or len(ids) > budget:
                raise RuntimeError(f"the sampler gave {len(ids)} tokens and {len(lps)} log-probs for {budget} asked")
            gen = gens[r]
            gen.completion_ids.extend(ids)
            gen.logprobs.extend(lps)
            gen.token_versions.extend([version] * len(ids))
            if len(ids) == budget and ids[-1] != eos_id:
                still_open.append(r)
        open_rows = still_open
        produced += budget
        chunk += 1
    return gens


def check_sampling(prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ValueError for a call this engine cannot serve under the seam's conventions (module
    docstring: why top_p < 1 and 0 < T < 0.01 are refused)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (bos)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(
            f"temperature must be 0 (greedy) or >= {VLLM_MIN_TEMPERATURE:g} with vLLM "
            f"(it silently raises smaller ones), got {temperature}"
        )
    if top_p != 1.0:
        raise ValueError(
            f"--engine vllm needs top_p = 1, got {top_p}: vLLM's log-probs with top_p < 1 are those of "
            "the truncated distribution, not the tempered one the learner recomputes; use --engine torch"
        )


# ---------------------------------------------------------------------------------------------
# The engine.


class VLLMEngine:
    """The `Engine` seam over `vllm.LLM` (module docstring: guarantees, and what was never run)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        eos_id: int,
        pad_id: int,
        version: int = 0,
        gpu_memory_utilization: float = 0.5,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        seed: int = 0,
        enforce_eager: bool = False,
    ) -> None:
        """`dtype`: a rollout dtype name (echo_node/ml/device.py), what vLLM runs in and casts
        loaded weights to. `pad_id` is kept for the seam's symmetry with TorchEngine: vLLM pads
        nothing. `seed` seeds vLLM's own RNG (unseeded calls draw from it). `enforce_eager`: no
        torch.compile nor CUDA-graph capture, a faster start for a slower decode (tests)."""
        from transformers import AutoConfig
        from vllm import LLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        path = Path(model_path)
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self._tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        self._expected = checkpoint_shapes(path, tied=self._tied)
        self._dtype = DTYPES[dtype]
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.version = version
        self.chunk_tokens = chunk_tokens
        self._llm = LLM(
            model=str(path),
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            generation_config="vllm",
            enforce_eager=enforce_eager,
            worker_extension_cls=f"{__name__}.{VLLMWorkerExtension.__qualname__}",
        )

    def load_weights(self, state: WeightState, version: int) -> None:
        """Swap weights in place (module docstring); a state that does not fit is a ValueError
        and leaves the engine as it was."""
        if isinstance(state, (bytes, bytearray, memoryview)):
            try:
                tensors = st_load(bytes(state))
            except Exception as exc:  # safetensors raises its own error types for malformed blobs
                raise ValueError(f"not a safetensors blob: {exc}") from exc
        else:
            tensors = state
        items = vllm_weight_items(tensors, tied=self._tied, dtype=self._dtype)
        check_state_fits(items, self._expected)
        self._llm.collective_rpc("echo_weights_begin")
        for blob in weight_pieces(items):
            self._llm.collective_rpc("echo_weights_piece", args=(blob,))
        unwritten = sorted({name for names in self._llm.collective_rpc("echo_weights_end") for name in names})
        if unwritten:
            raise RuntimeError(
                f"vLLM left parameters unwritten ({unwritten[:5]}): the engine now mixes two versions; rebuild it"
            )
        # K/V cached under the old weights must never serve a prefix again. False means blocks
        # were still in use (older vLLM versions return None: nothing to check there).
        if self._llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM kept its prefix cache (requests still running): stale K/V could be reused")
        self.version = version

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        swap: SwapHook | None = None,
    ) -> list[Generation]:
        """A completion per prompt, in order; `swap` is taken between chunks (module docstring)."""
        check_sampling(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        return run_chunks(
            self,
            prompts,
            max_new_tokens=max_new_tokens,
            chunk_tokens=self.chunk_tokens if swap is not None else max_new_tokens,
            eos_id=self.eos_id,
            seed=seed,
            sample=partial(self._sample, temperature=temperature),
            swap=swap,
        )

    def _sample(
        self, requests: list[ChunkRequest], max_tokens: int, *, temperature: float
    ) -> list[tuple[list[int], list[float]]]:
        """One `LLM.generate` call: a request per row (vLLM runs `n` samples as n requests anyway,
        vllm/v1/engine/parallel_sampling.py, and the prefix cache shares a repeated prompt's
        blocks), outputs in request order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=1.0,
                max_tokens=max_tokens,
                logprobs=0,
                seed=r.seed,
                stop_token_ids=[self.eos_id],
                detokenize=False,
            )
            for r in requests
        ]
        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=r.context) for r in requests], params, use_tqdm=False
        )
        return [
            completion_from_vllm(out.outputs[0].token_ids, out.outputs[0].logprobs, eos_id=self.eos_id)
            for out in outputs
        ]
