"""benchmarks.verification's count of the lies an attacker got trained (pure bookkeeping)."""

from __future__ import annotations

from benchmarks.verification import lying_groups_trained


def published(peer: str, seq: int, *, lying: bool, groups: int = 2) -> dict[str, object]:
    return {"event": "published", "peer": peer, "seq": seq, "lying": lying, "ids": [f"{peer}-{seq}.{i}" for i in range(groups)]}


def test_a_caught_keys_honest_batches_are_not_lies_and_what_cannot_be_told_apart_is() -> None:
    lines = [published("a", 1, lying=False), published("a", 2, lying=True), published("b", 1, lying=True)]
    caught = [{"peer": "a", "trained_groups": 3, "trained_recent": ["a-1.0", "a-1.1", "a-2.0"]}]
    # a: two honest groups and one lie named; b was never caught: all 4 of its trained count.
    assert lying_groups_trained(["a", "b"], {"a": 3, "b": 4}, caught, lines) == 1 + 4
    # More trained than the record names (beyond TRAINED_IDS_KEPT, or after it): those count too.
    assert lying_groups_trained(["a"], {"a": 5}, caught, lines) == 1 + 2
    # A record without ids (an older learner) tells nothing apart.
    assert lying_groups_trained(["a"], {"a": 3}, [{"peer": "a"}], lines) == 3
