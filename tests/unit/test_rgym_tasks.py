"""reasoning-gym tasks by name in `[task]` (echo_node/envs/rgym.py): every exposed task builds,
poses prompts as a pure function of the draw, scores its own answers 1 and others 0."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("reasoning_gym")

from echo_node.config import TaskConfig  # noqa: E402
from echo_node.envs.rgym import RG_TASKS, ReasoningGymTask  # noqa: E402
from echo_node.ml.tasks import build_task  # noqa: E402


@pytest.mark.parametrize("name", RG_TASKS)
def test_exposed_tasks_pose_and_score(name: str) -> None:
    task = build_task(TaskConfig(name=f"rg:{name}"))
    assert isinstance(task, ReasoningGymTask) and task.task_id.startswith(f"rg:{name}@")
    again = ReasoningGymTask(f"rg:{name}")
    draws = [random.Random(7).getrandbits(64) for _ in range(8)]
    prompts = [task.prompt_for(d) for d in draws]
    assert prompts == [again.prompt_for(d) for d in draws] and again.task_id == task.task_id
    right = [task.answer(p) for p in prompts]
    assert task.reward(prompts, right) == [1.0] * len(prompts)
    assert task.reward(prompts, ["<answer>no such answer</answer>"] * len(prompts)) == [0.0] * len(prompts)
    # The answer alone, without tags, is scored too; a huge completion is cut, not parsed whole.
    bare = [r.removeprefix("<answer>").removesuffix("</answer>") for r in right]
    assert task.reward(prompts[:1], bare[:1]) == [1.0]
    assert task.reward(prompts[:1], ["(" * 100_000]) == [0.0]


def test_unknown_and_foreign_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="not exposed"):
        build_task(TaskConfig(name="rg:arc_agi"))
    # A chat form is not built for generators: said as such, not as an unknown built-in.
    with pytest.raises(ValueError, match="reasoning-gym generator.*no chat form"):
        build_task(TaskConfig(name="rg:chain_sum", chat=True))
    task = build_task(TaskConfig(name="rg:chain_sum"))
    with pytest.raises(ValueError, match="not one of its rows"):
        task.reward(["2+2="], ["4"])
