"""GRPO pieces: group advantages, the clipped loss on hand-made numbers, one optimizer step."""

import math

import pytest
import torch

from echo_node.ml.grpo import (
    PolicyOptimizer,
    TrainGroup,
    _advantages,
    group_advantages,
    grpo_loss,
    importance_weights,
    sequence_logprobs,
    tis_loss,
)
from echo_node.ml.model import build_model, tiny_llama_config

torch.set_num_threads(1)


def test_group_advantages() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6))
    assert torch.equal(group_advantages(torch.full((8,), 0.3)), torch.zeros(8))
    assert torch.equal(group_advantages(torch.tensor([1.0])), torch.zeros(1))
    rows = group_advantages(torch.tensor([[1.0, 1.0], [0.0, 2.0]]))
    assert torch.equal(rows[0], torch.zeros(2)) and rows[1, 1] > 0 > rows[1, 0]
    assert float(group_advantages(torch.tensor([3.0, 1.0, 2.0])).sum()) == pytest.approx(0.0, abs=1e-6)


def test_batched_advantages_equal_one_call_per_group() -> None:
    same = [[1.0, 0.0, 1.0, 0.5], [0.2, 0.9, 0.1, 0.4], [0.0, 1.0, 1.0, 1.0]]
    per_group = torch.cat([group_advantages(torch.tensor(r)) for r in same])
    assert torch.equal(_advantages(same), per_group)  # bitwise: the update must not move
    mixed = [[1.0, 0.0], [0.0, 0.5, 1.0]]
    assert torch.equal(_advantages(mixed), torch.cat([group_advantages(torch.tensor(r)) for r in mixed]))


def test_grpo_loss_clipping_by_hand() -> None:
    old = torch.zeros(2, 3)
    # ratios: row 0 = [1.5, 1.0, 0.5], row 1 = [1.5, 0.5, (masked)]
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 9.0]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(new, old, adv, mask, clip_eps=0.2)
    # row 0 (A=+1): min(r, clip(r)) = [1.2, 1.0, 0.5]; row 1 (A=-1): min(-r, -clip(r)) = [-1.5, -0.8]
    expected = -(1.2 + 1.0 + 0.5 - 1.5 - 0.8) / 5
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    # clipped (no gradient): row 0 token 0 (r>1+eps, A>0) and row 1 token 1 (r<1-eps, A<0)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 1.5 + 0.5) / 5)
    assert stats["tokens"] == 5.0


def test_grpo_loss_gradient_vanishes_on_clipped_tokens() -> None:
    new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = grpo_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert new.grad[0, 0] == 0.0 and new.grad[0, 1] != 0.0


def test_one_step_raises_probability_of_rewarded_completion() -> None:
    arch = {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2}
    model = build_model(arch, seed=0)
    prompt = [1, 5, 6]
    good, bad = [7, 8, 2], [9, 10, 2]
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [prompt, prompt], [good, bad], 0)
    before = lp.sum(-1)
    group = TrainGroup(prompt, [good, bad], [lp[0].tolist(), lp[1].tolist()], [1.0, 0.0])
    opt = PolicyOptimizer(model, lr=1e-3, pad_id=0)
    stats = opt.step([group])
    # On-policy data: the learner's recomputation equals the engine's, so every weight is 1.
    assert stats["groups_used"] == 1.0 and stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_truncated_frac"] == 0.0
    with torch.no_grad():
        after = sequence_logprobs(model, [prompt, prompt], [good, bad], 0)[0].sum(-1)
    assert after[0] > before[0] and after[1] < before[1]
    # A group with equal rewards carries no signal: no update at all.
    skipped = opt.step([TrainGroup(prompt, [good, bad], [lp[0].tolist(), lp[1].tolist()], [1.0, 1.0])])
    assert skipped["skipped"] == 1.0 and opt.steps == 1


