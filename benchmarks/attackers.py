"""Attacker rollout peers for benchmarks/verification.py: each a real `echo-node join` peer (it
joins, follows the weights, samples with the engine) whose published batches lie in one way.

    .venv/bin/python -m benchmarks.attackers CLASS [join options...]

Classes (the verification issue's a-f):
- `fake_rewards` (a): samples honestly, then claims wrong answers right and right ones wrong.
- `garbage` (b): random digits in place of each completion, fabricated log-probs (-20 a
  token), the rewards the garbage honestly earns (so only a spot check can tell).
- `other_model` (c): samples from its own perturbation of each version it loads (noise of
  std NOISE on every weight), claiming that version and its own model's log-probs.
- `cherry_picked` (d): answers easy prompts of its choosing ("AB+00=") instead of its slots'.
- `copier` (e): samples nothing; re-publishes the groups of other peers' batches it hears on
  the rollouts topic under its own key (its own seqs).
- `reordered_copier` (the adaptive attacker's): a copier that disguises each copy: the samples
  of a group in reverse order, every log-prob nudged down by 1e-3, the group renamed (what a
  copy fingerprint hashing samples in order, or hashing log-probs, would miss).
- `poison` (f): half of each group's completions replaced by the right answer with a bos token
  injected after its first digit (the tokenizer's decoding drops bos, so the reward is right),
  with the log-probs the current weights honestly give those tokens: plausible, rewarded, and
  teaching the policy to emit a token no honest sample would.
- `slot_picker` (g, the adaptive attacker's): samples and scores honestly, one group a batch, but
  publishes only the seqs whose assigned prompt it likes (first operand below 20) and leaves
  the others out, so it answers prompts of its choosing without forging one; it cannot repair
  the gaps.
- `rejoining_slot_picker`: a slot picker that samples each picked seq with that seq's own seed
  and joins the run again before publishing it (the gap a rejoin makes is no choice of the
  publisher's when it is a restart: a learner that excused it would excuse every pick).
  `paced_rejoining_slot_picker` waits between joins so that the learner's join rate refuses
  none of them.
- `stale_1`, `stale_5` (the adaptive attacker's): samples every batch on the weights it had 1
  (5) versions before the newest it loaded, with the newest's prompts and assigned seed, and
  claims the newest: version tags and log-probs recomputed under the newest weights (so the
  log-prob check passes). Before it saw enough versions it uses the oldest it kept; a batch
  sampled before it loaded a second version is honest, and its `published` line says so.
- `tempered`: samples at temperature 0.6 instead of the run's, claiming the log-probs the run's
  temperature gives its tokens (correct values, a sharper sampler).
- `greedy`: greedy picks, claiming the run's-temperature log-probs.
- `freeze` (benchmarks/hostile.py's `capacity_freeze`): honest, then silent on SIGUSR1 (or after
  `--after N` batches): it generates nothing more while its weight follower keeps sending
  heartbeats, a peer that looks present and free but delivers nothing.

`--after N`: honest for the first N batches, lying from then on (a peer that earns trust first:
past probation, only the spot rate catches it).

Key rotation after a ban (a new identity for free) is not a class here: benchmarks/verification.py
(`rotating`) restarts an attacker under a new key each time the learner catches it.

Each batch published is one JSON line on stdout: {"event": "published", "seq", "groups",
"lying", "wall", "peer", "ids"} (`ids`: its groups' ids, which the learner's `caught` record
names for the groups of a publisher it trained).
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch
import trio

from echo_node.cli import _config, _identity, _setup_logging, build_parser
from echo_node.ml.grpo import sequence_logprobs
from echo_node.ml.rollout import ScoredGroup, generate_groups
from echo_node.ml.tasks import Task
from echo_node.ml.tokenizer import Tokenizer
from echo_node.net.ratelimit import JOINS_PER_PEER
from echo_node.peer.rollout_peer import Generator, RolloutPeer
from echo_node.policy import Policy, set_threads
from echo_node.topics import rollouts_topic
from protocol import RolloutBatch, RolloutGroup, open_envelope
from protocol.assignment import batch_seed
from protocol.errors import RemoteProtocolError

log = logging.getLogger(__name__)
NOISE = 0.05


# --- the lies, on what a peer sampled (tests/adversarial/test_attack_classes.py uses them too) ---


def rescore(g: ScoredGroup, tokenizer: Tokenizer, task: Task) -> None:
    """The rewards `g`'s (changed) completions honestly earn."""
    g.completions = [tokenizer.decode(gen.completion_ids) for gen in g.generations]
    g.rewards = task.reward([g.prompt] * len(g.completions), g.completions)


