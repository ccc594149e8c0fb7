"""The sharded learner (FSDP2 over two CPU ranks, gloo) against the single-process one.

Two ranks under torchrun (`sharded_worker.py`) run each scenario; this process runs the same
batches through `PolicyOptimizer(fast_path=False)` and compares.

Measured (torch 2.13 CPU, lr 1e-4, weights moving by up to 3e-4 and 9e-4): the parameters differ
by at most 6.8e-7 ("tis") and 5.7e-7 ("decoupled") after one and after all steps, the stats by
2.3e-6 relative, the gradients of a first step by 7e-9 absolute. The gradients differ by float
rounding only (the reduce-scatter sums the two shares in another order); the weights more,
because AdamW divides each gradient by its own running RMS plus eps = 1e-8, so where a gradient
is itself ~1e-8 (cancelling terms) its rounding shows in the update at up to ~1% of lr. Hence
`TOL` = lr / 10. Gathering and reloading a state is exact, and so is a step repeated after it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from echo_node.ml.grpo import PolicyOptimizer, Share, TrainGroup, _split, merge_share_stats
from echo_node.ml.model import canonical_state
from echo_node.ml.sharded import init_from_env
from tests.unit import sharded_worker as worker

TOL = worker.LR / 10
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What rank 0 saw in every scenario (see `sharded_worker.drive`)."""
    out = tmp_path_factory.mktemp("sharded") / "rank0.pt"
    # One thread per rank: two ranks on two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), "-m", "tests.unit.sharded_worker", str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _reference(name: str) -> dict[str, Any]:
    """The scenario on one process, as `sharded_worker.drive` runs it (less the reload)."""
    torch.set_num_threads(1)
    model = worker.model()
    opt = PolicyOptimizer(model, lr=worker.LR, pad_id=worker.PAD, fast_path=False, **worker.SCENARIOS[name])
    steps = worker.batches()[name]
    seen: dict[str, Any] = {"initial": {k: v.clone() for k, v in canonical_state(model).items()}}
    seen["stats"] = [opt.step(steps[0])]
    seen["after_first"] = {k: v.clone() for k, v in canonical_state(model).items()}
    seen["stats"] += [opt.step(b) for b in steps[1:]]
    seen["final"] = {k: v.clone() for k, v in canonical_state(model).items()}
    with pytest.raises(RuntimeError) as failed:
        opt.step(worker.zero_token_batch())
    seen["failed_step"] = f"RuntimeError: {failed.value}"
    return seen


@pytest.mark.parametrize("name", list(worker.SCENARIOS))
def test_sharded_steps_equal_the_single_process_steps(sharded: dict[str, Any], name: str) -> None:
    got, want = sharded[name], _reference(name)
    # Sharding, then gathering, moves no bit.
    assert _max_diff(got["initial"], want["initial"]) == 0.0
    assert _max_diff(got["after_first"], want["after_first"]) <= TOL
    assert _max_diff(got["final"], want["final"]) <= TOL
    assert len(got["stats"]) == len(want["stats"])
    for mine, ref in zip(got["stats"], want["stats"]):
        assert list(mine) == list(ref)
        for key, value in ref.items():
            # With several minibatches one process averages its minibatches' maxima; the merge
            # takes the larger share's (`merge_share_stats`).
            if key == "ratio_max" and worker.SCENARIOS[name]["minibatches"] > 1:
                continue
            assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    # A batch that fails on every rank at the same point fails as on one process, and the
    # learner goes on (the reload below is further commands).
    assert got["failed_step"] == want["failed_step"]


@pytest.mark.parametrize("name", list(worker.SCENARIOS))
def test_sharded_state_round_trip_and_resume(sharded: dict[str, Any], name: str) -> None:
    got = sharded[name]
    assert all(torch.equal(got["reloaded"][k], got["after_first"][k]) for k in got["after_first"])
    # load(state, optimizer state) and the same steps again: the same weights, bit for bit.
    assert all(torch.equal(got["final_again"][k], got["final"][k]) for k in got["final"])
    # Resumed from a single-process learner's checkpoint (its AdamW state keyed by name, as
    # `get_optimizer_state_dict` gives it), the same steps land where that learner did.
    assert _max_diff(got["final_from_single"], _reference(name)["final"]) <= TOL
    # Rank 0 refused an out-of-vocabulary batch before sending it; the followers never saw it.
    assert got["bad_batch"].startswith("ValueError: a token id is outside")


