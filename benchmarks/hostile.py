"""A swarm of honest peers under attack: does the learner keep training, alive and bounded?

Per attack class a fresh loopback swarm (the real `echo-node` binary: bootstrap, learner in async
mode, `--peers` honest rollout peers) warms up until every honest peer had rollouts accepted and
the learner published a few versions; then the attacker(s) run for `--seconds` inside this
process, on the real libp2p adapter (`echo_node.net.P2PNode`) and the real data channel, and
the swarm is stopped (SIGTERM; the learner writes its summary). The `clean` class
is the same swarm with no attacker: the baseline.

Attack classes:
- `bad_rollouts`: joins, publishes every message of `tests.factories.bad_rollout_messages`
  (garbage, truncated/oversize frames, bad signature, wrong schema/run, forged versions,
  out-of-vocab tokens, 256-token completions, out-of-range rewards), again and again for the
  window (it should be banned after three strikes).
- `sybil_status`: 12 fresh identities send StatusRequest over /echo-node/status/1 in a loop
  without ever joining.
- `data_get_flood`: a joined peer opens the learner's data channel for the current version,
  reads the manifest, then sends `["get", i]` frames without ever reading (the learner must cut
  it with its memory bounded); then it keeps re-dialing.
- `data_bad_frames`: one joined identity per malformed frame (out-of-range piece index, `get`
  of -1 / beyond the version, control frames from a non-source, unknown kind, a length prefix
  beyond any frame, non-msgpack bytes) sends it after the handshake, then re-dials.
- `repair_stall`: 3 joined identities publish well-formed batches with sequence gaps (seq 1,
  then 5, ...) and accept the learner's repair streams (/echo-node/repair/1) but never answer.
- `conn_flood`: the learner runs with a soft RLIMIT_NOFILE of 1024; a throwaway identity joins
  (to learn the data port), then 1,100 silent TCP connections are held to the data port and
  1,100 to the libp2p port, each re-opened when cut (at most 20,000 attempts a port).
- `join_reflect`: one identity re-joins in a tight loop, 3 more every 0.2 s, naming as data
  address 127.0.0.1, 10.0.0.1 and 169.254.169.254 with the ports of 4 loopback listeners (and a
  closed port); the listeners count the learner's dial-backs by the joiner each hello names.
  The learner runs under a dial guard (`DIAL_GUARD`: every connect outside loopback is refused
  and logged), and hosts outside loopback are named only once the guard is seen in place.
- `ban_flood`: 4 workers, each a fresh identity after another (at most 2,000): join, one batch
  with rewards the task does not give (`bad_reward`: banned at once), a ban seen as a refused
  re-join.
- `unchecked_backlog`: 8 publishers of batches that pass every cheap check (assigned prompts,
  the task's rewards, as many groups as a batch holds) with invented log-probs, back to back;
  a banned one is replaced by a fresh identity (at most 64, 50,000 batches).
- `metrics_flood`: the learner runs with `--metrics-port`; 8 connections GET /metrics back to
  back, 2 send 1 MiB request heads.
- `capacity_freeze`: honest peers run with `--price-per-hour 1`; 3 free Sybils (real join peers,
  `benchmarks.attackers freeze`, price 0) deliver honest rollouts, then stop generating while
  heartbeating (told once half the window passed and their rollouts were accepted for 20 s, or
  at 3/4 of it). The controller measures a peer after 60 s and decides every 30 s: the freeze
  itself needs `--seconds 240` or more.

Measured per class:
- `alive`: every honest process (learner, peers) still running at the end of the window, and
  each one's exit code after the stop (learner: 143 on SIGTERM with its summary written);
- `learner_rss_mb`: VmRSS of the learner at the start of the window, the max sampled every
  0.25 s during it and 3 s after, and the growth (max - start);
- `honest_rate`: honest rollouts trained per second in the window (train records of
  metrics.jsonl: `trained` delta over wall time, minus whatever the attackers had accepted),
  and `honest_rate_run`: sum of `accepted` over the honest peers in summary.json / summary
  `wall_s` (the whole run, warm-up included); ratios are against `clean`;
- `learner_wait_share`: the share of the window the learner waited for rollouts (train
  records' `wait_s`): where the honest rate falls while this stays high, the attacker took the
  honest peers' core (its `attacker_cpu_s`), not the learner's time;
- the summary's `rollouts_dropped`, `banned` (`banned_count`; lists over 16 become counts),
  `penalties`, and what the attacker saw (`attack`);
- `learner_fds`: descriptors the learner holds (start, max, growth), sampled with the RSS;
  `learner_dials_refused` (join_reflect): what the dial guard refused the learner, by address.

The baseline is the mean of two clean runs, the first and the last of the benchmark;
`baseline.clean_spread` (their difference over the mean) is the noise a ratio should be read
against. The attackers' CPU time in the window (`attack.attacker_cpu_s`) is spent on the honest
peers' core.

Targets printed alongside: window-rate ratio >= 0.9, all honest alive, RSS growth <= 50 MB.
Pinning on this 2-core machine: learner on core 0; bootstrap, peers and this process (the
attackers) on core 1, so attackers compete with the honest peers, not with the learner.
One JSON object on stdout (and in benchmarks/results/hostile.json with --out).

    .venv/bin/python -m benchmarks.hostile
    .venv/bin/python -m benchmarks.hostile --classes clean,data_get_flood --seconds 20
    .venv/bin/python -m benchmarks.hostile --classes clean,capacity_freeze --seconds 240
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import resource
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from echo_node.demo import Child, Swarm, _is_ready, _wait_line
from echo_node.metrics import read_metrics
from echo_node.net import rpc
from echo_node.net.transport import PeerAddr
from echo_node.net.framing import read_frame, write_frame
from echo_node.net.p2p import P2PNode
from echo_node.topics import rollouts_topic
from protocol import Identity, JoinRequest, JoinResponse, seal
from protocol._wire import unpack_strict
from protocol.assignment import groups_that_fit
from protocol.envelope import open_manifest
from protocol.framing import encode_length_prefixed
from protocol.identity import load_or_create_key_file
from protocol.messages import RunSpec, StatusRequest, StatusResponse, worst_group_bytes
from protocol.weights.datachannel import FULL, HELLO_MAX, MAX_WIRE_FRAME, Get, ManifestFrame, decode_frame, encode, make_hello
from tests.factories import bad_rollout_messages, closed_port, make_batch

CLASSES = [
    "clean", "bad_rollouts", "sybil_status", "data_get_flood", "data_bad_frames", "repair_stall",
    "conn_flood", "join_reflect", "ban_flood", "unchecked_backlog", "metrics_flood", "capacity_freeze",
]
LEARNER_CPUS, OTHER_CPUS = {0}, {1}
TARGETS = {"rate_ratio_min": 0.9, "all_alive": True, "rss_growth_mb_max": 50.0}
WARM_VERSIONS = 3
WARM_TIMEOUT_S = 240.0
AFTER_S = 3.0


# --- the swarm ----------------------------------------------------------------------------------


def open_fds(pid: int) -> int | None:
    """Descriptors `pid` holds open now (None once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def vmrss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """How a class's swarm differs from the clean one."""

    # The learner's soft RLIMIT_NOFILE (hard limit kept): what a default Linux login gives.
    learner_nofile: int | None = None
    # The learner refuses (and logs) every connect outside loopback (DIAL_GUARD): a join request
    # naming 10.0.0.1 or 169.254.169.254 must not make a learner under test reach either.
    dial_guard: bool = False
    metrics_port: bool = False
    peer_args: tuple[str, ...] = ()


SETUPS: dict[str, Setup] = {
    "conn_flood": Setup(learner_nofile=1024),
    "join_reflect": Setup(dial_guard=True),
    "metrics_flood": Setup(metrics_port=True),
    # Honest peers cost something, the Sybils nothing: the capacity controller activates the
    # cheapest peers first.
    "capacity_freeze": Setup(peer_args=("--price-per-hour", "1.0")),
}

# A sitecustomize for the learner's interpreter (on PYTHONPATH): an audit hook that refuses any
# socket connect outside loopback with EACCES and writes it to ECHO_HOSTILE_DIAL_LOG, one JSON
# [host, port] a line; the first line, written at start, says the guard is in place.
DIAL_GUARD = '''\
import ipaddress, json, os, sys

_LOG = os.environ["ECHO_HOSTILE_DIAL_LOG"]


def _loopback(host):
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _hook(event, args):
    if event != "socket.connect":
        return
    address = args[1]
    if isinstance(address, tuple) and address and isinstance(address[0], str) and not _loopback(address[0]):
        with open(_LOG, "a") as f:
            f.write(json.dumps([address[0], address[1]]) + "\\n")
        raise PermissionError(13, "hostile benchmark: connect outside loopback refused", address[0])


sys.addaudithook(_hook)
with open(_LOG, "a") as f:
    f.write(json.dumps({"guard": os.getpid()}) + "\\n")
'''


def free_port() -> int:
    """A loopback TCP port free now (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def nofile_limit(soft: int) -> Callable[[], None]:
    """A preexec hook: the child's soft RLIMIT_NOFILE becomes `soft` (its hard limit stays)."""

    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    return apply


def ignore_sigusr1() -> None:
    # Inherited through exec: a SIGUSR1 sent before the attacker peer installs its handler is
    # ignored, not fatal (the benchmark sends it again until the peer says it went silent).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class HostileSwarm:
    def __init__(self, root: Path, run_id: str, peers: int, setup: Setup | None = None) -> None:
        self.root = root
        self.run_id = run_id
        self.swarm = Swarm(root / "swarm")
        self.keys = root / "keys"
        self.runs = root / "runs"
        self.n_peers = peers
        self.setup = setup or Setup()
        self.learner: Child | None = None
        self.peers: list[Child] = []
        self.ready: dict[str, Any] = {}
        self.common: list[str] = []
        self.metrics_port: int | None = None
        self.dial_log: Path | None = None
        self.attacker_peers: set[str] = set()  # names of the attacker peers started (not honest)

    @property
    def run_dir(self) -> Path:
        return self.runs / self.run_id

    @property
    def logs(self) -> Path:
        return self.swarm.run_dir / "logs"

    def start(self) -> None:
        boot = self.swarm.spawn("bootstrap", ["bootstrap", "--key-file", str(self.keys / "boot.key")], cpus=OTHER_CPUS)
        addr = _wait_line(boot, lambda l: "/p2p/" in l, 30, "its address").strip()
        common = ["--bootstrap", addr, "--run-id", self.run_id, "--runs-dir", str(self.runs)]
        self.common = common
        self.learner = self.swarm.spawn(
            "learner",
            ["learn", *common, "--key-file", str(self.keys / "learner.key"), "--mode", "async", "--staleness", "4",
             "--seconds", "3600", *self._learner_args()],
            cpus=LEARNER_CPUS,
            **self._learner_child(),
        )
        self.ready = json.loads(_wait_line(self.learner, _is_ready, 240, "ready"))
        self.peers = [
            self.swarm.spawn(f"peer{i}", ["join", *common, "--learner", self.ready["peer_id"], "--key-file", str(self.keys / f"peer{i}.key"), *self.setup.peer_args], cpus=OTHER_CPUS)
            for i in range(self.n_peers)
        ]

    def _learner_args(self) -> list[str]:
        if not self.setup.metrics_port:
            return []
        self.metrics_port = free_port()
        return ["--metrics-port", str(self.metrics_port)]

    def _learner_child(self) -> dict[str, Any]:
        """Swarm.spawn's env and preexec for this setup's learner."""
        child: dict[str, Any] = {}
        if self.setup.learner_nofile is not None:
            child["preexec"] = nofile_limit(self.setup.learner_nofile)
        if self.setup.dial_guard:
            guard = self.root / "dial_guard"
            guard.mkdir(parents=True, exist_ok=True)
            (guard / "sitecustomize.py").write_text(DIAL_GUARD)
            self.dial_log = self.root / "learner_dials.jsonl"
            path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH", "")) if p)
            child["env"] = {"PYTHONPATH": path, "ECHO_HOSTILE_DIAL_LOG": str(self.dial_log)}
        return child

    def dials_refused(self) -> dict[str, Any] | None:
        """What the dial guard refused the learner: {"guard": its pid or None, "count", "to": {host:port: n}}."""
        if self.dial_log is None:
            return None
        guard: int | None = None
        to: Counter[str] = Counter()
        if self.dial_log.exists():
            for line in self.dial_log.read_text().splitlines():
                entry = json.loads(line)
                if isinstance(entry, dict):
                    guard = int(entry["guard"])
                else:
                    to[f"{entry[0]}:{entry[1]}"] += 1
        return {"guard": guard, "count": sum(to.values()), "to": dict(to.most_common(20))}

    def spawn_attacker_peer(self, name: str, attack: str, *extra: str) -> tuple[Child, str]:
        """A `benchmarks.attackers` peer (a real join peer) on the attackers' core: (child, peer id)."""
        key = self.keys / f"{name}.key"
        peer_id = load_or_create_key_file(key).peer_id
        self.attacker_peers.add(name)
        child = self.swarm.spawn(
            name, [attack, *self.common, "--learner", self.ready["peer_id"], "--key-file", str(key), *extra],
            cpus=OTHER_CPUS, module="benchmarks.attackers", preexec=ignore_sigusr1,
        )
        return child, peer_id

    def peer_ids(self) -> list[str]:
        return [load_or_create_key_file(self.keys / f"peer{i}.key").peer_id for i in range(self.n_peers)]

    def records(self, event: str | None = "train") -> list[dict[str, Any]]:
        """The learner's metrics.jsonl records of `event` (None: all of them)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in read_metrics(path) if event is None or r.get("event") == event]

    def wait_warm(self) -> None:
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while time.monotonic() < deadline:
            train = self.records()
            if len(self.records("first_accept")) >= self.n_peers and train and int(train[-1]["version"]) >= WARM_VERSIONS:
                return
            for c in [self.learner, *self.peers]:
                assert c is not None
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode} during warm-up; see {self.logs / (c.name + '.log')}")
            time.sleep(0.25)
        raise RuntimeError(f"swarm not warm within {WARM_TIMEOUT_S:g}s")

    def honest(self) -> list[Child]:
        assert self.learner is not None
        return [self.learner, *self.peers]

    def stop(self) -> dict[str, int | None]:
        self.swarm.stop_all()
        return {c.name: c.proc.returncode for c in self.honest()}


# --- attackers ----------------------------------------------------------------------------------


class Target:
    """What an attacker knows of the learner: its ready line (peer id and addresses) and run;
    for the classes that need them, its metrics port, the window's length and the swarm (to
    start attacker peers)."""

    def __init__(
        self, ready: dict[str, Any], run_id: str, *, metrics_port: int | None = None, window_s: float = 0.0,
        swarm: HostileSwarm | None = None,
    ) -> None:
        self.peer_id = str(ready["peer_id"])
        self.addrs = tuple(str(a) for a in ready["addrs"])
        self.run_id = run_id
        self.metrics_port = metrics_port
        self.window_s = window_s
        self.swarm = swarm


async def start_node(nursery: trio.Nursery, target: Target, identity: Identity) -> P2PNode:
    node = P2PNode(identity)
    await nursery.start(node.run)
    with trio.fail_after(30):
        await node.connect(PeerAddr(target.peer_id, target.addrs))
    return node


async def join(node: P2PNode, target: Target, *, data_host: str = "127.0.0.1", data_port: int = 9) -> JoinResponse:
    request = JoinRequest(run_id=target.run_id, peer_id=node.peer_id, data_host=data_host, data_port=data_port)
    with trio.fail_after(30):
        return await rpc.call(node, target.peer_id, rpc.JOIN, request, JoinResponse)


async def status(node: P2PNode, target: Target) -> StatusResponse:
    with trio.fail_after(10):
        return await rpc.call(node, target.peer_id, rpc.STATUS, StatusRequest(run_id=target.run_id), StatusResponse)


async def wait_gossip(node: P2PNode, target: Target) -> None:
    topic = rollouts_topic(target.run_id)
    with trio.fail_after(30):
        while target.peer_id not in node.gossip_peers(topic):
            await trio.sleep(0.05)


def count(stats: dict[str, Any], key: str, n: int = 1) -> None:
    stats[key] = stats.get(key, 0) + n


def note_error(stats: dict[str, Any], exc: BaseException) -> None:
    if isinstance(exc, BaseExceptionGroup):  # a nursery's: what went wrong is inside
        for inner in exc.exceptions:
            note_error(stats, inner)
        return
    errors = stats.setdefault("errors", {})
    key = f"{type(exc).__name__}: {str(exc)[:120]}"
    errors[key] = errors.get(key, 0) + 1


async def attack_bad_rollouts(target: Target, stats: dict[str, Any]) -> None:
    identity = Identity.generate()
    stats["attackers"] = [identity.peer_id]
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, target, identity)
        await join(node, target)
        await wait_gossip(node, target)
        topic = rollouts_topic(target.run_id)
        rounds = 0
        while True:
            for name, data, _, _ in bad_rollout_messages(identity, target.run_id, seq0=1000 + 20 * rounds):
                try:
                    await node.publish(topic, data)
                    count(stats, "published")
                except Exception as exc:  # noqa: BLE001 - the attacker keeps going
                    note_error(stats, exc)
            rounds += 1
            stats["rounds"] = rounds
            await trio.sleep(0.5)
            if rounds % 10 == 0:  # does a banned peer get back in through a fresh join?
                try:
                    await join(node, target)
                    count(stats, "rejoins_accepted")
                except Exception as exc:  # noqa: BLE001
                    count(stats, "rejoins_refused")
                    stats["rejoin_refusal"] = str(exc)[:160]


async def attack_sybil_status(target: Target, stats: dict[str, Any]) -> None:
    identities = [Identity.generate() for _ in range(12)]
    stats["attackers"] = [i.peer_id for i in identities]
    demands: list[int] = []

    async def one(nursery: trio.Nursery, identity: Identity) -> None:
        try:
            node = await start_node(nursery, target, identity)
        except Exception as exc:  # noqa: BLE001
            note_error(stats, exc)
            return
        while True:
            try:
                resp = await status(node, target)
                count(stats, "answered")
                demands.append(resp.demand_groups)
            except Exception as exc:  # noqa: BLE001
                count(stats, "failed")
                note_error(stats, exc)
            stats["demand_groups_seen"] = sorted(set(demands))
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        for identity in identities:
            nursery.start_soon(one, nursery, identity)


async def open_data(target: Target, identity: Identity, resp: JoinResponse, version: int) -> tuple[trio.SocketStream, int]:
    """Handshake on the learner's data channel; (stream, pieces of the version)."""
    stream = await trio.open_tcp_stream(resp.data_host, resp.data_port)
    hello = make_hello(identity, target=target.peer_id, run_id=target.run_id, version=version, base=FULL, now=time.time())
    await write_frame(stream, hello)
    with trio.fail_after(10):
        first = decode_frame(await read_frame(stream, max_len=MAX_WIRE_FRAME), from_source=True)
    if not isinstance(first, ManifestFrame):
        await stream.aclose()
        raise ConnectionRefusedError(f"data channel answered {type(first).__name__}, not a manifest")
    manifest = open_manifest(first.sealed, learner_peer_id=target.peer_id, run_id=target.run_id)
    return stream, manifest.num_pieces


