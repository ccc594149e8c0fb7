"""`run_until_signal` starts a role with `nursery.start`: what the role reports when ready, its
result, and its errors (before and after it was ready) as the role raised them. Signals
themselves are tested with real processes (tests/integration/test_signals.py)."""

from __future__ import annotations

import pytest
import trio

from echo_node.stopping import run_until_signal


def test_the_ready_value_is_handed_on_while_the_role_runs() -> None:
    seen: list[object] = []
    handed_on = trio.Event()

    def on_ready(value: object) -> None:
        seen.append(value)
        handed_on.set()

    async def role(*, task_status: trio.TaskStatus[dict[str, int]]) -> str:
        task_status.started({"version": 3})
        await handed_on.wait()  # would never return if on_ready waited for the role to end
        return "summary"

    result, signum = run_until_signal(role, on_ready=on_ready)
    assert (result, signum) == ("summary", None)
    assert seen == [{"version": 3}]


@pytest.mark.parametrize("ready_first", [False, True])
def test_a_role_error_comes_out_as_the_role_raised_it(ready_first: bool) -> None:
    ready: list[object] = []

    async def role(*, task_status: trio.TaskStatus[None]) -> None:
        if ready_first:
            task_status.started()
        raise ValueError("no such run")

    with pytest.raises(ValueError, match="no such run"):
        run_until_signal(role, on_ready=ready.append)
    assert ready == ([None] if ready_first else [])


def test_a_role_that_never_says_it_is_ready_is_an_error() -> None:
    async def role(*, task_status: trio.TaskStatus[None]) -> int:
        return 1

    with pytest.raises(RuntimeError, match="without calling task_status.started"):
        run_until_signal(role)