def flip_rewards(groups: list[ScoredGroup]) -> None:
    """(a) Wrong answers claimed right, right ones wrong."""
    for g in groups:
        g.rewards = [1.0 - r for r in g.rewards]


def garbage(groups: list[ScoredGroup], tokenizer: Tokenizer, task: Task, rng: random.Random) -> None:
    """(b) Random digits for every completion, -20 per token claimed, rewards honestly earned."""
    digits = tokenizer.encode("0123456789")
    for g in groups:
        for gen in g.generations:
            n = len(gen.completion_ids)
            gen.completion_ids = [rng.choice(digits) for _ in range(n - 1)] + [tokenizer.eos_id]
            gen.logprobs = [-20.0] * n
        rescore(g, tokenizer, task)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """(c) Another model: noise of std NOISE on every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=gen))


def easy_prompts(n: int, rng: random.Random) -> list[str]:
    """(d) Prompts of the attacker's choosing: "AB+00=", whatever its slots assign."""
    return [f"{rng.randrange(100):02d}+00=" for _ in range(n)]


def poison(groups: list[ScoredGroup], policy: Policy, *, temperature: float, max_new_tokens: int) -> None:
    """(f) Every other completion becomes the right answer with a bos after its first digit,
    claimed with the log-probs `policy.model` (the weights it sampled on) gives those tokens."""
    tok, task = policy.tokenizer, policy.task
    assert tok.bos_id is not None
    for g in groups:
        answer = tok.encode(task.answer(g.prompt))
        poisoned = [answer[0], tok.bos_id, *answer[1:]][:max_new_tokens]
        rows = g.generations[1::2]
        with torch.no_grad():
            lp, _ = sequence_logprobs(policy.model, [g.prompt_ids] * len(rows), [poisoned] * len(rows), tok.pad_id, temperature=temperature)
        for i, gen in enumerate(rows):
            gen.completion_ids = list(poisoned)
            gen.logprobs = [min(0.0, x) for x in lp[i, : len(poisoned)].tolist()]
            gen.token_versions = [gen.token_versions[0]] * len(poisoned)
        rescore(g, tok, task)


# --- attacker peers -------------------------------------------------------------------------


class Attacker(Generator):
    """A generator that says what it published (the benchmark counts the attacker's batches),
    honest for its first `after` batches (a peer that earns trust first), lying from then on."""

    after = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.rng = random.Random(0)
        self.batches = 0
        publish = self.publisher.publish_groups

        async def announced(groups: Any, *, seq: int) -> None:
            lying = self.batch_lied()
            await publish(groups, seq=seq)
            self.batches += 1
            print(json.dumps({"event": "published", "seq": seq, "groups": len(groups), "lying": lying, "wall": time.time(),
                              "peer": self.publisher.identity.peer_id, "ids": [g.group_id for g in groups]}), flush=True)

        self.publisher.publish_groups = announced  # type: ignore[method-assign]

    @property
    def lying(self) -> bool:
        return self.batches >= self.after

    def batch_lied(self) -> bool:
        """Whether the batch about to be published lies (what its `published` line says)."""
        return self.lying