async def try_redial(target: Target, identity: Identity, resp: JoinResponse, node: P2PNode, stats: dict[str, Any]) -> None:
    """A fresh hello after the cut: served again (`redial_served`) or refused."""
    try:
        version = (await status(node, target)).version
        stream, _ = await open_data(target, identity, resp, version)
    except Exception as exc:  # noqa: BLE001
        count(stats, "redial_refused")
        stats["redial_refusal"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return
    count(stats, "redial_served")
    await stream.aclose()


async def attack_data_get_flood(target: Target, stats: dict[str, Any]) -> None:
    identity = Identity.generate()
    stats["attackers"] = [identity.peer_id]
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, target, identity)
        resp = await join(node, target)
        version = (await status(node, target)).version
        stream, pieces = await open_data(target, identity, resp, version)
        stats.update(version=version, pieces=pieces, gets_sent=0, bytes_sent=0)
        t0 = trio.current_time()
        burst = b"".join(encode_length_prefixed(encode(Get(i % pieces))) for i in range(200))
        outcome = "not cut after 50000 gets"
        while stats["gets_sent"] < 50_000:
            with trio.move_on_after(10) as stalled:
                try:
                    await stream.send_all(burst)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    outcome = f"cut: {type(exc).__name__}: {exc}"
                    break
            if stalled.cancelled_caught:
                outcome = "send stalled 10 s (learner stopped reading, connection not closed)"
                break
            stats["gets_sent"] += 200
            stats["bytes_sent"] += len(burst)
        stats["outcome"] = outcome
        stats["cut_after_s"] = round(trio.current_time() - t0, 3)
        # Is the connection really closed? Read what is left until EOF (bounded).
        drained = 0
        with trio.move_on_after(5) as eof_wait:
            try:
                while chunk := await stream.receive_some(1 << 16):
                    drained += len(chunk)
                stats["eof_seen"] = True
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                stats["eof_seen"] = True
        if eof_wait.cancelled_caught:
            stats["eof_seen"] = False
        stats["bytes_queued_for_us_then_drained"] = drained
        await stream.aclose()
        while True:
            await trio.sleep(2)
            await try_redial(target, identity, resp, node, stats)