def test_sharded_mixed_precision_keeps_float32_weights(sharded: dict[str, Any]) -> None:
    """compute_dtype=bfloat16 (FSDP mixed precision, on gloo too): float32 weights, and the step
    moves them as the float32 step does, up to bfloat16's rounding."""
    got, want = sharded["bf16"], _reference("tis")
    assert all(t.dtype == torch.float32 for t in got["final"].values())
    assert _max_diff(got["initial"], want["initial"]) == 0.0

    def moved(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(state[k] - want["initial"][k]).flatten() for k in state])

    assert torch.nn.functional.cosine_similarity(moved(got["final"]), moved(want["after_first"]), dim=0) > 0.95
    assert got["stats"][0]["grad_norm"] == pytest.approx(want["stats"][0]["grad_norm"], rel=1e-2)


def test_shares_split_minibatches_like_tensor_split() -> None:
    for n in range(0, 9):
        for parts in range(1, 5):
            want = [t.tolist() for t in torch.arange(n).tensor_split(parts)]
            assert [list(r) for r in _split(range(n), parts)] == want
    lengths = [3, 0, 0, 2, 0]
    # Rank 1's half of rows 0..2 has no token: the minibatch's first row with one stands in.
    assert Share(1, 2).of(range(0, 3), lengths) == (range(0, 1), True)
    assert Share(0, 2).of(range(0, 3), lengths) == (range(0, 2), False)
    # A one-row minibatch leaves rank 1 nothing: a stand-in too.
    assert Share(1, 2).of(range(3, 4), lengths) == (range(3, 4), True)
    # No token anywhere: no stand-in, every rank fails as one process does.
    assert Share(1, 2).of(range(1, 3), lengths) == (range(2, 3), False)
    with pytest.raises(ValueError):
        Share(2, 2)


def test_merge_share_stats_ignores_shares_without_tokens() -> None:
    same = {"reward_mean": 0.5, "groups": 2.0, "groups_used": 2.0, "grad_norm": 1.5, "skipped": 0.0}
    a = {**same, "is_weight_mean": 0.6, "is_weight_max": 0.75, "is_weight_min": 0.5, "loss": 1.0, "tokens": 3.0,
         "lp_gap_tokens": 1.0, "lp_gap_mean": 0.2, "lp_gap_max": 0.2}
    # A stand-in's share: no token, and the defaults of an empty mask (a max of 1.0 would win).
    b = {**same, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_min": 1.0, "loss": 0.0, "tokens": 0.0}
    c = {**same, "is_weight_mean": 0.4, "is_weight_max": 0.7, "is_weight_min": 0.1, "loss": -1.0, "tokens": 1.0,
         "lp_gap_tokens": 3.0, "lp_gap_mean": 0.6, "lp_gap_max": 0.9}
    assert merge_share_stats([a, b, c]) == pytest.approx(
        {**same, "is_weight_mean": 0.55, "is_weight_max": 0.75, "is_weight_min": 0.1, "loss": 0.5, "tokens": 4.0,
         "lp_gap_tokens": 4.0, "lp_gap_mean": 0.5, "lp_gap_max": 0.9}
    )
    assert list(merge_share_stats([a, b, c])) == list(a)


def test_no_process_group_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_from_env()


def test_autocast_forward_keeps_float32_weights_and_loss() -> None:
    """`autocast_dtype`: the forward in bfloat16, everything the optimizer touches in float32."""
    torch.set_num_threads(1)
    group = TrainGroup([1, 5, 6], [[7, 8, 2], [9, 10, 2]], [[-2.0] * 3, [-2.0] * 3], [1.0, 0.0])
    deltas = {}
    for dtype in (None, torch.bfloat16):
        model = worker.model()
        before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
        opt = PolicyOptimizer(model, lr=1e-3, pad_id=worker.PAD, autocast_dtype=dtype)
        stats = opt.step([group])
        assert stats["skipped"] == 0.0
        for p in opt.params:
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        deltas[dtype] = torch.nn.utils.parameters_to_vector(model.parameters()) - before
    assert torch.nn.functional.cosine_similarity(deltas[None], deltas[torch.bfloat16], dim=0) > 0.9