class FakeRewards(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        if self.lying:
            flip_rewards(groups)
        return groups


class Garbage(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        if self.lying:
            garbage(groups, self.session.policy.tokenizer, self.session.policy.task, self.rng)
        return groups


class OtherModel(Attacker):
    perturbed = -1

    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        if self.lying and self.engine.version != self.perturbed:  # new weights loaded: perturb them, once
            perturb(self.session.policy.model, self.engine.version)
            self.perturbed = self.engine.version
        return super()._generate(prompts, seed)


class CherryPicked(Attacker):
    def assigned_prompts(self, seq: int, wanted: int) -> list[str]:
        return easy_prompts(wanted, self.rng) if self.lying else super().assigned_prompts(seq, wanted)


class Copier(Attacker):
    async def run(self) -> None:
        node = self.publisher.node
        topic = rollouts_topic(self.spec.run_id)
        me = self.publisher.identity.peer_id
        # Its validator passes everything: py-libp2p validates our own messages too before
        # sending them, and a validator refusing them would keep the copies at home.
        await node.subscribe(topic, lambda forwarder, origin, data: True)
        async for msg in node.messages(topic):
            if msg.sender == me:
                continue
            try:
                batch, _ = open_envelope(msg.data, expected_kind=RolloutBatch, expected_sender=msg.sender)
            except RemoteProtocolError:
                continue
            assert isinstance(batch, RolloutBatch)
            await self.publisher.publish_groups(batch.groups, seq=self.publisher.seq)


class ReorderedCopier(Copier):
    """A copier whose copies differ from the original in everything a copier may change without
    changing what is trained: sample order, log-probs (nudged), the group's name."""

    async def run(self) -> None:
        publish = self.publisher.publish_groups

        async def disguised(groups: Any, *, seq: int) -> None:
            await publish(tuple(disguise(g, i) for i, g in enumerate(groups)), seq=seq)

        self.publisher.publish_groups = disguised  # type: ignore[method-assign]
        await super().run()


def disguise(group: RolloutGroup, index: int) -> RolloutGroup:
    """`group` with its samples reversed, each log-prob 1e-3 lower (still <= 0), a new name."""
    samples = tuple(
        replace(s, behaviour_logprobs=tuple(min(0.0, x - 1e-3) for x in s.behaviour_logprobs)) for s in reversed(group.samples)
    )
    return replace(group, samples=samples, group_id=f"{group.group_id}~{index}")


def likes(prompt: str) -> bool:
    """The slot picker's taste: additions whose first operand is below 20 (a fifth of them)."""
    return int(prompt.split("+", 1)[0]) < 20


class SlotPicker(Attacker):
    """(g) Answers honestly, but only the seqs whose assigned prompts it likes: it leaves the
    others out (the gaps it cannot repair), so it chooses its prompts without forging one."""

    picked: int | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        publish = self.publisher.publish_groups

        async def at_pick(groups: Any, *, seq: int) -> None:
            if self.picked is not None:  # publish under the seq whose prompts these are
                self.publisher.seq = seq = self.picked
                self.picked = None
            await publish(groups, seq=seq)

        self.publisher.publish_groups = at_pick  # type: ignore[method-assign]

    def assigned_prompts(self, seq: int, wanted: int) -> list[str]:
        if not self.lying:
            return super().assigned_prompts(seq, wanted)
        # One group a batch: a seq whose every prompt it likes is then one in five, not 5^-8.
        prompts = super().assigned_prompts(seq, 1)
        while not likes(prompts[0]):
            seq += 1
            prompts = super().assigned_prompts(seq, 1)
        self.picked = seq
        return prompts


class RejoiningSlotPicker(SlotPicker):
    """A slot picker that joins the run again before it publishes each seq it picked, and samples
    with that seq's own seed (so its batches are honest in every respect but their order). Were
    a rejoin to excuse the gap it makes (a restarted peer's new base), every pick would be free;
    joins are rate-limited, not refused, so it goes on publishing when one is refused."""

    # Seconds it waits after a join before the next (0: none; the learner refuses joins past
    # JOINS_PER_PEER, and a refused one excused nothing even when rejoins did).
    join_interval = 0.0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        publish = self.publisher.publish_groups
        joined_at = -math.inf

        async def rejoined(groups: Any, *, seq: int) -> None:
            nonlocal joined_at
            if self.lying and self.follower._rejoin is not None:
                await trio.sleep_until(joined_at + self.join_interval)
                try:
                    await self.follower._rejoin()
                except Exception as exc:  # rate-limited: publish anyway
                    log.info("rejoin refused: %s", exc)
                joined_at = trio.current_time()
            await publish(groups, seq=seq)

        self.publisher.publish_groups = rejoined  # type: ignore[method-assign]

    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        if self.picked is not None:
            seed = batch_seed(self.spec.run_id, self.publisher.identity.peer_id, self.picked)
        return super()._generate(prompts, seed)


class PacedRejoiningSlotPicker(RejoiningSlotPicker):
    """A rejoining slot picker that keeps to the learner's join rate per identity, so that none
    of its joins is refused: every pick comes right after a join that went through."""

    join_interval = 1.05 / JOINS_PER_PEER[0]


def claimed_logprobs(groups: list[ScoredGroup], policy: Policy, *, temperature: float) -> None:
    """Replace each completion's log-probs with what `policy.model` (the weights it claims)
    gives its tokens at the run's `temperature`: the values a spot check recomputes."""
    pad = policy.tokenizer.pad_id
    for g in groups:
        ids = [gen.completion_ids for gen in g.generations]
        with torch.no_grad():
            lp, _ = sequence_logprobs(policy.model, [g.prompt_ids] * len(ids), ids, pad, temperature=temperature)
        for i, gen in enumerate(g.generations):
            gen.logprobs = [min(0.0, x) for x in lp[i, : len(gen.completion_ids)].tolist()]


class Resampler(Attacker):
    """Samples its assigned prompts with its assigned seed but its own way (`sample`), then
    claims the current version and the log-probs it gives at the run's temperature."""

    def sample(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        raise NotImplementedError

    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        if not self.lying:
            return super()._generate(prompts, seed)
        groups = self.sample(prompts, seed)
        claimed_logprobs(groups, self.session.policy, temperature=self.spec.sampling.temperature)
        return groups

    def generate_at(self, prompts: list[str], seed: int, temperature: float) -> list[ScoredGroup]:
        policy, s = self.session.policy, self.spec.sampling
        return generate_groups(self.engine, policy.tokenizer, policy.task, prompts, group_size=self.spec.group_size,
                               temperature=temperature, top_p=s.top_p, seed=seed, max_new_tokens=s.max_new_tokens)


class Tempered(Resampler):
    def sample(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        return self.generate_at(prompts, seed, 0.6)


class Greedy(Resampler):
    def sample(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        return self.generate_at(prompts, seed, 0.0)


class Stale(Resampler):
    """Generates on the weights `behind` versions older than the engine's (the newest it
    loaded) and claims the newest: its tags say so (the engine's version is untouched)."""

    behind = 1

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.kept: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.stale_batch = False

    def batch_lied(self) -> bool:
        """Whether the batch just generated was sampled on older weights than it claims: not
        before a second version was loaded (until then the oldest weights kept are the newest)."""
        return self.lying and self.stale_batch

    def sample(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        model = self.session.policy.model
        if self.engine.version not in self.kept:
            self.kept[self.engine.version] = {k: t.detach().clone() for k, t in model.state_dict().items()}
            while len(self.kept) > self.behind + 1:
                self.kept.popitem(last=False)
        old = next(iter(self.kept.values()))
        newest = self.kept[self.engine.version]
        self.stale_batch = old is not newest
        model.load_state_dict(old)
        try:
            return self.generate_at(prompts, seed, self.spec.sampling.temperature)
        finally:
            model.load_state_dict(newest)


class Stale1(Stale):
    behind = 1


class Stale5(Stale):
    behind = 5


class Poison(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        if self.lying:
            s = self.spec.sampling
            poison(groups, self.session.policy, temperature=s.temperature, max_new_tokens=s.max_new_tokens)
        return groups


class Freeze(Attacker):
    """Samples honestly until SIGUSR1 (or, with `after` > 0, its first `after` batches), then
    never again; the follower's status polls (the learner's heartbeats) go on. One JSON line
    {"event": "silent", "batches", "wall"} says when it stopped."""

    # Set by the SIGUSR1 handler `main` installs before anything else: a signal that arrives
    # while the peer still loads or joins must not kill it (the default action) or be lost.
    told = False

    async def run(self) -> None:
        with trio.CancelScope() as honest:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_when_told, honest)
                await super().run()
        print(json.dumps({"event": "silent", "batches": self.batches, "wall": time.time()}), flush=True)
        await trio.sleep_forever()

    async def _stop_when_told(self, scope: trio.CancelScope) -> None:
        while not (Freeze.told or 0 < self.after <= self.batches):
            await trio.sleep(0.1)
        scope.cancel()


ATTACKS: dict[str, type[Attacker]] = {
    "fake_rewards": FakeRewards,
    "garbage": Garbage,
    "other_model": OtherModel,
    "cherry_picked": CherryPicked,
    "copier": Copier,
    "reordered_copier": ReorderedCopier,
    "poison": Poison,
    "freeze": Freeze,
    "slot_picker": SlotPicker,
    "rejoining_slot_picker": RejoiningSlotPicker,
    "paced_rejoining_slot_picker": PacedRejoiningSlotPicker,
    "stale_1": Stale1,
    "stale_5": Stale5,
    "tempered": Tempered,
    "greedy": Greedy,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        print(f"usage: python -m benchmarks.attackers {{{','.join(ATTACKS)}}} [--after N] [join options]", file=sys.stderr)
        return 2
    rest = argv[1:]
    after = 0
    if rest[:1] == ["--after"]:
        after, rest = int(rest[1]), rest[2:]
    attack = type(argv[0], (ATTACKS[argv[0]],), {"after": after})
    if issubclass(attack, Freeze):
        signal.signal(signal.SIGUSR1, lambda signum, frame: setattr(Freeze, "told", True))
    args = build_parser().parse_args(["join", *rest])
    _setup_logging(args.log_level, "join")
    cfg = _config(args)
    set_threads(cfg.threads)

    class Peer(RolloutPeer):
        generator_class = attack

    try:
        trio.run(Peer(cfg, _identity(args, "peer")).run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
