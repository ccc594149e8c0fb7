"""Staleness rules at the edges (Echo's pull and async modes)."""

from __future__ import annotations

import pytest

from protocol import DropReason, Identity, RolloutGroup, RunSpec, Sample, SamplingParams, admissible, judge_group

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


def _spec(mode: str = "async", staleness: int = 1) -> RunSpec:
    return RunSpec(
        run_id="run", model={}, tokenizer={}, task="t",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), sync_mode=mode,  # type: ignore[arg-type]
        staleness=staleness, group_size=2, current_version=0, learner_peer_id=Identity.from_seed(b"\x05" * 32).peer_id,
    )


def _group(versions: list[tuple[int, ...]], run_id: str = "run") -> RolloutGroup:
    return RolloutGroup(
        run_id=run_id, peer_id=Identity.from_seed(b"\x06" * 32).peer_id, seq=0, group_id="g", prompt_ids=(1,),
        samples=tuple(
            Sample(completion_ids=(1,) * len(v), behaviour_logprobs=(-1.0,) * len(v), token_versions=v, reward=0.0)
            for v in versions
        ),
    )


def test_judge_group() -> None:
    spec = _spec()
    assert judge_group(_group([(4, 5), (5,)]), spec, 5) is None
    assert judge_group(_group([(3, 5), (5,)]), spec, 5) is STALE
    assert judge_group(_group([(5, 6), (5,)]), spec, 5) is FUTURE
    assert judge_group(_group([(5,), ()]), spec, 5) is None  # an empty completion has no version
    assert judge_group(_group([(5,), (5,)], run_id="other"), spec, 5) is DropReason.WRONG_RUN
    assert judge_group(_group([(5,)]), spec, 5) is DropReason.BAD_GROUP
    assert judge_group(_group([(4,), (5,)]), _spec("pull"), 5) is STALE