def _raw(*fields: object) -> bytes:
    import msgpack

    return encode_length_prefixed(msgpack.packb(list(fields)), max_len=1 << 22)


BAD_FRAMES: dict[str, Callable[[int], bytes]] = {
    "piece_index_out_of_range": lambda n: _raw("piece", 10**6, b"x"),
    "piece_index_just_past_end": lambda n: _raw("piece", n, b"x" * 16),
    "get_negative": lambda n: _raw("get", -1),
    "get_past_end": lambda n: _raw("get", n),
    "peers_from_non_source": lambda n: _raw("peers", [["12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA", "127.0.0.1", 1]]),
    "unknown_kind": lambda n: _raw("what"),
    "oversize_length_prefix": lambda n: b"\xff\xff\xff\xff",
    "not_msgpack": lambda n: encode_length_prefixed(b"\xc1\xc1 not msgpack"),
}


async def attack_data_bad_frames(target: Target, stats: dict[str, Any]) -> None:
    stats["attackers"] = []
    stats["frames"] = {}

    async def one(nursery: trio.Nursery, kind: str, build: Callable[[int], bytes]) -> None:
        identity = Identity.generate()
        stats["attackers"].append(identity.peer_id)
        rec: dict[str, Any] = {}
        stats["frames"][kind] = rec
        try:
            node = await start_node(nursery, target, identity)
            resp = await join(node, target)
            version = (await status(node, target)).version
            stream, pieces = await open_data(target, identity, resp, version)
            await stream.send_all(build(pieces))
            t0 = trio.current_time()
            with trio.move_on_after(10) as wait:
                try:
                    while await stream.receive_some(1 << 16):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            rec["cut"] = not wait.cancelled_caught
            rec["cut_after_s"] = round(trio.current_time() - t0, 3)
            await stream.aclose()
            while True:
                await trio.sleep(3)
                await try_redial(target, identity, resp, node, rec)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"

    async def garbage_hellos() -> None:
        # No identity at all: garbage where the hello goes, to the data port, in a loop.
        resp_host, resp_port = stats.get("data_addr", (None, None))
        while resp_host is None:
            await trio.sleep(0.2)
            resp_host, resp_port = stats.get("data_addr", (None, None))
        while True:
            try:
                stream = await trio.open_tcp_stream(resp_host, resp_port)
                await stream.send_all(encode_length_prefixed(os.urandom(200)))
                with trio.move_on_after(11):
                    while await stream.receive_some(1024):
                        pass
                await stream.aclose()
                count(stats, "garbage_hellos")
            except OSError as exc:
                note_error(stats, exc)
            await trio.sleep(0.2)

    async with trio.open_nursery() as nursery:
        probe_node_id = Identity.generate()
        node = await start_node(nursery, target, probe_node_id)
        resp = await join(node, target)
        stats["attackers"].append(probe_node_id.peer_id)
        stats["data_addr"] = (resp.data_host, resp.data_port)
        for kind, build in BAD_FRAMES.items():
            nursery.start_soon(one, nursery, kind, build)
        nursery.start_soon(garbage_hellos)


