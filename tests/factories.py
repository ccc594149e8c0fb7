"""Builders for protocol objects used across test layers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import trio

from echo_node.ml.tasks import get_task
from echo_node.ml.tokenizer import CharTokenizer
from protocol import Identity, RolloutBatch, RolloutGroup, Sample, encode_frame, seal
from protocol.assignment import prompt_draw
from protocol.framing import decode_frame

if TYPE_CHECKING:
    from echo_node.learner.learner import Learner
    from echo_node.policy import Policy

ALICE = Identity.from_seed(b"\x0a" * 32)
MALLORY = Identity.from_seed(b"\x0b" * 32)


@asynccontextmanager
async def learner_tasks(learner: Learner) -> AsyncIterator[None]:
    """The nursery `Learner.run` lends the learner's own background work (checkpoint writes),
    for a test that drives `update` itself; leaving waits for that work. An exception that is
    alone in the nursery's group comes out bare, as the test's own code raised it."""
    outer = learner._nursery
    try:
        async with trio.open_nursery() as nursery:
            learner._nursery = nursery
            yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        learner._nursery = outer


# A second honest publisher for learner tests (ALICE is the first).
BOB = Identity.from_seed(b"\x0c" * 32)
# Learners `new_learner` made, for a fixture to close the metrics files of (a test that crashes
# one on purpose never closes it itself).
CREATED: list[Learner] = []


def new_learner(runs_dir: Path, *, groups_per_step: int = 2, checkpoint_every: int = 3, **cfg: Any) -> Learner:
    """A learner of run "run-1" on the embedded toy policy (verification off, S = 4), whose
    libp2p host is not started: its announcements go nowhere."""
    from echo_node.config import CheckpointConfig, RLConfig, RunConfig, VerifyConfig
    from echo_node.learner.learner import Learner
    from echo_node.ml.model import build_model, tiny_llama_config
    from echo_node.policy import Policy

    cfg.setdefault("checkpoint", CheckpointConfig(every_versions=checkpoint_every, min_interval_s=0))
    config = RunConfig(
        run_id="run-1", runs_dir=runs_dir, verify=VerifyConfig(enabled=False),
        rl=RLConfig(groups_per_step=groups_per_step, staleness=4), **cfg,
    )
    tok = CharTokenizer()
    arch = tiny_llama_config(tok.vocab_size)
    policy = Policy(build_model(arch), tok, get_task("addition"), {"kind": "embedded", **arch}, tok.to_dict())
    learner = Learner(config, Identity.from_seed(b"\x01" * 32), policy)

    async def announce(topic: str, data: bytes) -> None:  # the host is not started
        pass

    learner.node.publish = announce  # type: ignore[method-assign]
    CREATED.append(learner)
    return learner


async def start_learner(learner: Learner, peers: tuple[Identity, ...] = (ALICE, BOB)) -> None:
    """What `Learner.run` does before it serves: resume (or start), publish the version; then
    `peers` join."""
    blob = learner._start()
    await learner._publish_version(blob)
    for peer in peers:
        learner.peers.join(peer.peer_id, trio.current_time())


async def closed_port() -> int:
    """A loopback TCP port nothing listens on (bound, then released)."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


