"""`echo-node plan`'s offline half: candidates CSV, the T_bcast <-> chosen-set iteration, the
plan dict and its table.

The worked example (1 GB versions, a 1000 Mbit/s learner uplink, T_train = 10 s, R = 4, S = 3):
round 1 bounds the broadcast for all four candidates, and z's 500 Mbit/s downlink makes it 16 s,
so μ_min = 2·4/(2·10 − 16) = 2/s, target 2.2/s: a and b. Round 2: without z the bound is the
learner's 8 s, μ_min = 8/12, target 0.733/s: a alone. Round 3: a alone, 8 s again: settled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from echo_node import plan as plan_module
from echo_node.plan import (
    MBIT,
    Candidate,
    format_table,
    load_candidates,
    plan_from_inputs,
    plan_from_status,
    safetensors_bytes,
)
from protocol.capacity import Worker, broadcast_bound

CANDIDATES = """peer_id,mu,price,bandwidth_mbit,up_mbit
a,2,1,1000,1000
b,2,1.5,1000,1000
c,2,2,1000,1000
z,1,10,500,
"""
HEAD = "peer_id,mu,price,bandwidth_mbit"
KEYS = {
    "kappa", "kappa_warning", "mu_min", "target", "t_bcast_bound_s", "chosen", "choice", "cost_per_hour", "mu_active",
    "delta_max_predicted", "idle_predicted", "feasible", "reason", "t_bcast_source", "rounds", "notes", "inputs",
}


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "candidates.csv"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def example(tmp_path: Path, **overrides: object) -> dict:
    args: dict = dict(
        model_bytes=1e9, learner_up_mbit=1000, t_train=10, rollouts_per_update=4, staleness=3,
        workers=load_candidates(write(tmp_path, CANDIDATES)), pipelined=False,  # ECHO-2's model: peers wait for weights
    )
    return plan_from_inputs(**{**args, **overrides})


def test_candidates_load_with_rates_in_bytes_per_second(tmp_path: Path) -> None:
    workers = load_candidates(write(tmp_path, CANDIDATES))
    assert [w.peer_id for w in workers] == ["a", "b", "c", "z"]
    assert workers[0] == Candidate("a", 2.0, 1.0, bandwidth=1000 * MBIT, up=1000 * MBIT)
    assert workers[3].up is None and workers[3].bandwidth == 500 * MBIT
    assert all(isinstance(w, Worker) for w in workers)  # what protocol.capacity takes
    # `name` for `peer_id`, columns in any order, no up_mbit column, a BOM, blank lines.
    other = write(tmp_path, "\ufeffprice, name ,bandwidth_mbit,mu\n\n0.5,x,100,1\n,,,\n")
    assert load_candidates(other) == [Candidate("x", 1.0, 0.5, bandwidth=100 * MBIT)]


def test_the_worked_example_end_to_end(tmp_path: Path) -> None:
    plan = example(tmp_path)
    assert set(plan) == KEYS
    assert json.loads(json.dumps(plan, allow_nan=False)) == plan  # strict JSON
    assert plan["chosen"] == ["a"]
    assert plan["rounds"] == 3
    assert plan["kappa"] == 2 and plan["kappa_warning"] is None
    assert plan["t_bcast_bound_s"] == pytest.approx(8.0)
    assert plan["mu_min"] == pytest.approx(8 / 12)
    assert plan["target"] == pytest.approx(1.1 * 8 / 12)
    assert (plan["mu_active"], plan["cost_per_hour"]) == (2.0, 1.0)
    assert plan["delta_max_predicted"] == 3  # 2 + ⌈(1 − 1/2)·8/10⌉
    assert plan["idle_predicted"] == 0.0
    assert plan["feasible"] is True
    assert any("downlink / 5" in note for note in plan["notes"])  # z's uplink was defaulted
    table = format_table(plan)
    assert "chosen    1 of 4: a" in table
    assert "1.00 per hour" in table
    assert "feasible  yes" in table


def test_async_mode_plans_for_peers_that_generate_while_weights_download(tmp_path: Path) -> None:
    """Pipelined (async, the default, as the learner's): the broadcast costs staleness, not
    generation time, so μ_min = R/T_train, and a broadcast slower than κ updates is no longer
    infeasible."""
    plan = example(tmp_path, pipelined=True)
    assert plan["mu_min"] == pytest.approx(4 / 10)  # waiting peers: κ·R/(κ·T_train − T_bcast) = 8/12
    assert plan["inputs"]["pipelined"] is True
    slow = example(tmp_path, pipelined=True, learner_up_mbit=100)  # G/b0 = 80 s > κ·T_train = 20 s
    assert slow["feasible"] is True and slow["mu_min"] == pytest.approx(0.4)
    short = example(tmp_path, pipelined=True, rollouts_per_update=64)
    assert "μ_min = R/T_train = 64/10" in short["reason"]


def test_the_iteration_settles_on_the_chosen_sets_own_bound(tmp_path: Path) -> None:
    """The first round (bound over every candidate) chooses a and b; the reported T_bcast is
    the bound for the set finally chosen, not for the candidates."""
    plan = example(tmp_path)
    chosen = [w for w in load_candidates(write(tmp_path, CANDIDATES)) if w.peer_id in plan["chosen"]]
    own = broadcast_bound(1e9, 1000 * MBIT, [w.bandwidth for w in chosen], [w.up for w in chosen])
    assert plan["t_bcast_bound_s"] == own
    everyone = broadcast_bound(1e9, 1000 * MBIT, [1000 * MBIT] * 3 + [500 * MBIT], [1000 * MBIT] * 3 + [100 * MBIT])
    assert everyone == pytest.approx(16.0)
    assert own == pytest.approx(8.0)


def test_a_set_that_does_not_settle_is_reported_with_its_own_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_module, "MAX_ROUNDS", 1)
    plan = example(tmp_path)
    assert plan["chosen"] == ["a", "b"]  # round 1's choice, as it is
    assert plan["t_bcast_bound_s"] == pytest.approx(8.0)  # a and b's bound, not all four's 16 s
    assert plan["feasible"] is True
    assert any("did not settle" in note for note in plan["notes"])


def test_a_pool_that_falls_short_is_infeasible_with_all_chosen(tmp_path: Path) -> None:
    plan = example(tmp_path, rollouts_per_update=64)  # μ_min = 128/4 = 32/s, the pool has 7/s
    assert plan["feasible"] is False
    assert plan["chosen"] == ["a", "b", "c", "z"]
    assert "whole pool gives 7/s < target 35.2/s" in plan["reason"]
    assert plan["idle_predicted"] > 0
    assert "feasible  NO" in format_table(plan)


def test_a_broadcast_slower_than_kappa_updates_is_infeasible_whatever_the_pool(tmp_path: Path) -> None:
    plan = example(tmp_path, learner_up_mbit=100)  # G/b0 = 80 s > κ·T_train = 20 s
    assert plan["feasible"] is False
    assert plan["mu_min"] is None and plan["target"] is None
    assert "no pool avoids training bubbles" in plan["reason"]
    assert "no pool avoids training bubbles" in plan["kappa_warning"]
    assert any("learner uplink" in note for note in plan["notes"])  # the bottleneck is named
    json.dumps(plan, allow_nan=False)
    assert "unbounded" in format_table(plan)


def test_a_given_kappa_is_used_and_warned_about(tmp_path: Path) -> None:
    plan = example(tmp_path, kappa=4)
    assert plan["kappa"] == 4
    assert "Δ_max = 5 > S = 3" in plan["kappa_warning"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (HEAD + "\na,1,1,100\nb,nan,1,100\n", ":3: column 2 (mu): must be a finite number >= 0"),
        ("peer_id,mu,price,bandwidth_mbit\na,1,-1,100\n", ":2: column 3 (price): must be a finite number >= 0"),
        ("peer_id,mu,price,bandwidth_mbit\na,1,1,0\n", ":2: column 4 (bandwidth_mbit): must be a finite number > 0"),
        ("peer_id,mu,price,bandwidth_mbit\na,1,1,inf\n", ":2: column 4 (bandwidth_mbit): must be a finite number > 0"),
        ("peer_id,mu,price,bandwidth_mbit\na,,1,100\n", ":2: column 2 (mu): missing"),
        ("peer_id,mu,price,bandwidth_mbit\na,fast,1,100\n", ":2: column 2 (mu): not a number: 'fast'"),
        (HEAD + ",up_mbit\na,1,1,100,-5\n", ":2: column 5 (up_mbit): must be a finite number >= 0"),
        ("name,mu,price,bandwidth_mbit\na,1,1,100\na,2,1,100\n", ":3: column 1 (name): 'a' already on line 2"),
        ("peer_id,mu,price,bandwidth_mbit\n,1,1,100\n", ":2: column 1 (peer_id): missing"),
        ("peer_id,mu,price,bandwidth_mbit\n\x1b[2Jx,1,1,100\n", ":2: column 1 (peer_id): must be printable"),
        ("peer_id,mu,price,bandwidth_mbit\na,1,1\n", ":2: 3 fields, the header has 4"),
        ("peer_id,mu,price\na,1,1\n", ":1: missing column(s): bandwidth_mbit"),
        ("peer_id,mu,price,bandwidth_mbit,up_mbits\n", ":1: column 5: unknown column 'up_mbits'"),
        ("peer_id,name,mu,price,bandwidth_mbit\n", ":1: column 2: 'name' repeats column 1"),
        ("peer_id,mu,price,bandwidth_mbit\n", ":1: no candidates after the header"),
        ("", ":1: empty file"),
        ("peer_id,mu,price,bandwidth_mbit\na,1\x00,1,100\n", ":2: column 2 (mu): not a number: '1\\x00'"),
        (HEAD + "\na," + "9" * 200_000 + ",1,100\n", ":2: not CSV: field larger than field limit"),
    ],
    ids=[
        "nan", "negative", "zero-bandwidth", "inf", "missing", "word", "negative-up", "duplicate", "no-id",
        "escape", "short-row", "no-column", "unknown-column", "repeated-column", "no-rows", "empty", "nul",
        "huge-field",
    ],
)
def test_a_bad_candidates_file_is_one_line_naming_file_line_and_column(tmp_path: Path, text: str, where: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_candidates(path)
    message = str(info.value)
    assert message.startswith(f"{path}{where}"), message
    assert "\n" not in message


def test_unreadable_candidates_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not UTF-8"):
        load_candidates(write(tmp_path, b"peer_id,mu\n\xff\xfe,1\n"))
    with pytest.raises(ValueError, match="nope.csv: cannot read"):
        load_candidates(tmp_path / "nope.csv")


def test_safetensors_bytes_sums_safetensors_times_the_dtype_factor(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 500)
    (tmp_path / "config.json").write_bytes(b"{}" * 100)
    assert safetensors_bytes(tmp_path) == 1500
    assert safetensors_bytes(tmp_path, dtype_factor=0.5) == 750  # fp32 files published as bf16
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        safetensors_bytes(tmp_path / "config.json")
    with pytest.raises(ValueError, match="dtype_factor"):
        safetensors_bytes(tmp_path, dtype_factor=math.nan)


def test_inputs_without_downlinks_or_with_a_bad_uplink_are_refused() -> None:
    with pytest.raises(ValueError, match="'w': a downlink bandwidth"):
        plan_from_inputs(
            model_bytes=1e9, learner_up_mbit=1000, t_train=10, rollouts_per_update=4, staleness=3,
            workers=[Worker("w", 1, 1)],
        )
    with pytest.raises(ValueError, match="learner uplink"):
        plan_from_inputs(
            model_bytes=1e9, learner_up_mbit=math.nan, t_train=10, rollouts_per_update=4, staleness=3,
            workers=[Worker("w", 1, 1, bandwidth=MBIT)],
        )
    with pytest.raises(ValueError, match="no candidate workers"):
        plan_from_inputs(
            model_bytes=1e9, learner_up_mbit=1000, t_train=10, rollouts_per_update=4, staleness=3, workers=[]
        )


STATUS = {
    "t_train": 10.0,
    "t_bcast": 8.0,
    "rollouts_per_update": 4,
    "staleness": 3,
    "kappa": 2,
    "workers": [
        {"peer_id": "a", "mu": 2.0, "price": 1.0},
        {"peer_id": "b", "mu": 2.0, "price": 1.5},
        {"peer_id": "idle", "mu": 0, "price": 0.1},  # not measured yet: ranked last
    ],
}


def test_plan_from_a_learners_measurements_has_the_same_shape() -> None:
    plan = plan_from_status(STATUS)
    assert set(plan) == KEYS
    assert plan["t_bcast_source"] == "measured" and plan["rounds"] == 0
    assert plan["t_bcast_bound_s"] == 8.0
    assert plan["chosen"] == ["a"]
    assert plan["mu_min"] == pytest.approx(8 / 12)
    assert plan["feasible"] is True
    table = format_table(plan)
    assert "measured" in table and "chosen    1 of 3: a" in table
    # The learner's capacity record lists workers as peer_id -> {mu, price}: the same plan.
    by_id = {w["peer_id"]: {"mu": w["mu"], "price": w["price"]} for w in STATUS["workers"]}
    assert plan_from_status({**STATUS, "workers": by_id}) == plan


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"t_train": None}, "lacks t_train"),
        ({"t_bcast": math.nan}, "t_bcast must be finite"),
        ({"t_bcast": "8"}, "t_bcast must be a real number"),
        ({"kappa": 2.0}, "kappa must be an integer"),
        ({"staleness": -1}, "staleness must be an integer >= 0"),
        ({"workers": "a"}, "workers must be a list"),
        ({"workers": [{"peer_id": "a", "mu": 1}]}, r"workers\[0\] must be a mapping"),
        ({"workers": {"a": 1}}, r"workers\[0\] must be a mapping"),
        ({"workers": [{"peer_id": "a", "mu": -1, "price": 1}]}, r"workers\[0\]: mu"),
        ({"workers": [{"peer_id": "a\n", "mu": 1, "price": 1}]}, r"workers\[0\]: peer_id must be printable"),
        ({"workers": [{"peer_id": "a", "mu": 1, "price": 1}] * 2}, "appears twice"),
    ],
)
def test_a_bad_learner_status_is_one_clear_error(change: dict, message: str) -> None:
    status = {**STATUS, **change}
    if change.get("t_train", 0) is None:
        del status["t_train"]
    with pytest.raises(ValueError, match=message):
        plan_from_status(status)


def test_the_plan_command_offline(tmp_path: Path) -> None:
    """`echo-node plan` from a CSV, as a table and as JSON; a missing input is one line."""
    from echo_node.cli import main

    csv = tmp_path / "workers.csv"
    csv.write_text("peer_id,mu,price,bandwidth_mbit\ncheap,50,0.5,500\ndear,80,3.0,500\nfree,10,0,100\n")
    args = ["plan", "--candidates", str(csv), "--model-bytes", "1e7", "--learner-up", "1000", "--t-train", "2",
            "--rollouts-per-update", "64", "--staleness", "4"]
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    plan = json.loads(out.getvalue())
    assert plan["feasible"] and plan["kappa"] == 3 and "free" in plan["chosen"] and "dear" not in plan["chosen"]
    assert plan["inputs"]["pipelined"] is True and plan["mu_min"] == pytest.approx(64 / 2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--mode", "pull", "--json"]) == 0
    pull = json.loads(out.getvalue())
    # Pull: every version published (κ = 1) and waited for: μ_min = R/(T_train − T_bcast).
    assert pull["inputs"]["pipelined"] is False and pull["kappa"] == 1
    assert pull["mu_min"] == pytest.approx(64 / (2 - pull["t_bcast_bound_s"]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*args, "--mode", "pull", "--kappa", "3"]) == 2
    assert "--mode pull publishes every version: --kappa must be 1, got 3" in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["plan", "--candidates", str(csv)]) == 2
    assert "offline planning needs --learner-up, --t-train, --model or --model-bytes" in err.getvalue()
