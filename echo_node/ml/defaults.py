"""Recommended ML defaults for the embedded run (tiny Llama + char tokenizer + addition).

Tuned on 2 CPU cores, 1 torch thread per process. Every process sets its torch thread count
explicitly: oversubscribing the cores is the largest slowdown on this platform (docs/platform.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupConfig:
    """Supervised warm-up (teacher forcing on prompt + answer + eos, loss on answer + eos only).

    `steps` is tuned so the warmed policy's mean *sampled* reward at T = 1 lands around 0.3–0.5:
    RL from ~0 collapses (docs/platform.md), and from ~1 there is nothing left to show.
    """

    steps: int = 325
    batch_size: int = 64
    lr: float = 2e-3
    ramp_steps: int = 50
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RLConfig:
    lr: float = 1e-4
    temperature: float = 1.0
    top_p: float = 1.0
    group_size: int = 8
    groups_per_step: int = 8
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0


TORCH_THREADS = 1
MODEL_SEED = 0
WARMUP = WarmupConfig()
RL = RLConfig()