async def attack_repair_stall(target: Target, stats: dict[str, Any]) -> None:
    identities = [Identity.generate() for _ in range(3)]
    stats["attackers"] = [i.peer_id for i in identities]
    stats["repair_streams"] = 0
    stats["repair_streams_open"] = 0
    stats["repair_streams_open_max"] = 0

    async def hold(stream: Any) -> None:
        stats["repair_streams"] += 1
        stats["repair_streams_open"] += 1
        stats["repair_streams_open_max"] = max(stats["repair_streams_open_max"], stats["repair_streams_open"])
        try:
            await trio.sleep_forever()  # accept, never read, never answer
        finally:
            stats["repair_streams_open"] -= 1

    async def one(nursery: trio.Nursery, identity: Identity) -> None:
        node = P2PNode(identity)
        node.set_stream_handler(rpc.REPAIR, hold)
        await nursery.start(node.run)
        with trio.fail_after(30):
            await node.connect(PeerAddr(target.peer_id, target.addrs))
        await join(node, target)
        await wait_gossip(node, target)
        topic = rollouts_topic(target.run_id)
        seq = 1
        while True:
            try:
                version = (await status(node, target)).version
                await node.publish(topic, seal(make_batch(run_id=target.run_id, identity=identity, seq=seq, version=version), identity))
                count(stats, "published")
            except Exception as exc:  # noqa: BLE001
                note_error(stats, exc)
            seq += 4  # 1, 5, 9, ...: three missing seqs before each one
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for identity in identities:
            nursery.start_soon(one, nursery, identity)


# --- issue 24: descriptors, dial-backs, bans, backlogs, the metrics endpoint, capacity --------

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def loopback(host: str) -> str:
    """`host` if it is in 127.0.0.0/8, else ValueError: this benchmark connects to nothing else
    (a join request may *name* another host; refusing to dial it is the learner's job)."""
    try:
        inside = ipaddress.ip_address(host) in LOOPBACK
    except ValueError:
        inside = False
    if not inside:
        raise ValueError(f"refusing to connect to {host!r}: this benchmark connects only to 127.0.0.0/8")
    return host


def libp2p_tcp(addrs: tuple[str, ...]) -> tuple[str, int]:
    """(host, port) of the first /ip4/<loopback>/tcp/<port> address among the learner's."""
    for addr in addrs:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and ipaddress.ip_address(parts[2]) in LOOPBACK:
            return parts[2], int(parts[4])
    raise ValueError(f"no loopback TCP address among the learner's {addrs}")


def refusal(exc: BaseException) -> str:
    """A refused request's code ("banned", "full", ...), else the exception's type."""
    if isinstance(exc, rpc.RequestFailed):
        return str(exc).split(":", 1)[0]
    return type(exc).__name__


