"""GRPO on the learner: group-relative advantages and an off-policy-corrected policy gradient.

Invariants:
- Advantages are computed within one group (the completions of one prompt); a group whose rewards
  are all equal carries no signal, gets exactly zero advantage, and is left out of the loss.
- Three policies meet in one update (AReaL's decoupled PPO names them): the *behaviour* policy mu
  that sampled each token (its per-token log-prob travels in the rollout, and in async mode it
  may be several versions old, even within one completion), the *proximal* policy pi_prox = the
  learner's own weights at the start of the update, whose log-probs the learner recomputes, and
  the policy being optimised, pi_theta.
- Correction (`correction=`):
  - "tis" (default): truncated importance sampling. Each token's loss is weighted by
    w = min(pi_prox / mu, cap), a constant (no gradient): stale tokens the policy has moved away
    from count less, and the cap bounds the variance (marin: async without it collapsed).
  - "decoupled": AReaL's decoupled PPO: w (truncated the same way) times the PPO-clip surrogate
    with ratio pi_theta / pi_prox. With one minibatch per update pi_theta == pi_prox at the only
    step, so it equals "tis"; with `minibatches` > 1 the clip keeps later steps near pi_prox.
  - "none": w = 1, the stale data is trained on as if it were on-policy (the ablation).
- The loss is a token-level mean over all completion tokens in the step (DAPO's token-mean), so a
  long completion weighs by its tokens, not as one sample.
- `sequence_logprobs(..., temperature=T)` recomputes exactly what `TorchEngine` reports at T (test
  tolerance 1e-5), so on-policy data has w = 1. For a plain LlamaForCausalLM it runs a lean
  forward that computes each distinct prompt once per batch; it matches the model's own forward
  (`fast_path=False`) in log-probs and in every parameter's gradient (tested).
- Device and precision: every tensor the step creates (ids, targets, masks, behaviour log-probs,
  advantages, indices) lands on the model's device. With `autocast_dtype` only the model's forward
  runs under `torch.autocast`; the weights, gradients and optimizer state stay the model's own
  (float32 master weights), and the log-softmax, the importance weights and the loss are float32.
- Sharing one update (`Share`, used by `echo_node.ml.sharded`): every process gets the whole batch
  and derives the same used groups, advantages and minibatches from it; each runs only its share
  of every minibatch's rows and divides its loss by the minibatch's token count over all shares,
  so the gradients summed over processes are the single-process gradient. A process whose share
  holds no token still runs a forward and backward (on a stand-in row, masked out): FSDP's
  collectives live in those, and every process must enter every collective.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast, get_args

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from echo_node.ml.engine import LlamaLayerWeights, is_lean_llama, rms_norm

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


Correction = Literal["tis", "decoupled", "none"]
CORRECTIONS: tuple[str, ...] = get_args(Correction)
# exp() of a log-ratio above this is treated as this (stats only; the weight itself is capped).
_MAX_LOG_WEIGHT = 20.0


@dataclass(slots=True)
class TrainGroup:
    """All completions of one prompt, as sampled (ids exclude the prompt; eos included if emitted)."""

    prompt_ids: list[int]
    completions: list[list[int]]
    behaviour_logprobs: list[list[float]]
    rewards: list[float]
    # Per token: sampled by the very weights this step trains (its claimed version is the
    # learner's current one), so the behaviour log-prob must match the learner's own. Optional:
    # feeds the `lp_gap_*` stats, the calibration for log-prob spot checks.
    on_policy: list[list[bool]] | None = None
    # Per token: whether it enters the loss. Multi-turn episodes (echo_node/envs) run the
    # environment's turns through the forward as context and leave them out of the loss, the
    # importance weights and the token mean (their "log-probs" are placeholders). None: all do.
    loss_masks: list[list[bool]] | None = None
    # The group's loss weight in its update (0 < weight <= 1): below 1 for a publisher the learner
    # has not proven yet (echo_node/learner/replay.py, `step_weights`). The update's learning rate is
    # scaled by its used groups' mean weight (`PolicyOptimizer.step`).
    weight: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.completions)
        if not 0 < self.weight <= 1:
            raise ValueError(f"a group's weight must be in (0, 1], got {self.weight}")
        if len(self.behaviour_logprobs) != n or len(self.rewards) != n:
            raise ValueError(
                f"group sizes differ: {n} completions, {len(self.behaviour_logprobs)} log-prob rows,"
                f" {len(self.rewards)} rewards"
            )
        for c, lp in zip(self.completions, self.behaviour_logprobs):
            if len(c) != len(lp):
                raise ValueError(f"completion of {len(c)} tokens has {len(lp)} log-probs")
        if self.loss_masks is not None and (
            len(self.loss_masks) != n or any(len(m) != len(c) for m, c in zip(self.loss_masks, self.completions))
        ):
            raise ValueError("loss_masks needs one flag per completion token")


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(r − mean) / (std + eps) along the last dim (one group per row); all-equal groups → 0.

    std is the unbiased one, as in TRL's GRPO; the explicit zero for all-equal groups avoids
    amplifying float round-off in (r − mean) by 1/eps.
    """
    r = rewards.float()
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    mean = r.mean(dim=-1, keepdim=True)
    std = r.std(dim=-1, keepdim=True)
    adv = (r - mean) / (std + eps)
    flat = (r.amax(dim=-1, keepdim=True) == r.amin(dim=-1, keepdim=True)).expand_as(r)
    return adv.masked_fill(flat, 0.0)


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    *,
    temperature: float = 1.0,
    fast_path: bool | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of each completion given its prompt and previous tokens.

    Returns (logprobs [B, Tmax], mask [B, Tmax]) with Tmax the longest completion; rows are
    right-padded, so causal attention alone keeps pads out of every real token's context and no
    attention mask (nor position-id shift) is needed. Gradients flow unless the caller disables them.
    `fast_path`: None takes the lean Llama forward (`_lean_llama_logits`) when the model is one
    it reproduces, else the model's own forward; False forces the model's own forward (the
    reference the lean one is tested against); True demands the lean one. `autocast_dtype`: the
    forward's precision under `torch.autocast` (None: the model's own); log-probs are float32.
    """
    logp, targets, mask = completion_log_softmax(
        model, prompt_ids, completion_ids, pad_id, temperature=temperature, fast_path=fast_path,
        autocast_dtype=autocast_dtype,
    )
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logp.masked_fill(~mask, 0.0), mask


def completion_log_softmax(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    pad_id: int,
    *,
    temperature: float = 1.0,
    fast_path: bool | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole tempered next-token distribution at every completion position, as
    `sequence_logprobs` computes it: (log-probs [B, Tmax, V], targets [B, Tmax] right-padded
    with `pad_id`, mask [B, Tmax]). What a log-prob spot check needs beyond the sampled token."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    batch = len(prompt_ids)
    t_max = max((len(c) for c in completion_ids), default=0)
    device = model_device(model)
    if batch == 0 or t_max == 0:
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        return (
            torch.zeros((batch, t_max, vocab), device=device),
            torch.zeros((batch, t_max), dtype=torch.long, device=device),
            torch.zeros((batch, t_max), dtype=torch.bool, device=device),
        )
    if any(not p for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (bos)")
    targets = torch.tensor([c + [pad_id] * (t_max - len(c)) for c in completion_ids], dtype=torch.long, device=device)
    mask = torch.tensor([[j < len(c) for j in range(t_max)] for c in completion_ids], dtype=torch.bool, device=device)
    with _autocast(device, autocast_dtype):
        if _lean_path_applies(model, fast_path):
            lean = cast("LlamaForCausalLM", model)
            picked = _lean_llama_logits(lean, prompt_ids, completion_ids, t_max, pad_id, device)
        else:
            picked = _hf_logits(model, prompt_ids, completion_ids, t_max, pad_id, device)
    # Outside autocast: the log-softmax (and all that follows from it) in float32.
    return torch.log_softmax(picked.float() / temperature, dim=-1), targets, mask


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: its first parameter's device (an FSDP-sharded parameter reports
    its local shard's), the CPU for a model without parameters."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """`torch.autocast` to `dtype` on `device`'s kind; no-op for None."""
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def _hf_logits(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    t_max: int,
    pad_id: int,
    device: torch.device,
) -> Tensor:
    """Logits [B, Tmax, V] of the positions predicting each completion token, by the model's own
    forward over right-padded prompt + completion rows."""
    # The last completion token is only ever predicted, never a predictor: leave it out.
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)) - 1
    ids_rows, src_rows = [], []
    for p, c in zip(prompt_ids, completion_ids):
        row = (p + c)[:width]
        ids_rows.append(row + [pad_id] * (width - len(row)))
        # Token j of the completion sits at len(p)+j and is predicted by the position one before;
        # padding entries point at position 0 and are masked out by the caller.
        src_rows.append(list(range(len(p) - 1, len(p) - 1 + len(c))) + [0] * (t_max - len(c)))
    # One tensor per list of lists: per-row torch.tensor calls cost more than the tiny model's matmuls.
    ids = torch.tensor(ids_rows, dtype=torch.long, device=device)
    src_pos = torch.tensor(src_rows, dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits
    # Gather the predicting positions first: log_softmax over [B, Tmax, V], not [B, S, V].
    return logits.gather(1, src_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def _attention_dropout(model: torch.nn.Module) -> float:
    """A LlamaForCausalLM's attention dropout (HF applies it in train mode only)."""
    return float(cast("LlamaForCausalLM", model).config.attention_dropout or 0)


def _lean_path_applies(model: torch.nn.Module, fast_path: bool | None) -> bool:
    if fast_path is False:
        return False
    # In train mode HF applies attention dropout; the lean forward has none.
    ok = is_lean_llama(model) and not (model.training and _attention_dropout(model) > 0)
    if fast_path and not ok:
        raise ValueError(
            f"the lean forward supports LlamaForCausalLM without attention dropout only, not {type(model).__name__}"
        )
    return ok


def _lean_llama_logits(
    model: LlamaForCausalLM,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    t_max: int,
    pad_id: int,
    device: torch.device,
) -> Tensor:
    """Logits [B, Tmax, V] predicting each completion token, differentiable in the model's own
    parameters; the same numbers as `_hf_logits` up to float rounding (tested to 1e-5).

    Why: the learner's step is matmul-bound, and a GRPO batch repeats each prompt `group_size`
    times. Causal attention makes a prompt's hidden states independent of what follows, so each
    distinct prompt runs once (its "prefix" rows, right-padded, plain causal SDPA) and each
    completion row runs only its own tokens, attending to its prompt's K/V plus its own (one
    boolean mask) — 8x8 addition rollouts shrink from 640 token positions to ~250. The two kinds
    of rows share one flat token axis, so every norm and projection is one op per layer; q/k/v
    and gate/up are one matmul each against torch.cat of the live parameters, built in this call,
    so gradients reach the parameters and no optimizer step is ever missed. Otherwise it is HF's
    Llama arithmetic: RMSNorm, rotate-half RoPE at absolute positions, SDPA, SwiGLU.
    """
    cfg = model.config
    inner = model.model
    # LlamaConfig fills a missing num_key_value_heads with num_attention_heads; so do we.
    n_q = cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads or n_q
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    half = hd // 2
    seen: dict[tuple[int, ...], int] = {}
    row_of = [seen.setdefault(tuple(p), len(seen)) for p in prompt_ids]
    distinct = list(seen)
    n_u, p_max, batch = len(distinct), max(len(p) for p in distinct), len(prompt_ids)
    # Completion inputs: every token but the last, which is only ever predicted.
    c_len = t_max - 1
    n_prefix = n_u * p_max
    rows = torch.tensor(row_of, dtype=torch.long, device=device)
    p_len = torch.tensor([len(p) for p in distinct], dtype=torch.long, device=device)
    row_p_len = p_len[rows]
    prefix_rows = [list(p) + [pad_id] * (p_max - len(p)) for p in distinct]
    comp_rows = [c[:c_len] + [pad_id] * (c_len - min(len(c), c_len)) for c in completion_ids]
    ids = torch.tensor([t for row in prefix_rows + comp_rows for t in row], dtype=torch.long, device=device)
    arange = functools.partial(torch.arange, device=device)
    linear = torch.nn.functional.linear
    sdpa = torch.nn.functional.scaled_dot_product_attention
    h = torch.nn.functional.embedding(ids, inner.embed_tokens.weight)
    # Rotary tables by absolute position: prefix slot s sits at s, completion input j of row b
    # at len(prompt_b) + j. Laid out [N, 1, hd] along the flat token axis, broadcast over heads;
    # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi] (negation is exact).
    cos, sin = inner.rotary_emb(h, arange(p_max + c_len).unsqueeze(0))
    cos, sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    pos = torch.cat((arange(p_max).repeat(n_u), (row_p_len[:, None] + arange(c_len)).view(-1)))
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    # Completion query j sees its prompt's real slots and its own inputs 0..j. Never an all-False
    # row (every prompt has a token), so SDPA gives no NaN even on padding queries.
    allowed = torch.cat(
        (
            (arange(p_max)[None, :] < row_p_len[:, None])[:, None, :].expand(batch, c_len, p_max),
            torch.ones(c_len, c_len, dtype=torch.bool, device=device).tril().expand(batch, c_len, c_len),
        ),
        dim=-1,
    ).unsqueeze(1)
    # After the last attention only the predicting positions matter: each prompt's last slot and
    # every completion input.
    keep = torch.cat((arange(n_u) * p_max + p_len - 1, n_prefix + arange(batch * c_len)))

    def heads(x: Tensor, start: int, n_rows: int, width: int) -> Tensor:
        """Rows [start, start + n_rows * width) of the flat axis as [n_rows, n_q, width, hd]."""
        x = x[start : start + n_rows * width].view(n_rows, width, -1, hd).transpose(1, 2)
        # GQA: each K/V head serves n_q // n_kv consecutive query heads, as HF's repeat_kv.
        return x if x.shape[1] == n_q else x.repeat_interleave(n_q // n_kv, dim=1)

    layers = [LlamaLayerWeights.of(layer, trainable=True) for layer in inner.layers]
    for i, w in enumerate(layers):
        qkv = linear(rms_norm(h, *w.norm1), w.qkv, w.qkv_bias).view(-1, n_q + 2 * n_kv, hd)
        # RoPE on q and k at once: they are adjacent heads of the fused projection.
        qk = qkv[:, : n_q + n_kv]
        qk = qk * cos + qk.roll(half, dims=-1) * sin
        q, k, v = qk[:, :n_q], qk[:, n_q:], qkv[:, n_q + n_kv :]

        kp, vp = heads(k, 0, n_u, p_max), heads(v, 0, n_u, p_max)
        outs = [sdpa(heads(q, 0, n_u, p_max), kp, vp, is_causal=True, scale=hd**-0.5)]
        if c_len:
            keys = torch.cat((kp[rows], heads(k, n_prefix, batch, c_len)), dim=2)
            values = torch.cat((vp[rows], heads(v, n_prefix, batch, c_len)), dim=2)
            outs.append(sdpa(heads(q, n_prefix, batch, c_len), keys, values, attn_mask=allowed, scale=hd**-0.5))
        o = torch.cat([x.transpose(1, 2).reshape(-1, n_q * hd) for x in outs])
        if i == len(layers) - 1:
            o, h = o[keep], h[keep]
        h = h + linear(o, w.o, w.o_bias)
        gate, up = linear(rms_norm(h, *w.norm2), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        h = h + linear(torch.nn.functional.silu(gate) * up, w.down, w.down_bias)
    if not layers:
        h = h[keep]
    logits = linear(rms_norm(h, inner.norm.weight, inner.norm.variance_epsilon), model.lm_head.weight, model.lm_head.bias)
    first = logits[:n_u][rows].unsqueeze(1)
    return torch.cat((first, logits[n_u:].view(batch, c_len, logits.shape[-1])), dim=1)


def importance_weights(
    prox_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Per-token truncated importance weights min(pi_prox / mu, cap), no gradient, 0 off `mask`.

    Stats are of the weight *before* truncation (how far off-policy the batch was) plus the
    share of tokens the cap truncated.
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    with torch.no_grad():
        log_w = (prox_logprobs - behaviour_logprobs).clamp(max=_MAX_LOG_WEIGHT).masked_fill(~mask, 0.0)
        raw = torch.exp(log_w)
        weights = raw.clamp(max=cap).masked_fill(~mask, 0.0)
        maskf = mask.float()
        n = maskf.sum().clamp(min=1.0)
        if mask.any():
            stats = {
                "is_weight_mean": float((raw * maskf).sum() / n),
                "is_weight_max": float(raw.masked_fill(~mask, -math.inf).max()),
                "is_weight_min": float(raw.masked_fill(~mask, math.inf).min()),
                "is_truncated_frac": float(((raw > cap) & mask).float().sum() / n),
            }
        else:
            stats = {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_min": 1.0, "is_truncated_frac": 0.0}
    return weights, stats


def grpo_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    weights: Tensor | None = None,
    token_total: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip surrogate of new vs `old_logprobs`, token-mean over `mask`, each token's term
    times `weights` (constant; None = 1). advantages: [B] (per sequence) or [B, T].

    `token_total`: the loss's divisor instead of the tokens under `mask` (a share of a sharded
    update divides by the whole minibatch's count). The stats are means over `mask` either way.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    maskf = mask.float()
    n_tokens = maskf.sum().clamp(min=1.0)
    log_ratio = (new_logprobs - old_logprobs).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if weights is not None:
        per_token = per_token * weights.detach()
    summed = (per_token * maskf).sum()
    loss = summed / (n_tokens if token_total is None else max(token_total, 1.0))
    with torch.no_grad():
        # A token is "clipped" when the clamp is the active branch of the min: it gives no gradient.
        was_clipped = ((ratio > 1.0 + clip_eps) & (advantages > 0)) | (
            (ratio < 1.0 - clip_eps) & (advantages < 0)
        )
        stats = {
            "loss": float(summed / n_tokens),
            "clip_frac": float((was_clipped.float() * maskf).sum() / n_tokens),
            "ratio_mean": float((ratio * maskf).sum() / n_tokens),
            "ratio_max": float(ratio.masked_fill(~mask, 0.0).max()) if mask.any() else 1.0,
            # k3 estimator of KL(old || new) (Schulman), non-negative per token.
            "kl_old": float(((ratio - 1.0 - log_ratio) * maskf).sum() / n_tokens),
            "tokens": float(maskf.sum()),
        }
    return loss, stats


@dataclass(frozen=True, slots=True)
class LogprobGaps:
    """|learner log-prob - claimed behaviour log-prob| over one group's tokens sampled by the
    weights being trained: how many, their sum and the largest."""

    tokens: int
    total: float
    largest: float


def _on_policy_gaps(rows: list[list[bool]], prox: Tensor, mu: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(gaps, which tokens count) of `rows` (`TrainGroup.on_policy` of each row)."""
    t_max = prox.shape[1]
    on = torch.tensor([r + [False] * (t_max - len(r)) for r in rows], dtype=torch.bool, device=mask.device) & mask
    return (prox - mu).abs().masked_fill(~on, 0.0), on


def _logprob_gaps(rows: list[list[bool]], prox: Tensor, mu: Tensor, mask: Tensor) -> dict[str, float]:
    """|learner log-prob - claimed behaviour log-prob| over the tokens sampled by the weights
    being trained: what an honest peer's engine and the learner's forward disagree by, and what
    a forged log-prob shows up as."""
    gap, on = _on_policy_gaps(rows, prox, mu, mask)
    n = int(on.sum())
    if n == 0:
        return {}
    return {"lp_gap_tokens": float(n), "lp_gap_mean": float(gap.sum()) / n, "lp_gap_max": float(gap.max())}


def _group_gaps(rows: list[list[bool]], row_group: list[int], prox: Tensor, mu: Tensor, mask: Tensor) -> dict[int, LogprobGaps]:
    """The gaps of `_logprob_gaps` per group (`row_group`: each row's group index)."""
    if prox.shape[1] == 0:
        return {}
    gap, on = _on_policy_gaps(rows, prox, mu, mask)
    counts, sums, maxes = on.sum(1).tolist(), gap.sum(1).tolist(), gap.max(1).values.tolist()
    out: dict[int, LogprobGaps] = {}
    for g, n, total, largest in zip(row_group, counts, sums, maxes):
        if n:
            was = out.get(g, LogprobGaps(0, 0.0, 0.0))
            out[g] = LogprobGaps(was.tokens + int(n), was.total + total, max(was.largest, largest))
    return out


def tis_loss(
    new_logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor, *, token_total: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Truncated-IS policy gradient: -w * (pi_theta / sg(pi_theta)) * A, token-mean over `mask`.

    The ratio to its own detached value is 1 in the forward pass and gives grad log pi_theta,
    so the gradient is w * A * grad log pi_theta with no clipping (w already bounds it).
    `token_total`: the loss's divisor, as in `grpo_loss`.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    maskf = mask.float()
    n_tokens = maskf.sum().clamp(min=1.0)
    ratio = torch.exp(new_logprobs - new_logprobs.detach()).masked_fill(~mask, 0.0)
    summed = -(weights.detach() * ratio * advantages * maskf).sum()
    loss = summed / (n_tokens if token_total is None else max(token_total, 1.0))
    return loss, {"loss": float(summed.detach() / n_tokens), "tokens": float(maskf.sum())}


def _advantages(rewards: list[list[float]]) -> Tensor:
    """`group_advantages` of each group, flattened; one batched call when the groups are the
    same size (the usual case: bitwise the same numbers as one call per group)."""
    if len({len(r) for r in rewards}) == 1:
        return group_advantages(torch.tensor(rewards, dtype=torch.float32)).flatten()
    return torch.cat([group_advantages(torch.tensor(r, dtype=torch.float32)) for r in rewards])


def _adamw(params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.AdamW:
    """AdamW without weight decay; torch's fused kernel where the parameters allow it (1.6 ms of
    a 27 ms step on the embedded model, the same update to 5e-7)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # e.g. a device or dtype the fused kernel lacks
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _split(rows: range, n: int) -> list[range]:
    """`rows` cut into `n` contiguous parts as `torch.tensor_split` cuts: sizes differ by at most
    one, the longer parts first."""
    q, r = divmod(len(rows), n)
    bounds = [rows.start + i * q + min(i, r) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True, slots=True)
class Share:
    """Process `rank` of `world` that compute one update together (module docstring)."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, world), got rank {self.rank} of {self.world}")

    def of(self, minibatch: range, lengths: list[int]) -> tuple[range, bool]:
        """This process's rows of `minibatch` (`lengths`: every row's completion length) and
        whether they are a stand-in.

        The rows are the `rank`-th of `world` contiguous parts (`_split`). A part without a token
        becomes the minibatch's first row with one, marked as a stand-in: the process still has to
        run the forward and backward. A minibatch without any token keeps its parts as they are;
        then no process runs a forward on it and all fail the same way a single process does.
        """
        part = _split(minibatch, self.world)[self.rank]
        if any(lengths[i] for i in part):
            return part, False
        stand_in = next((i for i in minibatch if lengths[i]), None)
        return (part, False) if stand_in is None else (range(stand_in, stand_in + 1), True)


# How `merge_share_stats` combines a stat over the shares of one update: the stats a process
# derives from the whole batch are the same in every share; counts add up; the rest are maxima,
# minima or means over the share's tokens, each counted by "tokens" unless `_COUNTED_BY` says.
_SAME = frozenset({"reward_mean", "groups", "groups_used", "skipped", "grad_norm", "weight_mean"})
_SUMMED = frozenset({"tokens", "lp_gap_tokens"})
_LARGEST = frozenset({"is_weight_max", "ratio_max", "lp_gap_max"})
_SMALLEST = frozenset({"is_weight_min"})
_COUNTED_BY = {"lp_gap_mean": "lp_gap_tokens", "lp_gap_max": "lp_gap_tokens"}


def merge_share_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """One sharded update's stats from its shares' (`PolicyOptimizer.step(..., share=)`): what one
    process would report up to float rounding. A share whose count for a stat is zero (a
    stand-in) has no say in it. With `minibatches` > 1 a share's "ratio_max" is already a mean
    over its minibatches (as one process reports it); here the largest share's wins."""
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        if key in _SAME:
            merged[key] = parts[0][key]
            continue
        if key in _SUMMED:
            merged[key] = sum(p.get(key, 0.0) for p in parts)
            continue
        count = _COUNTED_BY.get(key, "tokens")
        have = [p for p in parts if key in p and p.get(count, 0.0) > 0]
        if not have:
            merged[key] = next(p[key] for p in parts if key in p)
        elif key in _LARGEST:
            merged[key] = max(p[key] for p in have)
        elif key in _SMALLEST:
            merged[key] = min(p[key] for p in have)
        else:
            merged[key] = sum(p[key] * p[count] for p in have) / sum(p[count] for p in have)
    return merged


class PolicyOptimizer:
    """One GRPO update per `step(groups)`: AdamW (no weight decay), grad-norm clipping, the
    off-policy correction of the module docstring, `minibatches` optimizer steps per update."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        clip_eps: float = 0.2,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        pad_id: int = 0,
        correction: Correction = "tis",
        is_cap: float = 2.0,
        minibatches: int = 1,
        fast_path: bool | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        """`fast_path`: `sequence_logprobs`'s choice of forward (None: lean when it applies).
        `autocast_dtype`: the forward's precision (module docstring; None: the model's own)."""
        if correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
        if is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {is_cap}")
        if minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {minibatches}")
        self.model = model
        self.clip_eps = clip_eps
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.pad_id = pad_id
        self.correction = correction
        self.is_cap = is_cap
        self.minibatches = minibatches
        self.fast_path = fast_path
        self.autocast_dtype = autocast_dtype
        self.device = model_device(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = _adamw(self.params, lr=lr)
        self.steps = 0
        # The last step's on-policy log-prob gaps per group (index into its `groups`): the
        # learner's own forward re-checks claimed log-probs at no extra cost (echo_node/learner/spot_check.py).
        self.last_gaps: dict[int, LogprobGaps] = {}
        # Train mode only changes what a forward computes where there is dropout; the lean Llama
        # forward has none, and walking the modules twice per update is a visible share of a step.
        self._mode_matters = not (is_lean_llama(model) and _attention_dropout(model) == 0)

    def _set_training(self, mode: bool) -> None:
        if self._mode_matters:
            self.model.train(mode)

    def _logprobs(
        self, rows: Sequence[int], prompts: list[list[int]], completions: list[list[int]]
    ) -> tuple[Tensor, Tensor]:
        return sequence_logprobs(
            self.model, [prompts[i] for i in rows], [completions[i] for i in rows], self.pad_id,
            temperature=self.temperature, fast_path=self.fast_path, autocast_dtype=self.autocast_dtype,
        )

    def step(self, groups: list[TrainGroup], *, share: Share | None = None) -> dict[str, float]:
        """One update on `groups`; its stats. With `share`: this process's part of an update that
        `share.world` processes compute together, each passing the same `groups` (module
        docstring); the stats are then this share's, for `merge_share_stats`."""
        rewards = [r for g in groups for r in g.rewards]
        stats: dict[str, float] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "groups": float(len(groups)),
        }
        # A group whose rewards are all equal has zero advantage: no signal, and it would only
        # dilute the token mean.
        used_at = [i for i, g in enumerate(groups) if min(g.rewards, default=0.0) != max(g.rewards, default=0.0)]
        used = [groups[i] for i in used_at]
        stats["groups_used"] = float(len(used))
        self.last_gaps = {}
        if not used:
            stats["skipped"] = 1.0
            return stats
        prompts = [g.prompt_ids for g in used for _ in g.completions]
        completions = [c for g in used for c in g.completions]
        behaviour = [lp for g in used for lp in g.behaviour_logprobs]
        on_policy = [f for g in used for f in (g.on_policy or [[False] * len(c) for c in g.completions])]
        loss_masks = [m for g in used for m in (g.loss_masks or [[True] * len(c) for c in g.completions])]
        masked = any(g.loss_masks is not None for g in used)
        advantages = _advantages([g.rewards for g in used]).to(self.device)
        # Every used group has two or more completions, so no minibatch is empty.
        chunks = _split(range(len(completions)), min(self.minibatches, len(completions)))
        # What this process computes of each minibatch, and the divisor of its token mean (None:
        # the tokens it computes, which are all of them without a share).
        token_totals: list[float | None]
        if share is None:
            parts, token_totals = [(c, False) for c in chunks], [None] * len(chunks)
        else:
            lengths = [len(c) for c in completions]
            parts = [share.of(c, lengths) for c in chunks]
            token_totals = [float(sum(sum(loss_masks[i]) for i in c)) for c in chunks]
        rows = [i for part, _ in parts for i in part]
        # Where each minibatch's rows sit in `rows` (and so in `prox`, `mask` and `weights`).
        spans: list[slice] = []
        for part, _ in parts:
            start = spans[-1].stop if spans else 0
            spans.append(slice(start, start + len(part)))
        self._set_training(True)
        new_lp: Tensor | None = None
        if len(chunks) == 1:
            # pi_prox is pi_theta before the step: the forward that carries the gradient also
            # gives the learner's recomputed log-probs, no second pass.
            new_lp, mask = self._logprobs(rows, prompts, completions)
            prox = new_lp.detach()
        else:
            with torch.no_grad():
                prox, mask = self._logprobs(rows, prompts, completions)
        # A stand-in row counts for nothing: none of its tokens enters a weight, a loss or a stat.
        for (_, stand_in), span in zip(parts, spans):
            if stand_in:
                mask[span] = False
        t_max = prox.shape[1]
        if masked:
            mask &= torch.tensor([loss_masks[i] + [False] * (t_max - len(loss_masks[i])) for i in rows], dtype=torch.bool, device=self.device)
        mu = torch.tensor(
            [behaviour[i] + [0.0] * (t_max - len(behaviour[i])) for i in rows], dtype=torch.float32, device=self.device
        )
        weights, is_stats = importance_weights(prox, mu, mask, cap=self.is_cap)
        stats.update(_logprob_gaps([on_policy[i] for i in rows], prox, mu, mask))
        if share is None:  # rows are every completion, in order
            row_group = [i for i, g in zip(used_at, used) for _ in g.completions]
            self.last_gaps = _group_gaps(on_policy, row_group, prox, mu, mask)
        if self.correction == "none":
            weights = mask.float()
        stats.update(is_stats)
        # Groups weighted below 1 (unproven publishers): their tokens' loss is scaled by the
        # weight, and the update's learning rate by the used groups' mean weight. AdamW divides
        # the gradient by its running scale, so a step of such groups alone would otherwise move
        # the weights as far as any other; with both, it moves them by its mean weight of a step.
        scale = sum(g.weight for g in used) / len(used)
        if scale < 1.0:
            row_weight = [g.weight for g in used for _ in g.completions]
            weights = weights * torch.tensor([row_weight[i] for i in rows], dtype=weights.dtype, device=weights.device).unsqueeze(1)
        stats["weight_mean"] = scale
        lrs = [group["lr"] for group in self.opt.param_groups]

        totals: dict[str, float] = {}
        grad_norm = 0.0
        for (part, _), span, token_total in zip(parts, spans, token_totals):
            width = max((len(completions[i]) for i in part), default=0)
            lp = self._logprobs(part, prompts, completions)[0] if new_lp is None else new_lp
            m, c_prox, c_w = mask[span, :width], prox[span, :width], weights[span, :width]
            c_adv = advantages[part.start : part.stop]
            if self.correction == "tis":
                loss, loss_stats = tis_loss(lp, c_adv, m, c_w, token_total=token_total)
            else:
                loss, loss_stats = grpo_loss(
                    lp, c_prox, c_adv, m, clip_eps=self.clip_eps, weights=c_w, token_total=token_total
                )
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            # Over sharded (DTensor) gradients the norm is the whole model's, the same on every
            # process: the clip is the single-process clip.
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            for group, lr in zip(self.opt.param_groups, lrs):
                group["lr"] = lr * scale
            try:
                self.opt.step()
            finally:
                for group, lr in zip(self.opt.param_groups, lrs):
                    group["lr"] = lr
            # The fused kernel writes the parameters without moving their version counters, and a
            # TorchEngine over this model keeps its cached weights until they move.
            increment_version(self.params)
            # Token-weighted means over the minibatches (a minibatch's stats are token means).
            for k, v in loss_stats.items():
                totals[k] = totals.get(k, 0.0) + (v if k == "tokens" else v * loss_stats["tokens"])
        self._set_training(False)
        self.steps += 1
        tokens = totals.pop("tokens")
        stats.update({k: v / max(tokens, 1.0) for k, v in totals.items()})
        stats["tokens"] = tokens
        stats["grad_norm"] = grad_norm
        stats["skipped"] = 0.0
        return stats
