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
- `poison` (f): half of each group's completions replaced by the right answer with a bos token
  injected after its first digit (the tokenizer's decoding drops bos, so the reward is right),
  with the log-probs the current weights honestly give those tokens: plausible, rewarded, and
  teaching the policy to emit a token no honest sample would.

Each batch published is one JSON line on stdout: {"event": "published", "seq", "groups", "wall"}.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import torch
import trio

from echo_node.cli import _config, _identity, _setup_logging, build_parser
from echo_node.ml.grpo import sequence_logprobs
from echo_node.ml.rollout import ScoredGroup
from echo_node.policy import set_threads
from echo_node.rollout_peer import Generator, RolloutPeer
from echo_node.topics import rollouts_topic
from protocol import RolloutBatch, open_envelope
from protocol.errors import RemoteProtocolError

NOISE = 0.05


class Attacker(Generator):
    """A generator that says what it published (the benchmark counts the attacker's batches)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.rng = random.Random(0)
        publish = self.publisher.publish_groups

        async def announced(groups: Any, *, seq: int) -> None:
            await publish(groups, seq=seq)
            print(json.dumps({"event": "published", "seq": seq, "groups": len(groups), "wall": time.time()}), flush=True)

        self.publisher.publish_groups = announced  # type: ignore[method-assign]

    def rescore(self, g: ScoredGroup) -> None:
        tok, task = self.session.policy.tokenizer, self.session.policy.task
        g.completions = [tok.decode(gen.completion_ids) for gen in g.generations]
        g.rewards = task.reward([g.prompt] * len(g.completions), g.completions)


class FakeRewards(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        for g in groups:
            g.rewards = [1.0 - r for r in g.rewards]
        return groups


class Garbage(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        tok = self.session.policy.tokenizer
        digits = tok.encode("0123456789")
        for g in groups:
            for gen in g.generations:
                n = len(gen.completion_ids)
                gen.completion_ids = [self.rng.choice(digits) for _ in range(n - 1)] + [tok.eos_id]
                gen.logprobs = [-20.0] * n
            self.rescore(g)
        return groups


class OtherModel(Attacker):
    perturbed = -1

    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        engine = self.engine
        if engine.version != self.perturbed:  # new weights loaded: perturb them, once
            gen = torch.Generator().manual_seed(engine.version)
            with torch.no_grad():
                for p in self.session.policy.model.parameters():
                    p.add_(NOISE * torch.randn(p.shape, generator=gen))
            self.perturbed = engine.version
        return super()._generate(prompts, seed)


class CherryPicked(Attacker):
    def assigned_prompts(self, version: int, seq: int, wanted: int) -> list[str]:
        return [f"{self.rng.randrange(100):02d}+00=" for _ in range(wanted)]


class Copier(Attacker):
    async def run(self) -> None:
        node = self.publisher.node
        topic = rollouts_topic(self.spec.run_id)
        me = self.publisher.identity.peer_id
        await node.subscribe(topic, lambda forwarder, origin, data: origin != me)
        async for msg in node.messages(topic):
            try:
                batch, _ = open_envelope(msg.data, expected_kind=RolloutBatch, expected_sender=msg.sender)
            except RemoteProtocolError:
                continue
            assert isinstance(batch, RolloutBatch)
            await self.publisher.publish_groups(batch.groups, seq=self.publisher.seq)


class Poison(Attacker):
    def _generate(self, prompts: list[str], seed: int) -> list[ScoredGroup]:
        groups = super()._generate(prompts, seed)
        policy = self.session.policy
        tok, task = policy.tokenizer, policy.task
        assert tok.bos_id is not None
        for g in groups:
            answer = tok.encode(task.answer(g.prompt))
            poisoned = [answer[0], tok.bos_id, *answer[1:]][: self.spec.sampling.max_new_tokens]
            rows = g.generations[1::2]
            with torch.no_grad():
                lp, _ = sequence_logprobs(
                    policy.model, [g.prompt_ids] * len(rows), [poisoned] * len(rows), tok.pad_id,
                    temperature=self.spec.sampling.temperature,
                )
            for i, gen in enumerate(rows):
                n = len(poisoned)
                gen.completion_ids = list(poisoned)
                gen.logprobs = [min(0.0, x) for x in lp[i, :n].tolist()]
                gen.token_versions = [gen.token_versions[0]] * n
            self.rescore(g)
        return groups


ATTACKS: dict[str, type[Attacker]] = {
    "fake_rewards": FakeRewards,
    "garbage": Garbage,
    "other_model": OtherModel,
    "cherry_picked": CherryPicked,
    "copier": Copier,
    "poison": Poison,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        print(f"usage: python -m benchmarks.attackers {{{','.join(ATTACKS)}}} [join options]", file=sys.stderr)
        return 2
    attack = ATTACKS[argv[0]]
    args = build_parser().parse_args(["join", *argv[1:]])
    _setup_logging(args.log_level, "join")
    cfg = _config(args)
    set_threads(cfg.threads)

    class Peer(RolloutPeer):
        generator_class = attack

    try:
        trio.run(Peer(cfg, _identity(args, "peer"), model_path=cfg.model.path).run)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
