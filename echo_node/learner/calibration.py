"""How far an honest peer's behaviour log-probs may fall from the spot checker's: per (engine,
device, dtype), the envelope `echo_node.learner.spot_check` judges claimed log-probs by.

An honest peer samples with its engine (KV-cache decoding, its kernels, the run's rollout
dtype); the learner's spot checker recomputes every checked token's log-prob with one
full-sequence forward over the same published weights, in float32 on a CPU. The two differ by
rounding only: nothing in fp32 (a few 1e-6), a lot in bf16, whose 8-bit mantissa rounds every
activation of every layer (a per-token gap of a tenth of a nat is common). One limit for both is
either useless in fp32 or a ban for every honest bf16 peer, so limits come from measurements of
honest peers, per pair, recorded with the command that made them:

    python -m benchmarks.logprob_calibration --batches 8 --groups 4 \
        --out benchmarks/results/logprob_calibration.json

Rules:
- A token's gap may reach `verify.lp_max_factor` times the largest honest gap measured for its
  pair; the mean gap over the checked tokens of one version may reach the honest mean plus
  `verify.lp_mean_z` standard errors (honest mean + z * sd / sqrt(k)), with k the groups those
  tokens come from (their effective number: `spot_check.independent_units`), not the tokens.
  Gaps within a group are not independent draws (a shared prompt, each position's rounding
  depends on the context before it, and the level on the content), so an honest group's mean
  can lie many per-token standard errors from the envelope's mean
  (benchmarks/results/measurements.md). A mean of correlated gaps has at most the per-token
  variance, so over independent groups the bound
  holds whatever the correlation inside them; for z = 6 an honest mean lies beyond it with
  chance below 1e-8 where the central limit holds over groups, and the per-token limit covers
  the rest. A nudge of every log-prob below one group's limit is what check 4(b) pools across
  batches.
- Neither limit is ever below `FLOOR_TOKEN` / `FLOOR_MEAN`: gaps that small give a forger no
  lever (an importance weight moves by e^0.05, 5 %), and fp32 kernels other than the measured
  ones (another thread count, a GPU's TF32 matmuls) round differently by more than fp32's own
  envelope.
- The gap does not grow with a token's improbability in the measurements (its maximum is
  the same in every probability bucket), so the limits are flat in the token's probability.
- A pair never measured (a vLLM or CUDA peer, until someone with the hardware runs the
  benchmark) is refused only beyond `UNCALIBRATED_SLACK` times the widest envelope measured for
  any pair, and warned about (not banned) between the narrow envelope of its dtype and that
  line. A peer's (engine, device) is what its heartbeat claims: a forger that claims a pair
  never measured gains that slack and no more, and the sampling tests, which use the learner's
  own log-probs, do not depend on the claim at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOOR_TOKEN = 0.05
FLOOR_MEAN = 0.01
UNCALIBRATED_SLACK = 4.0


@dataclass(frozen=True, slots=True)
class Envelope:
    """Honest |claimed - recomputed| log-prob gaps of one pair, per token: their mean, standard
    deviation and the largest measured, over `tokens` tokens."""

    mean: float
    sd: float
    max: float
    tokens: int


# (engine, device type, rollout dtype) -> honest gaps against the float32 checker, from
# benchmarks/results/logprob_calibration.json (SmolLM2-135M-Instruct, math with its chat
# template, temperature 1, 48 new tokens) and, for fp32, the embedded toy's largest gap too.
CALIBRATED: dict[tuple[str, str, str], Envelope] = {
    ("torch", "cpu", "float32"): Envelope(mean=2.57e-06, sd=3.2e-06, max=2.9e-05, tokens=5414),
    ("torch", "cpu", "bfloat16"): Envelope(mean=0.0312, sd=0.0399, max=0.707, tokens=5387),
}


@dataclass(frozen=True, slots=True)
class Tolerance:
    """What a spot check lets through: `token` per token; a mean over n independent units (groups)
    up to `mean + z * sd / sqrt(n)`."""

    token: float
    mean: float
    sd: float = 0.0
    z: float = 0.0

    def mean_limit(self, n: float) -> float:
        return self.mean + self.z * self.sd / math.sqrt(max(1.0, n))


@dataclass(frozen=True, slots=True)
class Judgement:
    """How one peer's log-probs are judged: beyond `refuse` a batch fails; beyond `warn` (a pair
    never measured: its dtype's narrow envelope) the learner warns and counts, nothing more."""

    pair: str
    calibrated: bool
    refuse: Tolerance
    warn: Tolerance | None = None
    # The largest per-token rounding gap allowed without the floor (factor x the measured
    # maximum): what a replay of the pair's sampling may differ by (echo_node/learner/spot_check.py, check
    # 6), where the floor's reasons (other kernels, a forger's lever) do not apply. None: the
    # pair was never measured.
    rounding: float | None = None


def tolerance(envelope: Envelope, *, factor: float, z: float, slack: float = 1.0) -> Tolerance:
    return Tolerance(
        token=max(FLOOR_TOKEN, factor * envelope.max * slack),
        mean=max(FLOOR_MEAN, envelope.mean * slack),
        sd=envelope.sd * slack,
        z=z,
    )


def judgement(engine: str, device: str, dtype: str, *, factor: float, z: float) -> Judgement:
    """The judgement for a peer running `engine` on `device` (a device type, or "cuda:N") with
    rollout dtype `dtype` (torch's name without the "torch." prefix)."""
    key = (engine, device.split(":", 1)[0], dtype)
    pair = "/".join(key)
    envelope = CALIBRATED.get(key)
    if envelope is not None:
        return Judgement(pair, True, tolerance(envelope, factor=factor, z=z), rounding=factor * envelope.max)
    widest = max(CALIBRATED.values(), key=lambda e: e.max)
    same_dtype = [e for k, e in CALIBRATED.items() if k[2] == dtype]
    narrow = max(same_dtype, key=lambda e: e.max) if same_dtype else widest
    return Judgement(
        pair, False,
        refuse=tolerance(widest, factor=factor, z=z, slack=UNCALIBRATED_SLACK),
        warn=tolerance(narrow, factor=factor, z=z),
    )
