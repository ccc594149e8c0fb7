"""Environment calls bounded in time and in threads: what keeps a hung or crashing environment
from taking a node with it. No torch here: the registry's load-time probe uses it too.

Rules:
- Each call runs in its own daemon thread; the caller waits at most its timeout for all of them.
  Whatever a call does (returns, raises anything, hangs) becomes its `Outcome`: `call_bounded`
  never raises, so no environment can end the caller's loop.
- A thread stuck in a hung call cannot be killed: it is left running, "hung", and keeps its
  place among the MAX_ENV_THREADS environment threads the process may have alive (running or
  hung) until it ends. A call that finds no place is not started: its outcome is
  `env_unavailable`. So hung environments cost at most MAX_ENV_THREADS threads, and the places
  come back as hung calls end.
- A hung thread is charged to the `owner` its caller names (on the learner: the publisher whose
  episodes the re-run was playing), so the caller can refuse more work to an owner whose earlier
  calls still hang (echo_node/envs/gate.py, `RerunCooldown`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Environment threads alive in the process, running or hung. It bounds the threads hung calls
# can pin, and the calls one `call_bounded` runs at once: a batch whose episodes need more
# places than are free is not played or re-run (env_unavailable). An idle thread blocked in a
# hung call costs its stack's resident pages (tens of KiB), so the bound is on count, not size;
# it is above the episodes of one honest batch (rl.group_size <= 64 times rollout.groups_per_batch,
# 8 by default).
MAX_ENV_THREADS = 1024

ENV_ERROR = "env_error"
ENV_TIMEOUT = "env_timeout"
ENV_UNAVAILABLE = "env_unavailable"


@dataclass(slots=True)
class Outcome(Generic[T]):
    value: T | None = None
    error: str | None = None  # "env_error: ...", "env_timeout" or "env_unavailable"


class _Threads:
    """The process's environment threads: every one alive (a place each), and which are hung."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.alive: set[threading.Thread] = set()
        self.hung: dict[threading.Thread, str | None] = {}  # thread -> owner

    def ended(self, t: threading.Thread) -> None:
        with self.lock:
            self.alive.discard(t)
            self.hung.pop(t, None)


_threads = _Threads()


def env_threads() -> int:
    """Environment threads alive in the process (running or hung)."""
    with _threads.lock:
        return len(_threads.alive)


def free_env_threads() -> int:
    """Places left for environment calls."""
    with _threads.lock:
        return max(0, MAX_ENV_THREADS - len(_threads.alive))


def hung_threads(owner: str | None = None) -> int:
    """Hung environment calls still running: all of them, or those charged to `owner`."""
    with _threads.lock:
        if owner is None:
            return len(_threads.hung)
        return sum(1 for o in _threads.hung.values() if o == owner)


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    except Exception:  # a plug-in's exception whose str() itself raises
        return type(exc).__name__


def call_bounded(calls: Sequence[Callable[[], T]], timeout_s: float, *, owner: str | None = None) -> list[Outcome[T]]:
    """Run `calls` at once, each in its own daemon thread, and wait at most `timeout_s` for all.
    A call that raised is an env_error, one still running at the deadline an env_timeout (its
    thread is hung, charged to `owner`), one that found no free place env_unavailable."""
    # What each thread writes; read only once its thread ended, so a hung call that returns
    # or raises later changes nothing the caller holds.
    slots: list[Outcome[T]] = [Outcome() for _ in calls]

    def run(i: int, fn: Callable[[], T]) -> None:
        try:
            slots[i].value = fn()
        # An environment's failure of any kind, SystemExit and KeyboardInterrupt raised by its
        # code included, ends its own call only: in a worker thread there is nothing to re-raise to.
        except BaseException as exc:
            slots[i].error = f"{ENV_ERROR}: {_describe(exc)}"
        finally:
            _threads.ended(threading.current_thread())

    threads: dict[int, threading.Thread] = {}
    with _threads.lock:
        room = max(0, MAX_ENV_THREADS - len(_threads.alive))
        for i, fn in enumerate(calls[:room]):
            threads[i] = t = threading.Thread(target=run, args=(i, fn), daemon=True, name="echo-env")
            _threads.alive.add(t)
    for i, t in list(threads.items()):
        try:
            t.start()
        except RuntimeError:  # the OS has no thread to give
            _threads.ended(t)
            del threads[i]
    deadline = time.monotonic() + timeout_s
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    outcomes: list[Outcome[T]] = []
    for i in range(len(calls)):
        t_i = threads.get(i)
        if t_i is None:
            outcomes.append(Outcome(error=ENV_UNAVAILABLE))
            continue
        with _threads.lock:
            hung = t_i in _threads.alive  # still in the call (its `ended` has not run)
            if hung:
                _threads.hung[t_i] = owner
        outcomes.append(Outcome(error=ENV_TIMEOUT) if hung else Outcome(slots[i].value, slots[i].error))
    return outcomes


def reason_of(error: str) -> str:
    """The counted reason of an outcome's error ("env_error", "env_timeout" or "env_unavailable")."""
    return error.split(":", 1)[0]
