"""How the suite is split over pytest-xdist workers (`make test` runs `-n 2 --dist loadgroup`).

Rules:
- A module is one unit of work: its module-scoped fixtures (a loaded model, a tokenizer) are
  built once, on one worker.
- Every test that starts real processes (tests/integration/) runs on one worker, one after
  another. Those tests start a bootstrap, a learner and peers, several processes that want more
  than the one core a worker has; two swarms at once on two cores would each wait on the other,
  and their learning tests count versions, not seconds, but still end at a deadline. The other
  worker runs the in-process tests meanwhile, one core's worth of load beside the swarm.
Without xdist (`pytest tests/unit/...`) the marks change nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_PROCESSES = Path(__file__).parent / "integration"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        path = Path(item.path)
        group = "processes" if _PROCESSES in path.parents else path.relative_to(Path(__file__).parent).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
