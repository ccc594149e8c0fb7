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
"""

from __future__ import annotations

import math
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

    def __post_init__(self) -> None:
        n = len(self.completions)
        if len(self.behaviour_logprobs) != n or len(self.rewards) != n:
            raise ValueError(
                f"group sizes differ: {n} completions, {len(self.behaviour_logprobs)} log-prob rows,"
                f" {len(self.rewards)} rewards"
            )
        for c, lp in zip(self.completions, self.behaviour_logprobs):
            if len(c) != len(lp):
                raise ValueError(f"completion of {len(c)} tokens has {len(lp)} log-probs")


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
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of each completion given its prompt and previous tokens.

    Returns (logprobs [B, Tmax], mask [B, Tmax]) with Tmax the longest completion; rows are
    right-padded, so causal attention alone keeps pads out of every real token's context and no
    attention mask (nor position-id shift) is needed. Gradients flow unless the caller disables them.
    `fast_path`: None takes the lean Llama forward (`_lean_llama_logits`) when the model is one
    it reproduces, else the model's own forward; False forces the model's own forward (the
    reference the lean one is tested against); True demands the lean one.
    """
    logp, targets, mask = completion_log_softmax(
        model, prompt_ids, completion_ids, pad_id, temperature=temperature, fast_path=fast_path
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
    if batch == 0 or t_max == 0:
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        return torch.zeros((batch, t_max, vocab)), torch.zeros((batch, t_max), dtype=torch.long), torch.zeros((batch, t_max), dtype=torch.bool)
    if any(not p for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (bos)")
    targets = torch.tensor([c + [pad_id] * (t_max - len(c)) for c in completion_ids], dtype=torch.long)
    mask = torch.tensor([[j < len(c) for j in range(t_max)] for c in completion_ids], dtype=torch.bool)
    if _lean_path_applies(model, fast_path):
        picked = _lean_llama_logits(cast("LlamaForCausalLM", model), prompt_ids, completion_ids, t_max, pad_id)
    else:
        picked = _hf_logits(model, prompt_ids, completion_ids, t_max, pad_id)
    return torch.log_softmax(picked.float() / temperature, dim=-1), targets, mask


def _hf_logits(
    model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]], t_max: int, pad_id: int
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
    ids = torch.tensor(ids_rows, dtype=torch.long)
    src_pos = torch.tensor(src_rows, dtype=torch.long)
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
    model: LlamaForCausalLM, prompt_ids: list[list[int]], completion_ids: list[list[int]], t_max: int, pad_id: int
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
    rows = torch.tensor(row_of, dtype=torch.long)
    p_len = torch.tensor([len(p) for p in distinct], dtype=torch.long)
    row_p_len = p_len[rows]
    prefix_rows = [list(p) + [pad_id] * (p_max - len(p)) for p in distinct]
    comp_rows = [c[:c_len] + [pad_id] * (c_len - min(len(c), c_len)) for c in completion_ids]
    ids = torch.tensor([t for row in prefix_rows + comp_rows for t in row], dtype=torch.long)
    linear = torch.nn.functional.linear
    sdpa = torch.nn.functional.scaled_dot_product_attention
    h = torch.nn.functional.embedding(ids, inner.embed_tokens.weight)
    # Rotary tables by absolute position: prefix slot s sits at s, completion input j of row b
    # at len(prompt_b) + j. Laid out [N, 1, hd] along the flat token axis, broadcast over heads;
    # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi] (negation is exact).
    cos, sin = inner.rotary_emb(h, torch.arange(p_max + c_len).unsqueeze(0))
    cos, sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    pos = torch.cat((torch.arange(p_max).repeat(n_u), (row_p_len[:, None] + torch.arange(c_len)).view(-1)))
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    # Completion query j sees its prompt's real slots and its own inputs 0..j. Never an all-False
    # row (every prompt has a token), so SDPA gives no NaN even on padding queries.
    allowed = torch.cat(
        (
            (torch.arange(p_max)[None, :] < row_p_len[:, None])[:, None, :].expand(batch, c_len, p_max),
            torch.ones(c_len, c_len, dtype=torch.bool).tril().expand(batch, c_len, c_len),
        ),
        dim=-1,
    ).unsqueeze(1)
    # After the last attention only the predicting positions matter: each prompt's last slot and
    # every completion input.
    keep = torch.cat((torch.arange(n_u) * p_max + p_len - 1, n_prefix + torch.arange(batch * c_len)))

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
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip surrogate of new vs `old_logprobs`, token-mean over `mask`, each token's term
    times `weights` (constant; None = 1). advantages: [B] (per sequence) or [B, T]."""
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
    loss = (per_token * maskf).sum() / n_tokens
    with torch.no_grad():
        # A token is "clipped" when the clamp is the active branch of the min: it gives no gradient.
        was_clipped = ((ratio > 1.0 + clip_eps) & (advantages > 0)) | (
            (ratio < 1.0 - clip_eps) & (advantages < 0)
        )
        stats = {
            "loss": float(loss.detach()),
            "clip_frac": float((was_clipped.float() * maskf).sum() / n_tokens),
            "ratio_mean": float((ratio * maskf).sum() / n_tokens),
            "ratio_max": float(ratio.masked_fill(~mask, 0.0).max()) if mask.any() else 1.0,
            # k3 estimator of KL(old || new) (Schulman), non-negative per token.
            "kl_old": float(((ratio - 1.0 - log_ratio) * maskf).sum() / n_tokens),
            "tokens": float(maskf.sum()),
        }
    return loss, stats


def _logprob_gaps(groups: list[TrainGroup], prox: Tensor, mu: Tensor, mask: Tensor) -> dict[str, float]:
    """|learner log-prob - claimed behaviour log-prob| over the tokens sampled by the weights
    being trained (`TrainGroup.on_policy`): what an honest peer's engine and the learner's forward
    disagree by, and what a forged log-prob shows up as."""
    rows = [flags for g in groups for flags in (g.on_policy or [[False] * len(c) for c in g.completions])]
    t_max = prox.shape[1]
    on = torch.tensor([r + [False] * (t_max - len(r)) for r in rows], dtype=torch.bool) & mask
    n = int(on.sum())
    if n == 0:
        return {}
    gap = (prox - mu).abs()[on]
    return {"lp_gap_tokens": float(n), "lp_gap_mean": float(gap.mean()), "lp_gap_max": float(gap.max())}


def tis_loss(
    new_logprobs: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Truncated-IS policy gradient: -w * (pi_theta / sg(pi_theta)) * A, token-mean over `mask`.

    The ratio to its own detached value is 1 in the forward pass and gives grad log pi_theta,
    so the gradient is w * A * grad log pi_theta with no clipping (w already bounds it).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    maskf = mask.float()
    n_tokens = maskf.sum().clamp(min=1.0)
    ratio = torch.exp(new_logprobs - new_logprobs.detach()).masked_fill(~mask, 0.0)
    loss = -(weights.detach() * ratio * advantages * maskf).sum() / n_tokens
    return loss, {"loss": float(loss.detach()), "tokens": float(maskf.sum())}


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
    ) -> None:
        """`fast_path`: `sequence_logprobs`'s choice of forward (None: lean when it applies)."""
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
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = _adamw(self.params, lr=lr)
        self.steps = 0
        # Train mode only changes what a forward computes where there is dropout; the lean Llama
        # forward has none, and walking the modules twice per update is a visible share of a step.
        self._mode_matters = not (is_lean_llama(model) and _attention_dropout(model) == 0)

    def _set_training(self, mode: bool) -> None:
        if self._mode_matters:
            self.model.train(mode)

    def step(self, groups: list[TrainGroup]) -> dict[str, float]:
        rewards = [r for g in groups for r in g.rewards]
        stats: dict[str, float] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "groups": float(len(groups)),
        }
        # A group whose rewards are all equal has zero advantage: no signal, and it would only
        # dilute the token mean.
        used = [g for g in groups if min(g.rewards, default=0.0) != max(g.rewards, default=0.0)]
        stats["groups_used"] = float(len(used))
        if not used:
            stats["skipped"] = 1.0
            return stats
        prompts = [g.prompt_ids for g in used for _ in g.completions]
        completions = [c for g in used for c in g.completions]
        behaviour = [lp for g in used for lp in g.behaviour_logprobs]
        advantages = _advantages([g.rewards for g in used])
        rows = len(completions)
        chunks = [c for c in torch.arange(rows).tensor_split(min(self.minibatches, rows)) if len(c)]
        self._set_training(True)
        new_lp: Tensor | None = None
        if len(chunks) == 1:
            # pi_prox is pi_theta before the step: the forward that carries the gradient also
            # gives the learner's recomputed log-probs, no second pass.
            new_lp, mask = sequence_logprobs(
                self.model, prompts, completions, self.pad_id, temperature=self.temperature, fast_path=self.fast_path
            )
            prox = new_lp.detach()
        else:
            with torch.no_grad():
                prox, mask = sequence_logprobs(
                    self.model, prompts, completions, self.pad_id, temperature=self.temperature,
                    fast_path=self.fast_path,
                )
        t_max = prox.shape[1]
        mu = torch.tensor([row + [0.0] * (t_max - len(row)) for row in behaviour], dtype=torch.float32)
        weights, is_stats = importance_weights(prox, mu, mask, cap=self.is_cap)
        stats.update(_logprob_gaps(used, prox, mu, mask))
        if self.correction == "none":
            weights = mask.float()
        stats.update(is_stats)

        totals: dict[str, float] = {}
        grad_norm = 0.0
        for chunk in chunks:
            idx = chunk.tolist()
            width = max(len(completions[i]) for i in idx)
            if new_lp is None:
                lp, m = sequence_logprobs(
                    self.model, [prompts[i] for i in idx], [completions[i] for i in idx], self.pad_id,
                    temperature=self.temperature, fast_path=self.fast_path,
                )
            else:
                lp, m = new_lp, mask
            c_prox, c_w, c_adv = prox[idx, :width], weights[idx, :width], advantages[idx]
            if self.correction == "tis":
                loss, loss_stats = tis_loss(lp, c_adv, m, c_w)
            else:
                loss, loss_stats = grpo_loss(lp, c_prox, c_adv, m, clip_eps=self.clip_eps, weights=c_w)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            self.opt.step()
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
