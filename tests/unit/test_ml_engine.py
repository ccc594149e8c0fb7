"""TorchEngine: HF-generate parity (greedy, left-padded batch), log-probs, eos, top_p, versions."""

import pytest
import torch

from echo_node.ml.engine import Engine, Generation, TorchEngine
from echo_node.ml.grpo import sequence_logprobs
from echo_node.ml.model import (
    build_model,
    state_to_bytes,
    tiny_llama_config,
)

torch.set_num_threads(1)

PAD = 0
PROMPTS = [[1, 3, 4, 5], [1, 6], [1, 7, 8, 9, 10, 11, 12], [1, 4, 4]]


def _model(seed: int = 0, kv_heads: int = 2):
    # A large init range makes a random model's greedy output vary from step to step.
    arch = {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": kv_heads, "initializer_range": 0.5}
    return build_model(arch, seed=seed)


def _hf_greedy(model, prompts, eos_id: int, max_new: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         pad_token_id=PAD, eos_token_id=eos_id)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return rows


def test_torch_engine_satisfies_the_seam() -> None:
    engine: Engine = TorchEngine(_model(), eos_id=2, pad_id=PAD)
    assert engine.version == 0


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize(
    ("prompts", "kv_heads"),
    # Repeated prompts take the prefill-once-per-distinct-prompt path; one KV head, the GQA one.
    [(PROMPTS, 2), ([p for p in PROMPTS for _ in range(3)], 2), (PROMPTS, 1)],
    ids=["distinct", "repeated", "gqa"],
)
def test_greedy_matches_hf_generate_token_for_token(
    fast_path: bool, prompts: list[list[int]], kv_heads: int
) -> None:
    model = _model(kv_heads=kv_heads)
    free = TorchEngine(model, eos_id=-1, pad_id=PAD).generate(prompts, max_new_tokens=12, temperature=0.0)
    # Pick as eos a token that row 0 emits mid-way, so rows finish at different steps.
    eos = free[0].completion_ids[3]
    engine = TorchEngine(model, eos_id=eos, pad_id=PAD, fast_path=fast_path)
    gens = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    expected = _hf_greedy(model, prompts, eos, 12)
    assert [g.completion_ids for g in gens] == expected
    lengths = {len(g.completion_ids) for g in gens}
    assert len(lengths) > 1 and gens[0].completion_ids[-1] == eos


def test_eos_is_included_and_ends_the_completion() -> None:
    model = _model()
    free = TorchEngine(model, eos_id=-1, pad_id=PAD).generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    eos = free[0].completion_ids[0]
    gens = TorchEngine(model, eos_id=eos, pad_id=PAD).generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    assert gens[0].completion_ids == [eos] and len(gens[0].logprobs) == 1
    for g in gens:
        assert eos not in g.completion_ids[:-1]
        assert g.completion_ids[-1] == eos or len(g.completion_ids) == 8


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_sequence_logprobs(temperature: float, fast_path: bool) -> None:
    model = _model()
    engine = TorchEngine(model, eos_id=5, pad_id=PAD, fast_path=fast_path)
    gens = engine.generate(PROMPTS * 2, max_new_tokens=10, temperature=temperature, seed=0)
    comps = [g.completion_ids for g in gens]
    lp, mask = sequence_logprobs(model, PROMPTS * 2, comps, PAD, temperature=temperature)
    assert mask.sum(-1).tolist() == [len(c) for c in comps]
    for i, g in enumerate(gens):
        torch.testing.assert_close(lp[i, : len(g.logprobs)], torch.tensor(g.logprobs), atol=1e-5, rtol=0)


def test_fast_path_sampling_equals_hf_path_sampling() -> None:
    model = _model()
    fast = TorchEngine(model, eos_id=5, pad_id=PAD, fast_path=True)
    ref = TorchEngine(model, eos_id=5, pad_id=PAD, fast_path=False)
    a = fast.generate(PROMPTS * 4, max_new_tokens=10, temperature=1.0, seed=2)
    b = ref.generate(PROMPTS * 4, max_new_tokens=10, temperature=1.0, seed=2)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_top_p_tiny_is_greedy() -> None:
    engine = TorchEngine(_model(), eos_id=-1, pad_id=PAD)
    a = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=11)
    b = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=11)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    greedy = engine.generate(PROMPTS, max_new_tokens=6, temperature=0.0)
    nucleus = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=3)
    assert [g.completion_ids for g in nucleus] == [g.completion_ids for g in greedy]


def test_load_weights_sets_version_and_tags_tokens() -> None:
    engine = TorchEngine(_model(seed=0), eos_id=-1, pad_id=PAD)
    engine.generate(PROMPTS, max_new_tokens=3, temperature=1.0, seed=0)
    other = _model(seed=1)
    engine.load_weights(state_to_bytes(other), version=5)
    assert engine.version == 5
    assert state_to_bytes(engine.model) == state_to_bytes(other)
    gens = engine.generate(PROMPTS, max_new_tokens=3, temperature=1.0, seed=0)
    assert all(g.token_versions == [5, 5, 5] for g in gens)
    # The fast path's fused weights follow the load (the first call built them for the old ones).
    fresh = TorchEngine(_model(seed=1), eos_id=-1, pad_id=PAD).generate(PROMPTS, max_new_tokens=3, temperature=1.0, seed=0)
    assert gens == [Generation(g.completion_ids, g.logprobs, [5, 5, 5]) for g in fresh]
    with pytest.raises(ValueError):
        engine.generate([[]], max_new_tokens=3, temperature=1.0, seed=0)

