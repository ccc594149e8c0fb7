"""Environment calls bounded in time: what keeps a hung or crashing environment from taking a
node with it. No torch here: the registry's load-time probe uses it too.

Each call runs in its own daemon thread; the caller waits at most its timeout for all of them.
A thread stuck in a hung call cannot be killed: it is abandoned, and once MAX_ABANDONED of them
are alive in the process, `call_bounded` refuses (`EnvUnavailable`), so a hung environment costs
bounded threads and then a clear error, never the node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Threads left running in a hung environment call, process-wide, before the runner refuses.
MAX_ABANDONED = 16
_abandoned: list[threading.Thread] = []
_abandoned_lock = threading.Lock()


class EnvUnavailable(RuntimeError):
    """Too many environment calls hung: this process runs no more episodes of it."""


@dataclass(slots=True)
class Outcome(Generic[T]):
    value: T | None = None
    error: str | None = None  # "env_error: ..." or "env_timeout"


def abandoned_threads() -> int:
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()]
        return len(_abandoned)


def call_bounded(calls: Sequence[Callable[[], T]], timeout_s: float) -> list[Outcome[T]]:
    """Run `calls` at once, each in its own daemon thread, and wait at most `timeout_s` for all.
    A call that raised is an env_error, one still running at the deadline an env_timeout."""
    if abandoned_threads() >= MAX_ABANDONED:
        raise EnvUnavailable(f"{MAX_ABANDONED} environment calls are hung in this process; refusing to run more")
    outcomes: list[Outcome[T]] = [Outcome() for _ in calls]

    def run(i: int, fn: Callable[[], T]) -> None:
        try:
            outcomes[i].value = fn()
        except Exception as exc:  # an environment's bug of any kind ends its episode only
            outcomes[i].error = f"env_error: {type(exc).__name__}: {str(exc)[:200]}"

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True, name="echo-env") for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for t, o in zip(threads, outcomes):
        if t.is_alive():
            o.value, o.error = None, "env_timeout"
            with _abandoned_lock:
                _abandoned.append(t)
    return outcomes


def reason_of(error: str) -> str:
    """The counted reason of an outcome's error ("env_error" or "env_timeout")."""
    return error.split(":", 1)[0]
