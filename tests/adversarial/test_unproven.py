"""Publishers the learner has not proven yet (echo_node/learner/spot_check.py, `Verifier.proven`: fewer than
`trust_tokens` of their tokens passed checks, and, on a replayable engine, their noise not shown
to be ours). Their batches never reach training unchecked, and together they move a step by at
most `verify.unproven_share` of a full one, whoever else has data and however many identities
they use. Real verifier, intake, buffer and optimizer; the checker is held busy by hand where a
test needs it busy."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

from echo_node.config import VerifyConfig
from echo_node.learner.intake import BESIDE_WAITING
from echo_node.learner.replay import ReplayBuffer, step_weights
from echo_node.learner.spot_check import EARNING_RATE, Verifier
from echo_node.ml.grpo import PolicyOptimizer, TrainGroup
from echo_node.ml.model import build_model, tiny_llama_config
from protocol import Identity, seal
from tests.adversarial.test_unchecked_backlog import ATTACKERS, checking_learner
from tests.factories import ALICE, TASK, TOKENIZER, make_batch, make_group
from tests.sampling import RUN, sample_batch, tiny_model


def test_an_unproven_publishers_batch_is_checked_or_dropped_never_trained_unchecked(tmp_path: Path) -> None:
    """While the checker is busy, an unproven publisher's batches wait for it (two at most) and
    the rest are dropped as `unchecked`, counted; their seqs count as delivered, not as skips.
    Every one of its groups that reaches the buffer passed its own check. A proven publisher's
    batch in the same moment still goes unchecked (`checker_busy`): its trust was earned."""
    learner = checking_learner(tmp_path)
    intake, verifier = learner.intake, learner.verifier
    assert verifier is not None
    held, young, trusted = ATTACKERS[0], ATTACKERS[1], ATTACKERS[2]
    for who in (held, young, trusted):
        learner.peers.join(who.peer_id, 0.0)
        verifier._probation[who.peer_id] = 0  # past probation
    verifier._trusted_tokens[trusted.peer_id] = 1 << 30
    verifier._rng = SimpleNamespace(random=lambda: 0.0)  # type: ignore[assignment]  # every batch is chosen
    release, checking = threading.Event(), threading.Event()
    checked: list[tuple[str, int]] = []

    def spot(batch: Any, indices: list[int], *, rows: int | None = None, budgeted: bool = False) -> None:
        if batch.peer_id == held.peer_id:
            checking.set()
            assert release.wait(30)
        checked.append((batch.peer_id, batch.seq))
        return None

    verifier.spot = spot  # type: ignore[method-assign]
    sent = 6

    async def main() -> None:
        send, receive = trio.open_memory_channel[Any](32)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(intake.consume, receive)
            for who, seqs in ((held, [1]), (young, range(1, sent + 1)), (trusted, [1])):
                for seq in seqs:
                    data = seal(make_batch(identity=who, seq=seq, groups=2), who)
                    assert intake.validate(who.peer_id, who.peer_id, data)
                    await send.send(SimpleNamespace(data=data, sender=who.peer_id))
            with trio.fail_after(30):
                while learner.buffer.ledger.received < (sent - 2 + 1) * 16:
                    await trio.sleep(0.01)
            assert checking.is_set()
            assert not [g for g in learner.buffer._groups if learner.buffer.origin(g) == young.peer_id]
            release.set()
            with trio.fail_after(30):
                while len(checked) < 3:
                    await trio.sleep(0.01)
            await send.aclose()

    trio.run(main)
    assert BESIDE_WAITING >= 3
    assert verifier.stats.unproven_dropped == sent - 2 and verifier.stats.checker_busy == 1
    assert learner.buffer.ledger.dropped["unchecked"] == (sent - 2) * 16
    assert checked == [(held.peer_id, 1), (young.peer_id, 1), (young.peer_id, 2)]
    buffered = {(learner.buffer.origin(g), g.group_id) for g in learner.buffer._groups}
    assert {o for o, _ in buffered} == {held.peer_id, young.peer_id, trusted.peer_id}
    assert sum(o == young.peer_id for o, _ in buffered) == 2 * 2  # the two checked batches, nothing else
    assert intake.tracker.skips(young.peer_id)[0] == 0 and not intake.tracker.missing(young.peer_id)
    learner.buffer.check()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


def test_no_credit_never_excuses_an_unproven_publishers_batch(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher cannot get its batch past the checks by sending it when the budget is spent
    (the learner's credit is not something it can see, but it can flood to spend it): while
    unproven, its batch is checked in full anyway (every row, up to UNPROVEN_ROWS); once proven,
    by tokens that passed or by its noise, an unaffordable batch goes unchecked (`over_budget`),
    as every proven peer's."""
    from echo_node.learner import spot_check as verify_module

    v = Verifier(VerifyConfig(spot_rate=1.0, probation_batches=0, budget=0.05, min_rows=2), run_id=RUN, tokenizer=TOKENIZER,
                 task=TASK, model=model, temperature=1.0, keep_versions=4, engine_of=lambda peer: ("torch", "cpu"))
    batch = sample_batch(model, groups=8)
    clock = [1000.0]
    monkeypatch.setattr(verify_module.time, "monotonic", lambda: clock[0])
    v._budget_from = clock[0]
    v._cost_per_row = 1.0  # no credit for a single row
    for _ in range(5):
        plan = v.plan(batch)
        assert plan is not None and plan.rows == min(batch.num_samples, verify_module.UNPROVEN_ROWS) > 2
    assert v.stats.over_budget == 0 and not v.proven(ALICE.peer_id)
    v._shared_noise[ALICE.peer_id] = (25.0, None)  # its tokens proved it draws the assigned noise ...
    assert not v.proven(ALICE.peer_id)  # ... which says nothing yet of its distribution
    v._trusted_tokens[ALICE.peer_id] = v.cfg.trust_tokens // verify_module.NOISE_TRUST  # judged exactly, passed
    assert v.proven(ALICE.peer_id) and v.plan(batch) is None and v.stats.over_budget == 1
    del v._shared_noise[ALICE.peer_id]
    assert not v.proven(ALICE.peer_id)
    v._trusted_tokens[ALICE.peer_id] = v.cfg.trust_tokens
    assert v.proven(ALICE.peer_id) and v.plan(batch) is None and v.stats.over_budget == 2
    v.suspect(ALICE.peer_id)  # a refused message starts trust over
    assert not v.proven(ALICE.peer_id)