def test_train_group_validates_shapes() -> None:
    with pytest.raises(ValueError):
        TrainGroup([1], [[3, 2]], [[-0.1]], [1.0])
    with pytest.raises(ValueError):
        TrainGroup([1], [[3]], [[-0.1]], [1.0, 0.0])
    assert math.isfinite(-0.1)


def test_importance_weights_truncate_by_hand() -> None:
    # pi_prox / mu per token: [0.5, 1.0, 3.0] and [8.0, (masked)]
    mu = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.05, 0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.2, 0.2, 0.3], [0.4, 0.9, 0.9]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w, stats = importance_weights(prox, mu, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0], [2.0, 0.0, 0.0]]))
    assert stats["is_weight_mean"] == pytest.approx((0.5 + 1.0 + 3.0 + 8.0) / 4)
    assert stats["is_weight_max"] == pytest.approx(8.0) and stats["is_weight_min"] == pytest.approx(0.5)
    assert stats["is_truncated_frac"] == pytest.approx(2 / 4)
    with pytest.raises(ValueError):
        importance_weights(prox, mu, mask, cap=0.0)


def test_tis_loss_gradient_is_weight_times_advantage() -> None:
    new = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]])).requires_grad_()
    mask = torch.tensor([[True, True], [True, False]])
    w = torch.tensor([[1.0, 2.0], [0.5, 7.0]])
    loss, stats = tis_loss(new, torch.tensor([1.0, -2.0]), mask, w)
    assert float(loss.detach()) == pytest.approx(-(1.0 + 2.0 - 2.0 * 0.5) / 3)  # the ratio is 1 forward
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0, -2.0], [1.0, 0.0]]) / 3)
    assert stats["tokens"] == 3.0


def test_grpo_loss_weights_scale_each_token() -> None:
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                        weights=torch.tensor([[0.5, 2.0]]))
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.25, -1.0]]))


def _tiny_setup() -> tuple[dict, list[int], list[int], list[int]]:
    arch = {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2}
    return arch, [1, 5, 6], [7, 8, 2], [9, 10, 2]


