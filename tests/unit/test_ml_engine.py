"""TorchEngine: HF-generate parity (greedy, left-padded batch), log-probs, eos, top_p, versions,
and weights swapped in mid-generation."""

import pytest
import torch

from echo_node.ml.engine import Engine, Generation, SwapHook, TorchEngine, WeightState
from echo_node.ml.grpo import sequence_logprobs
from echo_node.ml.model import (
    build_model,
    canonical_state,
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


class _SwapAt:
    """A swap hook that hands over `state` as `version` on its `step`-th call (before step `step`)."""

    def __init__(self, step: int, state: WeightState | None, version: int) -> None:
        self.step, self.state, self.version = step, state, version
        self.calls = 0

    def __call__(self) -> tuple[WeightState, int] | None:
        self.calls += 1
        if self.calls != self.step or self.state is None:
            return None
        return self.state, self.version


def _recompute(model, prompts: list[list[int]], gens: list[Generation], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, prompts, [g.completion_ids for g in gens], PAD, temperature=temperature)
    return lp


SWAP_STEP = 3  # the hook's third call comes before decode step 3: tokens 0..2 are old, 3.. new


def _swapped_run(fast_path: bool, temperature: float) -> tuple[list[Generation], int]:
    """A sampled run (eos set so some rows end before the swap) that swaps in _model(1) as v7."""
    prompts = PROMPTS * 2
    free = TorchEngine(_model(0), eos_id=-1, pad_id=PAD).generate(
        prompts, max_new_tokens=8, temperature=temperature, seed=4
    )
    # Until the swap the run is the free run (same weights, same seed): an eos that row 0
    # samples at step 1 ends some rows before the swap.
    eos = free[0].completion_ids[1]
    engine = TorchEngine(_model(0), eos_id=eos, pad_id=PAD, fast_path=fast_path)
    gens = engine.generate(
        prompts, max_new_tokens=8, temperature=temperature, seed=4,
        swap=_SwapAt(SWAP_STEP, state_to_bytes(_model(1)), 7),
    )
    assert engine.version == 7
    return gens, eos


@pytest.mark.parametrize("fast_path", [True, False])
def test_swap_tags_tokens_from_the_swap_step_with_the_new_version(fast_path: bool) -> None:
    gens, eos = _swapped_run(fast_path, temperature=1.0)
    ended_before = [g for g in gens if len(g.completion_ids) <= SWAP_STEP]
    ran_on = [g for g in gens if len(g.completion_ids) > SWAP_STEP]
    assert ended_before and ran_on
    for g in ended_before:
        assert g.completion_ids[-1] == eos and g.token_versions == [0] * len(g.completion_ids)
    for g in ran_on:
        assert g.token_versions == [0] * SWAP_STEP + [7] * (len(g.completion_ids) - SWAP_STEP)


@pytest.mark.parametrize("fast_path", [True, False])
def test_swap_logprobs_are_those_of_the_weights_that_sampled_each_token(fast_path: bool) -> None:
    temperature = 0.7
    gens, _ = _swapped_run(fast_path, temperature)
    old = _recompute(_model(0), PROMPTS * 2, gens, temperature)
    new = _recompute(_model(1), PROMPTS * 2, gens, temperature)
    # rtol as well as the usual atol: _model(1) at T = 0.7 samples tokens of log-prob ~ -3.5,
    # where float32 round-off between a cached and an uncached forward reaches ~1.7e-5.
    for i, g in enumerate(gens):
        lp = torch.tensor(g.logprobs)
        n_old = min(SWAP_STEP, len(lp))
        torch.testing.assert_close(old[i, :n_old], lp[:n_old], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[i, n_old : len(lp)], lp[n_old:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("as_tensors", [False, True], ids=["bytes", "tensors"])
def test_greedy_swap_to_identical_weights_changes_no_token(fast_path: bool, as_tensors: bool) -> None:
    model = _model()
    state: WeightState = (
        {k: v.clone() for k, v in canonical_state(model).items()} if as_tensors else state_to_bytes(model)
    )
    engine = TorchEngine(model, eos_id=-1, pad_id=PAD, fast_path=fast_path)
    plain = engine.generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    swapped = engine.generate(PROMPTS, max_new_tokens=8, temperature=0.0, swap=_SwapAt(4, state, 1))
    assert [g.completion_ids for g in swapped] == [g.completion_ids for g in plain]
    assert all(g.token_versions == [0] * 4 + [1] * 4 for g in swapped)
    for a, b in zip(swapped, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_swap_hook_that_returns_none_changes_nothing(fast_path: bool) -> None:
    engine = TorchEngine(_model(), eos_id=5, pad_id=PAD, fast_path=fast_path)
    hook = _SwapAt(0, None, 9)
    swap: SwapHook = hook
    plain = engine.generate(PROMPTS * 2, max_new_tokens=6, temperature=1.0, seed=1)
    hooked = engine.generate(PROMPTS * 2, max_new_tokens=6, temperature=1.0, seed=1, swap=swap)
    assert hooked == plain  # ids, log-probs (bit for bit) and versions
    # Called before every decode step, never before the prefill.
    assert hook.calls == max(len(g.completion_ids) for g in plain) - 1
    assert engine.version == 0


def test_swapped_version_tags_reach_the_learners_staleness_rule() -> None:
    """Engine -> the peer's wire record -> sealed -> opened by the learner: a completion that
    spans the swap keeps both versions, and the learner judges it by its oldest token."""
    from echo_node.learner.replay import ReplayBuffer
    from echo_node.learner.trainer import staleness
    from echo_node.ml.rollout import ScoredGroup
    from echo_node.peer.rollout_peer import rollout_group
    from protocol import Identity, RolloutBatch, open_envelope, seal
    from protocol.drops import DropReason

    gens, _ = _swapped_run(fast_path=True, temperature=1.0)
    spanning = [g for g in gens if len(g.completion_ids) > SWAP_STEP]
    me = Identity.from_seed(b"\x05" * 32)
    scored = ScoredGroup("p", PROMPTS[0], spanning, ["x"] * len(spanning), [float(i % 2) for i in range(len(spanning))])
    record = RolloutBatch(run_id="run-1", peer_id=me.peer_id, seq=1, groups=(rollout_group(scored, group_id="g"),))
    batch, _ = open_envelope(seal(record, me), expected_kind=RolloutBatch)
    (group,) = batch.groups
    assert all(s.token_versions[0] == 0 and s.token_versions[-1] == 7 for s in group.samples)
    assert (group.min_version, group.max_version) == (0, 7)
    # The train record counts each of them as a partial rollout.
    assert staleness([group], 7)["spanning"] == len(spanning) > 0
    assert ReplayBuffer(mode="async", staleness=4, capacity_groups=4).offer(group, current_version=7) == DropReason.STALE
    assert ReplayBuffer(mode="async", staleness=8, capacity_groups=4).offer(group, current_version=7) is None
