"""A whole echo-node swarm across simulated hosts: each role in its own network namespace,
started through the `echo-node` CLI with the flags the README's "Running a real swarm" gives.

Layout on a `Topology`: h0 runs the bootstrap, h1 the learner, h2.. the rollout peers (a host
made with `Rates(nat=True)` sits behind a NAT router that drops inbound connections). Every
node listens on `/ip4/0.0.0.0/tcp/4001`, advertises the address of its own interface (behind a
NAT that is a private address nobody else can reach, as a volunteer would pass it) and serves
weights on data port 4002. Logs go to `<root>/<name>.log`; the learner writes
`<root>/runs/<run id>/`, each peer `<root>/runs/<run id>/peers/<peer id>.jsonl`.

Without a topology (`topo=None`) the same roles run on this machine's loopback, each on its own
free port: the benchmark's comparison case.

Shared by `tests/integration/test_multihost.py` and `benchmarks/wan_swarm.py`, so the test runs
exactly what the benchmark measures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from benchmarks.wan.netns import Topology
from echo_node.metrics import read_metrics
from protocol.identity import load_or_create_key_file

LISTEN = "/ip4/0.0.0.0/tcp/4001"
DATA_PORT = 4002
BOOTSTRAP_HOST, LEARNER_HOST = 0, 1


def echo_node_argv() -> list[str]:
    """The installed `echo-node` script next to this interpreter, else `python -m echo_node.cli`."""
    script = Path(sys.executable).with_name("echo-node")
    return [str(script)] if script.exists() else [sys.executable, "-m", "echo_node.cli"]


@dataclass
class NetnsSwarm:
    topo: Topology | None
    root: Path
    run_id: str
    procs: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)
    peer_ids: dict[str, str] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)
    bootstrap_addr: str = ""
    _logs: list[TextIO] = field(default_factory=list)

    def _node_flags(self, host: int, name: str) -> list[str]:
        key = self.root / "keys" / f"{name}.key"
        self.peer_ids[name] = load_or_create_key_file(key).peer_id
        if self.topo is None:
            return ["--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(key)]
        return ["--listen", LISTEN, "--advertise-host", self.topo.addr(host), "--key-file", str(key)]

    def _spawn(self, host: int, name: str, args: list[str], *, cpus: set[int] | None = None) -> subprocess.Popen[Any]:
        log, out = (self.root / f"{name}.log").open("w"), (self.root / f"{name}.out").open("w")
        self._logs += [log, out]
        argv = [*echo_node_argv(), *args]
        if self.topo is not None:
            proc = self.topo.run(host, argv, cpus=cpus, stdout=out, stderr=log)
        else:
            pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=log, start_new_session=True, preexec_fn=pin)
        self.procs[name] = proc
        self.started[name] = time.time()
        return proc

    def start_bootstrap(self, *, cpus: set[int] | None = None, timeout: float = 60) -> str:
        proc = self._spawn(BOOTSTRAP_HOST, "bootstrap", ["bootstrap", *self._node_flags(BOOTSTRAP_HOST, "bootstrap")], cpus=cpus)
        self.bootstrap_addr = self._read_line(proc, "bootstrap", lambda line: "/p2p/" in line, timeout).strip()
        return self.bootstrap_addr

    def _run_flags(self) -> list[str]:
        ports = ["--data-port", str(DATA_PORT)] if self.topo is not None else []
        return ["--bootstrap", self.bootstrap_addr, "--run-id", self.run_id, *ports, "--runs-dir", str(self.root / "runs")]

    def start_learner(self, *extra: str, cpus: set[int] | None = None, timeout: float = 300) -> dict[str, Any]:
        args = ["learn", *self._node_flags(LEARNER_HOST, "learner"), *self._run_flags(), *extra]
        proc = self._spawn(LEARNER_HOST, "learner", args, cpus=cpus)
        ready: dict[str, Any] = json.loads(self._read_line(proc, "learner", lambda line: '"ready"' in line, timeout))
        return ready

    def start_peer(self, host: int, *extra: str, cpus: set[int] | None = None) -> str:
        name = f"peer{host}"
        pin = ["--learner", self.peer_ids["learner"]]  # start_learner wrote its key first
        self._spawn(host, name, ["join", *self._node_flags(host, name), *self._run_flags(), *pin, *extra], cpus=cpus)
        return name

    def _read_line(self, proc: subprocess.Popen[Any], name: str, want: Any, timeout: float) -> str:
        """The first line of `name`'s stdout that `want`s, polled from its file."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in (self.root / f"{name}.out").read_text(errors="replace").splitlines(keepends=True):
                if line.endswith("\n") and want(line):
                    return line
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{name} did not start within {timeout:g}s (exit {proc.poll()}):\n{self.log(name)[-3000:]}")

    # -- what the nodes wrote ----------------------------------------------------------------

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / self.run_id

    def learner_records(self, event: str = "train") -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.run_dir / "metrics.jsonl") if r.get("event") == event]

    def peer_records(self, name: str, event: str = "installed") -> list[dict[str, Any]]:
        path = self.run_dir / "peers" / f"{self.peer_ids[name]}.jsonl"
        return [r for r in read_metrics(path) if r.get("event") == event]

    def newest_installed(self, name: str) -> int:
        return max((int(r["version"]) for r in self.peer_records(name)), default=-1)

    def wait(self, what: str, ready: Any, timeout: float, poll_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited {proc.returncode} while waiting for {what}:\n{self.log(name)[-3000:]}")
            time.sleep(poll_s)
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")

    def stop_learner(self, timeout: float = 60) -> dict[str, Any]:
        """SIGTERM, as a service manager stops it: the learner writes its summary and exits, as on
        Ctrl-C. Not SIGINT: a benchmark started as a background job (`cmd &` in a script) has
        SIGINT ignored, its children inherit that, and the learner would never stop."""
        proc = self.procs["learner"]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the learner did not stop within {timeout:g}s:\n{self.log('learner')[-3000:]}") from None
        summary: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text())
        return summary

    def close(self) -> None:
        """Stop what still runs (a topology also does so on exit) and close the log files."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