def _step(correction: str, behaviour_shift: float, *, minibatches: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """One update on stale-looking data (behaviour log-probs shifted): parameter change, stats."""
    arch, prompt, good, bad = _tiny_setup()
    model = build_model(arch, seed=0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [prompt, prompt], [good, bad], 0)
    rows = [[x + behaviour_shift for x in lp[i].tolist()] for i in range(2)]
    before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    opt = PolicyOptimizer(model, lr=1e-3, pad_id=0, correction=correction, is_cap=2.0, minibatches=minibatches)  # type: ignore[arg-type]
    stats = opt.step([TrainGroup(prompt, [good, bad], rows, [1.0, 0.0])])
    return torch.nn.utils.parameters_to_vector(model.parameters()) - before, stats


def test_corrections_on_stale_data() -> None:
    # Behaviour log-probs 0.3 nats below the learner's: pi_prox / mu = e^0.3 = 1.35 per token.
    none_fresh, none_stale = _step("none", 0.0)[0], _step("none", -0.3)[0]
    torch.testing.assert_close(none_fresh, none_stale)  # "none" never reads the behaviour log-probs
    # With one minibatch, decoupled PPO (ratio to pi_prox = 1, clip inactive) equals TIS.
    torch.testing.assert_close(_step("tis", -0.3)[0], _step("decoupled", -0.3)[0])
    # TIS on fresh data is the plain on-policy step.
    torch.testing.assert_close(_step("tis", 0.0)[0], none_fresh)
    _, stale = _step("tis", -0.3)
    assert stale["is_weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-4) and stale["is_truncated_frac"] == 0.0
    _, far = _step("tis", -5.0)
    assert far["is_weight_min"] == pytest.approx(math.exp(5.0), rel=1e-4) and far["is_truncated_frac"] == 1.0


def test_truncation_bounds_a_far_off_completion() -> None:
    """One completion sampled by a policy far from the learner's: untruncated it would outweigh
    the other e^5 : 1; truncated at 2 the update stays close to the on-policy one."""
    arch, prompt, good, bad = _tiny_setup()
    deltas = {}
    for cap in (2.0, 1e6):
        model = build_model(arch, seed=0)
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, [prompt, prompt], [good, bad], 0)
        rows = [[x - 5.0 for x in lp[0].tolist()], lp[1].tolist()]
        before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
        PolicyOptimizer(model, lr=1e-3, pad_id=0, is_cap=cap).step([TrainGroup(prompt, [good, bad], rows, [1.0, 0.0])])
        deltas[cap] = torch.nn.utils.parameters_to_vector(model.parameters()) - before
    on_policy = _step("none", 0.0)[0]
    cos = torch.nn.functional.cosine_similarity
    assert cos(deltas[2.0], on_policy, dim=0) > cos(deltas[1e6], on_policy, dim=0) + 0.01


def test_minibatches_take_several_optimizer_steps() -> None:
    arch, prompt, good, bad = _tiny_setup()
    model = build_model(arch, seed=0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [prompt] * 4, [good, bad, good, bad], 0)
    group = TrainGroup(prompt, [good, bad, good, bad], [lp[i].tolist() for i in range(4)], [1.0, 0.0, 1.0, 0.0])
    opt = PolicyOptimizer(model, lr=1e-2, pad_id=0, correction="decoupled", minibatches=2)
    stats = opt.step([group])
    assert opt.opt.state[next(model.parameters())]["step"] == 2  # two AdamW steps in one update
    # The second minibatch sees pi_theta != pi_prox: its ratios moved off 1.
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    with pytest.raises(ValueError):
        PolicyOptimizer(model, lr=1e-3, correction="bogus")  # type: ignore[arg-type]


# Repeated prompts (a GRPO group), prompts of different lengths, completions of different lengths
# (one empty, one of a single token) - every layout case of the lean forward.
_PARITY_PROMPTS = [[1, 5, 6], [1, 5, 6], [1, 5, 6], [1, 7], [1, 9, 10, 11, 12], [1, 7], [1]]
_PARITY_COMPLETIONS = [[7, 8, 2], [9], [10, 11, 12, 13], [], [3, 4], [5, 6, 7], [8, 2]]


def _parity_model(kv_heads: int) -> torch.nn.Module:
    # A large init range makes a random model's log-probs far from uniform.
    arch = {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": kv_heads, "initializer_range": 0.5}
    return build_model(arch, seed=3)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    ("prompts", "completions"),
    [(_PARITY_PROMPTS, _PARITY_COMPLETIONS), ([[1, 5, 6], [1, 7], [1, 7]], [[3], [4], [5]])],
    ids=["mixed", "one-token"],
)
def test_lean_forward_matches_hf_forward(
    kv_heads: int, temperature: float, prompts: list[list[int]], completions: list[list[int]]
) -> None:
    model = _parity_model(kv_heads).train()
    results = {}
    for fast_path in (True, False):
        model.zero_grad(set_to_none=True)
        lp, mask = sequence_logprobs(model, prompts, completions, 0, temperature=temperature, fast_path=fast_path)
        # Distinct weights per token, so a token's gradient landing on the wrong row would show.
        coef = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
        (lp * coef).sum().backward()
        results[fast_path] = (lp.detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters()})
    (lean, lean_mask, lean_grads), (ref, ref_mask, ref_grads) = results[True], results[False]
    assert torch.equal(lean_mask, ref_mask)
    assert bool((ref[ref_mask] < -0.01).all())  # non-trivial log-probs, and padding stays 0
    torch.testing.assert_close(lean, ref, atol=1e-5, rtol=0)
    assert lean_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0.0, name
        # The two paths sum a shared prompt's gradient in different orders: float32 round-off
        # relative to the largest term (up to ~100 with this init), hence a tolerance scaled by it.
        torch.testing.assert_close(lean_grads[name], grad, atol=1e-5 * max(1.0, scale), rtol=0, msg=name)


