"""How the suite is split over pytest-xdist workers (`make test` runs `-n 2`).

Rules:
- A module is one unit of work: its module-scoped fixtures (a loaded model, a tokenizer) are
  built once, on one worker.
- The tests that start real processes (tests/integration/) form two units, `HEAVY` and the
  rest, one per worker, so at most two swarms run at once: each starts a bootstrap, a learner
  and peers, and two cores hold two of them (slower, which their learning tests absorb: they
  wait for versions, not seconds), not four. `HEAVY` holds the modules that need the most CPU or
  measure rates (a real model, FSDP ranks, shaped links, paced rates, the demo's stale share),
  about two thirds of the processes' time; the other unit and then the in-process modules fill
  the second worker, so both end at about the same time.
- The process units are handed out first, the in-process modules after them (they are many and
  short, so they even out the end).

The units are made by the scheduler from node ids, not by `xdist_group` marks: xdist's
loadgroup writes the group into `item._nodeid`, which pytest 9.2 no longer reads, so those marks
group nothing there. Without xdist (`pytest tests/unit/...`) these hooks change nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

PROCESSES = "tests/integration/"
# Measured on two loaded cores (pytest --durations, stop 44): test_smollm2 151 s, test_real_model
# 85, test_demo_waste 51, test_capacity_paced 50, test_sharded_learner 37, test_multihost 26,
# test_capacity_live 24, test_wan_netns 14: ~440 s of the ~760 s all process tests take.
HEAVY = frozenset(
    f"{PROCESSES}{name}.py"
    for name in (
        "test_smollm2", "test_real_model", "test_demo_waste", "test_capacity_paced", "test_sharded_learner",
        "test_multihost", "test_capacity_live", "test_wan_netns",
    )
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: "processes-heavy" or "processes" for one that starts
    real processes, else its module."""
    module = nodeid.split("::", 1)[0]
    if not module.startswith(PROCESSES):
        return module
    return "processes-heavy" if module in HEAVY else "processes"


def _rank(item: pytest.Item) -> int:
    unit = unit_of(item.nodeid)
    return 0 if unit == "processes-heavy" else 1 if unit == "processes" else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # On xdist workers only: the scheduler queues units in the order their first test was
    # collected, so the process units go first. A serial run keeps pytest's own order.
    if hasattr(config, "workerinput"):
        items.sort(key=_rank)  # stable: each unit keeps its tests' order


@pytest.hookimpl(tryfirst=True)  # before xdist's own scheduler for --dist load
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    # Queue the units in collection order (above), not by their number of tests.
    config.option.loadscopereorder = False
    return Units(config, log)
