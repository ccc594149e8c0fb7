"""GRPO pieces: group advantages, the clipped loss on hand-made numbers, one optimizer step."""

import math

import pytest
import torch

from echo_node.ml.grpo import PolicyOptimizer, TrainGroup, group_advantages, grpo_loss, sequence_logprobs
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
    assert stats["groups_used"] == 1.0 and stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
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