def raise_own_nofile() -> int:
    """This process's soft RLIMIT_NOFILE raised to its hard limit (an attacker holding 2,200
    sockets needs them); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# conn_flood: silent connections held per learner port (over its soft limit of 1024 together and
# each alone), re-opened when cut, at most this many attempts per port in a window.
CONN_FLOOD_PER_PORT = 1100
CONN_FLOOD_MAX_ATTEMPTS = 20_000
CONNECT_TIMEOUT_S = 5.0
REOPEN_PAUSE_S = 0.5


async def hold_connection(host: str, port: int, rec: dict[str, Any]) -> None:
    """Open a TCP connection to host:port, say nothing, hold it until the learner closes it,
    then open another, until the attempts of this port run out (or the window ends)."""
    while rec["attempts"] < CONN_FLOOD_MAX_ATTEMPTS:
        rec["attempts"] += 1
        stream: trio.SocketStream | None = None
        with trio.move_on_after(CONNECT_TIMEOUT_S) as connecting:
            try:
                stream = await trio.open_tcp_stream(loopback(host), port)
            except OSError as exc:
                count(rec, "connect_failed")
                note_error(rec, exc)
        if stream is None:
            if connecting.cancelled_caught:
                count(rec, "connect_timeout")
            await trio.sleep(REOPEN_PAUSE_S)
            continue
        rec["opened"] += 1
        rec["open_now"] += 1
        rec["open_max"] = max(rec["open_max"], rec["open_now"])
        try:
            async with stream:
                while await stream.receive_some(4096):  # whatever the learner says, read; never answer
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            rec["open_now"] -= 1
        count(rec, "closed_by_learner")
        await trio.sleep(REOPEN_PAUSE_S)


async def attack_conn_flood(target: Target, stats: dict[str, Any]) -> None:
    stats["attacker_nofile"] = raise_own_nofile()
    identity = Identity.generate()  # a throwaway identity: joining tells it the data port
    stats["attackers"] = [identity.peer_id]
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, target, identity)
        resp = await join(node, target)
        ports = {"data": (loopback(resp.data_host), resp.data_port), "libp2p": libp2p_tcp(target.addrs)}
        for kind, (host, port) in ports.items():
            rec = stats[kind] = {"port": port, "attempts": 0, "opened": 0, "open_now": 0, "open_max": 0, "closed_by_learner": 0}
            for _ in range(CONN_FLOOD_PER_PORT):
                nursery.start_soon(hold_connection, host, port, rec)


# join_reflect: joins answered per identity in a tight loop, and where the learner dialed back.
REFLECT_LISTENERS = 4
REFLECT_OTHERS = 3
REFLECT_MAX_JOINS = 20_000
# Named in join requests, never dialed by this benchmark (the learner runs under DIAL_GUARD).
NAMED_ELSEWHERE = ("10.0.0.1", "169.254.169.254")


def hello_target(frame: bytes) -> str:
    """The peer id a data-channel hello (a probe's) is addressed to: the joiner it checks."""
    outer = unpack_strict(frame, what="probe hello")
    fields = unpack_strict(outer[0], what="probe hello body")
    return str(fields[1])


async def probe_listener(nursery: trio.Nursery, stats: dict[str, Any], probes: Counter[tuple[str, int]]) -> int:
    """A loopback port that counts the learner's dial-backs (by the joiner the hello names),
    then closes each at once (a failed probe: the learner may try again right away)."""

    async def on_probe(stream: trio.SocketStream) -> None:
        port = stream.socket.getsockname()[1]
        who = "?"
        with trio.move_on_after(2):
            try:
                who = hello_target(await read_frame(stream, max_len=HELLO_MAX))
            except Exception:  # noqa: BLE001 - whatever it sent, the dial is what counts
                count(stats, "probe_hellos_unreadable")
        probes[(who, port)] += 1
        count(stats, "probes")
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, on_probe, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def attack_join_reflect(target: Target, stats: dict[str, Any]) -> None:
    swarm = target.swarm
    guard = swarm.dials_refused() if swarm is not None else None
    # Hosts outside loopback are named only while the guard is known to hold the learner.
    guarded = guard is not None and guard["guard"] is not None
    stats["dial_guard"] = guarded
    probes: Counter[tuple[str, int]] = Counter()
    stats.update(joins_answered=0, probes=0, joins_refused={}, named={})
    t0 = trio.current_time()

    def summarize() -> None:
        elapsed = max(1e-9, trio.current_time() - t0)
        stats["joins_per_s"] = round(stats["joins_answered"] / elapsed, 1)
        stats["probes_per_join"] = round(stats["probes"] / max(1, stats["joins_answered"]), 3)
        by_port: Counter[int] = Counter()
        for (_, port), n in probes.items():
            by_port[port] += n
        stats["probes_by_port"] = {str(p): n for p, n in sorted(by_port.items())}
        stats["probed_identity_addresses"] = len(probes)
        stats["probes_max_per_identity_address"] = max(probes.values(), default=0)

    async def rejoin_loop(nursery: trio.Nursery, identity: Identity, names: list[tuple[str, int]], pause: float) -> None:
        node = await start_node(nursery, target, identity)
        i = 0
        while stats["joins_answered"] + sum(stats["joins_refused"].values()) < REFLECT_MAX_JOINS:
            host, port = names[i % len(names)]
            i += 1
            stats["named"][host] = stats["named"].get(host, 0) + 1
            try:
                await join(node, target, data_host=host, data_port=port)
                count(stats, "joins_answered")
            except Exception as exc:  # noqa: BLE001 - a refusal is an outcome
                code = refusal(exc)
                stats["joins_refused"][code] = stats["joins_refused"].get(code, 0) + 1
            summarize()
            await trio.sleep(pause)

    async with trio.open_nursery() as nursery:
        ports = [await probe_listener(nursery, stats, probes) for _ in range(REFLECT_LISTENERS)]
        hosts = ["127.0.0.1", *(NAMED_ELSEWHERE if guarded else ())]
        names = [(h, p) for p in ports for h in hosts] + [("127.0.0.1", await closed_port())]
        stats["listener_ports"] = ports
        tight, *others = [Identity.generate() for _ in range(1 + REFLECT_OTHERS)]
        stats["attackers"] = [tight.peer_id, *(o.peer_id for o in others)]
        nursery.start_soon(rejoin_loop, nursery, tight, names, 0.0)
        for k, other in enumerate(others):
            nursery.start_soon(rejoin_loop, nursery, other, names[k::len(others)], 0.2)


# ban_flood: fresh identities, each joining and earning a ban with one batch whose rewards the
# task does not give (a `bad_reward` claim: cheating, banned at once).
BAN_WORKERS = 4
BAN_MAX_IDENTITIES = 2000
BAN_CONFIRM_S = 5.0


async def earn_ban(target: Target, stats: dict[str, Any], latencies: deque[float]) -> None:
    identity = Identity.generate()
    stats["attackers"].append(identity.peer_id)
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, target, identity)
        try:
            resp = await join(node, target)
        except rpc.RequestFailed as exc:
            code = refusal(exc)
            stats["join_refused"][code] = stats["join_refused"].get(code, 0) + 1
            nursery.cancel_scope.cancel()
            return
        count(stats, "joined")
        await wait_gossip(node, target)
        spec = resp.spec
        batch = make_batch(run_id=target.run_id, identity=identity, seq=1, version=spec.current_version,
                           samples=spec.group_size, rewards=[0.5] * spec.group_size)
        await node.publish(rollouts_topic(target.run_id), seal(batch, identity))
        count(stats, "published")
        sent = trio.current_time()
        with trio.move_on_after(BAN_CONFIRM_S) as waited:
            while True:  # banned: a join refused as such (a rate-limited one says nothing yet)
                await trio.sleep(0.1)
                try:
                    await join(node, target)
                except rpc.RequestFailed as exc:
                    code = refusal(exc)
                    if code == "banned":
                        break
                    if code != "rate_limited":
                        raise
                    count(stats, "confirm_rate_limited")
        if waited.cancelled_caught:
            count(stats, "ban_unconfirmed")
        else:
            count(stats, "banned")
            latencies.append(trio.current_time() - sent)
        nursery.cancel_scope.cancel()


async def attack_ban_flood(target: Target, stats: dict[str, Any]) -> None:
    stats.update(identities=0, joined=0, published=0, banned=0, join_refused={}, attackers=[])
    latencies: deque[float] = deque(maxlen=BAN_MAX_IDENTITIES)
    t0 = trio.current_time()

    async def worker() -> None:
        while stats["identities"] < BAN_MAX_IDENTITIES:
            stats["identities"] += 1
            try:
                await earn_ban(target, stats, latencies)
            except Exception as exc:  # noqa: BLE001 - the next identity tries again
                note_error(stats, exc)
            stats["bans_per_s"] = round(stats["banned"] / max(1e-9, trio.current_time() - t0), 3)
            if latencies:
                stats["ban_latency_s"] = {"median": round(statistics.median(latencies), 3), "max": round(max(latencies), 3)}

    async with trio.open_nursery() as nursery:
        for _ in range(BAN_WORKERS):
            nursery.start_soon(worker)


