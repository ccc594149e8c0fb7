"""VLLMEngine on a CUDA GPU with vLLM installed: greedy parity with TorchEngine, log-probs against
the learner's recomputation (`sequence_logprobs`), and weight swaps, between calls and between
chunks. Skips unless vLLM imports and CUDA is available; never run where it was written (no GPU).

Both sides run float32, so what differs is kernels only: a greedy divergence must sit on a
near-tie of the recomputed distribution, and log-probs agree within `TOL`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from echo_node.ml.engine import Generation, TorchEngine, WeightState
from echo_node.ml.grpo import completion_log_softmax, sequence_logprobs
from echo_node.ml.model import canonical_state, load_pretrained, state_to_bytes
from echo_node.ml.vllm_engine import VLLMEngine  # imports no vLLM: that happens in its constructor

pytestmark = [
    pytest.mark.gpu,
    # vLLM's import and start-up raise third-party warnings (deprecations in its dependencies)
    # that the repo-wide filterwarnings=error would turn into failures; these tests check outputs.
    pytest.mark.filterwarnings("ignore"),
]

# Largest |vLLM log-prob - recomputed| of a token (float32 both sides, different kernels).
TOL = 1e-2
# A greedy choice within this of the recomputed maximum is a tie the kernels may break either way.
TIE = 1e-3
# The tiny qwen2 has no bos; ids below its specials' and above none of them.
PROMPTS = [[40, 41, 42], [50, 51], [60, 61, 62, 63, 64], [70]]
MAX_NEW = 24
CHUNK = 4


@dataclass
class Setup:
    engine: VLLMEngine
    model: torch.nn.Module
    eos_id: int
    pad_id: int


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from echo_node.ml.tiny_hf import build_tiny_model

    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("vllm") / "qwen2", family="qwen2")
    model, tok = load_pretrained(str(model_dir), dtype=torch.float32, device="cpu")
    # vLLM first: its engine process then starts before this process has a CUDA context.
    engine = VLLMEngine(str(model_dir), dtype="float32", eos_id=tok.eos_id, pad_id=tok.pad_id,
                        gpu_memory_utilization=0.3, chunk_tokens=CHUNK, enforce_eager=True)
    yield Setup(engine, model.to("cuda"), tok.eos_id, tok.pad_id)


def _ids(gens: list[Generation]) -> list[list[int]]:
    return [g.completion_ids for g in gens]


def _recomputed(model: torch.nn.Module, prompts: list[list[int]], gens: list[Generation], pad: int,
                temperature: float) -> list[torch.Tensor]:
    lp, _ = sequence_logprobs(model, prompts, [g.completion_ids for g in gens], pad, temperature=temperature)
    return [lp[i, : len(g.completion_ids)].cpu() for i, g in enumerate(gens)]


def _assert_logprobs(model: torch.nn.Module, prompts: list[list[int]], gens: list[Generation], pad: int,
                     temperature: float) -> None:
    with torch.no_grad():
        for g, ref in zip(gens, _recomputed(model, prompts, gens, pad, temperature)):
            torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=TOL, rtol=0)


def test_greedy_matches_torch_engine_up_to_near_ties(setup: Setup) -> None:
    vllm_gens = setup.engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    torch_gens = TorchEngine(setup.model, eos_id=setup.eos_id, pad_id=setup.pad_id).generate(
        PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    with torch.no_grad():
        logp, _, _ = completion_log_softmax(setup.model, PROMPTS, [g.completion_ids for g in vllm_gens],
                                            setup.pad_id, temperature=1.0)
    for i, (v, t) in enumerate(zip(vllm_gens, torch_gens)):
        assert setup.eos_id not in v.completion_ids[:-1]
        # Every vLLM choice is the recomputed argmax, up to a tie.
        for pos, token in enumerate(v.completion_ids):
            assert float(logp[i, pos].max() - logp[i, pos, token]) < TIE
        same = next((n for n, (a, b) in enumerate(zip(v.completion_ids, t.completion_ids)) if a != b), None)
        if same is None:
            assert v.completion_ids == t.completion_ids
        else:  # the first divergence is a tie between the two choices
            row = logp[i, same]
            assert abs(float(row[v.completion_ids[same]] - row[t.completion_ids[same]])) < TIE


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_are_the_tempered_distribution_the_learner_recomputes(setup: Setup, temperature: float) -> None:
    prompts = [p for p in PROMPTS for _ in range(4)]  # a GRPO batch: each prompt group_size times
    gens = setup.engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=temperature, seed=1)
    assert len(gens) == len(prompts)
    for g in gens:
        assert 1 <= len(g.completion_ids) <= MAX_NEW
        assert setup.eos_id not in g.completion_ids[:-1]
        assert g.token_versions == [setup.engine.version] * len(g.completion_ids)
    # Greedy log-probs are the T = 1 ones (the seam's convention).
    _assert_logprobs(setup.model, prompts, gens, setup.pad_id, temperature or 1.0)


def test_top_p_below_one_is_refused(setup: Setup) -> None:
    with pytest.raises(ValueError, match="top_p"):
        setup.engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, top_p=0.9)


def test_weight_swaps_between_calls_and_between_chunks(setup: Setup) -> None:
    engine, model = setup.engine, setup.model
    v0 = engine.version
    original = state_to_bytes(model)
    perturbed = copy.deepcopy(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device=p.device))
    try:
        before = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)

        # A state that does not fit is refused and changes nothing.
        bad: dict[str, torch.Tensor] = dict(canonical_state(perturbed))
        bad.pop(next(iter(bad)))
        with pytest.raises(ValueError, match="missing"):
            engine.load_weights(bad, version=v0 + 99)
        assert engine.version == v0
        assert _ids(engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)) == _ids(before)

        # Between calls: outputs change, tags carry the new version, log-probs are the new model's.
        engine.load_weights(state_to_bytes(perturbed), version=v0 + 7)
        after = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
        assert _ids(after) != _ids(before)
        assert all(g.token_versions == [v0 + 7] * len(g.completion_ids) for g in after)
        _assert_logprobs(perturbed, PROMPTS, after, setup.pad_id, 1.0)

        # Between chunks: the hook's weights land after the first chunk; every token is tagged
        # with, and its log-prob is that of, the weights that sampled it given its whole prefix.
        calls = []

        def swap() -> tuple[WeightState, int] | None:
            calls.append(1)
            return (original, v0 + 8) if len(calls) == 1 else None

        mixed = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0, swap=swap)
        assert calls and engine.version == v0 + 8
        with torch.no_grad():
            by_perturbed = _recomputed(perturbed, PROMPTS, mixed, setup.pad_id, 1.0)
            by_original = _recomputed(model, PROMPTS, mixed, setup.pad_id, 1.0)
        for g, lp_p, lp_o in zip(mixed, by_perturbed, by_original):
            head = min(CHUNK, len(g.completion_ids))
            assert g.token_versions == [v0 + 7] * head + [v0 + 8] * (len(g.completion_ids) - head)
            torch.testing.assert_close(torch.tensor(g.logprobs[:head]), lp_p[:head], atol=TOL, rtol=0)
            torch.testing.assert_close(torch.tensor(g.logprobs[head:]), lp_o[head:], atol=TOL, rtol=0)
    finally:
        engine.load_weights(original, version=v0)
    restored = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    assert _ids(restored) == _ids(before)
    _assert_logprobs(model, PROMPTS, restored, setup.pad_id, 1.0)
