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
  tolerance 1e-5), so on-policy data has w = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor


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
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of each completion given its prompt and previous tokens.

    Returns (logprobs [B, Tmax], mask [B, Tmax]) with Tmax the longest completion; rows are
    right-padded, so causal attention alone keeps pads out of every real token's context and no
    attention mask (nor position-id shift) is needed. Gradients flow unless the caller disables them.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    batch = len(prompt_ids)
    t_max = max((len(c) for c in completion_ids), default=0)
    if batch == 0 or t_max == 0:
        empty = torch.zeros((batch, t_max))
        return empty, empty.bool()
    seq_len = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    targets = torch.full((batch, t_max), pad_id, dtype=torch.long)
    src_pos = torch.zeros((batch, t_max), dtype=torch.long)
    mask = torch.zeros((batch, t_max), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if not p:
            raise ValueError("every prompt needs at least one token (bos)")
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        n = len(c)
        targets[i, :n] = torch.tensor(c, dtype=torch.long)
        # Token j of the completion sits at len(p)+j and is predicted by the logits one before.
        src_pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
        mask[i, :n] = True
    logits = model(input_ids=ids, use_cache=False).logits
    # Gather the predicting positions first: log_softmax over [B, Tmax, V], not [B, S, V].
    picked = logits.gather(1, src_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logp = torch.log_softmax(picked.float() / temperature, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logp.masked_fill(~mask, 0.0), mask


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
    ) -> None:
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
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.steps = 0

    def step(self, groups: list[TrainGroup]) -> dict[str, float]:
        rewards = [r for g in groups for r in g.rewards]
        stats: dict[str, float] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "groups": float(len(groups)),
        }
        prompts: list[list[int]] = []
        completions: list[list[int]] = []
        behaviour: list[list[float]] = []
        advs: list[Tensor] = []
        for g in groups:
            adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32))
            if not bool(adv.any()):
                continue  # no signal; would only dilute the token mean
            prompts += [g.prompt_ids] * len(g.completions)
            completions += g.completions
            behaviour += g.behaviour_logprobs
            advs.append(adv)
        stats["groups_used"] = float(len(advs))
        if not advs:
            stats["skipped"] = 1.0
            return stats

        advantages = torch.cat(advs)
        rows = len(completions)
        chunks = [c for c in torch.arange(rows).tensor_split(min(self.minibatches, rows)) if len(c)]
        self.model.train()
        new_lp: Tensor | None = None
        if len(chunks) == 1:
            # pi_prox is pi_theta before the step: the forward that carries the gradient also
            # gives the learner's recomputed log-probs, no second pass.
            new_lp, mask = sequence_logprobs(self.model, prompts, completions, self.pad_id, temperature=self.temperature)
            prox = new_lp.detach()
        else:
            with torch.no_grad():
                prox, mask = sequence_logprobs(self.model, prompts, completions, self.pad_id, temperature=self.temperature)
        mu = torch.zeros_like(prox)
        for i, row in enumerate(behaviour):
            mu[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        weights, is_stats = importance_weights(prox, mu, mask, cap=self.is_cap)
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
                    temperature=self.temperature,
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
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
            self.opt.step()
            # Token-weighted means over the minibatches (a minibatch's stats are token means).
            for k, v in loss_stats.items():
                totals[k] = totals.get(k, 0.0) + (v if k == "tokens" else v * loss_stats["tokens"])
        self.model.eval()
        self.steps += 1
        tokens = totals.pop("tokens")
        stats.update({k: v / max(tokens, 1.0) for k, v in totals.items()})
        stats["tokens"] = tokens
        stats["grad_norm"] = grad_norm
        stats["skipped"] = 0.0
        return stats
