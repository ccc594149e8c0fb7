"""Where node code runs blocking work (training steps, generation, hashing, file writes).

Rule: node code never calls `trio.to_thread.run_sync` itself; it calls `run_sync` here. In a
node a user runs, that is a worker thread, so the event loop keeps serving the network while a
step or a batch computes. Under `inline()` it is the calling task itself: the loop stops while the
work runs, so trio's clock does not move. That is what a swarm on virtual time needs
(echo_node/net/memory.py under `MockClock(autojump_threshold=0)`): the clock jumps whenever every
task waits, and a task waiting on a thread counts as waiting, so with threads a learner's step
would let every peer's timeout fire before the step ends.

Work that polls for its caller's cancellation calls `check_cancelled` here, never
`trio.from_thread.check_cancelled` (which raises RuntimeError outside a worker thread, so inline
it would fail the work instead of polling).

The mode is a context variable, set once around a whole swarm (`with inline(): trio.run(...)`,
or inside the root task before any node starts): every task inherits it when spawned.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("echo_node_offload_inline", default=False)


@contextmanager
def inline() -> Iterator[None]:
    """Run blocking work in the calling task, not a thread, for tasks spawned inside this block."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)


def is_inline() -> bool:
    return _INLINE.get()


async def run_sync(fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False, limiter: trio.CapacityLimiter | None = None) -> T:
    """`fn(*args)` off the event loop (a worker thread), or in this task under `inline()`.
    `abandon_on_cancel` and `limiter` are trio.to_thread's; inline, the call cannot be
    cancelled and needs no limiter (it holds the only thread)."""
    if _INLINE.get():
        await trio.lowlevel.checkpoint()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel, limiter=limiter)


def check_cancelled() -> None:
    """Inside work given to `run_sync`: raise `trio.Cancelled` if its caller was cancelled (in a
    worker thread); inline, nothing (the work holds the loop: no cancellation can arrive while
    it runs, and the caller's next checkpoint delivers one that came before)."""
    if not _INLINE.get():
        trio.from_thread.check_cancelled()