def test_no_credit_never_excuses_a_chosen_batch_until_trust_is_earned_in_full(model: torch.nn.Module,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Honest until proven, lying after (benchmarks.verification's `rotating`): proven by 4,096
    tokens that passed, it is still checked on nearly every batch, and a chosen batch gets the
    smallest check with no credit left (an attacker's Sybils on probation can spend it); only
    once its check rate is down to EARNING_RATE may an unaffordable batch go unchecked."""
    from echo_node.learner import spot_check as verify_module

    v = Verifier(VerifyConfig(spot_rate=0.1, probation_batches=0, budget=0.05, min_rows=2), run_id=RUN, tokenizer=TOKENIZER,
                 task=TASK, model=model, temperature=1.0, keep_versions=4)
    batch = sample_batch(model, groups=8)
    clock = [1000.0]
    monkeypatch.setattr(verify_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(v._rng, "random", lambda: 0.0)  # every batch is chosen
    v._budget_from = clock[0]
    v._cost_per_row = 1.0  # no credit for a single row
    v.plan(batch)  # (first sight: it becomes a suspect, trust at zero)
    v._trusted_tokens[ALICE.peer_id] = v.cfg.trust_tokens
    assert v.proven(ALICE.peer_id) and v.earning(ALICE.peer_id) and v.check_rate(ALICE.peer_id) == 1.0
    plan = v.plan(batch)
    assert plan is not None and plan.rows == 2 and v.stats.over_budget == 0
    v._trusted_tokens[ALICE.peer_id] = 2 * v.cfg.trust_tokens - 1
    assert v.earning(ALICE.peer_id) and v.plan(batch) is not None
    v._trusted_tokens[ALICE.peer_id] = 2 * v.cfg.trust_tokens
    assert v.check_rate(ALICE.peer_id) == EARNING_RATE and not v.earning(ALICE.peer_id)
    assert v.plan(batch) is None and v.stats.over_budget == 1


def test_sybils_on_probation_do_not_spend_the_budget_of_proven_publishers(model: torch.nn.Module,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks the budget cannot refuse (probation, a publisher still earning trust) spend only the
    credit there is. Charged in full, fresh identities each checked on probation drove the
    credit below zero, and every chosen batch of a proven publisher then went unchecked
    (`over_budget`) for 1/budget seconds per CPU-second their checks cost, long after they were
    gone: Sybils bought a proven liar time without checks. The budget's own checks still spend it."""
    from echo_node.learner import spot_check as verify_module

    v = Verifier(VerifyConfig(spot_rate=1.0, probation_batches=1, budget=0.05, min_rows=2), run_id=RUN, tokenizer=TOKENIZER,
                 task=TASK, model=model, temperature=1.0, keep_versions=4)
    clock = [1000.0]
    monkeypatch.setattr(verify_module.time, "monotonic", lambda: clock[0])
    for i in range(3):
        sybil = sample_batch(model, identity=Identity.from_seed(bytes([0x40 + i]) * 32), groups=2)
        plan = v.plan(sybil)
        assert plan is not None and plan.probation and not plan.budgeted
        assert v.spot(sybil, plan.groups, rows=plan.rows, budgeted=plan.budgeted) is None
    assert v.stats.spot_s > 0 and v._cost_per_row is not None
    assert v.credit_s() == 0.0  # spent down to nothing, not below
    clock[0] += 4 * v._cost_per_row / 0.05  # credit for about four rows, far less than the Sybils cost
    assert v.credit_s() > 3 * v._cost_per_row
    v._probation[ALICE.peer_id] = 0
    v._trusted_tokens[ALICE.peer_id] = 1 << 30  # proven long ago: checked as the budget allows
    batch = sample_batch(model, groups=2)
    plan = v.plan(batch)
    assert plan is not None and plan.budgeted and plan.rows is not None and plan.rows >= 2 and v.stats.over_budget == 0
    before = v.credit_s()
    assert v.spot(batch, plan.groups, rows=plan.rows, budgeted=plan.budgeted) is None
    assert v.credit_s() < before  # what the budget chose, it paid for


@pytest.mark.parametrize("identities", [1, 3, 64])
def test_unproven_publishers_share_one_quota_of_a_step_however_many_identities(identities: int) -> None:
    """Sybils do not multiply the quota: all unproven groups of a step weigh share x N together;
    proven groups weigh 1; one unproven group never more than 1."""
    n, share = 8, 0.25
    unproven = [True] * identities + [False] * 3
    weights = step_weights(unproven, n, share)
    assert sum(w for w, u in zip(weights, unproven) if u) == pytest.approx(min(identities, share * n))
    assert all(w == 1.0 for w, u in zip(weights, unproven) if not u)
    assert step_weights([False] * 8, n, share) == [1.0] * 8


def test_a_step_takes_unproven_groups_only_where_proven_ones_leave_room() -> None:
    """With proven groups admissible, unproven publishers (any number of identities) get at most
    share x N slots of a step, one each, and do not fill what proven ones leave empty (the step
    is smaller); alone, they fill it (the learner does not wait for proven data)."""
    buffer = ReplayBuffer(mode="pull", staleness=0, capacity_groups=1000, max_share=0.5)
    sybils = [f"sybil{i}" for i in range(20)]
    for i in range(8):
        buffer.offer(make_group(n=100 + i), 0, ("honest0", "honest1")[i % 2])
    for i in range(40):  # fresher than the proven ones: ranked first
        buffer.offer(make_group(n=i), 0, sybils[i % 20])

    def unproven(origin: str) -> bool:
        return origin.startswith("sybil")

    taken = buffer.take(8, 0, unproven=unproven, unproven_share=0.25)
    assert sum(unproven(buffer.origin(g)) for g in taken) == 2 and len(taken) == 8
    buffer.mark_trained(taken)
    taken = buffer.take(8, 0, unproven=unproven, unproven_share=0.25)
    assert sum(unproven(buffer.origin(g)) for g in taken) == 2 and len(taken) == 4  # 2 proven groups left: not filled
    buffer.mark_trained(taken)
    alone = buffer.take(8, 0, unproven=unproven, unproven_share=0.25)
    assert len(alone) == 8 and all(unproven(buffer.origin(g)) for g in alone)


def test_one_unproven_publisher_gets_one_slot_of_a_step_beside_proven_data() -> None:
    """An attacker whose lies only pooled evidence proves is caught after a few batches; until
    then, however much it sends and however fresh, it trains one group per step while proven
    groups can fill the rest (below the quota of two that several unproven publishers share),
    and `unproven_groups` in all: then none, until it is proven."""
    buffer = ReplayBuffer(mode="pull", staleness=0, capacity_groups=1000, max_share=0.5)
    for i in range(40):
        buffer.offer(make_group(n=100 + i), 0, ("honest0", "honest1")[i % 2])
    for i in range(40):  # fresher than the proven ones: ranked first
        buffer.offer(make_group(n=i), 0, "attacker")
    attacker = [0, 0]  # (trained while unproven, trained once proven)
    for step in range(5):
        proven = step >= 4
        taken = buffer.take(8, 0, unproven=lambda o: o == "attacker" and not proven, unproven_share=0.25, unproven_groups=2)
        assert len(taken) == 8
        attacker[proven] += [buffer.origin(g) for g in taken].count("attacker")
        if not proven:
            assert [buffer.origin(g) for g in taken].count("attacker") == (1 if step < 2 else 0)
        buffer.mark_trained(taken)
    assert attacker == [2, 4]  # proven: up to its max_peer_share of a step


def test_alone_unproven_publishers_still_fill_a_step_past_their_groups_beside_proven_data() -> None:
    """The cap holds beside proven data only: with nobody proven (a run's start) the learner
    does not wait, and unproven groups fill the step at their loss weight."""
    buffer = ReplayBuffer(mode="pull", staleness=0, capacity_groups=1000, max_share=0.5)
    for i in range(16):
        buffer.offer(make_group(n=i), 0, ("a", "b")[i % 2])
    for _ in range(2):
        taken = buffer.take(8, 0, unproven=lambda o: True, unproven_share=0.25, unproven_groups=2)
        assert len(taken) == 8
        buffer.mark_trained(taken)


def test_alone_a_publisher_that_left_out_seqs_trains_no_more_than_its_cap_until_proven() -> None:
    """The fill of a step nobody proven can fill is for a run's honest start: a publisher with
    seqs owed, skipped or disowned (`clean` False: it may have chosen its slots) trains its
    `unproven_groups` and then waits for its proof, alone or beside clean unproven ones."""
    buffer = ReplayBuffer(mode="pull", staleness=0, capacity_groups=1000, max_share=0.5)
    for i in range(24):
        buffer.offer(make_group(n=i), 0, ("honest", "picker")[i % 2])
    trained: list[str] = []
    for _ in range(3):
        taken = buffer.take(8, 0, unproven=lambda o: True, unproven_share=0.25, unproven_groups=2,
                            clean=lambda o: o != "picker")
        trained += [buffer.origin(g) or "?" for g in taken]
        buffer.mark_trained(taken)
    assert trained.count("picker") == 2 and trained.count("honest") == 12
    assert len(buffer) == 10 and buffer.take(8, 0, unproven=lambda o: True, unproven_groups=2, clean=lambda o: o != "picker") == []
    # Clean again (its gaps repaired) or proven: it fills as before.
    assert len(buffer.take(8, 0, unproven=lambda o: True, unproven_groups=2)) == 8
    assert len(buffer.take(8, 0, unproven=lambda o: False, unproven_groups=2, clean=lambda o: False)) == 2


def _update(model: torch.nn.Module, weight: float, history: int) -> float:
    """How far (L2) one update on a fixed batch at `weight` moves `model`'s parameters, after
    `history` full-weight updates on other data (AdamW's running scale)."""
    torch.manual_seed(0)
    opt = PolicyOptimizer(model, lr=1e-3, pad_id=0)
    prompt = [1, 5, 6]

    def group(w: float, salt: int) -> TrainGroup:
        rows = [[7 + salt, 8, 2], [9, 10 + salt, 2], [11, 12, 2 + salt], [13, 14, 2]]
        return TrainGroup(prompt, rows, [[-1.0] * 3] * 4, [1.0, 0.0, 0.5, 0.0], weight=w)

    for i in range(history):
        opt.step([group(1.0, i % 3)])
    before = [p.detach().clone() for p in model.parameters()]
    stats = opt.step([group(weight, 0)])
    assert stats["weight_mean"] == pytest.approx(weight)
    return float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))))


