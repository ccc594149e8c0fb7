"""Staleness rules at the edges (Echo's pull and async modes)."""

from __future__ import annotations

import pytest

from protocol import DropReason, admissible

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