# unchecked_backlog: publishers of batches that pass every cheap check (assigned prompts, the
# task's rewards) with invented log-probs, as many groups as one batch holds, back to back; a
# banned one is replaced by a fresh identity so the pressure lasts the window.
BACKLOG_SLOTS = 8
BACKLOG_MAX_IDENTITIES = 64
BACKLOG_MAX_MESSAGES = 50_000
BACKLOG_CHECK_S = 2.0


def batch_groups(spec: RunSpec, prompt_tokens: int = 8) -> int:
    """Groups one rollout batch of this run always holds (the bound an honest peer plans by)."""
    worst = worst_group_bytes(group_size=spec.group_size, prompt_tokens=prompt_tokens, max_new_tokens=spec.sampling.max_new_tokens)
    return groups_that_fit(worst)


async def backlog_publisher(target: Target, identity: Identity, stats: dict[str, Any]) -> None:
    """Publish as `identity` until its re-join is refused (banned), then return."""
    async with trio.open_nursery() as nursery:
        node = await start_node(nursery, target, identity)
        resp = await join(node, target)
        await wait_gossip(node, target)
        spec = resp.spec
        groups = stats["groups_per_batch"] = batch_groups(spec)
        state = {"version": spec.current_version, "banned": False}

        async def watch() -> None:
            while True:
                await trio.sleep(BACKLOG_CHECK_S)
                try:
                    await join(node, target)
                    state["version"] = (await status(node, target)).version
                except Exception as exc:  # noqa: BLE001
                    if refusal(exc) == "banned":
                        state["banned"] = True
                        count(stats, "banned_seen")
                        return
                    note_error(stats, exc)

        nursery.start_soon(watch)
        topic = rollouts_topic(target.run_id)
        seq = 1
        while not state["banned"] and stats["published"] < BACKLOG_MAX_MESSAGES:
            batch = make_batch(run_id=target.run_id, identity=identity, seq=seq, groups=groups, version=int(state["version"]),
                               samples=spec.group_size)
            data = seal(batch, identity)
            try:
                await node.publish(topic, data)
                stats["published"] += 1
                stats["bytes_published"] += len(data)
            except Exception as exc:  # noqa: BLE001
                note_error(stats, exc)
                await trio.sleep(0.1)
            seq += 1
            await trio.sleep(0)
        nursery.cancel_scope.cancel()


async def attack_unchecked_backlog(target: Target, stats: dict[str, Any]) -> None:
    stats.update(identities=0, published=0, bytes_published=0, banned_seen=0, attackers=[])
    t0 = trio.current_time()

    async def slot() -> None:
        while stats["identities"] < BACKLOG_MAX_IDENTITIES and stats["published"] < BACKLOG_MAX_MESSAGES:
            stats["identities"] += 1
            identity = Identity.generate()
            stats["attackers"].append(identity.peer_id)
            try:
                await backlog_publisher(target, identity, stats)
            except Exception as exc:  # noqa: BLE001 - a fresh identity takes the slot
                note_error(stats, exc)
                await trio.sleep(0.5)

    async def rate() -> None:
        while True:
            await trio.sleep(1)
            stats["batches_per_s"] = round(stats["published"] / (trio.current_time() - t0), 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rate)
        for _ in range(BACKLOG_SLOTS):
            nursery.start_soon(slot)


# metrics_flood: GET /metrics back to back from several connections, and 1 MiB request heads.
METRICS_GETTERS = 8
METRICS_BIG_HEADS = 2
BIG_HEAD_BYTES = 1 << 20
METRICS_MAX_REQUESTS = 200_000
ANSWER_MAX = 4 << 20  # what is read of one answer
GET = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def http_status(answer: bytes) -> str:
    """The status code of an HTTP answer ("none": the server closed without one)."""
    if not answer:
        return "none"
    parts = answer.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].decode(errors="replace")[:3] if len(parts) > 1 else "garbled"


