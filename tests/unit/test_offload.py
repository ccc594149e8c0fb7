"""echo_node/offload.py: blocking work in a worker thread, or inline for a swarm on virtual time."""

from __future__ import annotations

import threading
import time

import trio
import trio.testing

from echo_node import offload


def _work() -> str:
    time.sleep(0.05)  # blocking work, as a step or a batch is
    return threading.current_thread().name


def test_work_runs_in_a_worker_thread_and_the_loop_goes_on_meanwhile() -> None:
    ticks: list[float] = []

    async def main() -> str:
        async with trio.open_nursery() as nursery:
            async def tick() -> None:
                while True:
                    ticks.append(trio.current_time())
                    await trio.sleep(0.005)

            nursery.start_soon(tick)
            name = await offload.run_sync(_work)
            nursery.cancel_scope.cancel()
        return name

    assert trio.run(main) != threading.current_thread().name
    assert len(ticks) > 1


def test_inline_work_runs_in_the_task_and_virtual_time_stands_still_meanwhile() -> None:
    """With threads, a MockClock that jumps whenever every task waits would fire a 1 s timeout
    during 50 ms of work; inline, the work holds the loop and the timeout never fires."""

    async def main() -> tuple[str, float]:
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 0.5)  # a timer the clock could jump to
                t0 = trio.current_time()
                name = await offload.run_sync(_work)
                return name, trio.current_time() - t0

    with offload.inline():
        name, elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert name == threading.current_thread().name and elapsed == 0.0
    assert not offload.is_inline()


def test_threaded_work_under_a_jumping_clock_lets_timers_fire_which_is_why_inline_exists() -> None:
    fired: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def timer() -> None:
                await trio.sleep(60)
                fired.append(trio.current_time())

            nursery.start_soon(timer)
            await offload.run_sync(lambda: time.sleep(0.2))
            nursery.cancel_scope.cancel()

    # A 60 s timer fires in virtual time while the thread sleeps 0.2 s of real time.
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert fired == [60.0]


def _poll_until_cancelled(started: threading.Event) -> str:
    """Blocking work that polls for its caller's cancellation, as the delta encoder does."""
    started.set()
    for _ in range(400):
        offload.check_cancelled()
        time.sleep(0.005)
    return "ran to the end"


def test_threaded_work_that_polls_stops_when_its_caller_is_cancelled() -> None:
    async def main() -> bool:
        started = threading.Event()
        with trio.move_on_after(0.05) as scope:
            await offload.run_sync(_poll_until_cancelled, started)
        return scope.cancelled_caught

    assert trio.run(main)


def test_inline_work_that_polls_runs_to_the_end_instead_of_failing() -> None:
    """trio.from_thread.check_cancelled raises RuntimeError outside a worker thread: inline, the
    delta encoder would have failed every encode."""

    async def main() -> str:
        return await offload.run_sync(_poll_until_cancelled, threading.Event())

    with offload.inline():
        assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == "ran to the end"
