"""No stall when rewards carry no signal: a batch in which no group has reward variance makes no
version (so nothing peers hold goes stale and nobody waits for weights that would not differ),
is counted as `no_signal`, and training resumes at the first batch with a group that has
variance. A peer told of a newer number for the weights it holds moves to it without a transfer.
No network runs (the learner's libp2p host is not started)."""

from __future__ import annotations

import json

from pathlib import Path
from types import SimpleNamespace

import trio

from echo_node.config import NetConfig, RunConfig
from echo_node.learner.learner import Learner
from echo_node.peer.weight_follower import Target, WeightFollower
from echo_node.weights.broadcast import DataServer
from protocol import seal
from tests.factories import ALICE, learner_tasks, make_batch
from tests.node.test_resume import BOB, GROUPS_PER_STEP, new_learner, start

ROLLOUTS = 8  # samples per factory group


async def feed(learner: Learner, seq: int, rewards: list[float] | None) -> None:
    """One update's worth: a one-group batch from each of two peers, sampled on the published
    version; `rewards` for every group (None: the task's own, which vary)."""
    for peer in (ALICE, BOB):
        kw = {} if rewards is None else {"rewards": rewards}
        batch = make_batch(identity=peer, seq=seq, version=learner.weights.published, **kw)
        envelope = seal(batch, peer)
        assert learner.intake.validate(peer.peer_id, peer.peer_id, envelope)
        await learner.intake.deliver(envelope, peer.peer_id)



async def update(learner: Learner) -> None:
    """One update, and the checkpoint it may have started written (Learner.run's nursery does that)."""
    async with learner_tasks(learner):
        await learner.update()

def test_twenty_batches_without_reward_variance_make_no_version_and_nothing_stale(tmp_path: Path) -> None:
    learner = new_learner(tmp_path)  # staleness 4: 20 bumped versions would have made v0 stale
    records: list[dict[str, object]] = []
    learner._write = records.append  # type: ignore[method-assign]

    async def go() -> None:
        await start(learner)
        digest0 = learner.state.history.versions[0][0]
        for seq in range(20):
            await feed(learner, seq, [0.0] * ROLLOUTS)
            await update(learner)
            assert learner.version == 0 and learner.weights.published == 0
        ledger = learner.buffer.ledger
        assert ledger.dropped.get("no_signal") == 20 * GROUPS_PER_STEP * ROLLOUTS
        assert ledger.trained == 0 and "stale" not in ledger.dropped
        assert learner.trainer.no_signal_steps == 20
        assert sum(r["event"] == "no_signal" for r in records) == 20
        assert learner.state.history.versions.keys() == {0}, "nothing published for a step that changed nothing"
        # Rollouts sampled on version 0 during all that are still admissible, and the first
        # batch with variance trains at once into a version with new weights.
        await feed(learner, 20, None)
        await update(learner)
        assert learner.version == 1 and learner.buffer.ledger.trained == GROUPS_PER_STEP * ROLLOUTS
        assert learner.state.history.versions[1][0] != digest0
        summary = learner._finish()
        assert summary["no_signal_steps"] == 20
        stages = summary["profile"]["stages"]
        assert stages["train_step"]["calls"] == 21 and stages["metrics"]["calls"] == 1
        assert {"take", "audit", "snapshot", "manifest", "journal_write", "offer", "announce"} <= stages.keys()
        assert summary["rollouts_dropped"]["no_signal"] == 20 * GROUPS_PER_STEP * ROLLOUTS

    trio.run(go)


def test_no_signal_drops_survive_a_restart(tmp_path: Path) -> None:
    """The drops are journaled: a resumed learner neither trains those groups nor counts them twice."""
    learner = new_learner(tmp_path)

    async def first() -> None:
        await start(learner)
        for seq in range(3):
            await feed(learner, seq, [1.0] * ROLLOUTS)
            await update(learner)
        await learner._flush_journal()

    trio.run(first)
    learner._finish()
    again = new_learner(tmp_path)

    async def second() -> None:
        await start(again)
        assert again.version == 0 and len(again.buffer) == 0
        assert again.buffer.ledger.dropped.get("no_signal") == 3 * GROUPS_PER_STEP * ROLLOUTS

    trio.run(second)
    again._finish()


def follower() -> WeightFollower:
    cfg = RunConfig(run_id="run-1", runs_dir=Path("unused"), net=NetConfig())
    session = SimpleNamespace(engine=SimpleNamespace(version=3), spec=SimpleNamespace(sync_mode="async", epoch=1))
    return WeightFollower(cfg, None, DataServer(ALICE, "run-1"), session)  # type: ignore[arg-type]


def test_a_newer_number_for_the_same_weights_is_taken_without_a_transfer() -> None:
    """A publication whose bits did not change (e.g. a tiny step that rounds away in bf16):
    the peer tags its next tokens with the new number instead of going stale on the old one."""
    f = follower()
    f._hand_over(b"weights of 3", 3)
    f._blob_sha, f._blob_epoch = b"\x03" * 32, 1
    f.take_pending()
    same = Target(5, 12, b"\x03" * 32, 4, 1)
    assert f.offer(same) and f.needs(same)

    async def go() -> None:
        await f._fetch(same)  # no data server runs: any transfer would fail

    trio.run(go)
    assert f.installed_version == 5
    assert f.take_pending() == (b"weights of 3", 5)
    assert not f.needs(same)


def test_a_run_that_trained_nothing_writes_strict_json_with_reasons_for_its_nulls(tmp_path: Path) -> None:
    """summary.json is JSON (RFC 8259 has no NaN): what is not a number yet is null, and
    `null_reasons` says why."""
    learner = new_learner(tmp_path)

    async def go() -> None:
        await start(learner)

    trio.run(go)
    learner.trainer.idle_s = float("nan")  # any figure that comes out not a number
    summary = learner._finish()

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} in summary.json")

    written = json.loads((learner.cfg.run_dir / "summary.json").read_text(), parse_constant=refuse)
    assert written["versions"] == summary["versions"] == 0
    assert written["learner_idle_ratio"] is None
    assert written["null_reasons"]["learner_idle_ratio"] == "NaN: no update was trained"
