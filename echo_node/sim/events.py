"""The simulation's clock: a heap of (time, seq, callback, args), run in time order.

Rules: events run in increasing time; events at the same time run in the order they were
scheduled (`seq` breaks ties), so a run is a deterministic function of its inputs and seeds.
Scheduling in the past is a bug (it would reorder causes after effects) and raises. No threads,
no real clock: `now` is the time of the event being run.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop"]


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._halted = False

    def at(self, t: float, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` at time `t` (>= now)."""
        if t < self.now:
            raise ValueError(f"event at {t} scheduled in the past (now {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), callback, args))

    def after(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, callback, *args)

    def run(self, until: float = math.inf, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to time `until` (those at exactly `until` included), or until `stop()`
        turns true after an event, or an event calls `halt()`, or the heap is empty. `now` ends
        at the last event run, or at `until` when it is finite and the heap ran past it."""
        heap = self._heap
        pop = heapq.heappop
        self._halted = False
        n = 0
        try:
            while heap and heap[0][0] <= until:
                t, _, callback, args = pop(heap)
                self.now = t
                callback(*args)
                n += 1
                if self._halted or (stop is not None and stop()):
                    return
        finally:
            self.events_run += n
        if until != math.inf:
            self.now = max(self.now, until)

    def halt(self) -> None:
        """End the current `run` after the event that calls this (cheaper than a `stop`
        predicate, which is called after every event)."""
        self._halted = True

    def clear(self) -> None:
        """Forget every pending event (a simulation moving on to a fresh phase); `now` stays."""
        self._heap.clear()
