"""Staleness rules at the edges (Echo's pull and async modes)."""

from __future__ import annotations

import pytest

from protocol import DropReason, Identity, RolloutBatch, RolloutGroup, Sample, admissible, judge_batch

STALE, FUTURE = DropReason.STALE, DropReason.FUTURE_VERSION


@pytest.mark.parametrize(
    ("min_version", "current", "s", "mode", "expected"),
    [
        (10, 10, 0, "pull", None),
        (9, 10, 5, "pull", STALE),  # pull ignores S
        (11, 10, 0, "pull", FUTURE),
        (10, 10, 2, "async", None),
        (8, 10, 2, "async", None),  # exactly current - S
        (7, 10, 2, "async", STALE),  # one past
        (11, 10, 2, "async", FUTURE),
        (0, 0, 0, "async", None),
        (0, 3, 5, "async", None),  # S larger than current
        (9, 10, 0, "async", STALE),
    ],
)
def test_admissible_edges(min_version: int, current: int, s: int, mode: str, expected: DropReason | None) -> None:
    assert admissible(min_version, current, s, mode) == expected


def test_future_token_in_otherwise_fresh_group() -> None:
    assert admissible(9, 10, 2, "async", max_version=10) is None
    assert admissible(9, 10, 2, "async", max_version=11) is FUTURE
    assert admissible(10, 10, 0, "pull", max_version=11) is FUTURE


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        admissible(1, 1, 0, "sync")
    with pytest.raises(ValueError):
        admissible(1, 1, -1, "async")


def _batch(versions: list[tuple[int, ...]], run_id: str = "run", groups: int = 1) -> RolloutBatch:
    group = RolloutGroup(
        group_id="g", prompt_ids=(1,),
        samples=tuple(
            Sample(completion_ids=(1,) * len(v), behaviour_logprobs=(-1.0,) * len(v), token_versions=v, reward=0.0)
            for v in versions
        ),
    )
    return RolloutBatch(run_id=run_id, peer_id=Identity.from_seed(b"\x06" * 32).peer_id, seq=0, groups=(group,) * groups)


def test_judge_batch() -> None:
    def judge(batch: RolloutBatch, current: int = 5) -> DropReason | None:
        return judge_batch(batch, run_id="run", group_size=2, current_version=current)

    assert judge(_batch([(4, 5), (5,)], groups=3)) is None
    assert judge(_batch([(3, 5), (5,)])) is None  # staleness is the buffer's, per group
    assert judge(_batch([(5, 6), (5,)])) is FUTURE
    assert judge(_batch([(5,), ()])) is None  # an empty completion has no version
    assert judge(_batch([(5, 6), (5,)], run_id="other")) is DropReason.WRONG_RUN  # run first
    assert judge(_batch([(5,)])) is DropReason.BAD_GROUP
    assert judge(_batch([(5, 6)]), current=6) is DropReason.BAD_GROUP
