"""A swarm of honest peers under attack: does the learner keep training, alive and bounded?

Per attack class a fresh loopback swarm (the real `echo-node` binary: bootstrap, learner in async
mode, `--peers` honest rollout peers) warms up until every honest peer had rollouts accepted and
the learner published a few versions; then the attacker(s) run for `--seconds` inside this
process, on the real libp2p adapter (`echo_node.net.P2PNode`) and the real data channel, and
the swarm is stopped (peers SIGTERM, learner SIGINT: it writes its summary). The `clean` class
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

Measured per class:
- `alive`: every honest process (learner, peers) still running at the end of the window, and
  each one's exit code after the stop (learner: 130 on SIGINT with its summary written);
- `learner_rss_mb`: VmRSS of the learner at the start of the window, the max sampled every
  0.25 s during it and 3 s after, and the growth (max - start);
- `honest_rate`: honest rollouts trained per second in the window (train records of
  metrics.jsonl: `trained` delta over wall time, minus whatever the attackers had accepted),
  and `honest_rate_run`: sum of `accepted` over the honest peers in summary.json / summary
  `wall_s` (the whole run, warm-up included); ratios are against `clean`;
- the summary's `rollouts_dropped`, `banned`, `penalties`, and what the attacker saw.

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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from echo_node.demo import Child, Swarm, _is_ready, _wait_line
from echo_node.metrics import read_metrics
from echo_node.net import rpc
from echo_node.net.discovery import PeerAddr
from echo_node.net.framing import read_frame, write_frame
from echo_node.net.p2p import P2PNode
from echo_node.topics import rollouts_topic
from protocol import Identity, JoinRequest, JoinResponse, seal
from protocol.framing import encode_length_prefixed
from protocol.messages import StatusRequest, StatusResponse
from protocol.weights.datachannel import FULL, MAX_WIRE_FRAME, Get, ManifestFrame, decode_frame, encode, make_hello
from protocol.weights.manifest import open_manifest
from tests.factories import bad_rollout_messages, make_batch

CLASSES = ["clean", "bad_rollouts", "sybil_status", "data_get_flood", "data_bad_frames", "repair_stall"]
LEARNER_CPUS, OTHER_CPUS = {0}, {1}
TARGETS = {"rate_ratio_min": 0.9, "all_alive": True, "rss_growth_mb_max": 50.0}
WARM_VERSIONS = 3
WARM_TIMEOUT_S = 240.0
AFTER_S = 3.0


# --- the swarm ----------------------------------------------------------------------------------


def vmrss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class HostileSwarm:
    def __init__(self, root: Path, run_id: str, peers: int) -> None:
        self.root = root
        self.run_id = run_id
        self.swarm = Swarm(root / "swarm")
        self.keys = root / "keys"
        self.runs = root / "runs"
        self.n_peers = peers
        self.learner: Child | None = None
        self.peers: list[Child] = []
        self.ready: dict[str, Any] = {}

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
        self.learner = self.swarm.spawn(
            "learner",
            ["learn", *common, "--key-file", str(self.keys / "learner.key"), "--mode", "async", "--staleness", "4",
             "--seconds", "3600"],
            cpus=LEARNER_CPUS,
        )
        self.ready = json.loads(_wait_line(self.learner, _is_ready, 240, "ready"))
        self.peers = [
            self.swarm.spawn(f"peer{i}", ["join", *common, "--key-file", str(self.keys / f"peer{i}.key")], cpus=OTHER_CPUS)
            for i in range(self.n_peers)
        ]

    def records(self, event: str = "train") -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in read_metrics(path) if r.get("event") == event]

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
    """What an attacker knows of the learner: its ready line (peer id and addresses) and run."""

    def __init__(self, ready: dict[str, Any], run_id: str) -> None:
        self.peer_id = str(ready["peer_id"])
        self.addrs = tuple(str(a) for a in ready["addrs"])
        self.run_id = run_id


async def start_node(nursery: trio.Nursery, target: Target, identity: Identity) -> P2PNode:
    node = P2PNode(identity)
    await nursery.start(node.run)
    with trio.fail_after(30):
        await node.connect(PeerAddr(target.peer_id, target.addrs))
    return node


async def join(node: P2PNode, target: Target) -> JoinResponse:
    request = JoinRequest(run_id=target.run_id, peer_id=node.peer_id, data_host="127.0.0.1", data_port=9)
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


ATTACKS: dict[str, Callable[[Target, dict[str, Any]], Awaitable[None]]] = {
    "bad_rollouts": attack_bad_rollouts,
    "sybil_status": attack_sybil_status,
    "data_get_flood": attack_data_get_flood,
    "data_bad_frames": attack_data_bad_frames,
    "repair_stall": attack_repair_stall,
}


# --- one class ----------------------------------------------------------------------------------


async def attack_window(name: str, target: Target, learner_pid: int, seconds: float) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    rss = {"start": vmrss_mb(learner_pid), "max": 0.0}
    rss["max"] = rss["start"] or 0.0
    t0 = time.time()

    async def sample(until: float) -> None:
        while time.time() < until:
            v = vmrss_mb(learner_pid)
            if v is not None:
                rss["max"] = max(rss["max"], v)
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
    return {"t0": t0, "t1": t1, "rss": rss, "attack": stats}


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
    hs = HostileSwarm(root / name, f"hostile-{name}", peers)
    out: dict[str, Any] = {"class": name}
    window: dict[str, Any] | None = None
    alive: dict[str, bool] = {}
    try:
        hs.start()
        hs.wait_warm()
        assert hs.learner is not None
        target = Target(hs.ready, hs.run_id)
        window = trio.run(attack_window, name, target, hs.learner.proc.pid, seconds)
        alive = {c.name: c.proc.poll() is None for c in hs.honest()}
    except Exception as exc:  # noqa: BLE001 - a swarm that failed to come up is reported
        out["error"] = "".join(traceback.format_exception_only(exc)).strip()
        alive = {c.name: c.proc.poll() is None for c in hs.swarm.children if c.name != "bootstrap"}
    finally:
        codes = hs.stop()
    out["alive_at_end"] = alive
    out["exit_codes"] = codes
    # Learner: 130 is its answer to the SIGINT stop (summary written); peers: answer to SIGTERM.
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
        attackers = set(window["attack"].get("attackers", []))
        trained, secs = window_rate(hs.records(), window["t0"], window["t1"])
        attacker_accepted = 0
        if summary is not None:
            attacker_accepted = sum(int(v["accepted"]) for p, v in summary["peers"].items() if p in attackers)
        out["window_s"] = round(secs, 2)
        out["window_trained"] = trained
        out["attacker_accepted"] = attacker_accepted
        out["honest_rate"] = round(max(0, trained - attacker_accepted) / secs, 2) if secs > 0 else None
        out["attack"] = {k: v for k, v in window["attack"].items() if k not in ("data_addr",)}
    if summary is not None:
        attackers = set(out.get("attack", {}).get("attackers", []))
        honest = {p: v for p, v in summary["peers"].items() if p not in attackers}
        out["honest_accepted"] = sum(int(v["accepted"]) for v in honest.values())
        out["honest_rate_run"] = round(out["honest_accepted"] / summary["wall_s"], 2) if summary["wall_s"] else None
        out["honest_peers_accepting"] = sum(1 for v in honest.values() if int(v["accepted"]) > 0)
        for key in ("versions", "rollouts_received", "rollouts_accepted", "rollouts_dropped", "banned", "penalties",
                    "lost_messages", "train_errors", "wall_s"):
            out[key] = summary.get(key)
    else:
        out["summary"] = "missing: the learner wrote no summary.json"
    # Any honest process that died or failed: its log tail (where a traceback would be).
    failures = {}
    for c in hs.swarm.children:
        if c.name == "bootstrap":
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
