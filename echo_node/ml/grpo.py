"""GRPO on the learner: group-relative advantages, a clipped surrogate against behaviour log-probs.

Invariants:
- Advantages are computed within one group (the completions of one prompt); a group whose rewards
  are all equal carries no signal, gets exactly zero advantage, and is left out of the loss.
- The importance ratio is exp(new − behaviour): the behaviour log-probs are the ones the engine
  reported when sampling (log_softmax(logits / T)), so stale or off-policy tokens are corrected
  and clipped rather than trusted (Echo's async mode; PPO-clip as in DeepSeekMath GRPO).
- The loss is a token-level mean over all completion tokens in the step (DAPO's token-mean), so a
  long completion weighs by its tokens, not as one sample.
- `sequence_logprobs(..., temperature=T)` recomputes exactly what `TorchEngine` reports at T (test
  tolerance 1e-5), so on-policy data has ratio 1 at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def grpo_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip surrogate, token-mean over `mask`. advantages: [B] (per sequence) or [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    maskf = mask.float()
    n_tokens = maskf.sum().clamp(min=1.0)
    log_ratio = (new_logprobs - old_logprobs).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
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
            # k3 estimator of KL(behaviour || new) (Schulman), non-negative per token.
            "kl_behaviour": float(((ratio - 1.0 - log_ratio) * maskf).sum() / n_tokens),
            "tokens": float(maskf.sum()),
        }
    return loss, stats


class PolicyOptimizer:
    """One GRPO update per `step(groups)`: AdamW (no weight decay), grad-norm clipping."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        clip_eps: float = 0.2,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        pad_id: int = 0,
    ) -> None:
        self.model = model
        self.clip_eps = clip_eps
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.pad_id = pad_id
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
        old: list[list[float]] = []
        advs: list[Tensor] = []
        for g in groups:
            adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32))
            if not bool(adv.any()):
                continue  # no signal; would only dilute the token mean
            prompts += [g.prompt_ids] * len(g.completions)
            completions += g.completions
            old += g.behaviour_logprobs
            advs.append(adv)
        stats["groups_used"] = float(len(advs))
        if not advs:
            stats["skipped"] = 1.0
            return stats

        self.model.train()
        new_lp, mask = sequence_logprobs(
            self.model, prompts, completions, self.pad_id, temperature=self.temperature
        )
        old_lp = torch.zeros_like(new_lp)
        for i, row in enumerate(old):
            old_lp[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        loss, loss_stats = grpo_loss(
            new_lp, old_lp, torch.cat(advs), mask, clip_eps=self.clip_eps
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.model.eval()
        self.steps += 1
        stats.update(loss_stats)
        stats["grad_norm"] = float(grad_norm)
        stats["skipped"] = 0.0
        return stats