@pytest.mark.parametrize("history", [0, 3])
def test_an_unproven_step_moves_the_weights_by_its_weight_of_a_full_step(history: int) -> None:
    """AdamW divides the gradient by its own running scale, so weighting the loss alone would let
    a lone unproven publisher move the weights as far as a proven one (at the start of a run,
    exactly as far). With the learning rate scaled by the step's mean weight, a step of
    unproven groups alone moves them by that weight of a full step."""
    base = build_model(tiny_llama_config(TOKENIZER.vocab_size))
    full = _update(copy.deepcopy(base), 1.0, history)
    quarter = _update(copy.deepcopy(base), 0.25, history)
    assert quarter == pytest.approx(0.25 * full, rel=0.05)


def test_a_group_weight_outside_0_1_is_refused() -> None:
    for w in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            TrainGroup([1], [[3, 2], [4, 2]], [[-0.1, -0.1]] * 2, [1.0, 0.0], weight=w)


def test_the_config_refuses_a_share_outside_0_1_and_a_negative_cap() -> None:
    from echo_node.config import RunConfig, validate

    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="unproven_share"):
            validate(RunConfig(verify=VerifyConfig(unproven_share=share)))
    with pytest.raises(ValueError, match="unproven_groups"):
        validate(RunConfig(verify=VerifyConfig(unproven_groups=-1)))
