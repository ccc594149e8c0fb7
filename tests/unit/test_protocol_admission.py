"""A run admits only rollouts its model, task and config can use (protocol.admission)."""

from __future__ import annotations

import pytest

from protocol import DropReason, Identity, RolloutBatch, RolloutGroup, RunBounds, Sample, judge_batch

RUN = RunBounds(run_id="run", group_size=2, vocab_size=10, max_new_tokens=4, max_prompt_tokens=8, reward_low=0.0, reward_high=1.0)


def _batch(
    versions: list[tuple[int, ...]], *, run_id: str = "run", groups: int = 1, token: int = 3,
    prompt: tuple[int, ...] = (1, 4), reward: float = 1.0,
) -> RolloutBatch:
    group = RolloutGroup(
        group_id="g", prompt_ids=prompt,
        samples=tuple(
            Sample(completion_ids=(token,) * len(v), behaviour_logprobs=(-1.0,) * len(v), token_versions=v, reward=reward)
            for v in versions
        ),
    )
    return RolloutBatch(run_id=run_id, peer_id=Identity.from_seed(b"\x06" * 32).peer_id, seq=0, groups=(group,) * groups)


def judge(batch: RolloutBatch, current: int = 5) -> DropReason | None:
    return judge_batch(batch, run=RUN, current_version=current)


def test_versions_and_shape() -> None:
    assert judge(_batch([(4, 5), (5,)], groups=3)) is None
    assert judge(_batch([(3, 5), (5,)])) is None  # staleness is the buffer's, per group
    assert judge(_batch([(5, 6), (5,)])) is DropReason.FUTURE_VERSION
    assert judge(_batch([(5,), ()])) is None  # an empty completion has no version
    assert judge(_batch([(5, 6), (5,)], run_id="other")) is DropReason.WRONG_RUN  # run first
    assert judge(_batch([(5,)])) is DropReason.BAD_GROUP
    assert judge(_batch([(5, 6)]), current=6) is DropReason.BAD_GROUP


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (_batch([(5,), (5,)], token=10), DropReason.OUT_OF_VOCAB),  # == vocab size: no embedding
        (_batch([(5,), (5,)], token=999_999), DropReason.OUT_OF_VOCAB),
        (_batch([(5,), (5,)], prompt=(1, 10)), DropReason.OUT_OF_VOCAB),
        (_batch([(5,) * 5, (5,)]), DropReason.TOO_LONG),
        (_batch([(5,), (5,)], prompt=(1,) * 9), DropReason.TOO_LONG),
        (_batch([(5,), (5,)], reward=1.5), DropReason.BAD_REWARD),
        (_batch([(5,), (5,)], reward=-1e-9), DropReason.BAD_REWARD),
        # The first failing rule names the drop: a forged future token in an out-of-vocab batch.
        (_batch([(6,), (6,)], token=10), DropReason.OUT_OF_VOCAB),
    ],
)
def test_run_bounds_refuse(batch: RolloutBatch, reason: DropReason) -> None:
    assert judge(batch) is reason


def test_edges_are_admitted() -> None:
    assert judge(_batch([(5,) * 4, (5,)], token=9, prompt=(9,) * 8, reward=0.0)) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"vocab_size": 0}, {"max_new_tokens": 0}, {"group_size": 1}, {"reward_low": 2.0}, {"reward_high": float("inf")}],
)
def test_bounds_reject_nonsense(kwargs: dict[str, object]) -> None:
    base = dict(run_id="run", group_size=2, vocab_size=10, max_new_tokens=4, max_prompt_tokens=8, reward_low=0.0, reward_high=1.0)
    with pytest.raises(ValueError):
        RunBounds(**{**base, **kwargs})  # type: ignore[arg-type]
