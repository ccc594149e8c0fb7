"""Churn soak: a real loopback swarm whose learner and peers are killed and restarted for minutes.

One swarm of the real `echo-node` binary, each process its own OS process: a bootstrap, a learner
(async mode, S = 4, the defaults otherwise) and 4 rollout peers, each with its own key file. After
a warm-up (every peer had rollouts accepted, the learner at version >= 3) comes a window of
`--minutes` of churn, planned up front by a seeded RNG (`plan_churn`):

- each peer is SIGKILLed at exponential intervals (mean 90 s of life), stays down 2-10 s and is
  started again with the same command and key file (no peer kill in the last 30 s of the window,
  so the peers' end state is settled when it is measured);
- the learner is SIGKILLed twice, uniformly in the middle 80 % of the window and at least 90 s
  apart (evenly spread when the window is too short for that), and started again with the same
  command (same --run-id, --runs-dir, --key-file: it must resume the run) after 1-3 s;
- one peer is SIGSTOPped for 20 s right after the learner publishes a version (weights are
  moving: peers fetching from it must go on from other sources), then SIGCONTed.

After the window, no more churn: if the last learner restart has not trained yet, up to 60 s more
for its first update (`window_extended_s`); then at least 10 s and at most 30 s until every live
peer installed weights in its current incarnation (`settle_s`), so that the end state is measured
on settled peers. Then every peer gets SIGTERM, the learner too (it writes summary.json), the
bootstrap SIGTERM.
Every incarnation has its own name (learner-1, learner-2, peer2-r0, peer2-r1, ...) so each one's
stdout (<name>.out) and stderr (<name>.log) are kept.

Measured (pure functions of the records, below `# --- analysis`):
- `rollouts`: the final summary.json's ledger; lost = received - trained - sum(dropped) - buffered
  (target 0);
- `reused_versions`: version numbers that metrics.jsonl's "published" records give more than one
  distinct sha256 (target 0); `peer_installed_mismatch`: peers' installs whose sha256 differs from
  what the learner published for that version (that epoch's, when the install names one; target 0);
- `restart_to_first_update_s`: per learner restart, from the benchmark's restart (wall clock) to
  the first "train" record of the new epoch (target <= 30 s);
- `peers_newest`, `learner_version_end`, `max_peer_lag` = the learner's last published version -
  min over the live peers' newest install of their current incarnation (target <= K, the
  learner's net.keep_versions);
- `published_by_peers` (rollouts in the peers' "published" records) vs rollouts received, and
  `published_not_received` = published_by_peers - (received - dropped as duplicate);
- per learner restart (`learner_incarnations`): time to ready, the epoch and version it resumed
  at, the versions around the kill, duplicates dropped from the kill to 10 s after the first update;
- every process that exited on its own (`unexpected_exits`, with its log tail; a peer is started
  again, a learner or bootstrap ends the soak), every incarnation's exit code;
- the learner's VmRSS and open fds sampled every 5 s: the final incarnation's value 60 s after
  its start and at the end, growth = end / first - 1 (target <= 0.10).

Pinning on the 2-core machine: the learner on core 0; bootstrap, peers and this process on core 1.
One JSON object as the last stdout line (and in --out, indented); a PNG of learner and peer
versions over time with the kills marked (--png; default next to the logs). SIGTERM or SIGINT to
this process stops the swarm (same order as the end) and still writes the report, marked partial.

    .venv/bin/python -m benchmarks.soak --minutes 10 --out benchmarks/results/soak.json \\
        --png benchmarks/results/soak.png
    .venv/bin/python -m benchmarks.soak --minutes 2 --runs-dir /tmp/soak-trial
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.hostile import vmrss_mb
from echo_node.demo import Child, Swarm, _is_ready

LEARNER_CPUS, OTHER_CPUS = {0}, {1}
PEERS = 4
STALENESS = 4
# The learner's net.keep_versions (echo_node/config.py NetConfig); read from there when importable.
DEFAULT_KEEP_VERSIONS = 4
LEARNER_SECONDS = 30 * 86400  # never stops on its own: the soak stops it

# Churn.
PEER_MEAN_UP_S = 90.0
PEER_DOWN_S = (2.0, 10.0)
LEARNER_KILLS = 2
LEARNER_GAP_S = 90.0
LEARNER_DOWN_S = (1.0, 3.0)
STOP_S = 20.0
QUIET_TAIL_S = 30.0  # no peer kill in the window's last seconds
POSTPONE_S = 5.0  # an action on a process that is not up (yet) waits this long
ARM_TIMEOUT_S = 60.0  # the SIGSTOP waits at most this long for a publication
EXTEND_MAX_S = 60.0  # after the window, wait at most this long for the last restart's first update
SETTLE_MIN_S = 10.0  # then at least this long without churn before the end state is measured,
SETTLE_MAX_S = 30.0  # and at most this long for every live peer to have installed weights

# Timing.
TICK_S = 0.25
ARMED_TICK_S = 0.02
SAMPLE_EVERY_S = 5.0
FIRST_SAMPLE_AFTER_S = 60.0
SHORT_INCARNATION_S = 120.0
WARM_VERSIONS = 3
WARM_TIMEOUT_S = 300.0
BOOT_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 240.0
KILL_WAIT_S = 10.0
PEER_STOP_GRACE_S = 15.0
LEARNER_STOP_GRACE_S = 60.0
BOOT_STOP_GRACE_S = 10.0

TARGETS = {
    "lost": 0,
    "reused_versions": 0,
    "peer_installed_mismatch": 0,
    "restart_to_first_update_s_max": 30.0,
    "max_peer_lag_le_keep_versions": True,
    "rss_growth_max": 0.10,
    "fds_growth_max": 0.10,
}


def keep_versions() -> int:
    try:
        from echo_node.config import NetConfig

        return int(NetConfig().keep_versions)
    except Exception:  # noqa: BLE001 - the documented default
        return DEFAULT_KEEP_VERSIONS


# --- the plan (pure) ----------------------------------------------------------------------------


# The learner's last incarnation lives at least this long when the window allows it, so its
# memory and descriptors are compared between its first minute and a settled end.
FINAL_INCARNATION_S = 180.0


def learner_kill_times(rng: random.Random, window_s: float, n: int, gap_s: float, *, tries: int = 5000) -> list[float]:
    """`n` kill times uniform from 10 % of the window to 90 % of it or FINAL_INCARNATION_S before
    its end (whichever is earlier, as long as that leaves half the window), at least `gap_s`
    apart; evenly spread over that span when random draws do not find such a set (a short window)."""
    if n <= 0:
        return []
    lo, hi = 0.1 * window_s, 0.9 * window_s
    if window_s - FINAL_INCARNATION_S - lo >= 0.5 * window_s:
        hi = min(hi, window_s - FINAL_INCARNATION_S)
    for _ in range(tries):
        ts = sorted(rng.uniform(lo, hi) for _ in range(n))
        if all(b - a >= gap_s for a, b in zip(ts, ts[1:])):
            return ts
    if n == 1:
        return [(lo + hi) / 2]
    return [lo + k * (hi - lo) / (n - 1) for k in range(n)]


def plan_churn(
    seed: int,
    window_s: float,
    peers: int = PEERS,
    *,
    peer_mean_up_s: float = PEER_MEAN_UP_S,
    peer_down_s: tuple[float, float] = PEER_DOWN_S,
    learner_kills: int = LEARNER_KILLS,
    learner_gap_s: float = LEARNER_GAP_S,
    learner_down_s: tuple[float, float] = LEARNER_DOWN_S,
    stop_s: float = STOP_S,
    quiet_tail_s: float = QUIET_TAIL_S,
) -> list[dict[str, Any]]:
    """The soak's churn, seconds from the window's start, sorted by time. Events:
    {"kind": "learner_kill", "t", "down_s"}, {"kind": "peer_kill", "t", "peer", "down_s"},
    {"kind": "peer_stop", "t", "peer", "stop_s"}."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    for t in learner_kill_times(rng, window_s, learner_kills, learner_gap_s):
        events.append({"kind": "learner_kill", "t": round(t, 3), "down_s": round(rng.uniform(*learner_down_s), 3)})
    last = window_s - quiet_tail_s
    for i in range(peers):
        t = rng.expovariate(1.0 / peer_mean_up_s)
        while t < last:
            down = rng.uniform(*peer_down_s)
            events.append({"kind": "peer_kill", "t": round(t, 3), "peer": i, "down_s": round(down, 3)})
            t += down + rng.expovariate(1.0 / peer_mean_up_s)
    if peers > 0 and stop_s > 0:
        events.append({"kind": "peer_stop", "t": round(rng.uniform(0.2, 0.7) * window_s, 3), "peer": rng.randrange(peers),
                       "stop_s": stop_s})
    return sorted(events, key=lambda e: (e["t"], e["kind"]))