def test_lean_forward_tracks_optimizer_steps() -> None:
    """No fused weight outlives a call: after an update both forwards see the new weights."""
    model = _parity_model(2)
    group = TrainGroup([1, 5, 6], [[7, 8, 2], [9, 10, 2]], [[-1.0] * 3, [-1.0] * 3], [1.0, 0.0])
    opt = PolicyOptimizer(model, lr=1e-2, pad_id=0)
    before = sequence_logprobs(model, [[1, 5, 6]], [[7, 8, 2]], 0, fast_path=True)[0]
    opt.step([group])
    with torch.no_grad():
        lean = sequence_logprobs(model, [[1, 5, 6]], [[7, 8, 2]], 0, fast_path=True)[0]
        ref = sequence_logprobs(model, [[1, 5, 6]], [[7, 8, 2]], 0, fast_path=False)[0]
    assert not torch.allclose(lean, before.detach(), atol=1e-4)
    torch.testing.assert_close(lean, ref, atol=1e-5, rtol=0)


def test_an_engine_over_the_trained_model_samples_from_each_update() -> None:
    """The engine caches fused weights until a parameter's version counter moves; the optimizer
    must move it (torch's fused CPU AdamW does not, and an engine kept the old weights)."""
    from echo_node.ml.engine import TorchEngine

    model = _parity_model(2)
    engine = TorchEngine(model, eos_id=2, pad_id=0)
    group = TrainGroup([1, 5, 6], [[7, 8, 2], [9, 10, 2]], [[-1.0] * 3, [-1.0] * 3], [1.0, 0.0])
    opt = PolicyOptimizer(model, lr=1e-2, pad_id=0)
    engine.generate([[1, 5, 6]], max_new_tokens=3, temperature=1.0, seed=0)  # fills the cache
    opt.step([group])
    (sampled,) = engine.generate([[1, 5, 6]], max_new_tokens=3, temperature=1.0, seed=0)
    with torch.no_grad():
        now, _ = sequence_logprobs(model, [[1, 5, 6]], [sampled.completion_ids], 0, fast_path=False)
    torch.testing.assert_close(torch.tensor(sampled.logprobs), now[0, : len(sampled.logprobs)], atol=1e-5, rtol=0)


def test_lean_forward_refuses_what_it_cannot_reproduce() -> None:
    arch = {**_tiny_setup()[0], "attention_dropout": 0.1}
    model = build_model(arch, seed=0).train()
    with pytest.raises(ValueError):
        sequence_logprobs(model, [[1, 5]], [[3]], 0, fast_path=True)
    # Unforced, a model with attention dropout in training takes HF's forward (dropout applied).
    lp, _ = sequence_logprobs(model, [[1, 5]], [[3]], 0)
    assert lp.shape == (1, 1)


@pytest.mark.parametrize(("shift", "gap"), [(0.0, 0.0), (-20.0, 20.0)])
def test_the_step_reports_how_far_claimed_logprobs_are_from_its_own(shift: float, gap: float) -> None:
    """On tokens sampled by the weights being trained an honest claim matches the learner's own
    log-prob; a fabricated one (-20 per token, as a forger sent) is 20 off."""
    arch, prompt, good, bad = _tiny_setup()
    model = build_model(arch, seed=0)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, [prompt, prompt], [good, bad], 0)
    rows = [[x + shift for x in lp[i].tolist()] for i in range(2)]
    on = [[True] * len(good), [True] * len(bad)]
    stats = PolicyOptimizer(model, lr=1e-3, pad_id=0).step([TrainGroup(prompt, [good, bad], rows, [1.0, 0.0], on_policy=on)])
    assert stats["lp_gap_tokens"] == 6
    assert stats["lp_gap_max"] == pytest.approx(gap, abs=1e-4)