async def read_answer(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes, at most ANSWER_MAX bytes."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size < ANSWER_MAX and (chunk := await stream.receive_some(1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    except (trio.BrokenResourceError, OSError):
        pass
    return b"".join(chunks)


async def attack_metrics_flood(target: Target, stats: dict[str, Any]) -> None:
    if target.metrics_port is None:
        raise ValueError("metrics_flood needs the learner's --metrics-port")
    host, port = loopback("127.0.0.1"), target.metrics_port
    stats.update(port=port, requests=0, status={}, bytes_received=0, big_heads=0, big_head_status={}, big_head_bytes_taken_max=0)
    latencies: deque[float] = deque(maxlen=10_000)
    t0 = trio.current_time()

    def tally(key: str, code: str) -> None:
        stats[key][code] = stats[key].get(code, 0) + 1

    async def getter() -> None:
        while stats["requests"] < METRICS_MAX_REQUESTS:
            stats["requests"] += 1
            began = trio.current_time()
            try:
                with trio.fail_after(15):
                    stream = await trio.open_tcp_stream(host, port)
                    async with stream:
                        await stream.send_all(GET)
                        answer = await read_answer(stream)
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                tally("status", type(exc).__name__)
                await trio.sleep(0.05)  # a refused connect returns at once: do not spin
                continue
            tally("status", http_status(answer))
            stats["bytes_received"] += len(answer)
            latencies.append(trio.current_time() - began)
            elapsed = trio.current_time() - t0
            stats["answered_200_per_s"] = round(stats["status"].get("200", 0) / elapsed, 1)
            stats["latency_s"] = {"median": round(statistics.median(latencies), 4), "max": round(max(latencies), 4)}

    async def big_head() -> None:
        head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * BIG_HEAD_BYTES + b"\r\n\r\n"
        while stats["big_heads"] < 1000:
            stats["big_heads"] += 1
            taken = 0
            began = trio.current_time()
            try:
                with trio.fail_after(15):
                    stream = await trio.open_tcp_stream(host, port)
                    async with stream:
                        try:
                            for i in range(0, len(head), 1 << 16):
                                await stream.send_all(head[i : i + (1 << 16)])
                                taken += min(1 << 16, len(head) - i)
                        except (trio.BrokenResourceError, OSError):
                            pass
                        answer = await read_answer(stream)
                tally("big_head_status", http_status(answer))
            except (OSError, trio.TooSlowError) as exc:
                tally("big_head_status", type(exc).__name__)
            stats["big_head_bytes_taken_max"] = max(stats["big_head_bytes_taken_max"], taken)
            stats["big_head_s_max"] = round(max(stats.get("big_head_s_max", 0.0), trio.current_time() - began), 3)
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        for _ in range(METRICS_GETTERS):
            nursery.start_soon(getter)
        for _ in range(METRICS_BIG_HEADS):
            nursery.start_soon(big_head)


# capacity_freeze: free Sybil peers (real `join` peers, benchmarks.attackers `freeze`) deliver
# honestly, then stop generating while their heartbeats go on. Each is told to stop once half the
# window has passed and its rollouts have been accepted for FREEZE_DELIVER_S, or at 3/4 of the
# window whatever it delivered (a Sybil takes ~30 s to start on a loaded core; the controller
# measures a peer only after it has been joined for capacity.window_s = 60 s and decides every
# capacity.tick_s = 30 s, so the freeze itself shows with --seconds 240 or more).
FREEZE_SYBILS = 3
FREEZE_DELIVER_S = 20.0


def child_events(child: Child) -> list[dict[str, Any]]:
    """The JSON lines an attacker peer printed on stdout."""
    events = []
    for line in child.stdout_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def freeze_stats(
    records: list[dict[str, Any]], sybils: list[tuple[Child, str]], honest: set[str], t0: float, silent_at: float | None,
    stats: dict[str, Any],
) -> None:
    """What the learner's records (metrics.jsonl) say: Sybils accepted, capacity decisions,
    training after the Sybils went silent."""
    ids = {p for _, p in sybils}
    events = {p: child_events(c) for c, p in sybils}
    stats["sybils_published"] = sum(1 for ev in events.values() for e in ev if e.get("event") == "published")
    stats["sybils_silent"] = sum(1 for ev in events.values() if any(e.get("event") == "silent" for e in ev))
    stats["sybils_accepted"] = sum(1 for r in records if r.get("event") == "first_accept" and r.get("peer") in ids)
    decisions = [r for r in records if r.get("event") == "capacity" and r.get("wall", 0) >= t0]
    stats["capacity_decisions"] = len(decisions)
    stats["honest_standby_max"] = max((len(honest & set(d["standby"])) for d in decisions), default=0)
    if decisions:
        last = decisions[-1]
        stats["last_decision"] = {
            "active_sybils": len(ids & set(last["active"])), "active_honest": len(honest & set(last["active"])),
            "standby_honest": len(honest & set(last["standby"])), "reason": last.get("reason"),
        }
    if silent_at is None:
        return
    stats["silent_at_s"] = round(silent_at - t0, 2)
    stats["sybils_published_after_silent"] = sum(
        1 for ev in events.values() for e in ev if e.get("event") == "published" and e.get("wall", 0) > silent_at + 1.0
    )
    train = [r for r in records if r.get("event") == "train"]
    trained, secs = window_rate(train, silent_at, time.time())
    stats["trained_after_silent"] = trained
    stats["rate_after_silent"] = round(trained / secs, 2) if secs > 0 else None
    walls = [silent_at, *(float(r["wall"]) for r in train if r["wall"] > silent_at), time.time()]
    stats["train_gap_max_after_silent_s"] = round(max(b - a for a, b in zip(walls, walls[1:])), 2)


async def attack_capacity_freeze(target: Target, stats: dict[str, Any]) -> None:
    hs = target.swarm
    if hs is None:
        raise ValueError("capacity_freeze starts attacker peers: it needs the swarm")
    honest = set(hs.peer_ids())
    sybils = [hs.spawn_attacker_peer(f"sybil{i}", "freeze", "--price-per-hour", "0") for i in range(FREEZE_SYBILS)]
    stats["attackers"] = [p for _, p in sybils]
    t0 = time.time()
    told: dict[str, float] = {}
    while True:
        await trio.sleep(1.0)
        now = time.time()
        records = hs.records(None)
        accepted = {r["peer"]: float(r["wall"]) for r in records if r.get("event") == "first_accept"}
        for child, peer in sybils:
            if peer not in told and now - t0 >= target.window_s / 2 and (
                now - accepted.get(peer, math.inf) >= FREEZE_DELIVER_S or now - t0 >= 0.75 * target.window_s
            ):
                told[peer] = now
            # Again each second until it says it went silent (ignored before its handler is in).
            if peer in told and child.proc.poll() is None and not any(e.get("event") == "silent" for e in child_events(child)):
                child.proc.send_signal(signal.SIGUSR1)
        stats["told_silent_at_s"] = {p[-8:]: round(t - t0, 1) for p, t in told.items()}
        stats["sybils_running"] = sum(1 for c, _ in sybils if c.proc.poll() is None)
        freeze_stats(records, sybils, honest, t0, max(told.values()) if len(told) == len(sybils) else None, stats)


ATTACKS: dict[str, Callable[[Target, dict[str, Any]], Awaitable[None]]] = {
    "bad_rollouts": attack_bad_rollouts,
    "sybil_status": attack_sybil_status,
    "data_get_flood": attack_data_get_flood,
    "data_bad_frames": attack_data_bad_frames,
    "repair_stall": attack_repair_stall,
    "conn_flood": attack_conn_flood,
    "join_reflect": attack_join_reflect,
    "ban_flood": attack_ban_flood,
    "unchecked_backlog": attack_unchecked_backlog,
    "metrics_flood": attack_metrics_flood,
    "capacity_freeze": attack_capacity_freeze,
}


# --- one class ----------------------------------------------------------------------------------


async def attack_window(name: str, target: Target, learner_pid: int, seconds: float) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    rss: dict[str, float | None] = {"start": vmrss_mb(learner_pid), "max": 0.0}
    rss["max"] = rss["start"] or 0.0
    fds: dict[str, int | None] = {"start": open_fds(learner_pid), "max": 0}
    fds["max"] = fds["start"] or 0
    t0 = time.time()

    async def sample(until: float) -> None:
        while time.time() < until:
            v = vmrss_mb(learner_pid)
            if v is not None:
                rss["max"] = max(rss["max"] or 0.0, v)
            n = open_fds(learner_pid)
            if n is not None:
                fds["max"] = max(fds["max"] or 0, n)
            await trio.sleep(0.25)

    async def run_attack() -> None:
        try:
            await ATTACKS[name](target, stats)
        except Exception as exc:  # noqa: BLE001 - an attacker that broke is reported, not fatal
            stats["attacker_crashed"] = leaves(exc)

    cpu0 = os.times()
    async with trio.open_nursery() as nursery:
        if name in ATTACKS:
            nursery.start_soon(run_attack)
        await sample(t0 + seconds)
        nursery.cancel_scope.cancel()
    t1 = time.time()
    await sample(t1 + AFTER_S)
    cpu1 = os.times()
    stats["attacker_cpu_s"] = round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), 2)
    return {"t0": t0, "t1": t1, "rss": rss, "fds": fds, "attack": stats}


def leaves(exc: BaseException) -> list[str]:
    """The innermost exceptions of `exc` (through exception groups), one line each."""
    if isinstance(exc, BaseExceptionGroup):
        return [line for inner in exc.exceptions for line in leaves(inner)]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return [f"{type(exc).__name__}: {str(exc)[:300]}{at}"]


