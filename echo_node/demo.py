"""`echo-node demo`: a whole swarm on loopback, as separate OS processes, with live progress.

Starts a bootstrap peer, a learner and N rollout peers (each its own `echo-node` process with one
torch thread), follows the learner's metrics.jsonl, and ends with one JSON line on stdout that
summarizes the run. Every process it started is stopped on the way out, also on Ctrl-C; logs of
each process are kept under runs/<run-id>/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from echo_node.stopping import Stopped
from echo_node.metrics import json_safe, read_metrics, rounded

READY_TIMEOUT_S = 240.0
STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    stdout_path: Path


@dataclass
class Swarm:
    run_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(
        self, name: str, args: list[str], *, cpus: set[int] | None = None, module: str = "echo_node.cli",
        env: Mapping[str, str] | None = None, preexec: Callable[[], None] | None = None,
    ) -> Child:
        """`env`: added to this process's environment; `preexec`: run in the child before it
        starts (after the CPU pinning), e.g. a resource limit a benchmark runs it under."""
        logs = self.run_dir / "logs"

        def child_setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)
            if preexec is not None:
                preexec()

        logs.mkdir(parents=True, exist_ok=True)
        out, err = logs / f"{name}.out", logs / f"{name}.log"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=o,
                stderr=e,
                stdin=subprocess.DEVNULL,
                # Own process group: a terminal's Ctrl-C reaches only the demo, which then
                # stops the children in order (learner last, so it can write its summary).
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                preexec_fn=child_setup if cpus or preexec is not None else None,
            )
        child = Child(name, proc, out)
        self.children.append(child)
        return child

    def stop(self, child: Child, sig: int = signal.SIGTERM) -> None:
        if child.proc.poll() is None:
            child.proc.send_signal(sig)
        try:
            child.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()

    def stop_all(self) -> None:
        # Peers first, then the learner (it finishes its ledger and checkpoint), then the
        # bootstrap. SIGTERM, which every role takes as it takes Ctrl-C: a demo started in the
        # background of a script has SIGINT ignored, its children inherit that, and a learner
        # sent SIGINT would be killed at the grace period without its summary.
        order = sorted(self.children, key=lambda c: {"learner": 1, "bootstrap": 2}.get(c.name, 0))
        for child in order:
            self.stop(child, signal.SIGTERM)


def _wait_line(child: Child, predicate: Any, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in child.stdout_path.read_text(errors="replace").splitlines():
            if predicate(line):
                return line
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode} before {what}; see {child.stdout_path.with_suffix('.log')}")
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} did not report {what} within {timeout:g}s")


def _is_ready(line: str) -> bool:
    try:
        return json.loads(line).get("event") == "ready"
    except (json.JSONDecodeError, AttributeError):
        return False


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    run_id = args.run_id or f"demo-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.runs_dir) / run_id
    keys = run_dir / "keys"
    swarm = Swarm(run_dir)
    progress = _Progress(args, run_dir, enabled=not args.no_progress and sys.stderr.isatty())
    try:
        with ExitStack() as stack:
            stack.callback(swarm.stop_all)
            boot = swarm.spawn("bootstrap", ["bootstrap", "--key-file", str(keys / "bootstrap.key")])
            boot_addr = _wait_line(boot, lambda l: "/p2p/" in l, 30, "its address").strip()
            progress.note(f"bootstrap at {boot_addr}")
            common = ["--bootstrap", boot_addr, "--run-id", run_id, "--runs-dir", str(args.runs_dir)]
            if getattr(args, "task", None) is not None:  # every process plays the same environment
                common += ["--config", str(env_config(run_dir, args.task))]
            if args.model is not None:  # every process loads the same local model directory
                common += ["--model", str(args.model)]
            if args.dtype is not None:
                common += ["--dtype", args.dtype]
            tracking = ["--report-to", args.report_to] if args.report_to is not None else []
            learner = swarm.spawn(
                "learner",
                ["learn", *common, "--key-file", str(keys / "learner.key"), "--mode", args.mode,
                 "--staleness", str(args.staleness), "--seconds", str(args.seconds), *tracking],
            )
            progress.note("learner warming up (cached after the first run)")
            ready = json.loads(_wait_line(learner, _is_ready, READY_TIMEOUT_S, "ready"))
            progress.note(f"learner ready; starting {args.peers} rollout peers")
            for i in range(args.peers):  # pinned to the learner's peer id: no other announcer takes them
                swarm.spawn(f"peer{i}", ["join", *common, "--learner", ready["peer_id"], "--key-file", str(keys / f"peer{i}.key")])
            progress.follow(learner, swarm)
            if learner.proc.returncode != 0:
                raise RuntimeError(f"learner exited with {learner.proc.returncode}; see {run_dir / 'logs' / 'learner.log'}")
    except KeyboardInterrupt:
        progress.close()
        print("interrupted; all demo processes stopped", file=sys.stderr)
        return 130
    except Stopped as exc:  # SIGTERM (echo_node/stopping.py)
        progress.close()
        print("stopped; all demo processes stopped", file=sys.stderr)
        return 128 + exc.signum
    except RuntimeError as exc:
        progress.close()
        print(f"echo-node demo: error: {exc}", file=sys.stderr)
        return 1
    progress.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    result = {
        "run_id": run_id,
        "mode": args.mode,
        "staleness": args.staleness,
        "rollout_peers": args.peers,
        "model": summary.get("model", "embedded"),
        "task": summary.get("task"),
        "versions": summary["versions"],
        "rollouts_received": summary["rollouts_received"],
        "rollouts_accepted": summary["rollouts_accepted"],
        "rollouts_dropped": summary["rollouts_dropped"],
        "rollouts_buffered": summary["rollouts_buffered"],
        "reward_first": rounded(summary["reward_first"]),
        "reward_last": rounded(summary["reward_last"]),
        "learner_idle_ratio": rounded(summary["learner_idle_ratio"]),
        "train_s": summary["wall_s"],
        "wall_s": round(time.monotonic() - t0, 2),
        "run_dir": str(run_dir),
    }
    print(json.dumps(strict_line(result, summary), allow_nan=False))
    return 0


# A built-in environment's options in the demo: the embedded model's first steps.
DEMO_ENV_OPTIONS: dict[str, dict[str, Any]] = {"calc": {"problems": 2}}


def env_config(run_dir: Path, env: str) -> Path:
    """A config file with the `[env]` table of `env` (its demo options), for every process."""
    path = run_dir / "env.toml"
    options = DEMO_ENV_OPTIONS.get(env, {})
    lines = ["[env]", f"name = {json.dumps(env)}", "", "[env.options]", *(f"{k} = {json.dumps(v)}" for k, v in options.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def strict_line(result: dict[str, Any], summary: Mapping[str, Any]) -> dict[str, Any]:
    """The demo's last line as strict JSON: a field that is not a number (the idle ratio of a run
    that trained nothing is NaN) is null, and `null_reasons` says why, in summary.json's words
    where it gives them."""
    nulls: dict[str, str] = {}
    line: dict[str, Any] = json_safe(result, reasons=nulls)
    why = "no update was trained" if not summary.get("versions") else "not a number"
    reasons = {key: f"{what}: {why}" for key, what in nulls.items()}
    given = summary.get("null_reasons")
    if isinstance(given, Mapping):
        reasons.update({key: str(text) for key, text in given.items() if key in line and line[key] is None})
    if reasons:
        line["null_reasons"] = reasons
    return line


# The live table's widest line, whatever the run: a default terminal is 80 columns, and a cell
# too narrow for its text is cut (rich puts an ellipsis where the figures were).
TABLE_WIDTH = 80


class _Progress:
    """Live view of the learner's metrics with rich; plain lines when not on a terminal.

    Rules: the table is two columns (what, value) at most TABLE_WIDTH wide, so no figure is cut
    whatever the drop reasons or pool; its reward is the last update's (what summary.json's
    `reward_last` is at the end), with the mean of the last 10 beside it; its caption says
    what the demo is doing now."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, *, enabled: bool) -> None:
        self.args = args
        self.metrics = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._live: Any = None
        self._last_note = ""
        self._err: TextIO = sys.stderr
        self.capacity: dict[str, Any] | None = None
        self.held_out: dict[str, Any] | None = None

    def note(self, text: str) -> None:
        self._last_note = text
        if self._live is None:
            print(f"demo: {text}", file=self._err, flush=True)

    def follow(self, learner: Child, swarm: Swarm) -> None:
        last_print = 0.0
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render([], swarm), refresh_per_second=4, transient=False)
            self._live.start()
        while learner.proc.poll() is None:
            everything = read_metrics(self.metrics)
            records = [r for r in everything if r.get("event") == "train"]
            self.capacity = next((r for r in reversed(everything) if r.get("event") == "capacity"), None)
            self.held_out = next((r for r in reversed(everything) if r.get("event") == "eval"), None)
            if self._live is not None:
                self._live.update(self._render(records, swarm))
            elif records and time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                print(f"demo: {self._line(records, swarm)}", file=self._err, flush=True)
            time.sleep(0.25)
        self.note("learner stopped: writing the summary and stopping the peers")
        if self._live is not None:
            self._live.update(self._render([r for r in read_metrics(self.metrics) if r.get("event") == "train"], swarm))

    def _rows(self, records: list[dict[str, Any]], swarm: Swarm) -> list[tuple[str, str]]:
        """(what, value) of the newest update, for the table and the plain line."""
        alive = sum(1 for c in swarm.children if c.name.startswith("peer") and c.proc.poll() is None)
        if not records:
            return [("elapsed", f"- of {self.args.seconds:g}s"), ("version", "0"), ("peers running", str(alive))]
        r = records[-1]
        recent = [x["reward_mean"] for x in records[-10:]]
        dropped = r.get("dropped") or {}
        drops = ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items()))
        h = self.held_out
        return [
            ("elapsed", f"{r['t']:.0f} of {self.args.seconds:g}s"),
            ("version", str(r["version"])),
            ("reward", f"{r['reward_mean']:.3f} last update, {sum(recent) / len(recent):.3f} mean of last {len(recent)}"),
            ("held-out accuracy", "-" if h is None else f"{h['eval_accuracy']:.3f} at version {h['version']}"),
            ("rollouts accepted", f"{r['trained']:,}"),
            ("rollouts dropped", f"{sum(dropped.values()):,}" + (f" ({drops})" if drops else "")),
            ("learner idle", f"{r['idle_ratio']:.0%}"),
            ("peers running", str(alive)),
            ("pool", self._pool()),
        ]

    def _line(self, records: list[dict[str, Any]], swarm: Swarm) -> str:
        return " · ".join(f"{what} {value}" for what, value in self._rows(records, swarm))

    def _pool(self) -> str:
        """Active vs standby peers and the cost rate, from the last capacity decision."""
        c = self.capacity
        if c is None:
            return "all active (no capacity decision yet)"
        return f"{len(c['active'])} active, {len(c['standby'])} standby, {c['cost_per_hour']:g}/h"

    def _caption(self, records: list[dict[str, Any]]) -> str:
        if self._last_note.startswith("learner stopped") or not records:
            return self._last_note
        return f"training, {records[-1]['t']:.0f} of {self.args.seconds:g}s; Ctrl-C stops every process"

    def _render(self, records: list[dict[str, Any]], swarm: Swarm) -> Any:
        from rich.table import Table

        table = Table(title=f"echo-node demo: {self.args.mode} mode, S={self.args.staleness}", width=TABLE_WIDTH,
                      show_header=False, caption=self._caption(records))
        table.add_column("what", style="bold", no_wrap=True)
        table.add_column("value", overflow="fold")  # a long value wraps; nothing is cut
        for what, value in self._rows(records, swarm):
            table.add_row(what, value)
        return table

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
