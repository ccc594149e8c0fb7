"""How the suite is split over pytest-xdist workers (`make test` runs `-n 2`).

Rules:
- A module is one unit of work: its module-scoped fixtures (a loaded model, a tokenizer) are
  built once, on one worker.
- Every test that starts real processes (tests/integration/) is in one unit, so they run on one
  worker, one after another. Those tests start a bootstrap, a learner and peers, several
  processes that want more than the one core a worker has; two swarms at once on two cores
  would each wait on the other, and their learning tests count versions, not seconds, but still
  end at a deadline. The in-process modules go to whichever worker is free, so while one runs
  the swarms the other adds one core's worth of load beside them.

The units are made by the scheduler from node ids, not by `xdist_group` marks: xdist's
loadgroup writes the group into `item._nodeid`, which pytest 9.2 no longer reads, so those marks
group nothing there. Without xdist (`pytest tests/unit/...`) this hook is never called.
"""

from __future__ import annotations

from typing import Any

import pytest

PROCESSES = "tests/integration/"


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: "processes" for one that starts real processes, else
    its module."""
    module = nodeid.split("::", 1)[0]
    return "processes" if module.startswith(PROCESSES) else module


@pytest.hookimpl(tryfirst=True)  # before xdist's own scheduler for --dist load
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Units(config, log)
