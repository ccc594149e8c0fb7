"""Agentic RL throughput: episodes/s and learner idle, pull vs async, as the environment slows.

Two processes, pinned one core each: a rollout peer playing the built-in calculator environment
(echo_node/envs: the embedded model in a TorchEngine, `play_batch`, environment steps bounded in
threads) and a learner (`EpisodeGate`: envelope, budgets, versions, the re-run of every episode,
then a GRPO step on the masked episodes). Sealed episode batches go peer -> learner and weights
learner -> peer over pipes; no network, so what differs between the runs is the sync mode and
the environment's latency, added to every `step` (a sleep, as a remote tool or sandbox costs):

- pull: the peer plays one batch on the learner's newest version, the learner waits for it, trains
  and publishes the next version: each side waits while the other works.
- async: the peer plays batches back to back, taking the newest weights between batches; the
  learner trains on whatever is admissible (staleness S) and drops the rest as stale.

Reported per (mode, latency): episodes trained per second, the learner's idle share (waiting for
a batch / wall), and the share of the learner's busy time spent verifying episodes (the re-run).
The ratios async / pull are per latency.

    .venv/bin/python -m benchmarks.agentic                    # 0, 50, 500 ms; 20 s per run
    .venv/bin/python -m benchmarks.agentic --latency-ms 0 50 --seconds 10

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

RUN = "agentic-bench"
GROUP_SIZE = 4
GROUPS_PER_STEP = 4
STALENESS = 2
PROBLEMS = 2


def _pin(core: int) -> None:
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def _policy() -> tuple[Any, Any]:
    from echo_node.ml import defaults
    from echo_node.ml.model import build_model, tiny_llama_config
    from echo_node.ml.tasks import AdditionTask
    from echo_node.ml.tokenizer import CharTokenizer
    from echo_node.ml.warmup import warmup

    tok = CharTokenizer()
    model = build_model(tiny_llama_config(tok.vocab_size), seed=0)
    warmup(model, tok, AdditionTask(), config=defaults.WARMUP, cache_dir=Path.home() / ".cache" / "echo-node")
    return model, tok


def _spec(latency_s: float) -> Any:
    from echo_node.config import load_config
    from echo_node.envs import Step, load_env
    from echo_node.envs.calc import CalcEnv

    class SlowCalc(CalcEnv):
        def step(self, action: str) -> Step:
            time.sleep(latency_s)
            return super().step(action)

    spec = load_env(load_config(None, env__name="calc", env__options={"problems": PROBLEMS}, env__step_timeout_s=30.0))
    return dataclasses.replace(spec, factory=lambda: SlowCalc(problems=PROBLEMS))


def peer_main(mode: str, latency_s: float, seed_bytes: bytes, frames: Connection, weights: Connection) -> None:
    from echo_node.envs.format import CharFormat
    from echo_node.envs.peer import play_batch
    from echo_node.ml.engine import TorchEngine
    from protocol.identity import Identity

    _pin(1)
    model, tok = _policy()
    engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    fmt, spec, ident = CharFormat(tok), _spec(latency_s), Identity.from_seed(seed_bytes)
    seq = 0
    while True:
        if mode == "pull" or not weights.poll():
            msg = weights.recv() if mode == "pull" or engine.version < 0 else None
        else:
            msg = None
        while weights.poll():  # async: the newest weights that arrived, between batches
            msg = weights.recv()
        if msg == "stop":
            return
        if msg is not None:
            state, version = msg
            engine.load_weights(state, version)
        played = play_batch(engine, fmt, spec, run_id=RUN, identity=ident, seq=seq, groups=GROUPS_PER_STEP,
                            group_size=GROUP_SIZE, temperature=1.0)
        seq += 1
        frames.send((played.frame, dict(played.dropped)))


def learner_run(mode: str, latency_s: float, seconds: float) -> dict[str, Any]:
    from echo_node.envs.format import CharFormat
    from echo_node.envs.gate import EpisodeGate
    from echo_node.ml.grpo import PolicyOptimizer
    from echo_node.ml.model import state_to_bytes
    from protocol.identity import Identity

    _pin(0)
    model, tok = _policy()
    seed_bytes = os.urandom(32)
    peer_id = Identity.from_seed(seed_bytes).peer_id
    gate = EpisodeGate(spec=_spec(latency_s), fmt=CharFormat(tok), run_id=RUN, group_size=GROUP_SIZE,
                       vocab_size=tok.vocab_size, staleness=STALENESS, mode=mode)
    opt = PolicyOptimizer(model, lr=1e-4, pad_id=tok.pad_id)
    ctx = mp.get_context("spawn")
    frames_rx, frames_tx = ctx.Pipe(duplex=False)
    weights_rx, weights_tx = ctx.Pipe(duplex=False)
    peer = ctx.Process(target=peer_main, args=(mode, latency_s, seed_bytes, frames_tx, weights_rx), daemon=True)
    peer.start()
    version = 0
    weights_tx.send((state_to_bytes(model), version))
    buffer: list[Any] = []
    counts: dict[str, int] = {}
    idle = verify = train = 0.0
    episodes = steps = 0
    rewards: list[float] = []
    t0: float | None = None
    try:
        while t0 is None or time.monotonic() - t0 < seconds:
            w = time.monotonic()
            frame, dropped = frames_rx.recv()
            now = time.monotonic()
            if t0 is None:
                t0 = now  # the clock starts with the first batch: start-up is not idle
            else:
                idle += now - w
            for reason, n in dropped.items():
                counts[f"peer_{reason}"] = counts.get(f"peer_{reason}", 0) + n
            if frame is None:
                continue
            v0 = time.monotonic()
            adm = gate.check(frame, peer_id, current_version=version)
            verify += time.monotonic() - v0
            if adm.drop is not None:
                counts[str(adm.drop)] = counts.get(str(adm.drop), 0) + 1
                if mode == "pull":
                    weights_tx.send((state_to_bytes(model), version))
                continue
            buffer.extend(adm.groups)
            if len(buffer) < GROUPS_PER_STEP:
                continue
            s0 = time.monotonic()
            batch, buffer = buffer[:GROUPS_PER_STEP], buffer[GROUPS_PER_STEP:]
            stats = opt.step(batch)
            version += 1
            weights_tx.send((state_to_bytes(model), version))
            train += time.monotonic() - s0
            steps += 1
            episodes += sum(len(g.rewards) for g in batch)
            rewards.append(stats["reward_mean"])
    finally:
        weights_tx.send("stop")
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    wall = time.monotonic() - (t0 or time.monotonic())
    busy = verify + train
    return {
        "mode": mode, "latency_ms": round(latency_s * 1000), "seconds": round(wall, 2), "steps": steps,
        "episodes_per_s": round(episodes / wall, 3), "learner_idle": round(idle / wall, 4),
        "verify_share_of_busy": round(verify / busy, 4) if busy else None,
        "verify_s": round(verify, 3), "train_s": round(train, 3), "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "drops": counts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="measured time per run (default 20)")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0, 500.0], help="environment step latencies")
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = []
    for latency in args.latency_ms:
        for mode in ("pull", "async"):
            r = learner_run(mode, latency / 1000, args.seconds)
            print(json.dumps(r), flush=True)
            runs.append(r)
    ratios = {}
    for latency in args.latency_ms:
        by = {r["mode"]: r for r in runs if r["latency_ms"] == round(latency)}
        pull, asy = by["pull"]["episodes_per_s"], by["async"]["episodes_per_s"]
        ratios[f"{round(latency)}ms"] = round(asy / pull, 3) if pull else None
    print(json.dumps({"benchmark": "agentic", "async_over_pull_episodes_per_s": ratios, "runs": runs,
                      "group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "staleness": STALENESS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