# --- analysis (pure: records in, numbers out) ---------------------------------------------------


def parse_jsonl(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL text, and how many lines were not one (torn by a SIGKILL
    mid-write, or two writes run together)."""
    out: list[dict[str, Any]] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def events(records: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == kind]


def published_shas(metrics: list[dict[str, Any]]) -> dict[int, dict[Any, set[str]]]:
    """version -> epoch (None when a record names none) -> sha256s published for it."""
    out: dict[int, dict[Any, set[str]]] = {}
    for r in events(metrics, "published"):
        if r.get("sha256") is None or r.get("version") is None:
            continue
        out.setdefault(int(r["version"]), {}).setdefault(r.get("epoch"), set()).add(str(r["sha256"]))
    return out


def reused_versions(metrics: list[dict[str, Any]]) -> list[int]:
    """Version numbers published with more than one distinct sha256 (a version number that
    names two different weights)."""
    return sorted(v for v, by_epoch in published_shas(metrics).items() if len(set().union(*by_epoch.values())) > 1)


def install_check(metrics: list[dict[str, Any]], peer_records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Peers' installs against the learner's publications.

    mismatch: an install whose sha256 is not what the learner published for that version (for
    that epoch when both records name one); unmatched: a version the learner has no "published"
    record of; without_sha: an install record that names no sha256."""
    shas = published_shas(metrics)
    out: dict[str, Any] = {"installs": 0, "mismatch": 0, "unmatched": 0, "without_sha": 0, "examples": [],
                           "unmatched_versions": []}
    for peer, records in sorted(peer_records.items()):
        for r in events(records, "installed"):
            out["installs"] += 1
            sha = r.get("sha256")
            if sha is None:
                out["without_sha"] += 1
                continue
            v = int(r["version"])
            by_epoch = shas.get(v)
            if not by_epoch:
                out["unmatched"] += 1
                if len(out["unmatched_versions"]) < 20 and v not in out["unmatched_versions"]:
                    out["unmatched_versions"].append(v)
                continue
            epoch = r.get("epoch")
            expected = by_epoch[epoch] if epoch is not None and epoch in by_epoch else set().union(*by_epoch.values())
            if sha not in expected:
                out["mismatch"] += 1
                if len(out["examples"]) < 10:
                    out["examples"].append({"peer": peer, "version": v, "epoch": epoch, "installed": sha,
                                            "published": sorted(expected), "wall": r.get("wall")})
    return out


def ledger(record: dict[str, Any]) -> dict[str, Any]:
    """received, trained, dropped by reason, buffered and lost of a summary.json (or of a train
    record: its keys are received/trained/dropped/buffered); lost = received - trained -
    sum(dropped) - buffered."""
    received = int(record.get("rollouts_received", record.get("received", 0)) or 0)
    trained = int(record.get("rollouts_accepted", record.get("trained", 0)) or 0)
    dropped = {str(k): int(v) for k, v in (record.get("rollouts_dropped", record.get("dropped")) or {}).items()}
    buffered = int(record.get("rollouts_buffered", record.get("buffered", 0)) or 0)
    return {"received": received, "trained": trained, "dropped": dropped, "buffered": buffered,
            "lost": received - trained - sum(dropped.values()) - buffered}


def first_update_after(train: list[dict[str, Any]], restart_wall: float, epoch: Any = None) -> float | None:
    """Seconds from `restart_wall` to the first train record of the new incarnation: of `epoch`
    when the records carry epochs, else the first written at or after the restart (the previous
    incarnation was killed before it)."""
    for r in train:
        if epoch is not None and r.get("epoch") is not None:
            if r["epoch"] == epoch:
                return round(float(r["wall"]) - restart_wall, 3)
        elif float(r.get("wall", 0.0)) >= restart_wall:
            return round(float(r["wall"]) - restart_wall, 3)
    return None


def version_around(train: list[dict[str, Any]], kill_wall: float, restart_wall: float) -> dict[str, int | None]:
    """The learner's version at its last train record before a kill and at the first after the
    restart: the second below the first means the restart lost versions (they are trained again
    under the same numbers)."""
    before = [int(r["version"]) for r in train if float(r.get("wall", 0.0)) <= kill_wall]
    after = [int(r["version"]) for r in train if float(r.get("wall", 0.0)) >= restart_wall]
    return {"before_kill": before[-1] if before else None, "first_after": after[0] if after else None}


def dropped_delta(train: list[dict[str, Any]], reason: str, t0: float, t1: float) -> int | None:
    """How much the learner's `dropped[reason]` counter grew from its last train record before
    `t0` (0 if none) to its last at or before `t1`."""
    before = [r for r in train if float(r.get("wall", 0.0)) < t0]
    upto = [r for r in train if float(r.get("wall", 0.0)) <= t1]
    if not upto:
        return None
    base = int((before[-1].get("dropped") or {}).get(reason, 0)) if before else 0
    return int((upto[-1].get("dropped") or {}).get(reason, 0)) - base


def last_published(metrics: list[dict[str, Any]]) -> int | None:
    """The learner's last published version: its last "published" record, else the last train
    record's "published" field."""
    pub = events(metrics, "published")
    if pub:
        return int(pub[-1]["version"])
    train = [r for r in events(metrics, "train") if r.get("published") is not None]
    return int(train[-1]["published"]) if train else None


def newest_installed(records: list[dict[str, Any]], since_wall: float | None = None) -> int | None:
    """The newest version a peer installed (since `since_wall`: its current incarnation)."""
    vs = [int(r["version"]) for r in events(records, "installed")
          if since_wall is None or float(r.get("wall", 0.0)) >= since_wall]
    return max(vs) if vs else None


def max_peer_lag(last_pub: int | None, newest: dict[str, int | None]) -> int | None:
    """Last published version - the oldest newest-install among the peers (None if unknown: no
    publication, or a peer with no install)."""
    if last_pub is None or not newest or any(v is None for v in newest.values()):
        return None
    return last_pub - min(v for v in newest.values() if v is not None)


def rollouts_published(peer_records: dict[str, list[dict[str, Any]]]) -> int:
    return sum(int(r.get("rollouts", 0) or 0) for recs in peer_records.values() for r in events(recs, "published"))


def growth(samples: list[tuple[float, float]], start_wall: float, after_s: float = FIRST_SAMPLE_AFTER_S) -> dict[str, Any]:
    """(wall, value) samples of one incarnation: the first at or after `after_s` from its start,
    the last, and growth = end / first - 1."""
    first = next(((w, v) for w, v in samples if w - start_wall >= after_s), None)
    end = samples[-1] if samples else None
    out: dict[str, Any] = {
        "first_minute": round(first[1], 1) if first else None,
        "end": round(end[1], 1) if end else None,
        "growth": None,
        "first_at_s": round(first[0] - start_wall, 1) if first else None,
        "end_at_s": round(end[0] - start_wall, 1) if end else None,
    }
    if first and end and first[1] > 0 and end[0] >= first[0]:
        out["growth"] = round(end[1] / first[1] - 1.0, 4)
    return out


def install_series(records: list[dict[str, Any]]) -> list[tuple[float, int]]:
    return [(float(r["wall"]), int(r["version"])) for r in events(records, "installed") if r.get("wall") is not None]


def installs_between(peer_records: dict[str, list[dict[str, Any]]], t0: float, t1: float, *, skip: str | None = None) -> dict[str, Any]:
    """Installs of the peers other than `skip` in [t0, t1]: how many, the largest fetch_s."""
    n, worst = 0, 0.0
    for peer, recs in peer_records.items():
        if peer == skip:
            continue
        for r in events(recs, "installed"):
            if t0 <= float(r.get("wall", 0.0)) <= t1:
                n += 1
                worst = max(worst, float(r.get("fetch_s", 0.0) or 0.0))
    return {"installs": n, "max_fetch_s": round(worst, 3)}


def checks(report: dict[str, Any]) -> dict[str, bool | None]:
    """Each target met (True), missed (False) or not measurable (None)."""
    def le(v: Any, bound: float) -> bool | None:
        return None if v is None else v <= bound

    lat = [v for v in report.get("restart_to_first_update_s") or []]
    rss = (report.get("learner_rss_mb") or {}).get("growth")
    fds = (report.get("learner_fds") or {}).get("growth")
    k = report.get("keep_versions")
    return {
        "lost": le((report.get("rollouts") or {}).get("lost"), TARGETS["lost"]),
        "reused_versions": le(report.get("reused_versions"), TARGETS["reused_versions"]),
        "peer_installed_mismatch": le(report.get("peer_installed_mismatch"), TARGETS["peer_installed_mismatch"]),
        "restart_to_first_update": (None if not lat else all(v is not None and v <= TARGETS["restart_to_first_update_s_max"] for v in lat)),
        "max_peer_lag": (None if report.get("max_peer_lag") is None or k is None
                         else report["max_peer_lag"] <= k and not report.get("peers_without_install")),
        "rss_growth": le(rss, TARGETS["rss_growth_max"]),
        "fds_growth": le(fds, TARGETS["fds_growth_max"]),
    }


# --- processes ----------------------------------------------------------------------------------


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def write_key(path: Path, seed: int, name: str) -> str:
    """A deterministic identity per (seed, name), as the 32-byte key file echo-node reads; its peer id."""
    from protocol.identity import Identity

    ident = Identity.from_seed(hashlib.sha256(f"echo-node soak {seed} {name}".encode()).digest())
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, ident.seed)
        finally:
            os.close(fd)
    return ident.peer_id


