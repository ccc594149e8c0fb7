"""Where the learner's time goes: wall and CPU seconds per stage of its work, cumulative.

Stages on the event loop are timed around their code (`stage`): wall, and the loop thread's
CPU. Stages that run in a worker thread are timed inside it (`timed` wraps the function): wall,
and that thread's CPU — the loop thread spends ~nothing while it awaits them. The summary
(`to_dict`) gives each stage's share of the learner's wall time and of the process's CPU time
since the start; the shares need not add up to 1 (a spot check's thread runs beside a step,
waiting for rollouts is not a stage of work).

Rule: timing costs two clock reads per stage, never a lock on the loop (one update runs at a
time; worker threads only add to their own stage's entries after their work).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class Profile:
    def __init__(self) -> None:
        # Seconds per stage (a Counter holds ints).
        self.wall: defaultdict[str, float] = defaultdict(float)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._started = time.monotonic()
        self._cpu0 = time.process_time()

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.wall[name] += wall
        self.cpu[name] += cpu
        self.calls[name] += 1

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed code, on the thread that runs it."""
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0, time.thread_time() - c0)

    def timed(self, name: str, fn: Callable[P, R]) -> Callable[P, R]:
        """`fn`, timed as stage `name` in whatever thread calls it."""

        @wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.stage(name):
                return fn(*args, **kwargs)

        return run

    def to_dict(self, extra_cpu: dict[str, float] | None = None) -> dict[str, Any]:
        """Per stage: calls, wall and CPU seconds, and their shares of the learner's wall time
        and of the process's CPU time so far. `extra_cpu`: stages timed elsewhere (CPU only)."""
        wall = max(1e-9, time.monotonic() - self._started)
        cpu = max(1e-9, time.process_time() - self._cpu0)
        stages: dict[str, Any] = {}
        for name in sorted(self.wall, key=lambda n: -self.wall[n]):
            stages[name] = {
                "calls": self.calls[name], "wall_s": round(self.wall[name], 4), "cpu_s": round(self.cpu[name], 4),
                "wall_share": round(self.wall[name] / wall, 4), "cpu_share": round(self.cpu[name] / cpu, 4),
            }
        for name, seconds in (extra_cpu or {}).items():
            stages[name] = {"cpu_s": round(seconds, 4), "cpu_share": round(seconds / cpu, 4)}
        return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "stages": stages}
