"""The rule that assigns each group its prompt (protocol/assignment.py): pinned vectors, so any
implementation can check itself against ours, and the properties the learner relies on."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from echo_node.ml.tasks import get_task
from protocol.assignment import Slot, batch_seed, group_version, groups_that_fit, prompt_draw
from protocol.limits import MAX_BATCH_GROUPS, ROLLOUT_BATCH_BYTES
from protocol.messages import worst_group_bytes

PEER = "12D3KooWENTLiCwwoVwYNbKFEfmNdyHG1jxNn9oPB29JeeZXWjAb"


def test_pinned_vectors() -> None:
    assert Slot("run-1", PEER, 1000, 2).digest().hex() == "05087f178e4a6ae6f01603646f12ece85a05fb98d931a7c854e7e961220ac242"
    assert prompt_draw("run-1", PEER, 1000, 2) == 362679509151541990
    assert batch_seed("run-1", PEER, 1000) == 1989844286
    assert get_task("addition").prompt_for(362679509151541990) == "90+19="


def test_every_field_moves_the_draw_and_fields_cannot_run_into_each_other() -> None:
    base = ("run-1", PEER, 1000, 2)
    draws = {prompt_draw(*base)}
    for i, other in enumerate(("run-2", PEER[:-1] + "c", 1001, 3)):
        draws.add(prompt_draw(*base[:i], other, *base[i + 1 :]))  # type: ignore[arg-type]
    assert len(draws) == 5
    # Length prefixes: ("ab", "c") and ("a", "bc") are different slots.
    assert prompt_draw("ab", "c", 0, 0) != prompt_draw("a", "bc", 0, 0)
    with pytest.raises(ValueError):
        Slot("run-1", PEER, -1, 0).digest()


def test_prompts_drawn_cover_the_task_evenly() -> None:
    task = get_task("addition")
    counts = Counter(task.prompt_for(prompt_draw("run-1", PEER, seq, i))[:2] for seq in range(500) for i in range(8))
    assert len(counts) == 100 and max(counts.values()) < 80  # 40 expected per first operand
    rng = random.Random(0)
    for _ in range(1000):
        prompt = task.prompt_for(rng.getrandbits(64))
        assert len(task.answer(prompt)) == 3


def test_a_group_began_on_one_version() -> None:
    assert group_version([4, 4, 4]) == 4
    assert group_version([4, 5]) is None
    assert group_version([]) is None


def test_a_planned_batch_always_fits_one_message() -> None:
    worst = worst_group_bytes(group_size=8, prompt_tokens=7, max_new_tokens=4)
    assert groups_that_fit(worst) * worst <= ROLLOUT_BATCH_BYTES and groups_that_fit(worst) >= 8
    assert groups_that_fit(ROLLOUT_BATCH_BYTES * 3) == 1  # even a group that cannot fit is tried alone
    assert groups_that_fit(1) == MAX_BATCH_GROUPS
