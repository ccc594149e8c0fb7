"""Stopping a role on SIGINT/SIGTERM: `run_until_signal`, and `Stopped` for SIGTERM outside it.

Shared by the CLI and the demo (which runs the CLI's roles as child processes and stops them).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import trio

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Its lines are the CLI's (an operator reads "stopping on SIGTERM" as the command's own).
log = logging.getLogger("echo_node.cli")
T = TypeVar("T")

# Rules, in the order a process lives through them:
# - Outside `run_until_signal` (parsing, imports, loading a model; the last log line): SIGINT
#   raises KeyboardInterrupt as Python's default handler does, SIGTERM raises `Stopped`; `main`
#   turns both into 128 + the signal number. Before it nothing was written that a summary could
#   report; after it the role's cleanup is done. `import torch` runs with both held until it ends
#   (`signals_deferred`): its C extension swallows exceptions raised inside it.
# - While `run_until_signal` runs the role: the first SIGINT or SIGTERM cancels the role's
#   cancel scope and nothing else; the role's own `finally` blocks (the learner's summary and
#   checkpoint) run under that cancellation, and the exit status is 128 + the signal number.
# - A second SIGINT or SIGTERM while stopping exits at once (os._exit, 128 + its number),
#   skipping whatever cleanup is left: an operator who signals twice wants the process gone, and a
#   shutdown that hangs must not need SIGKILL.
# - A signal the process was started with ignored (SIG_IGN: `cmd &` in a script ignores SIGINT)
#   stays ignored, as Python itself leaves it.


def _stop_signals() -> tuple[int, ...]:
    """The stop signals this process acts on: those it was not told to ignore."""
    return tuple(s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN)


class Stopped(BaseException):
    """SIGTERM outside `run_until_signal`: unwinds like KeyboardInterrupt does for SIGINT."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_now(signum: int) -> None:
    # Called from a signal handler, possibly in the middle of a write to stderr: os.write, not
    # logging (a buffered stream re-entered from a signal handler raises).
    os.write(2, f"echo-node: {signal_name(signum)} while stopping: exiting at once\n".encode())
    os._exit(128 + signum)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Holds SIGINT/SIGTERM until the block ends, then re-raises the first one to the handler it
    would have met. For `import torch`: its C extension imports numpy and swallows whatever that
    import raises, so a KeyboardInterrupt (or `Stopped`) raised then would be lost and the process
    would carry on."""
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in _stop_signals()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if pending:
        signal.raise_signal(pending[0])


@dataclass
class _StopState:
    watched: tuple[int, ...] = field(default_factory=_stop_signals)
    signum: int | None = None  # the first stop signal received

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Python-level handler while trio runs but no receiver is open (before the watcher opens
        it, after it closed) and once stopping: the first signal is recorded, the watcher acts on
        it; any later one exits at once."""
        if self.signum is None:
            self.signum = signum
        else:
            _exit_now(signum)


async def _watch_signals(
    state: _StopState, role: trio.CancelScope, doing: str, *, task_status: trio.TaskStatus[None]
) -> None:
    import trio

    with trio.open_signal_receiver(*state.watched) as signals:
        task_status.started()
        if state.signum is None:  # else it arrived before the receiver was open
            async for signum in signals:
                state.signum = signum
                break
        assert state.signum is not None
        log.info("stopping on %s%s", signal_name(state.signum), f": {doing}" if doing else "")
        # The role's cleanup may run synchronously for a while (the learner's summary, plots and
        # checkpoint) and this task would not see a signal until it yields: a plain handler acts
        # on the next one at once. The receiver restores `state.on_signal` when it closes.
        for s in state.watched:
            signal.signal(s, state.on_signal)
        role.cancel()
        async for signum in signals:  # one queued before the handlers were replaced
            _exit_now(signum)


def _unwrap_one(exc: Exception) -> Exception:
    """The role's error as it raised it: the one nursery `run_until_signal` runs it in wraps an
    error raised after the role was ready in a group of one."""
    if isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        return exc.exceptions[0]
    return exc


def _leaf_errors(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaf_errors(inner)]
    return [exc]


def run_until_signal(
    fn: Callable[..., Awaitable[T]], *, doing: str = "", on_ready: Callable[[Any], None] | None = None
) -> tuple[T | None, int | None]:
    """Run the role `fn` under `trio.run` until it returns or SIGINT/SIGTERM cancels it.

    `fn` is started with `nursery.start`: it takes `task_status` and reports that it is ready
    (serving, joined) with `task_status.started(value)`; `on_ready(value)` is then called (the
    CLI prints the role's ready line from it). Returns fn's result (None if a signal cancelled
    it) and the stop signal's number (None if none came). `doing` says, in the log line a signal
    brings, what the role does on its way out. An error the role raises while stopping is
    logged, not raised: the operator asked it to stop, and the exit status says it was stopped.
    A role that returns without saying it is ready is an error (RuntimeError, trio's).
    """
    import trio

    state = _StopState()
    result: list[T] = []
    # The role's own error, raised after trio.run as the role raised it (the nurseries here
    # would wrap it in an exception group that the role's own code did not raise).
    error: list[Exception] = []

    async def role_task(*, task_status: trio.TaskStatus[Any]) -> None:
        result.append(await fn(task_status=task_status))

    async def main() -> None:
        role = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            if state.watched:  # else both are ignored: nothing to stop on
                # Started (receiver open) before the role runs, so no signal can reach the role
                # as KeyboardInterrupt: the role sees only a cancellation.
                await nursery.start(partial(_watch_signals, state, role, doing))
            try:
                with role:
                    async with trio.open_nursery() as running:
                        ready = await running.start(role_task)  # an error before it comes bare
                        if on_ready is not None:
                            on_ready(ready)
            except Exception as exc:
                exc = _unwrap_one(exc)
                if state.signum is None:
                    error.append(exc)
                    return
                errors = "; ".join(f"{type(e).__name__}: {e}" for e in _leaf_errors(exc))
                log.error("while stopping on %s: %s", signal_name(state.signum), errors)
                log.debug("while stopping", exc_info=exc)
            finally:
                nursery.cancel_scope.cancel()  # the watcher

    # trio installs its own SIGINT handler (KeyboardInterrupt at a safe point) only when it finds
    # Python's default one; with `state.on_signal` in place a signal outside the receiver is
    # recorded instead and stops the role like any other.
    previous = {s: signal.signal(s, state.on_signal) for s in state.watched}
    try:
        trio.run(main)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if error:
        raise error[0]
    return (result[0] if result else None), state.signum
