"""Rollouts sampled the way a peer samples them: the real engine on a real (tiny) model, on the
prompts the run assigns. For tests of what the learner can tell from them."""

from __future__ import annotations

import copy

import torch

from echo_node.ml.engine import TorchEngine
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.rollout import ScoredGroup, generate_groups
from echo_node.peer.rollout_peer import rollout_group
from protocol import Identity, RolloutBatch
from protocol.assignment import batch_seed
from tests.factories import ALICE, TASK, TOKENIZER, assigned_prompt

RUN = "run-1"


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny_llama_config(TOKENIZER.vocab_size))


def sharpened(model: torch.nn.Module, factor: float = 6.0) -> torch.nn.Module:
    """`model` made confident, as a trained policy is (a random one finds every token likely)."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(factor)
    return sharp


def perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def sample_groups(
    model: torch.nn.Module, *, identity: Identity = ALICE, seq: int = 0, version: int = 0, groups: int = 4,
    temperature: float = 1.0, prompts: list[str] | None = None,
) -> list[ScoredGroup]:
    """What a peer on `model` (claimed as `version`) samples for its batch `seq`."""
    engine = TorchEngine(model, eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    engine.version = version
    if prompts is None:
        prompts = [assigned_prompt(RUN, identity, seq, i) for i in range(groups)]
    return generate_groups(
        engine, TOKENIZER, TASK, prompts, group_size=8, temperature=temperature, max_new_tokens=4,
        seed=batch_seed(RUN, identity.peer_id, seq),
    )


def to_batch(scored: list[ScoredGroup], *, identity: Identity = ALICE, seq: int = 0) -> RolloutBatch:
    groups = tuple(rollout_group(g, group_id=f"{identity.peer_id[-8:]}-{seq}.{i}") for i, g in enumerate(scored))
    return RolloutBatch(run_id=RUN, peer_id=identity.peer_id, seq=seq, groups=groups)


def sample_batch(model: torch.nn.Module, *, identity: Identity = ALICE, seq: int = 0, version: int = 0, groups: int = 4,
                 temperature: float = 1.0) -> RolloutBatch:
    """What an honest peer on `model` (claimed as `version`) publishes under `seq`."""
    scored = sample_groups(model, identity=identity, seq=seq, version=version, groups=groups, temperature=temperature)
    return to_batch(scored, identity=identity, seq=seq)