def tail_text(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class JsonlTail:
    """Records appended to a JSONL file since the last poll (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.bad = 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        recs, bad = parse_jsonl(data[: end + 1].decode("utf-8", errors="replace"))
        self.bad += bad
        return recs


@dataclass
class Incarnation:
    role: str  # "bootstrap" | "learner" | "peer"
    index: int  # the peer's number (0 for the others)
    n: int  # 1, 2, ... for the learner; 0, 1, ... (restarts) for a peer
    child: Child
    spawned: float  # wall clock
    ready: float | None = None
    ready_info: dict[str, Any] | None = None
    ended: float | None = None
    how: str | None = None  # "sigkill", "exited", "stopped"
    code: int | None = None

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def pid(self) -> int:
        return self.child.proc.pid

    def alive(self) -> bool:
        return self.child.proc.poll() is None


class Soak:
    def __init__(self, runs_dir: Path, run_id: str, seed: int, window_s: float, plan: list[dict[str, Any]]) -> None:
        self.runs_dir = runs_dir
        self.run_id = run_id
        self.seed = seed
        self.window_s = window_s
        self.plan = plan
        self.home = runs_dir / f"{run_id}-soak"  # keys and logs, beside (not in) the run dir
        self.keys = self.home / "keys"
        self.swarm = Swarm(self.home)
        self.rng = random.Random(seed + 1)  # runtime choices (a stopped peer that is down)
        self.stop_requested: str | None = None
        self.boot: Incarnation | None = None
        self.learner: Incarnation | None = None
        self.learner_state = "down"  # "starting" | "up" | "down"
        self.learners: list[Incarnation] = []
        self.peers: dict[int, Incarnation] = {}
        self.peer_state: dict[int, str] = {}  # "up" | "down" | "stopped"
        self.peer_runs: dict[int, int] = {}
        self.incarnations: list[Incarnation] = []
        self.peer_ids: dict[int, str] = {}
        self.learner_id = ""  # its key's peer id, written at start: peers are pinned to it
        self.common: list[str] = []
        self.learner_args: list[str] = []
        self.log: list[dict[str, Any]] = []  # what the soak did, in order
        self.unexpected: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []  # learner RSS / fds
        self.window_start: float | None = None
        self.window_end: float | None = None
        self.warm_s: float | None = None
        self.t_start = time.time()
        self.metrics_tail = JsonlTail(self.run_dir / "metrics.jsonl")
        self.published_now: int | None = None
        self.first_accepts: set[str] = set()
        self.train_version: int | None = None
        self.stop_info: dict[str, Any] | None = None
        self.error: str | None = None
        self.queue: list[tuple[float, int, dict[str, Any]]] = []
        self._seq = 0
        self.armed: dict[str, Any] | None = None
        self.state_at_stop: dict[str, str] = {}
        self.last_train_wall = 0.0
        self.extended_s = 0.0
        self.settle_s = 0.0
        self.peer_tails: dict[int, JsonlTail] = {}
        self.peer_last_install: dict[int, float] = {}
        self._next_sample = 0.0
        self._has_published_records = False  # else the train records' "published" field is followed

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    # -- bookkeeping ------------------------------------------------------------------------

    def note(self, kind: str, **info: Any) -> dict[str, Any]:
        now = time.time()
        rec = {"kind": kind, "wall": round(now, 3), "t": round(now - self.window_start, 2) if self.window_start else None, **info}
        self.log.append(rec)
        where = f"t={rec['t']:+.1f}s" if rec["t"] is not None else f"warm-up {now - self.t_start:.1f}s"
        extra = " ".join(f"{k}={v}" for k, v in info.items() if k not in ("tail",))
        print(f"soak: {where} {kind} {extra}", file=sys.stderr, flush=True)
        return rec

    def schedule(self, at: float, action: dict[str, Any]) -> None:
        self._seq += 1
        heapq.heappush(self.queue, (at, self._seq, action))

    def spawn(self, role: str, index: int, n: int, name: str, args: list[str], cpus: set[int]) -> Incarnation:
        child = self.swarm.spawn(name, args, cpus=cpus)
        inc = Incarnation(role, index, n, child, time.time())
        self.incarnations.append(inc)
        return inc

    def poll_metrics(self) -> None:
        for r in self.metrics_tail.poll():
            ev = r.get("event")
            if ev == "published" and r.get("version") is not None:
                self.published_now = int(r["version"])
                self._has_published_records = True
            elif ev == "train":
                self.train_version = int(r["version"])
                self.last_train_wall = float(r.get("wall", time.time()))
                if r.get("published") is not None and not self._has_published_records:
                    self.published_now = int(r["published"])
            elif ev == "first_accept" and r.get("peer"):
                self.first_accepts.add(str(r["peer"]))

    def sample(self) -> None:
        inc = self.learner
        if inc is None or not inc.alive():
            return
        rss, fds = vmrss_mb(inc.pid), open_fds(inc.pid)
        if rss is not None and fds is not None:
            self.samples.append({"wall": round(time.time(), 3), "learner": inc.n, "rss_mb": round(rss, 2), "fds": fds})

    def wait_until(self, pred: Callable[[], bool], timeout: float, what: str, watch: list[Incarnation]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stop_requested:
                raise Interrupted(self.stop_requested)
            if pred():
                return
            for inc in watch:
                if not inc.alive():
                    raise RuntimeError(f"{inc.name} exited with {inc.child.proc.returncode} before {what}; "
                                       f"see {self.logs / (inc.name + '.log')}:\n{tail_text(self.logs / (inc.name + '.log'))}")
            time.sleep(TICK_S)
        raise RuntimeError(f"not {what} within {timeout:g}s")

    # -- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        self.keys.mkdir(parents=True, exist_ok=True)
        self.keys.chmod(0o700)
        write_key(self.keys / "boot.key", self.seed, "boot")
        self.learner_id = write_key(self.keys / "learner.key", self.seed, "learner")
        for i in range(PEERS):
            self.peer_ids[i] = write_key(self.keys / f"peer{i}.key", self.seed, f"peer{i}")
        self.boot = self.spawn("bootstrap", 0, 1, "bootstrap", ["bootstrap", "--key-file", str(self.keys / "boot.key")], OTHER_CPUS)
        addr: list[str] = []

        def boot_addr() -> bool:
            for line in self.boot.child.stdout_path.read_text(errors="replace").splitlines():  # type: ignore[union-attr]
                if "/p2p/" in line:
                    addr.append(line.strip())
                    return True
            return False

        self.wait_until(boot_addr, BOOT_TIMEOUT_S, "the bootstrap's address", [self.boot])
        self.common = ["--bootstrap", addr[0], "--run-id", self.run_id, "--runs-dir", str(self.runs_dir)]
        self.learner_args = ["learn", *self.common, "--key-file", str(self.keys / "learner.key"), "--mode", "async",
                             "--staleness", str(STALENESS), "--seconds", str(LEARNER_SECONDS)]
        self.start_learner()
        self.wait_until(self.learner_ready, READY_TIMEOUT_S, "ready", [self.learner])  # type: ignore[list-item]
        for i in range(PEERS):
            self.peer_runs[i] = 0
            self.start_peer(i)
        self.wait_until(self.warm, WARM_TIMEOUT_S, f"warm (every peer accepted, version >= {WARM_VERSIONS})",
                        [self.learner, *self.peers.values()])  # type: ignore[list-item]
        self.warm_s = round(time.time() - self.t_start, 1)

    def start_learner(self) -> Incarnation:
        n = len(self.learners) + 1
        inc = self.spawn("learner", 0, n, f"learner-{n}", self.learner_args, LEARNER_CPUS)
        self.learners.append(inc)
        self.learner = inc
        self.learner_state = "starting"
        return inc

    def learner_ready(self) -> bool:
        inc = self.learner
        if inc is None:
            return False
        if inc.ready is not None:
            return True
        for line in inc.child.stdout_path.read_text(errors="replace").splitlines():
            if _is_ready(line):
                inc.ready = time.time()
                inc.ready_info = json.loads(line)
                self.learner_state = "up"
                info = {k: inc.ready_info.get(k) for k in ("version", "epoch")}
                self.note("learner_ready", name=inc.name, after_s=round(inc.ready - inc.spawned, 2), **info)
                return True
        return False

    def start_peer(self, i: int) -> Incarnation:
        r = self.peer_runs[i]
        args = ["join", *self.common, "--learner", self.learner_id, "--key-file", str(self.keys / f"peer{i}.key")]
        inc = self.spawn("peer", i, r, f"peer{i}-r{r}", args, OTHER_CPUS)
        self.peers[i] = inc
        self.peer_state[i] = "up"
        return inc

    def warm(self) -> bool:
        self.poll_metrics()
        self.learner_ready()
        return len(self.first_accepts & set(self.peer_ids.values())) >= PEERS and (self.train_version or 0) >= WARM_VERSIONS

    # -- churn ------------------------------------------------------------------------------

    def kill(self, inc: Incarnation) -> None:
        """SIGKILL one of ours, by its pid, and reap it."""
        if inc.alive():
            inc.child.proc.send_signal(signal.SIGKILL)
        try:
            inc.child.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        inc.ended, inc.how, inc.code = time.time(), "sigkill", inc.child.proc.returncode

    def run_window(self) -> None:
        self.window_start = time.time()
        self.window_end = self.window_start + self.window_s
        self.note("window_start", minutes=round(self.window_s / 60, 2), planned=len(self.plan))
        for ev in self.plan:
            self.schedule(self.window_start + ev["t"], {"do": ev["kind"], **ev})
        self._next_sample = time.time()
        self.loop(self.window_end, churn=True)
        last = self.learners[-1] if self.learners else None
        if not self.stop_requested and self.error is None and last is not None and last.n > 1 and self.last_train_wall < last.spawned:
            # The last restart has not trained yet: wait for its first update (bounded), without churn.
            t = time.time()
            self.note("window_extended", why=f"{last.name} has no update yet", max_s=EXTEND_MAX_S)
            self.loop(t + EXTEND_MAX_S, churn=False, done=lambda: self.last_train_wall >= last.spawned)
            self.extended_s = round(time.time() - t, 1)
        if not self.stop_requested and self.error is None:
            # Peers (re)started late: wait (bounded) until each live one installed weights in its
            # current incarnation, so the end state (max_peer_lag) is measured on settled peers.
            t = time.time()
            self.loop(t + SETTLE_MAX_S, churn=False,
                      done=lambda: time.time() - t >= SETTLE_MIN_S and not self.peers_without_install())
            self.settle_s = round(time.time() - t, 1)
            if self.peers_without_install():
                self.note("peers_not_settled", peers=self.peers_without_install(), after_s=self.settle_s)
            self.note("window_end", at=round(self.window_end, 3), extended_s=self.extended_s, settle_s=self.settle_s)
            if self.armed is not None or any(a["do"] == "peer_stop" for _, _, a in self.queue):
                self.note("peer_stop_not_done", why="no publication seen in time" if self.armed else "window ended first")
        self.sample()  # the end value
        if self.stop_requested:
            self.note("interrupted", signal=self.stop_requested)

    def peers_without_install(self) -> list[str]:
        """Live peers with no "installed" record since their current incarnation started."""
        out = []
        for i, inc in sorted(self.peers.items()):
            if self.peer_state.get(i) != "up" or not inc.alive():
                continue
            tail = self.peer_tails.setdefault(i, JsonlTail(self.run_dir / "peers" / f"{self.peer_ids[i]}.jsonl"))
            for r in tail.poll():
                if r.get("event") == "installed":
                    self.peer_last_install[i] = float(r.get("wall", 0.0))
            if self.peer_last_install.get(i, 0.0) < inc.spawned:
                out.append(f"peer{i}")
        return out

    def loop(self, until: float, *, churn: bool, done: Callable[[], bool] | None = None) -> None:
        """Tick until `until` (or `done()`): follow metrics.jsonl, notice exits, run the due
        actions (only restarts and SIGCONTs when not `churn`), sample the learner."""
        while time.time() < until and not self.stop_requested and self.error is None:
            now = time.time()
            self.poll_metrics()
            if done is not None and done():
                return
            if self.learner_state == "starting":
                self.learner_ready()
                if self.learner_state == "starting" and self.learner is not None and now - self.learner.spawned > READY_TIMEOUT_S:
                    self.error = f"{self.learner.name} not ready {READY_TIMEOUT_S:g}s after its restart"
                    self.note("error", what=self.error)
                    return
            self.check_exits()
            if self.error:
                return
            held = []
            while self.queue and self.queue[0][0] <= now:
                item = heapq.heappop(self.queue)
                if churn or item[2]["do"] in ("peer_restart", "peer_cont", "learner_restart"):
                    self.act(item[2], now)
                else:
                    held.append(item)
            for item in held:
                heapq.heappush(self.queue, item)
            if self.armed is not None and churn:
                self.try_stop(now)
            if now >= self._next_sample:
                self.sample()
                self._next_sample = now + SAMPLE_EVERY_S
            time.sleep(ARMED_TICK_S if self.armed is not None else TICK_S)

    def act(self, a: dict[str, Any], now: float) -> None:
        do = a["do"]
        assert self.window_end is not None
        if do == "peer_kill":
            i = a["peer"]
            if self.peer_state.get(i) != "up":
                if now + POSTPONE_S < self.window_end - QUIET_TAIL_S:
                    self.schedule(now + POSTPONE_S, a)
                else:
                    self.note("peer_kill_skipped", peer=i, state=self.peer_state.get(i))
                return
            inc = self.peers[i]
            if not inc.alive():  # it died on its own first: noted as such, restarted, killed later
                self.check_exits()
                self.schedule(now + POSTPONE_S, a)
                return
            self.kill(inc)
            self.peer_state[i] = "down"
            self.note("peer_kill", peer=i, name=inc.name, pid=inc.pid, down_s=a["down_s"], code=inc.code)
            self.schedule(now + a["down_s"], {"do": "peer_restart", "peer": i, "why": "churn"})
        elif do == "peer_restart":
            i = a["peer"]
            self.peer_runs[i] += 1
            inc = self.start_peer(i)
            self.note("peer_restart", peer=i, name=inc.name, pid=inc.pid, why=a["why"])
        elif do == "learner_kill":
            if self.learner_state != "up" or self.learner is None:
                self.schedule(now + POSTPONE_S, a)
                return
            inc = self.learner
            self.kill(inc)
            self.learner_state = "down"
            self.note("learner_kill", name=inc.name, pid=inc.pid, down_s=a["down_s"], code=inc.code,
                      version=self.train_version, published=self.published_now)
            self.schedule(now + a["down_s"], {"do": "learner_restart"})
        elif do == "learner_restart":
            inc = self.start_learner()
            self.note("learner_restart", name=inc.name, pid=inc.pid)
        elif do == "peer_stop":
            if self.learner_state != "up" or self.armed is not None:
                self.schedule(now + POSTPONE_S, a)
                return
            self.armed = {"since": now, "published": self.published_now, "peer": a["peer"], "stop_s": a["stop_s"]}
            self.note("peer_stop_armed", peer=a["peer"], published=self.published_now)
        elif do == "peer_cont":
            i = a["peer"]
            inc = self.peers[i]
            if inc.alive():
                inc.child.proc.send_signal(signal.SIGCONT)
            self.peer_state[i] = "up"
            assert self.stop_info is not None
            self.stop_info["cont_wall"] = round(time.time(), 3)
            self.note("peer_cont", peer=i, name=inc.name)

    def try_stop(self, now: float) -> None:
        """SIGSTOP a peer right after a publication (its weights are moving), or give up after
        ARM_TIMEOUT_S and stop it anyway (noted)."""
        a = self.armed
        assert a is not None
        moved = self.published_now is not None and (a["published"] is None or self.published_now > a["published"])
        if not moved and now - a["since"] < ARM_TIMEOUT_S:
            return
        self.armed = None
        up = [i for i, s in self.peer_state.items() if s == "up" and self.peers[i].alive()]
        if not up:
            self.note("peer_stop_skipped", why="no peer up")
            return
        i = a["peer"] if a["peer"] in up else self.rng.choice(up)
        inc = self.peers[i]
        inc.child.proc.send_signal(signal.SIGSTOP)
        self.peer_state[i] = "stopped"
        self.stop_info = {"peer": f"peer{i}", "name": inc.name, "stop_wall": round(time.time(), 3), "seconds": a["stop_s"],
                          "published_at_stop": self.published_now, "after_publication": moved,
                          "armed_s": round(now - a["since"], 2)}
        self.note("peer_stop", peer=i, name=inc.name, pid=inc.pid, published=self.published_now, after_publication=moved)
        self.schedule(time.time() + a["stop_s"], {"do": "peer_cont", "peer": i})

    def check_exits(self) -> None:
        """A process of ours that died without our kill: noted with its log tail; a peer is
        started again (a crash restart), a learner or bootstrap ends the soak."""
        assert self.boot is not None
        if not self.boot.alive():
            self.error = f"bootstrap exited with {self.boot.child.proc.returncode}"
        if self.learner is not None and self.learner_state in ("up", "starting") and not self.learner.alive():
            inc = self.learner
            inc.ended, inc.how, inc.code = time.time(), "exited", inc.child.proc.returncode
            self.learner_state = "down"
            self.error = f"{inc.name} exited with {inc.code}"
            self.unexpected.append({"name": inc.name, "code": inc.code, "wall": round(inc.ended, 3),
                                    "log_tail": tail_text(self.logs / f"{inc.name}.log")})
        for i, inc in self.peers.items():
            if self.peer_state.get(i) in ("up",) and not inc.alive():
                inc.ended, inc.how, inc.code = time.time(), "exited", inc.child.proc.returncode
                self.peer_state[i] = "down"
                self.unexpected.append({"name": inc.name, "code": inc.code, "wall": round(inc.ended, 3),
                                        "lived_s": round(inc.ended - inc.spawned, 1),
                                        "log_tail": tail_text(self.logs / f"{inc.name}.log", 12)})
                self.note("peer_exited", peer=i, name=inc.name, code=inc.code)
                self.schedule(time.time() + POSTPONE_S, {"do": "peer_restart", "peer": i, "why": "crash"})
        if self.error:
            self.note("error", what=self.error)

    # -- stopping ---------------------------------------------------------------------------

    def stop(self) -> dict[str, Any]:
        """Peers SIGTERM (a stopped one SIGCONT first), the learner SIGTERM (summary.json), the
        bootstrap SIGTERM; each waited for, then SIGKILLed past its grace. Only our own pids."""
        out: dict[str, Any] = {}
        self.state_at_stop = {
            f"peer{i}": self.peer_state.get(i, "down") if inc.alive() else ("down" if self.peer_state.get(i) == "down" else "dead")
            for i, inc in sorted(self.peers.items())
        }
        live_peers = [inc for i, inc in sorted(self.peers.items()) if inc.alive()]
        for inc in live_peers:
            inc.child.proc.send_signal(signal.SIGCONT)
            inc.child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + PEER_STOP_GRACE_S
        for inc in live_peers:
            self._reap(inc, deadline, out)
        if self.learner is not None and self.learner.alive():
            self.learner.child.proc.send_signal(signal.SIGTERM)
            self._reap(self.learner, time.monotonic() + LEARNER_STOP_GRACE_S, out)
        if self.boot is not None and self.boot.alive():
            self.boot.child.proc.send_signal(signal.SIGTERM)
            self._reap(self.boot, time.monotonic() + BOOT_STOP_GRACE_S, out)
        for inc in self.incarnations:  # anything left (a restart that raced the stop)
            if inc.alive():
                self.kill(inc)
                out[inc.name] = {"code": inc.code, "needed_sigkill": True}
        # Every incarnation's end: "sigkill" (churn), "exited" (on its own), "stopped" (the end).
        for inc in self.incarnations:
            if inc.ended is None:
                inc.ended, inc.how, inc.code = time.time(), "exited", inc.child.proc.returncode
            out.setdefault(inc.name, {"code": inc.code, "needed_sigkill": False})["how"] = inc.how
        return {inc.name: out[inc.name] for inc in self.incarnations}

    def _reap(self, inc: Incarnation, deadline: float, out: dict[str, Any]) -> None:
        killed = False
        try:
            inc.child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            inc.child.proc.kill()
            inc.child.proc.wait()
            killed = True
        inc.ended, inc.how, inc.code = time.time(), "stopped", inc.child.proc.returncode
        out[inc.name] = {"code": inc.code, "needed_sigkill": killed}


class Interrupted(Exception):
    pass


# --- the report ---------------------------------------------------------------------------------


def read_all(path: Path) -> tuple[list[dict[str, Any]], int]:
    try:
        return parse_jsonl(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return [], 0


def analyse(soak: Soak, exit_codes: dict[str, Any], minutes: float, partial: bool) -> dict[str, Any]:
    metrics, metrics_bad = read_all(soak.run_dir / "metrics.jsonl")
    train = events(metrics, "train")
    peer_records: dict[str, list[dict[str, Any]]] = {}
    torn = {"metrics.jsonl": metrics_bad}
    for i, pid in soak.peer_ids.items():
        recs, bad = read_all(soak.run_dir / "peers" / f"{pid}.jsonl")
        peer_records[f"peer{i}"] = recs
        torn[f"peers/peer{i}.jsonl"] = bad
    summary_path = soak.run_dir / "summary.json"
    summary: dict[str, Any] | None = None
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError):
        summary = None
    k = keep_versions()

    # Learner incarnations.
    kills = [e for e in soak.log if e["kind"] == "learner_kill"]
    restarts = [e for e in soak.log if e["kind"] == "learner_restart"]
    starts = events(metrics, "start")
    incs = []
    latencies: list[float | None] = []
    for n, inc in enumerate(soak.learners, start=1):
        epoch = (inc.ready_info or {}).get("epoch")
        start_rec = next((r for r in starts if float(r.get("wall", 0.0)) >= inc.spawned - 1.0), None)
        if epoch is None and start_rec is not None:
            epoch = start_rec.get("epoch")
        rec: dict[str, Any] = {
            "name": inc.name, "spawned": round(inc.spawned, 3), "ready_after_s": round(inc.ready - inc.spawned, 2) if inc.ready else None,
            "ready_version": (inc.ready_info or {}).get("version"), "epoch": epoch,
            "start_record": {k2: start_rec.get(k2) for k2 in ("epoch", "version", "resumed")} if start_rec else None,
            "lived_s": round((inc.ended or time.time()) - inc.spawned, 1), "end": inc.how, "code": inc.code,
        }
        if n > 1:
            first = first_update_after(train, inc.spawned, epoch)
            rec["first_update_s"] = first
            latencies.append(first)
            kill = kills[n - 2] if n - 2 < len(kills) else None
            if kill is not None:
                rec["versions"] = version_around(train, kill["wall"], inc.spawned)
                rec["published_before_kill"] = kill.get("published")
                if first is not None:
                    # Rollouts dropped as duplicates from the kill to 10 s after the first update.
                    rec["duplicates_first_10s"] = dropped_delta(train, "duplicate", kill["wall"], inc.spawned + first + 10.0)
        incs.append(rec)

    # Ledger.
    if summary is not None:
        rollouts = {**ledger(summary), "source": "summary.json"}
    elif train:
        rollouts = {**ledger(train[-1]), "source": "last train record (no summary.json)"}
    else:
        rollouts = {"received": None, "trained": None, "dropped": None, "buffered": None, "lost": None, "source": "none"}
    if summary is not None and "lost_messages" in summary:
        rollouts["lost_messages"] = summary["lost_messages"]

    published_records = events(metrics, "published")
    reused = reused_versions(metrics)
    inst = install_check(metrics, peer_records)
    last_pub = last_published(metrics)
    alive_at_end = soak.state_at_stop or {f"peer{i}": s for i, s in soak.peer_state.items()}
    newest = {f"peer{i}": newest_installed(peer_records[f"peer{i}"], soak.peers[i].spawned) for i in sorted(soak.peers)}
    live_newest = {p: v for p, v in newest.items() if alive_at_end.get(p) == "up"}
    received = rollouts.get("received")
    pub_by_peers = rollouts_published(peer_records)

    # RSS and fds: the final incarnation's.
    last = soak.learners[-1] if soak.learners else None
    mine = [s for s in soak.samples if last is not None and s["learner"] == last.n]
    rss = growth([(s["wall"], s["rss_mb"]) for s in mine], last.spawned) if last else growth([], 0.0)
    fds = growth([(s["wall"], float(s["fds"])) for s in mine], last.spawned) if last else growth([], 0.0)
    lived = round((last.ended or time.time()) - last.spawned, 1) if last else None
    for g in (rss, fds):
        g["incarnation"] = last.name if last else None
        g["incarnation_lived_s"] = lived
        g["short_incarnation"] = lived is not None and lived < SHORT_INCARNATION_S
    fds_first, fds_end = fds.get("first_minute"), fds.get("end")
    fds["first_minute"] = int(fds_first) if fds_first is not None else None
    fds["end"] = int(fds_end) if fds_end is not None else None

    stop = dict(soak.stop_info) if soak.stop_info else None
    if stop is not None:
        t0 = stop["stop_wall"]
        t1 = stop.get("cont_wall") or t0 + stop["seconds"]
        stop["others_during"] = installs_between(peer_records, t0, t1, skip=stop["peer"])
        stop["stopped_peer_installs_after_cont_30s"] = installs_between(
            {stop["peer"]: peer_records.get(stop["peer"], [])}, t1, t1 + 30.0)["installs"]

    notes = []
    if not published_records:
        notes.append("metrics.jsonl has no 'published' records: reused_versions and peer_installed_mismatch are not measurable "
                     "(last published version taken from the train records' 'published' field)")
    if inst["installs"] and inst["without_sha"] == inst["installs"]:
        notes.append("the peers' 'installed' records carry no sha256")
    if rss.get("short_incarnation"):
        notes.append(f"the last learner incarnation lived {lived}s (< {SHORT_INCARNATION_S:g}s): its growth spans little time")
    if summary is None:
        notes.append("no summary.json: the learner did not stop cleanly")
    for record in incs[1:]:
        v = record.get("versions") or {}
        if v.get("before_kill") is not None and v.get("first_after") is not None and v["first_after"] <= v["before_kill"]:
            notes.append(f"{record['name']}: first update after the restart is version {v['first_after']}, "
                         f"the last before the kill was {v['before_kill']} (versions trained again under the same numbers)")
        if record.get("start_record") is not None and not record["start_record"].get("resumed"):
            notes.append(f"{record['name']}: its start record says it did not resume (resumed={record['start_record'].get('resumed')!r})")

    versions = int(summary["versions"]) if summary is not None and "versions" in summary else (int(train[-1]["version"]) if train else None)
    report: dict[str, Any] = {
        "benchmark": "soak",
        "partial": partial,
        "error": soak.error,
        "minutes": minutes,
        "seed": soak.seed,
        "run_id": soak.run_id,
        "run_dir": str(soak.run_dir),
        "logs": str(soak.logs),
        "warmup_s": soak.warm_s,
        "window_s": round(min(time.time(), soak.window_end or 0) - soak.window_start, 1) if soak.window_start else 0.0,
        "window_extended_s": soak.extended_s,
        "settle_s": soak.settle_s,
        "versions": versions,
        "learner_version_end": int(train[-1]["version"]) if train else None,
        "summary_epoch": summary.get("epoch") if summary else None,
        "learner_restarts": len(restarts),
        "peer_restarts": sum(1 for e in soak.log if e["kind"] == "peer_restart" and e.get("why") == "churn"),
        "peer_crash_restarts": sum(1 for e in soak.log if e["kind"] == "peer_restart" and e.get("why") == "crash"),
        "peer_kills": sum(1 for e in soak.log if e["kind"] == "peer_kill"),
        "rollouts": rollouts,
        "published_records": len(published_records),
        "reused_versions": len(reused) if published_records else None,
        "reused_version_list": reused[:30],
        "peer_installed_mismatch": inst["mismatch"] if published_records and inst["without_sha"] < inst["installs"] else None,
        "peer_installs": {k2: inst[k2] for k2 in ("installs", "mismatch", "unmatched", "without_sha", "unmatched_versions", "examples")},
        "restart_to_first_update_s": latencies,
        "learner_incarnations": incs,
        "peers_newest": newest,
        "peers_state_at_end": alive_at_end,
        "last_published_version": last_pub,
        "keep_versions": k,
        "max_peer_lag": max_peer_lag(last_pub, {p: v for p, v in live_newest.items() if v is not None}),
        "peers_without_install": sorted(p for p, v in live_newest.items() if v is None),
        "published_by_peers": pub_by_peers,
        "rollouts_received": received,
        # Published by the peers, never received by the learner (duplicates taken out of what it received).
        "published_not_received": (pub_by_peers - (received - int((rollouts.get("dropped") or {}).get("duplicate", 0)))
                                   if received is not None else None),
        "learner_rss_mb": rss,
        "learner_fds": fds,
        "sigstop": stop,
        "unexpected_exits": soak.unexpected,
        "exit_codes": exit_codes,
        "torn_lines": torn,
        "peer_ids": {f"peer{i}": pid for i, pid in soak.peer_ids.items()},
        "events": [{k2: v for k2, v in e.items()} for e in soak.log],
        "notes": notes,
        "targets": TARGETS,
    }
    report["checks"] = checks(report)
    report["pass"] = (not partial and soak.error is None and all(v is True for v in report["checks"].values()))
    return report


def plot(report: dict[str, Any], metrics: list[dict[str, Any]], peer_records: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = events(metrics, "train")
    walls = [e["wall"] for e in report["events"][:1]] + [float(r["wall"]) for r in train[:1]]
    t0 = min(walls) if walls else time.time()
    m = lambda w: (w - t0) / 60.0  # noqa: E731
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    # One line per learner incarnation (a restart that does not resume starts over from 0).
    cuts = [-math.inf] + [e["wall"] for e in report["events"] if e["kind"] == "learner_restart"] + [math.inf]
    for k in range(len(cuts) - 1):
        seg = [r for r in train if cuts[k] <= float(r["wall"]) < cuts[k + 1]]
        if seg:
            ax.step([m(float(r["wall"])) for r in seg], [int(r["version"]) for r in seg], where="post", color="black",
                    linewidth=1.4, label="learner version (train records)" if k == 0 else None)
    for e in report["events"]:
        if e["kind"] == "window_start":
            ax.axvline(m(e["wall"]), color="green", linewidth=0.9, label="churn window starts")
        elif e["kind"] == "window_end":
            ax.axvline(m(e["at"]), color="green", linestyle="--",
                       linewidth=0.9, label="churn window ends")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink"]
    for n, (peer, recs) in enumerate(sorted(peer_records.items())):
        s = install_series(recs)
        if s:
            ax.plot([m(w) for w, _ in s], [v for _, v in s], ".", markersize=2.5, color=colors[n % len(colors)],
                    label=f"{peer} installed")
    seen: set[str] = set()
    for e in report["events"]:
        style = {"learner_kill": ("red", "-", "learner SIGKILL"), "learner_restart": ("red", "--", "learner restart"),
                 "peer_kill": ("gray", ":", "peer SIGKILL"), "peer_exited": ("magenta", ":", "peer exited on its own")}.get(e["kind"])
        if style is None:
            continue
        ax.axvline(m(e["wall"]), color=style[0], linestyle=style[1], linewidth=0.9,
                   label=style[2] if style[2] not in seen else None)
        seen.add(style[2])
    stop = report.get("sigstop")
    if stop:
        ax.axvspan(m(stop["stop_wall"]), m(stop.get("cont_wall") or stop["stop_wall"] + stop["seconds"]), color="gold", alpha=0.3,
                   label=f"{stop['peer']} SIGSTOPped")
    ax.set_xlim(left=0)
    ax.set_xlabel("minutes since the soak started")
    ax.set_ylabel("policy version")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small", loc="best", framealpha=0.7)
    lat = [v for v in report["restart_to_first_update_s"] if v is not None]
    ro = report["rollouts"]
    ax.set_title(
        f"soak {report['minutes']:g} min, seed {report['seed']}: v{report['versions']}, learner restarts {report['learner_restarts']}, "
        f"peer restarts {report['peer_restarts']}; lost {ro.get('lost')}, reused {report['reused_versions']}, "
        f"mismatch {report['peer_installed_mismatch']}\nrestart->update {', '.join(f'{v:.1f}s' for v in lat) or '-'}, "
        f"peer lag {report['max_peer_lag']} (K={report['keep_versions']}), RSS growth {report['learner_rss_mb'].get('growth')}, "
        f"fd growth {report['learner_fds'].get('growth')}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="churn window after warm-up")
    p.add_argument("--seed", type=int, default=0, help="the churn plan and the nodes' keys")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--png", type=Path, default=None, help="the plot (default <runs-dir>/<run-id>-soak/soak.png)")
    p.add_argument("--runs-dir", type=Path, default=None, help="the echo-node --runs-dir (default a fresh /tmp/echo-soak-*)")
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    runs_dir = (args.runs_dir or Path(tempfile.mkdtemp(prefix="echo-soak-"))).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    run_id = f"soak-s{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    window_s = args.minutes * 60.0
    plan = plan_churn(args.seed, window_s)
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, OTHER_CPUS)
    soak = Soak(runs_dir, run_id, args.seed, window_s, plan)

    def on_signal(signum: int, frame: Any) -> None:
        if soak.stop_requested is None:
            soak.stop_requested = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    exit_codes: dict[str, Any] = {}
    try:
        try:
            soak.note("start", run_dir=str(soak.run_dir), logs=str(soak.logs), planned=len(plan))
            soak.start()
            soak.note("warm", after_s=soak.warm_s, version=soak.train_version)
            soak.run_window()
        except Interrupted as exc:
            soak.note("interrupted", signal=str(exc))
        except Exception as exc:  # noqa: BLE001 - a soak that broke is still reported
            soak.error = "".join(traceback.format_exception_only(exc)).strip()
            soak.note("error", what=soak.error.splitlines()[0][:300])
    finally:
        exit_codes = soak.stop()
        for s, h in old.items():
            signal.signal(s, h)
    partial = soak.stop_requested is not None or soak.error is not None or soak.window_start is None
    report = analyse(soak, exit_codes, args.minutes, partial)
    png = args.png or soak.home / "soak.png"
    try:
        metrics, _ = read_all(soak.run_dir / "metrics.jsonl")
        peers = {f"peer{i}": read_all(soak.run_dir / "peers" / f"{pid}.jsonl")[0] for i, pid in soak.peer_ids.items()}
        plot(report, metrics, peers, png)
        report["png"] = str(png)
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        report["png"] = None
        report["png_error"] = f"{type(exc).__name__}: {exc}"
    report["command"] = "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    report["wall_s"] = round(time.time() - soak.t_start, 1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return 1 if soak.error else 0


if __name__ == "__main__":
    sys.exit(main())