def window_rate(records: list[dict[str, Any]], t0: float, t1: float) -> tuple[int, float]:
    """(rollouts trained, seconds) between the last train record at or before t0 and the last at
    or before t1."""
    before = [r for r in records if r["wall"] <= t0]
    upto = [r for r in records if r["wall"] <= t1]
    if not upto:
        return 0, 0.0
    base = before[-1] if before else records[0]
    end = upto[-1]
    return int(end["trained"]) - int(base["trained"]), float(end["wall"]) - float(base["wall"])


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_class(name: str, seconds: float, peers: int, root: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    hs = HostileSwarm(root / name, f"hostile-{name}", peers, SETUPS.get(name))
    out: dict[str, Any] = {"class": name}
    window: dict[str, Any] | None = None
    alive: dict[str, bool] = {}
    try:
        hs.start()
        hs.wait_warm()
        assert hs.learner is not None
        target = Target(hs.ready, hs.run_id, metrics_port=hs.metrics_port, window_s=seconds, swarm=hs)
        window = trio.run(attack_window, name, target, hs.learner.proc.pid, seconds)
        alive = {c.name: c.proc.poll() is None for c in hs.honest()}
    except Exception as exc:  # noqa: BLE001 - a swarm that failed to come up is reported
        out["error"] = "".join(traceback.format_exception_only(exc)).strip()
        alive = {c.name: c.proc.poll() is None for c in hs.swarm.children if c.name != "bootstrap" and c.name not in hs.attacker_peers}
    finally:
        codes = hs.stop()
    out["alive_at_end"] = alive
    out["exit_codes"] = codes
    # 143 (or -SIGTERM) is every role's answer to the SIGTERM stop (the learner's summary written).
    out["all_alive"] = bool(alive) and all(alive.values())
    summary_path = hs.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if window is not None:
        rss = window["rss"]
        out["learner_rss_mb"] = {
            "start": round(rss["start"], 1) if rss["start"] is not None else None,
            "max": round(rss["max"], 1),
            "growth": round(rss["max"] - rss["start"], 1) if rss["start"] is not None else None,
        }
        fds = window["fds"]
        out["learner_fds"] = {**fds, "growth": fds["max"] - fds["start"] if fds["start"] is not None else None}
        attackers = set(window["attack"].get("attackers", []))
        trained, secs = window_rate(hs.records(), window["t0"], window["t1"])
        attacker_accepted = 0
        if summary is not None:
            attacker_accepted = sum(int(v["accepted"]) for p, v in summary["peers"].items() if p in attackers)
        out["window_s"] = round(secs, 2)
        out["window_trained"] = trained
        # The share of the window the learner spent waiting for rollouts: near 0, the learner is
        # the bottleneck (the attack costs it time); high, its peers are (e.g. an attacker's CPU
        # on the peers' core, where this benchmark pins attackers).
        waits = [r for r in hs.records() if window["t0"] < r["wall"] <= window["t1"]]
        out["learner_wait_share"] = round(sum(float(r.get("wait_s", 0.0)) for r in waits) / secs, 3) if secs > 0 else None
        out["attacker_accepted"] = attacker_accepted
        out["honest_rate"] = round(max(0, trained - attacker_accepted) / secs, 2) if secs > 0 else None
        out["attack"] = {k: v for k, v in window["attack"].items() if k not in ("data_addr",)}
        if len(attackers) > 16:  # ban_flood's thousands of identities: their number is enough
            out["attack"]["attackers"] = len(attackers)
    dials = hs.dials_refused()
    if dials is not None:
        out["learner_dials_refused"] = dials
    if summary is not None:
        attackers = set(window["attack"].get("attackers", [])) if window is not None else set()
        honest = {p: v for p, v in summary["peers"].items() if p not in attackers}
        out["honest_accepted"] = sum(int(v["accepted"]) for v in honest.values())
        out["honest_rate_run"] = round(out["honest_accepted"] / summary["wall_s"], 2) if summary["wall_s"] else None
        out["honest_peers_accepting"] = sum(1 for v in honest.values() if int(v["accepted"]) > 0)
        for key in ("versions", "rollouts_received", "rollouts_accepted", "rollouts_dropped", "banned", "penalties",
                    "lost_messages", "train_errors", "wall_s"):
            out[key] = summary.get(key)
        out["banned_count"] = len(out["banned"] or ())
        for key in ("banned", "penalties"):  # ban_flood's thousands of identities: their number
            if out[key] is not None and len(out[key]) > 16:
                out[key] = len(out[key])
    else:
        out["summary"] = "missing: the learner wrote no summary.json"
    # Any honest process that died or failed: its log tail (where a traceback would be).
    failures = {}
    for c in hs.swarm.children:
        if c.name == "bootstrap" or c.name in hs.attacker_peers:
            continue
        died = not alive.get(c.name, False)
        bad_code = c.proc.returncode not in (0, 130, -signal.SIGTERM, 143)
        if died or bad_code or (c.name == "learner" and summary is None):
            failures[c.name] = tail(hs.logs / f"{c.name}.log")
    if failures:
        out["failure_logs"] = failures
    out["logs"] = str(hs.logs)
    out["class_wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 2) if known else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma list among {','.join(CLASSES)} (clean is the baseline)")
    p.add_argument("--seconds", type=float, default=40.0, help="attack window per class (the clean run's window too)")
    p.add_argument("--peers", type=int, default=2, help="honest rollout peers")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--keep", type=Path, default=None, help="keep the swarms' run dirs under this folder")
    args = p.parse_args(argv)
    classes = [c for c in args.classes.split(",") if c]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        p.error(f"unknown classes {unknown}; choose among {CLASSES}")
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, OTHER_CPUS)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        root = args.keep or Path(tmp)
        # The baseline runs first and again last: the machine's speed drifts between runs, and
        # the spread of the two says how much of a ratio is noise.
        runs = [(name, name) for name in classes] + ([("clean_end", "clean")] if "clean" in classes else [])
        for key, name in runs:
            print(f"hostile: {key} ...", file=sys.stderr, flush=True)
            results[key] = run_class(name, args.seconds, args.peers, root / f"{key}-{int(time.time())}")
            r = results[key]
            print(f"hostile: {key}: alive={r.get('all_alive')} rate={r.get('honest_rate')} rss={r.get('learner_rss_mb')} "
                  f"({r['class_wall_s']} s)", file=sys.stderr, flush=True)
    cleans = [results[k] for k in ("clean", "clean_end") if k in results]
    base = _mean([r.get("honest_rate") for r in cleans])
    base_run = _mean([r.get("honest_rate_run") for r in cleans])
    rates = [r.get("honest_rate") for r in cleans]
    clean_spread = round(abs(rates[0] - rates[1]) / base, 3) if len(rates) == 2 and base and None not in rates else None
    verdicts = {}
    for name, r in results.items():
        rate = r.get("honest_rate")
        r["rate_ratio"] = round(rate / base, 3) if base and rate is not None else None
        r["rate_ratio_run"] = round(r["honest_rate_run"] / base_run, 3) if base_run and r.get("honest_rate_run") is not None else None
        growth = (r.get("learner_rss_mb") or {}).get("growth")
        checks = {
            "all_alive": bool(r.get("all_alive")),
            "rate_ratio_ok": r["rate_ratio"] is not None and r["rate_ratio"] >= TARGETS["rate_ratio_min"],
            "rss_growth_ok": growth is not None and growth <= TARGETS["rss_growth_mb_max"],
        }
        verdicts[name] = {**checks, "pass": all(checks.values())}
    out = {
        "benchmark": "hostile",
        "command": "python -m benchmarks.hostile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": args.seconds,
        "honest_peers": args.peers,
        "pinning": {"learner": sorted(LEARNER_CPUS), "bootstrap_peers_attackers": sorted(OTHER_CPUS)},
        "targets": TARGETS,
        "baseline": {"honest_rate": base, "honest_rate_run": base_run, "clean_spread": clean_spread},
        "verdicts": verdicts,
        "classes": results,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(out, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
