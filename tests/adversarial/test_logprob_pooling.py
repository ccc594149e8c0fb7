"""Check 4(b) (echo_node/learner/spot_check.py): a publisher's log-prob gaps pooled over all its checked
batches. A batch of one group holds a few dozen correlated tokens, where the per-batch mean test
must allow the honest spread of one group (mean + z sd / sqrt(k), k the groups'
`independent_units`); a forger nudging every log-prob by less
than that passes each batch alone. The pooled statistic, prod (1 + gap / mu) / 2 with mu twice
the envelope's mean, is a test supermartingale for honest gaps, kept per publisher as an e-CUSUM.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from echo_node.config import VerifyConfig
from echo_node.learner import spot_check as verify_module
from echo_node.learner.calibration import Judgement, Tolerance
from echo_node.learner.spot_check import GAP_MARGIN, Verifier, gap_log_e, independent_units
from echo_node.ml.model import state_to_bytes
from protocol import DropReason, RolloutBatch
from tests.factories import TASK, TOKENIZER
from tests.sampling import RUN, sample_batch, tiny_model

ALPHA = 0.05
PEERS, CHECKS, TOKENS = 2000, 40, 8


def _runs(mean: float, envelope_mean: float, seed: int) -> tuple[float, float]:
    """Over PEERS honest peers of CHECKS checks of TOKENS tokens, gaps exponential with `mean`:
    the share whose plain product of check 4(b)'s e-values ever reaches 1 / ALPHA, and the share
    whose e-CUSUM (restarted at 1 whenever below) does."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(PEERS, CHECKS, TOKENS, dtype=torch.float64).exponential_(1.0 / mean, generator=gen)
    mu = GAP_MARGIN * envelope_mean
    threshold = math.log(1 / ALPHA)
    # gap_log_e of every check at once (the same formula; checked against it on one check).
    e = (torch.log1p(gaps / mu) - math.log(2.0)).sum(-1)
    assert float(e[0, 0]) == pytest.approx(gap_log_e(gaps[0, 0], mu))
    plain = (e.cumsum(-1) >= threshold).any(-1)
    s = torch.zeros(PEERS, dtype=torch.float64)
    cusum = torch.zeros(PEERS, dtype=torch.bool)
    for c in range(CHECKS):
        s = (s + e[:, c]).clamp(min=0.0)
        cusum |= s >= threshold
    return float(plain.double().mean()), float(cusum.double().mean())


def test_the_pooled_statistics_false_alarm_rate_on_honest_gaps() -> None:
    """The stated rate: an honest publisher whose gaps have mean at most GAP_MARGIN x the
    envelope's reaches 1 / false_alarm with chance at most false_alarm from any start (Ville), so
    the e-CUSUM fails it within n checks with chance at most n x false_alarm. Measured at
    false_alarm = 0.05 over 2,000 simulated peers of 40 checks: at the assumption's edge (each
    factor of mean exactly 1) the plain product stays within the rate (binomial slack of three
    standard deviations); at the envelope's own mean (what honest peers of a measured pair show),
    neither the product nor the e-CUSUM ever fails a peer."""
    envelope = 0.01
    plain, cusum = _runs(GAP_MARGIN * envelope, envelope, seed=1)
    assert plain <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / PEERS), plain
    assert cusum <= CHECKS * ALPHA
    plain, cusum = _runs(envelope, envelope, seed=2)
    assert plain == 0.0 and cusum == 0.0


def test_the_pooled_statistic_grows_on_gaps_above_the_honest_mean() -> None:
    """What it convicts: a constant gap of 3 mu gains log 2 a token (30 tokens to e^20.7)."""
    mu = 0.02
    assert gap_log_e(torch.full((30,), 3 * mu), mu) == pytest.approx(30 * math.log(2.0))
    assert gap_log_e(torch.zeros(30), mu) == pytest.approx(-30 * math.log(2.0))
    assert gap_log_e(torch.zeros(0), mu) == 0.0


def shifted(batch: RolloutBatch, by: float) -> RolloutBatch:
    return replace(batch, groups=tuple(replace(g, samples=tuple(
        replace(s, behaviour_logprobs=tuple(x - by for x in s.behaviour_logprobs)) for s in g.samples)) for g in batch.groups))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


def verifier(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Verifier:
    """A pair whose honest gaps spread widely (mean 0.01, sd 0.1: a bf16-like envelope), so one
    small batch's mean may honestly reach 0.01 + 6 x 0.1 / sqrt(n)."""
    wide = Judgement("torch/cpu/float32", True, Tolerance(token=0.5, mean=0.01, sd=0.1, z=6.0), rounding=1e-4)
    monkeypatch.setattr(verify_module, "judgement", lambda *args, **kwargs: wide)
    v = Verifier(VerifyConfig(), run_id=RUN, tokenizer=TOKENIZER, task=TASK, model=model, temperature=1.0, keep_versions=4,
                 engine_of=lambda peer: ("torch", "cpu"))
    v.remember(0, state_to_bytes(model))
    return v


def test_a_small_nudge_in_small_batches_passes_each_alone_and_is_caught_pooled(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every claimed log-prob 0.04 lower, in batches of one group (~30 tokens): each batch alone
    passes the per-batch mean test (its limit there is ~0.12), but the publisher's pooled gaps
    convict it by its third checked batch, as `bad_logprobs`; an honest publisher's pooled
    evidence over the same number of batches stays at zero."""
    batches = [sample_batch(model, seq=seq, groups=1) for seq in range(1, 7)]
    for b in batches[:3]:
        alone = verifier(model, monkeypatch)
        assert alone.spot(shifted(b, 0.04), [0]) is None
    forger = verifier(model, monkeypatch)
    caught_at = None
    for i, b in enumerate(batches, 1):
        failure = forger.spot(shifted(b, 0.04), [0])
        if failure is not None:
            assert failure.reason is DropReason.BAD_LOGPROBS and "further from the learner's" in failure.evidence
            caught_at = i
            break
    assert caught_at is not None and 2 <= caught_at <= 3
    honest = verifier(model, monkeypatch)
    assert all(honest.spot(b, [0]) is None for b in batches)
    assert honest.stats.log_e_max["logprob_drift"] == 0.0


def test_the_mean_test_counts_groups_not_tokens() -> None:
    """Gaps inside a group are correlated, so the mean's standard error shrinks with the number
    of groups (their Kish effective number over the tokens tagged with the version judged), not
    with the tokens: one group is one unit however long, equal groups count one each, a large and
    a small group count less than two, and tokens of other versions none."""
    batch = sample_batch(tiny_model(), groups=3)
    g0, g1, g2 = batch.groups
    rows = lambda *gs: [(g, s) for g in gs for s in g.samples]  # noqa: E731
    assert independent_units(rows(g0), 0) == 1.0
    assert independent_units(rows(g0, g1, g2), 0) == pytest.approx(3.0, rel=0.2)
    one_row = [(g1, g1.samples[0])]  # a group of which one row was checked
    n0, n1 = sum(len(s.token_versions) for s in g0.samples), len(g1.samples[0].token_versions)
    assert n1 < n0 and independent_units(rows(g0) + one_row, 0) == pytest.approx((n0 + n1) ** 2 / (n0 * n0 + n1 * n1))
    assert independent_units(rows(g0, g1), 7) == 1.0  # no token of version 7: nothing to judge