async def silent_listener(nursery: trio.Nursery) -> int:
    """A loopback TCP port that accepts connections and never says a word (until `nursery` ends)."""

    async def hold(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def closed_by_server(streams: list[trio.SocketStream], *, wait_s: float = 0.01) -> int:
    """How many of `streams` the server at their other end has closed (a read sees the end, or
    a reset, within `wait_s`)."""
    closed = 0
    for stream in streams:
        with trio.move_on_after(wait_s):
            try:
                if await stream.receive_some(1) == b"":
                    closed += 1
            except trio.BrokenResourceError:
                closed += 1
    return closed


# The default run's tokenizer: bos=1, eos=2, digit d = 3 + d, '+' = 13, '=' = 14.
TOKENIZER = CharTokenizer()
TASK = get_task("addition")


def prompt_ids(prompt: str) -> tuple[int, ...]:
    return tuple(TOKENIZER.encode_prompt(prompt))


def answer_ids(prompt: str) -> tuple[int, ...]:
    """The right completion of `prompt` on the default run: its answer, then eos."""
    return (*TOKENIZER.encode(TASK.answer(prompt)), TOKENIZER.eos_id)


def assigned_prompt(run_id: str, identity: Identity, seq: int, index: int) -> str:
    """The prompt the run assigns group `index` of `identity`'s batch `seq`."""
    return TASK.prompt_for(prompt_draw(run_id, identity.peer_id, seq, index))


def offer(learner: Any, data: bytes, origin: str, forwarder: str | None = None) -> bool:
    """What a learner's gossip path does with one message: validate, and deliver what passes."""

    async def go() -> bool:
        if not learner.intake.validate(forwarder or origin, origin, data):
            return False
        await learner.intake.deliver(data, origin)
        return True

    return bool(trio.run(go))


def make_group(
    *,
    n: int = 0,
    prompt: str = "23+01=",
    version: int = 0,
    samples: int = 8,
    tokens: int = 4,
    rewards: list[float] | None = None,
) -> RolloutGroup:
    """A group of `samples` completions of `tokens` tokens for `prompt`, every token sampled at
    `version`, named f"g{n}". Honest by default: with 4 tokens the odd samples give the right
    answer, and every reward is the one the default run's task gives (the learner re-scores
    them). Its log-probs are not a model's: a learner that spot-checks them refuses it."""
    answer = answer_ids(prompt)
    completions = [
        answer if tokens == len(answer) and s % 2 else tuple(3 + (s + t) % 10 for t in range(tokens - 1)) + (2,)
        for s in range(samples)
    ]
    if rewards is None:
        rewards = [1.0 if c == answer else 0.0 for c in completions]
    return RolloutGroup(
        group_id=f"g{n}",
        prompt_ids=prompt_ids(prompt),
        samples=tuple(
            Sample(
                completion_ids=c,
                behaviour_logprobs=tuple(-0.5 for _ in range(tokens)),
                token_versions=(version,) * tokens,
                reward=rewards[s],
            )
            for s, c in enumerate(completions)
        ),
    )


def make_batch(
    *,
    run_id: str = "run-1",
    identity: Identity = ALICE,
    seq: int = 0,
    groups: int = 1,
    version: int = 0,
    **group_kw: Any,
) -> RolloutBatch:
    """A batch of `groups` groups made by `make_group(**group_kw)` on the prompts the run assigns
    them, published as `identity`."""
    return RolloutBatch(
        run_id=run_id,
        peer_id=identity.peer_id,
        seq=seq,
        groups=tuple(
            make_group(n=seq * 1000 + i, prompt=assigned_prompt(run_id, identity, seq, i), version=version, **group_kw)
            for i in range(groups)
        ),
    )


def _fields(frame: bytes) -> list[Any]:
    return msgpack.unpackb(decode_frame(frame))


def _reframe(fields: list[Any]) -> bytes:
    return encode_frame(msgpack.packb(fields, use_bin_type=True))


def bad_rollout_messages(identity: Identity, run_id: str, *, seq0: int = 1000) -> list[tuple[str, bytes, str, int]]:
    """(name, gossip payload, drop reason the learner must count, rollouts counted) per attack.

    Each is something a broken or hostile peer could publish as `identity` on the rollouts topic.
    """
    sealed = seal(make_batch(run_id=run_id, identity=identity, seq=seq0), identity)
    fields = _fields(sealed)
    bad_sig = bytearray(fields[4])
    bad_sig[0] ^= 0x01
    return [
        ("garbage bytes", b"\x00\xffnot a frame at all" * 3, "malformed", 1),
        ("truncated frame", sealed[: len(sealed) // 2], "malformed", 1),
        ("oversize frame", b"\x28\xb5\x2f\xfd" + bytes(300_000), "malformed", 1),
        ("bad signature", _reframe([*fields[:4], bytes(bad_sig)]), "bad_signature", 1),
        ("wrong schema version", _reframe([99, *fields[1:]]), "unsupported_schema", 1),
        ("wrong run id", seal(make_batch(run_id="another-run", identity=identity, seq=seq0 + 1), identity), "wrong_run", 8),
        ("version that never existed", seal(make_batch(run_id=run_id, identity=identity, seq=seq0 + 2, version=10**6), identity), "future_version", 8),
        # Valid for the wire, not for the run: each once ended or stalled the learner's step.
        ("token outside the vocabulary", seal(_reshaped(run_id, identity, seq0 + 3, token=5000), identity), "out_of_vocab", 8),
        ("prompt outside the vocabulary", seal(_reshaped(run_id, identity, seq0 + 4, prompt=(1, 70_000)), identity), "out_of_vocab", 8),
        ("256-token completions", seal(_reshaped(run_id, identity, seq0 + 5, length=256), identity), "too_long", 8),
        ("reward outside the task's range", seal(_reshaped(run_id, identity, seq0 + 6, reward=1e5), identity), "bad_reward", 8),
    ]


def _reshaped(
    run_id: str, identity: Identity, seq: int, *, token: int = 3, prompt: tuple[int, ...] = (1, 5), length: int = 2,
    reward: float = 1.0,
) -> RolloutBatch:
    """A well-formed batch of one 8-sample group whose tokens, prompt or reward break a run's
    bounds (the default run: tiny model, 4 new tokens, rewards in [0, 1])."""
    group = RolloutGroup(
        group_id="hostile",
        prompt_ids=prompt,
        samples=tuple(
            Sample(completion_ids=(token,) * length, behaviour_logprobs=(-0.5,) * length, token_versions=(0,) * length, reward=reward)
            for _ in range(8)
        ),
    )
    return RolloutBatch(run_id=run_id, peer_id=identity.peer_id, seq=seq, groups=(group,))


def sampled_reward(policy: Policy, *, prompts: int = 256, group_size: int = 4) -> float:
    """The mean reward `policy`'s model earns on its task's first `prompts` prompts (draws
    0...), `group_size` samples each at the default temperature, under sampling seed 0. Two
    models compared this way answer the same prompts with the same noise: the difference is the
    models', not which prompts each drew (what makes the sampled reward of a run's own updates a
    noisy measure of learning)."""
    from echo_node.ml import defaults
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.rollout import generate_groups

    tok = policy.tokenizer
    engine = TorchEngine(policy.model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    groups = generate_groups(engine, tok, policy.task, [policy.task.prompt_for(i) for i in range(prompts)],
                             group_size=group_size, temperature=defaults.RL.temperature, seed=0)
    rewards = [r for g in groups for r in g.rewards]
    return sum(rewards) / len(rewards)


def reward_gain(records: list[dict[str, Any]]) -> float:
    """The mean reward of a run's last quarter of updates minus its first quarter's, from its
    `train` records. One update's reward is too noisy to compare with another's (on the embedded
    task its standard deviation about the trend is several times the trend's gain per version);
    a quarter's mean is not."""
    rewards = [float(r["reward_mean"]) for r in sorted(records, key=lambda r: int(r["version"]))]
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k
