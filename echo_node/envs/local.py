"""An agentic run on one machine without a network: a rollout peer process and a learner process
over pipes (what benchmarks/agentic.py measures; a swarm runs episodes over libp2p, and
`echo-node demo --task ENV` starts one).

The peer plays the environment (echo_node/envs/peer.py: the embedded model in a TorchEngine,
each group's seed its slot's draw) and sends sealed episode batches; the learner opens each with
its `EpisodeGate` (budgets, versions, staleness, the re-run of every episode), trains GRPO steps
on the masked episodes and sends the new weights back, pull or async, at a given environment
latency (a sleep added to every step, as a remote tool or sandbox costs).

- pull: the peer plays one batch on the learner's newest version, the learner waits for it, trains
  and publishes the next version: each side waits while the other works.
- async: the peer plays batches back to back, taking the newest weights between batches; the
  learner checks batches (the re-run) in a thread while it trains, trains on whatever is
  admissible (staleness S) and drops the rest as stale.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

RUN = "agentic-local"
GROUP_SIZE = 4
GROUPS_PER_STEP = 4
STALENESS = 2
# The learning rate: the RL default of the embedded model (at 1e-3 the calc environment's
# reward fell from 0.08 to 0.003 in 44 updates).
LR = 1e-4
# The built-in environment's options when none are given.
CALC_OPTIONS: dict[str, Any] = {"problems": 2}


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


def _spec(env: str, options: dict[str, Any], latency_s: float) -> Any:
    """The environment, loaded as `[env]` would load it, with `latency_s` added to every step."""
    from echo_node.config import load_config
    from echo_node.envs import Message, Step, load_env

    spec = load_env(load_config(None, env__name=env, env__options=options, env__step_timeout_s=30.0 + latency_s))
    if latency_s <= 0:
        return spec
    inner = spec.factory

    class Slow:
        deterministic = spec.deterministic
        reward_range = spec.reward_range

        def __init__(self) -> None:
            self.env = inner()

        def reset(self, seed: int) -> Message:
            return self.env.reset(seed)

        def step(self, action: str) -> Step:
            time.sleep(latency_s)
            return self.env.step(action)

    return dataclasses.replace(spec, factory=Slow)


def peer_main(
    mode: str, env: str, options: dict[str, Any], latency_s: float, seed_bytes: bytes, frames: Connection, weights: Connection
) -> None:
    from echo_node.envs.format import CharFormat
    from echo_node.envs.peer import play_batch
    from echo_node.ml.engine import TorchEngine
    from protocol.identity import Identity

    _pin(1)
    model, tok = _policy()
    engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    fmt, spec, ident = CharFormat(tok), _spec(env, options, latency_s), Identity.from_seed(seed_bytes)
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


def learner_run(
    mode: str,
    latency_s: float,
    seconds: float,
    *,
    env: str = "calc",
    options: dict[str, Any] | None = None,
    lr: float = LR,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the peer process and this learner for `seconds` after the first batch; the summary."""
    from echo_node.envs.format import CharFormat
    from echo_node.envs.gate import EpisodeGate
    from echo_node.ml.grpo import PolicyOptimizer
    from echo_node.ml.model import state_to_bytes
    from protocol.identity import Identity

    _pin(0)
    model, tok = _policy()
    seed_bytes = os.urandom(32)
    peer_id = Identity.from_seed(seed_bytes).peer_id
    options = dict(CALC_OPTIONS if options is None and env == "calc" else options or {})
    gate = EpisodeGate(spec=_spec(env, options, latency_s), fmt=CharFormat(tok), run_id=RUN, group_size=GROUP_SIZE,
                       vocab_size=tok.vocab_size, staleness=STALENESS, mode=mode)
    opt = PolicyOptimizer(model, lr=lr, pad_id=tok.pad_id)
    ctx = mp.get_context("spawn")
    frames_rx, frames_tx = ctx.Pipe(duplex=False)
    weights_rx, weights_tx = ctx.Pipe(duplex=False)
    peer = ctx.Process(target=peer_main, args=(mode, env, options, latency_s, seed_bytes, frames_tx, weights_rx), daemon=True)
    peer.start()
    version = 0
    weights_tx.send((state_to_bytes(model), version))
    buffer: list[Any] = []
    counts: dict[str, int] = {}
    idle = train = 0.0
    verify = [0.0]  # added to by whichever thread checks batches
    episodes = steps = 0
    rewards: list[float] = []
    t0: float | None = None

    def admit(frame: bytes | None, dropped: dict[str, int]) -> list[Any]:
        """The groups of one batch the gate admits (the re-run included), drops counted."""
        for reason, n in dropped.items():
            counts[f"peer_{reason}"] = counts.get(f"peer_{reason}", 0) + n
        if frame is None:
            return []
        v0 = time.monotonic()
        adm = gate.check(frame, peer_id, current_version=version)
        verify[0] += time.monotonic() - v0
        if adm.drop is not None:
            counts[str(adm.drop)] = counts.get(str(adm.drop), 0) + 1
            if mode == "pull":  # the peer waits for weights before its next batch
                weights_tx.send((state_to_bytes(model), version))
            return []
        return list(adm.groups)

    # Async: batches are checked in a thread while the learner trains, as the swarm's learner
    # re-runs episodes off its train loop (echo_node/learner/intake.py); pull has nothing to
    # overlap (the batch it trains on is the one being checked).
    checked: queue.SimpleQueue[tuple[float, list[Any]]] = queue.SimpleQueue()
    stop = threading.Event()

    def check_loop() -> None:
        while not stop.is_set():
            if frames_rx.poll(0.05):
                frame, dropped = frames_rx.recv()
                arrived = time.monotonic()
                checked.put((arrived, admit(frame, dropped)))

    checker = threading.Thread(target=check_loop, name="episode-checks", daemon=True)
    if mode == "async":
        checker.start()
    try:
        while t0 is None or time.monotonic() - t0 < seconds:
            w = time.monotonic()
            if mode == "async":
                try:
                    arrived, groups = checked.get(timeout=1.0)
                except queue.Empty:
                    continue
            else:
                frame, dropped = frames_rx.recv()
                arrived = time.monotonic()
                groups = admit(frame, dropped)
            if t0 is None:
                t0 = arrived  # the clock starts with the first batch: start-up is not idle
            else:
                idle += max(0.0, min(time.monotonic(), arrived) - w)
            buffer.extend(groups)
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
            if on_step is not None:
                on_step({"version": version, "reward_mean": stats["reward_mean"], "t": time.monotonic() - (t0 or 0.0)})
    finally:
        stop.set()
        if checker.is_alive():
            checker.join(30)
        weights_tx.send("stop")
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    wall = time.monotonic() - (t0 or time.monotonic())
    busy = verify[0] + train
    return {
        "mode": mode, "latency_ms": round(latency_s * 1000), "seconds": round(wall, 2), "steps": steps,
        "episodes_per_s": round(episodes / wall, 3), "learner_idle": round(idle / wall, 4),
        # The re-run's time (most of it the environment's latency) over the learner's checks and
        # steps, and over its wall time (in async they overlap, so the two shares can sum past 1).
        "verify_share_of_busy": round(verify[0] / busy, 4) if busy else None,
        "verify_share_of_wall": round(verify[0] / wall, 4) if wall else None,
        "verify_s": round(verify[0], 3), "train_s": round(train, 3),
        "reward_first": _mean(rewards[:10]), "reward_last": _mean(rewards[-10:]),
        "drops": counts,
    }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None
