"""The generation engine seam, and the torch engine behind it (CPU or CUDA, any HF causal LM).

`Engine` is the whole interface a rollout peer uses, so the torch sampler here and a vLLM engine
(GPU) are interchangeable; the learner never learns which one produced a rollout.

Conventions (every engine keeps them):
- Prompt ids come in complete: the caller adds bos (`Tokenizer.encode_prompt`); engines add nothing.
- A completion stops at eos *inclusive*: the eos id and its log-prob are the last entries. A
  completion that hits `max_new_tokens` first simply ends without eos.
- `logprobs[i]` = log_softmax(logits / T)[token_i], the *tempered, untruncated* distribution, even
  when top_p < 1 — exactly what the learner's `sequence_logprobs(..., temperature=T)` recomputes.
  (vLLM's `processed_logprobs` are after the top-p cut too, so `VLLMEngine` refuses top_p < 1.)
  temperature == 0 means greedy and log-probs are then those of T = 1.
- `token_versions[i]` is the weight version that sampled token i. Generation is interruptible
  (AReaL, PipelineRL): before each decode step (never before the prefill) the engine calls the
  optional `swap` hook; when it hands over `(state, version)` the engine loads those weights
  between two steps, in the generating thread (no forward pass sees half-loaded weights), drops
  its KV cache and re-prefills every row's prompt and tokens so far with the new weights. So
  token i tagged v was sampled from exactly pi_v given its whole prefix: the learner's
  recomputation at v reproduces `logprobs[i]`. Rows that finished before a swap keep their
  tokens and tags; the hook, not the engine, decides which versions are worth taking.
- Generation is abandonable between decoding steps the same way: a `swap` hook that raises
  `GenerationCancelled` ends the call there (a peer stopping mid-batch: echo_node/peer/rollout_peer.py).
  The exception propagates out of `generate`; the engine keeps nothing of the abandoned call
  (every call starts its own cache), so the next call is unaffected.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from echo_node.ml.model import load_state_tensors, state_tensors

if TYPE_CHECKING:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

# What `load_weights` accepts: our safetensors blob (as received, possibly a view) or tensors.
WeightState = bytes | bytearray | memoryview | dict[str, Tensor]
# Called by the generation loop before each decode step: None to go on, or new weights.
SwapHook = Callable[[], tuple[WeightState, int] | None]


class GenerationCancelled(Exception):
    """Raised by a `swap` hook to abandon a `generate` call between two decoding steps."""


@dataclass(slots=True)
class Generation:
    completion_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]


class Engine(Protocol):
    version: int

    def load_weights(self, state: WeightState, version: int) -> None: ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        swap: SwapHook | None = None,
    ) -> list[Generation]: ...


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: transformers 5.x renamed `past_key_values` to
    `cache` and warns on the old name (an error under our filterwarnings=error)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Mask (to -inf) tokens outside the smallest set whose probability mass reaches top_p."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the mass *before* it already reaches top_p; the top token always stays.
    drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _prefill_mask(key_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive causal mask [B, 1, T, T] over left-padded rows (T = key_mask's width).

    Query i sees slots <= i that are not padding; each slot also sees itself, so a padding query
    never has an all-masked row (SDPA would give NaN there, and NaN in a padding slot's K/V would
    leak through 0-weight products). Additive float: measured ~7% faster in CPU SDPA than boolean;
    in the model's dtype, as SDPA wants the mask in the query's.
    """
    width, device = key_mask.shape[1], key_mask.device
    slots = torch.arange(width, device=device)
    allowed = (slots.unsqueeze(0) <= slots.unsqueeze(1)).unsqueeze(0) & key_mask[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool, device=device).unsqueeze(0)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's LlamaRMSNorm op for op, so the lean forwards round as it does: the statistics in
    float32, the result cast back to the input's dtype before the weight multiplies it (both
    casts are no-ops in float32)."""
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def is_lean_llama(model: torch.nn.Module) -> bool:
    """Whether the lean Llama forwards (this engine's stepper, the learner's training forward)
    reproduce `model`'s own: exactly a LlamaForCausalLM (a subclass may change the forward) with
    SiLU MLPs."""
    from transformers import LlamaForCausalLM

    return type(model) is LlamaForCausalLM and getattr(model.config, "hidden_act", "") == "silu"


class _Stepper(Protocol):
    def start(self, key_mask: Tensor, position_ids: Tensor) -> None:
        """Begin a sequence batch: `key_mask` [B, S] is False on left padding, `position_ids`
        [B, S] the position of every slot; S bounds the sequence. Drops any cache."""

    def forward(self, input_ids: Tensor, rows: Tensor | None = None) -> Tensor:
        """Append `input_ids` [b, T] at the next T slots; return last-position logits [b, V].

        `rows`: on the first forward only, the batch rows `input_ids` stand for (b < B); the
        cache then holds those rows until `expand` maps them back onto the whole batch.
        """

    def expand(self, index: Tensor) -> None:
        """Row r of the batch becomes cache row `index[r]` (after a forward with `rows`)."""


class LlamaLayerWeights(NamedTuple):
    """One Llama decoder layer's weights as plain tensors, q/k/v and gate/up concatenated (one
    matmul each instead of three and two), for the lean forwards (this engine's step loop, the
    learner's training forward), which then make no module calls."""

    norm1: tuple[Tensor, float]
    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    norm2: tuple[Tensor, float]
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None

    @classmethod
    def of(cls, layer: LlamaDecoderLayer, *, trainable: bool = False) -> LlamaLayerWeights:
        """`trainable`: the concatenations stay in the autograd graph, so gradients reach the
        layer's parameters (build them anew for every forward then: they are copies)."""
        a, m = layer.self_attn, layer.mlp
        qkv, qkv_bias = _concat([a.q_proj, a.k_proj, a.v_proj], trainable)
        gate_up, gate_up_bias = _concat([m.gate_proj, m.up_proj], trainable)
        return cls(
            norm1=_norm(layer.input_layernorm),
            qkv=qkv,
            qkv_bias=qkv_bias,
            o=a.o_proj.weight,
            o_bias=a.o_proj.bias,
            norm2=_norm(layer.post_attention_layernorm),
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=m.down_proj.weight,
            down_bias=m.down_proj.bias,
        )


def _concat(linears: list[torch.nn.Linear], trainable: bool) -> tuple[Tensor, Tensor | None]:
    def keep(t: Tensor) -> Tensor:
        return t if trainable else t.detach()

    weight = torch.cat([keep(lin.weight) for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat([keep(cast(Tensor, b)) for b in biases])
    return weight, bias


def _norm(norm: torch.nn.Module) -> tuple[Tensor, float]:
    return cast(Tensor, norm.weight), cast(float, norm.variance_epsilon)


class _LlamaStepper:
    """A lean forward pass for Llama-architecture HF models over the model's own weights.

    Why: per decode step HF's forward spends more time in Python wrappers, mask construction and
    DynamicCache concatenation than in the matmuls for a model this small. This stepper keeps a
    preallocated KV buffer (written in place, no torch.cat), takes the rotary tables and masks
    for the whole call once in `start`, calls functional ops on plain tensors (no module calls),
    and runs q/k/v (and gate/up) as one matmul each against concatenated weights. The arithmetic
    is otherwise HF's Llama (RMSNorm, rotate-half RoPE, SDPA, SwiGLU) in the same order: on our
    CPU build its logits are HF's bit for bit, and greedy output matches `generate` token for
    token (tested). The concatenated weights are rebuilt whenever a source parameter changed (its
    version counter moved: `load_weights`, `load_state_dict`, an optimizer step) or was replaced,
    so `start` always sees the model's current weights — except writes through `param.data`,
    which bypass the version counter.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self._key: tuple[int, ...] = ()
        self._layers: list[LlamaLayerWeights] = []
        self._embed = self._lm_head = torch.empty(0)
        self._final_norm = (torch.empty(0), 0.0)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return is_lean_llama(model)

    def _refresh(self) -> None:
        """Take the model's weights as plain tensors, unless no parameter changed since last time."""
        params = list(self.model.parameters())
        key = tuple(x for p in params for x in (p.data_ptr(), p._version))
        if key == self._key:
            return
        inner = self.model.model
        self._layers = [LlamaLayerWeights.of(layer) for layer in inner.layers]
        self._embed = inner.embed_tokens.weight
        self._final_norm = (inner.norm.weight, cast(float, inner.norm.variance_epsilon))
        self._lm_head = self.model.lm_head.weight
        self._key = key

    def start(self, key_mask: Tensor, position_ids: Tensor) -> None:
        self._refresh()
        self.key_mask = key_mask
        self.padded = not bool(key_mask.all())
        self.dtype = self._embed.dtype
        # A decode query sits on a real token, so its mask row is just "not padding".
        self.decode_mask = (
            torch.zeros(key_mask.shape, dtype=self.dtype, device=key_mask.device).masked_fill_(~key_mask, float("-inf"))[:, None, None, :]
            if self.padded
            else None
        )
        # Rotary tables for every slot of the call, from the model's own rotary module, laid out
        # [B, S, 1, hd] to broadcast over the heads of a [B, T, heads, hd] projection.
        cos, sin = self.model.model.rotary_emb(self.model.model.embed_tokens.weight, position_ids)
        half = self.head_dim // 2
        self.cos = cos.unsqueeze(2)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi], bit for bit (negation is exact).
        self.sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(2)
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.filled = 0

    @staticmethod
    def _rms(x: Tensor, norm: tuple[Tensor, float]) -> Tensor:
        return rms_norm(x, *norm)

    def forward(self, input_ids: Tensor, rows: Tensor | None = None) -> Tensor:
        bsz, q_len = input_ids.shape
        start, end = self.filled, self.filled + q_len
        cos, sin, key_mask = self.cos, self.sin, self.key_mask
        if start == 0:
            if rows is not None:
                cos, sin, key_mask = cos[rows], sin[rows], key_mask[rows]
            shape = (bsz, self.n_kv, key_mask.shape[1], self.head_dim)
            self.k = [torch.empty(shape, dtype=self.dtype, device=input_ids.device) for _ in self._layers]
            self.v = [torch.empty(shape, dtype=self.dtype, device=input_ids.device) for _ in self._layers]
        cos, sin = cos[:, start:end], sin[:, start:end]
        if q_len > 1:
            # Only a first forward (prefill, or re-prefill after a swap) is ever longer than one.
            assert start == 0
            mask = _prefill_mask(key_mask[:, :end], self.dtype) if self.padded else None
        else:
            mask = None if self.decode_mask is None else self.decode_mask[..., :end]
        causal = mask is None and q_len > 1

        n_q, n_kv, hd = self.n_heads, self.n_kv, self.head_dim
        half = hd // 2
        linear = torch.nn.functional.linear
        h = torch.nn.functional.embedding(input_ids, self._embed)
        for i, w in enumerate(self._layers):
            qkv = linear(self._rms(h, w.norm1), w.qkv, w.qkv_bias).view(bsz, q_len, n_q + 2 * n_kv, hd)
            # RoPE on q and k at once: they are adjacent heads of the fused projection.
            qk = qkv[:, :, : n_q + n_kv]
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            q = qk[:, :, :n_q].transpose(1, 2)
            self.k[i][:, :, start:end] = qk[:, :, n_q:].transpose(1, 2)
            self.v[i][:, :, start:end] = qkv[:, :, n_q + n_kv :].transpose(1, 2)
            keys, values = self.k[i][:, :, :end], self.v[i][:, :, :end]
            if n_kv != n_q:
                keys = keys.repeat_interleave(n_q // n_kv, dim=1)
                values = values.repeat_interleave(n_q // n_kv, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale
            )
            if i == len(self._layers) - 1 and q_len > 1:
                # Only the last position's logits are wanted, so after the last attention the
                # other positions are dead work (~1/6 of a prefill here). A row subset of a
                # matmul gives the same bits on our CPU build; attention itself stays whole, as
                # SDPA's kernel for one query rounds differently from its kernel for many.
                o, h = o[:, :, -1:], h[:, -1:]
            h = h + linear(o.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1), w.o, w.o_bias)
            gate, up = linear(self._rms(h, w.norm2), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            h = h + linear(torch.nn.functional.silu(gate) * up, w.down, w.down_bias)
        self.filled = end
        return linear(self._rms(h[:, -1, :], self._final_norm), self._lm_head)

    def expand(self, index: Tensor) -> None:
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]


class _HFStepper:
    """The generic path for any HF causal LM: the model's own forward with a DynamicCache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache_kw = cache_kwarg(model)

    def start(self, key_mask: Tensor, position_ids: Tensor) -> None:
        self.mask = key_mask.long()
        self.position_ids = position_ids
        self.cache = DynamicCache(config=self.model.config)
        self.filled = 0

    def forward(self, input_ids: Tensor, rows: Tensor | None = None) -> Tensor:
        start, end = self.filled, self.filled + input_ids.shape[1]
        mask, pos = self.mask, self.position_ids
        if rows is not None:
            mask, pos = mask[rows], pos[rows]
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask[:, :end],
            position_ids=pos[:, start:end],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        self.cache = getattr(out, self.cache_kw)
        self.filled = end
        return out.logits[:, -1, :]

    def expand(self, index: Tensor) -> None:
        self.cache.reorder_cache(cast(torch.LongTensor, index))


def _distinct_rows(prompts: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """(first row of each distinct prompt, each row's index among them), or None if all differ."""
    seen: dict[tuple[int, ...], int] = {}
    index = [seen.setdefault(tuple(p), len(seen)) for p in prompts]
    if len(seen) == len(prompts):
        return None
    first = [0] * len(seen)
    for row in reversed(range(len(prompts))):
        first[index[row]] = row
    return first, index


class TorchEngine:
    """A batched KV-cache sampler over an HF causal LM's own weights, on the model's device and in
    its dtype (CPU float32, CUDA bfloat16, ...).

    One prefill over the left-padded batch (attention mask + explicit position ids, as HF generate
    builds them), then one token per step from the cache. A GRPO batch repeats each prompt
    `group_size` times, so the prefill runs once per distinct prompt and the cache rows are then
    copied out to the repeats (vLLM's `n` samples per prompt do the same); on our CPU build the
    logits are the same bits either way, as a matmul's output rows do not depend on its other
    rows. Finished rows keep being fed pad tokens (cheaper
    than reshaping the cache) and their outputs are ignored; the loop ends when every row is
    finished. All per-step bookkeeping stays in tensors — no Python loop over the batch.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_id: int,
        pad_id: int,
        version: int = 0,
        fast_path: bool | None = None,
    ) -> None:
        """`fast_path`: None picks the lean Llama stepper when the model is a Llama, else HF's
        forward; False forces HF's forward (the reference the fast path is tested against)."""
        self.model = model.eval()
        # Every tensor a call makes lives where the model does (CPU or a CUDA device).
        self.device = next(model.parameters()).device
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.version = version
        if fast_path is None:
            fast_path = _LlamaStepper.supports(model)
        elif fast_path and not _LlamaStepper.supports(model):
            raise ValueError(f"the fast path supports LlamaForCausalLM only, not {type(model).__name__}")
        self._stepper: _Stepper = _LlamaStepper(model) if fast_path else _HFStepper(model)

    def load_weights(self, state: WeightState, version: int) -> None:
        if isinstance(state, (bytes, bytearray, memoryview)):
            # Zero-copy views of the blob (a peer's mapped version file), copied into the model
            # in place: no bytes copy of the blob, no tensors of its own.
            load_state_tensors(self.model, state_tensors(state))
        else:
            load_state_tensors(self.model, state)
        self.version = version

    @torch.inference_mode()
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
        """Sample a completion per prompt; `swap` is the in-flight weight hook (module docstring)."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (bos)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        device = self.device
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)

        batch = len(prompts)
        input_ids, key_mask, position_ids = (t.to(device) for t in self._layout(prompts, max_new_tokens))
        tokens = torch.full((batch, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
        step_versions: list[int] = []  # every row of a step samples from the same weights
        stepper = self._stepper
        stepper.start(key_mask, position_ids)
        logits = self._prefill(stepper, prompts, input_ids)
        for t in range(max_new_tokens):
            if t > 0:
                logits = self._decode(stepper, swap, input_ids, tokens[:, :t], key_mask, position_ids)
            tok, lp = self._sample(logits.float(), temperature, top_p, gen)
            tok = tok.masked_fill(finished, self.pad_id)
            tokens[:, t] = tok
            logprobs[:, t] = lp
            step_versions.append(self.version)
            is_eos = (tok == self.eos_id) & ~finished
            lengths = torch.where(is_eos, t + 1, lengths)
            finished |= is_eos
            if bool(finished.all()):
                break
        n_steps = len(step_versions)
        return self._to_generations(tokens[:, :n_steps], logprobs[:, :n_steps], lengths, step_versions)

    def _layout(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded prompt ids [B, W], and the key mask and position ids of every slot the
        call can fill [B, W + max_new_tokens], built once and sliced as the sequences grow."""
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        key_mask = torch.ones((batch, width + max_new_tokens), dtype=torch.bool)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            key_mask[i, : width - len(p)] = False
        # Same position ids as HF generate: count real tokens; pads get a dummy position 1.
        prompt_pos = (key_mask[:, :width].cumsum(-1) - 1).masked_fill_(~key_mask[:, :width], 1)
        new_pos = prompt_pos[:, -1:] + 1 + torch.arange(max_new_tokens)
        return input_ids, key_mask, torch.cat((prompt_pos, new_pos), dim=1)

    @staticmethod
    def _prefill(stepper: _Stepper, prompts: list[list[int]], input_ids: Tensor) -> Tensor:
        distinct = _distinct_rows(prompts)
        if distinct is None:
            return stepper.forward(input_ids)
        first = torch.tensor(distinct[0], device=input_ids.device)
        index = torch.tensor(distinct[1], device=input_ids.device)
        logits = stepper.forward(input_ids[first], rows=first)
        stepper.expand(index)
        return logits[index]

    def _decode(
        self,
        stepper: _Stepper,
        swap: SwapHook | None,
        input_ids: Tensor,
        generated: Tensor,
        key_mask: Tensor,
        position_ids: Tensor,
    ) -> Tensor:
        """Next-token logits after `generated` [B, t], taking new weights first if `swap` has any."""
        update = None if swap is None else swap()
        if update is None:
            return stepper.forward(generated[:, -1:])
        self.load_weights(*update)
        # The old cache holds K/V of the old weights: keeping it would make the next token a
        # sample from neither policy. Re-prefill instead (AReaL), so it is exactly pi_new's.
        # Finished rows are re-fed as well; as on every step, their outputs are ignored.
        stepper.start(key_mask, position_ids)
        return stepper.forward(torch.cat((input_ids, generated), dim=1))

    @staticmethod
    def _sample(
        logits: Tensor, temperature: float, top_p: float, gen: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        if temperature == 0.0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
        else:
            scaled = logits / temperature
            logp = torch.log_softmax(scaled, dim=-1)
            if top_p < 1.0:
                probs = torch.softmax(top_p_filter(scaled, top_p), dim=-1)
            else:
                probs = logp.exp()
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def _to_generations(
        tokens: Tensor, logprobs: Tensor, lengths: Tensor, step_versions: list[int]
    ) -> list[Generation]:
        # One conversion to Python lists for the whole batch, then slicing.
        tok_rows, lp_rows, lens = tokens.tolist(), logprobs.tolist(), lengths.tolist()
        return [
            Generation(completion_ids=t[:n], logprobs=lp[:n], token_versions=step_versions[:n])
            for t, lp, n in zip(tok_rows, lp_rows, lens)
        ]
