"""A learner killed at any point of an update resumes where a learner that was not killed is.

Each scenario feeds two learners the same signed batches, one update's worth before each
update: the reference runs through; the other dies at a chosen point (an exception stands in
for SIGKILL: nothing after it runs, and journal records not yet flushed are lost with the
object), and a new learner on the same run folder resumes and goes on. Both must end with
identical parameters and optimizer state, the same version, the same ledger, and no version
number published with two digests. No network runs (the learner's libp2p host is not started;
announcements go nowhere).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from safetensors.torch import load_file as st_load_file

from echo_node.config import CheckpointConfig
from echo_node.learner.checkpoint import CheckpointStore
from echo_node.learner.journal import SEGMENT_GLOB, frame, read_segment
from echo_node.learner.learner import Learner
from protocol import RolloutBatch, seal
from tests.factories import ALICE, BOB, CREATED, learner_tasks, make_batch
from tests.factories import new_learner as make_learner
from tests.factories import start_learner as start

GROUPS_PER_STEP = 2
EVERY = 3  # checkpoint every 3 versions
UPDATES = 7


@pytest.fixture(autouse=True)
def close_reports() -> Any:
    """Each learner here opened its metrics file; a crashed one never closes it itself."""
    yield
    while CREATED:
        CREATED.pop().report.close()


class Crash(BaseException):
    """Stands in for SIGKILL: a BaseException, so no `except Exception` swallows it."""


def new_learner(runs_dir: Path, **cfg: Any) -> Learner:
    return make_learner(runs_dir, groups_per_step=GROUPS_PER_STEP, checkpoint_every=EVERY, **cfg)


def batches_for(update: int, version: int) -> list[RolloutBatch]:
    """The batches fed before `update` (one update's worth, one group from each of two peers),
    sampled on `version`."""
    return [make_batch(identity=peer, seq=update, version=version) for peer in (ALICE, BOB)]


ROLLOUTS_PER_UPDATE = 2 * 8  # two one-group batches of 8 samples


def fed(learner: Learner) -> int:
    """Updates' worth of batches the learner accepted durably (what a restart knows of)."""
    return learner.buffer.ledger.received // ROLLOUTS_PER_UPDATE


async def feed(learner: Learner, update: int) -> None:
    for batch in batches_for(update, learner.weights.published):
        envelope = seal(batch, ALICE if batch.peer_id == ALICE.peer_id else BOB)
        assert learner.intake.validate(batch.peer_id, batch.peer_id, envelope)
        await learner.intake.deliver(envelope, batch.peer_id)
    await learner._flush_journal()  # what the flush loop does within journal_flush_s


async def run_updates(learner: Learner, until: int) -> None:
    """Updates until the learner is at version `until`, feeding the next update's batches
    whenever fewer than a step's groups wait; returns once the checkpoints they made are written."""
    async with learner_tasks(learner):
        while learner.version < until:
            if learner.buffer.count_admissible(learner.version) < GROUPS_PER_STEP:
                await feed(learner, fed(learner))
            await learner.update()


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.model.state_dict().items()}


def assert_same(a: Learner, b: Learner) -> None:
    assert a.version == b.version
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "parameters differ"
    sa, sb = a.trainer.optimizer.opt.state_dict()["state"], b.trainer.optimizer.opt.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) and torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert a.buffer.ledger.trained == b.buffer.ledger.trained
    # Every number one history names, the other names with the same digest.
    ha, hb = a.state.history.versions, b.state.history.versions
    assert all(ha[v] == hb[v] for v in ha.keys() & hb.keys()), "a version number names two digests"


def reference(tmp_path: Path) -> Learner:
    ref = new_learner(tmp_path / "reference")

    async def go() -> None:
        await start(ref)
        await run_updates(ref, UPDATES)

    trio.run(go)
    return ref


def crash_and_resume(tmp_path: Path, arm: Callable[[Learner], None], *, at: int) -> Learner:
    """Run updates until `arm`'s trap fires during update `at`, then resume in a new learner
    and finish the updates."""
    runs = tmp_path / "crashed"
    first = new_learner(runs)

    async def until_crash() -> None:
        await start(first)
        await run_updates(first, at)
        arm(first)
        with pytest.raises(Crash):
            await run_updates(first, at + 1)

    trio.run(until_crash)
    second = new_learner(runs)

    async def resume() -> None:
        await start(second)
        await run_updates(second, UPDATES)

    trio.run(resume)
    assert second.epoch == first.epoch + 1
    return second


def trap(obj: Any, name: str) -> None:
    def fire(*args: Any, **kwargs: Any) -> Any:
        raise Crash(name)

    setattr(obj, name, fire)


@pytest.mark.parametrize(
    "point",
    ["before_the_optimizer_step", "after_the_optimizer_step", "during_a_publication", "during_a_checkpoint_write", "after_a_checkpoint"],
)
def test_a_killed_learner_resumes_with_identical_parameters(tmp_path: Path, point: str) -> None:
    ref = reference(tmp_path)
    arms: dict[str, tuple[int, Callable[[Learner], None]]] = {
        # The optimizer never ran: the batch is still buffered (journaled when accepted).
        "before_the_optimizer_step": (4, lambda ln: trap(ln.trainer.optimizer, "step")),
        # Trained, but the step's journal record was not flushed: trained again after the restart.
        "after_the_optimizer_step": (4, lambda ln: trap(ln, "_publish_version")),
        # The step and the version are durable, peers were not told: redone, same digest.
        "during_a_publication": (4, lambda ln: trap(ln.weights, "publish")),
        # Version 6's checkpoint dies half-written: the one of version 3 and the journal serve.
        "during_a_checkpoint_write": (5, _die_in_checkpoint),
        # Killed right after a checkpoint: nothing to redo.
        "after_a_checkpoint": (3, lambda ln: trap(ln.trainer.optimizer, "step")),
    }
    at, arm = arms[point]
    resumed = crash_and_resume(tmp_path, arm, at=at)
    assert_same(ref, resumed)
    assert resumed.resumed is not None and resumed.resumed.diverged is None, resumed.resumed
    if point == "during_a_checkpoint_write":
        assert resumed.resumed.checkpoint == 3 and resumed.resumed.redone >= 2
        assert not list((tmp_path / "crashed" / "run-1" / "checkpoints").glob(".tmp-*")), "a half-written checkpoint was left"


def _die_in_checkpoint(learner: Learner) -> None:
    """The model file of version 6's checkpoint is written, then the process dies."""
    store = learner.state.store
    write = store.write

    def dying(version: int, epoch: int, writers: dict[str, Callable[[Path], None]]) -> Any:
        model = writers["model.safetensors"]

        def half(path: Path) -> None:
            model(path)
            raise Crash("mid-checkpoint")

        return write(version, epoch, {**writers, "model.safetensors": half})

    store.write = dying  # type: ignore[method-assign]


def test_a_checkpoint_is_written_while_training_goes_on_and_holds_its_own_version(tmp_path: Path) -> None:
    """The update path only copies the state: version 3's checkpoint is still being written (its
    writer thread held) while two more updates train, and what it writes is version 3's weights
    and optimizer state, not what the steps after it made of them. The next due checkpoint (6)
    waits for it."""
    learner = new_learner(tmp_path / "run")
    store = learner.state.store
    write, release = store.write, threading.Event()
    started: list[int] = []

    def held(version: int, epoch: int, writers: dict[str, Callable[[Path], None]]) -> Any:
        started.append(version)
        assert release.wait(30), "the test never released the writer"
        return write(version, epoch, writers)

    store.write = held  # type: ignore[method-assign]
    at_three: dict[str, Any] = {}

    async def go() -> None:
        await start(learner)
        async with learner_tasks(learner):
            await run_updates(learner, 2)
            await feed(learner, fed(learner))
            await learner.update()  # version 3: its checkpoint starts
            at_three["params"] = params(learner)
            at_three["optimizer"] = copy.deepcopy(learner.trainer.optimizer.opt.state_dict()["state"])
            await trio.testing.wait_all_tasks_blocked()
            while learner.version < 5:
                await feed(learner, fed(learner))
                await learner.update()
            assert learner.version == 5 and started == [3] and not (store.directory / f"v{3:012d}").exists()
            release.set()
        assert (store.directory / f"v{3:012d}").exists()

    trio.run(go)
    checkpoint = store.newest(lambda c: c)
    assert checkpoint is not None and checkpoint[0].version == 3
    saved = st_load_file(checkpoint[0].file("model.safetensors"))
    assert all(torch.equal(saved[k], at_three["params"][k]) for k in saved)
    assert any(not torch.equal(saved[k], params(learner)[k]) for k in saved), "later steps changed nothing: the test proves nothing"
    optimizer = torch.load(checkpoint[0].file("optimizer.pt"), weights_only=False)["optimizer"]["state"]
    assert all(torch.equal(optimizer[i]["exp_avg"], at_three["optimizer"][i]["exp_avg"]) for i in optimizer)


def test_checkpoints_come_no_sooner_than_min_interval_s(tmp_path: Path) -> None:
    """Versions 3 and 6 are due by count, but an hour has not passed since the start: none is
    written until the clock says so; then the next update checkpoints, and the count restarts
    from that version."""
    learner = new_learner(tmp_path / "run", checkpoint=CheckpointConfig(every_versions=EVERY, min_interval_s=3600))
    clock = trio.testing.MockClock()
    checkpoints = learner.state.store

    async def go() -> None:
        await start(learner)
        await run_updates(learner, 6)
        assert checkpoints.states() == []
        clock.jump(3600)
        await run_updates(learner, 7)
        assert [s["version"] for s in checkpoints.states()] == [7]
        clock.jump(3600)
        await run_updates(learner, 9)
        assert [s["version"] for s in checkpoints.states()] == [7], "9 is only 2 versions after 7"
        await run_updates(learner, 10)
        assert [s["version"] for s in checkpoints.states()] == [10, 7]

    trio.run(go, clock=clock)


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ref = reference(tmp_path)
    runs = tmp_path / "crashed"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 6)  # checkpoints at versions 3 and 6

    trio.run(go)
    newest = runs / "run-1" / "checkpoints" / f"v{6:012d}" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    second = new_learner(runs)

    async def resume() -> None:
        await start(second)
        await run_updates(second, UPDATES)

    trio.run(resume)
    assert "v000000000006: model.safetensors does not match its digest; trying the previous one" in caplog.text
    assert second.resumed is not None and second.resumed.checkpoint == 3
    assert_same(ref, second)


def test_a_truncated_journal_tail_loses_nothing_durable(tmp_path: Path) -> None:
    """A crash mid-write tears the journal's last record: everything before it is replayed."""
    runs = tmp_path / "run"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 2)
        await feed(first, 2)

    trio.run(go)
    segment = sorted((runs / "run-1" / "journal").glob(SEGMENT_GLOB))[-1]
    records, problem = read_segment(segment)
    assert problem is None and records[-1][0] == "tx" and [r[0] for r in records[-1][1]] == ["seen", "admit"]
    segment.write_bytes(segment.read_bytes()[:-3])  # BOB's batch: torn in the middle of its record
    second = new_learner(runs)
    trio.run(start, second)
    assert second.version == 2
    # ALICE's batch was durable: buffered again. BOB's is unknown, seq and group alike, so the
    # next seq BOB publishes makes it a gap that repair asks for.
    assert [origin for _, origin, _ in second.buffer.live()] == [ALICE.peer_id]
    assert second.intake.tracker.highest(BOB.peer_id) == 1 and second.intake.tracker.highest(ALICE.peer_id) == 2
    second.buffer.check()


def test_a_resume_that_cannot_redo_continues_above_every_published_number(tmp_path: Path) -> None:
    """Old-incarnation rollouts keep their version tags, and no number is reused: a step whose
    groups the journal lost cannot be redone, so the resumed weights get a new number."""
    runs = tmp_path / "run"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 5)  # versions 1..5 published, checkpoint at 3

    trio.run(go)
    published = dict(first.state.history.versions)
    # Lose the groups of the step to version 5 from the journal (admitted after checkpoint 3).
    segment = sorted((runs / "run-1" / "journal").glob(SEGMENT_GLOB))[-1]
    records, _ = read_segment(segment)
    step5 = next(r for r in records if r[0] == "step" and r[1] == 5)
    lost = set(step5[2])

    def without_lost(record: list[Any]) -> list[Any]:
        if record[0] == "tx":
            return ["tx", [r for r in record[1] if not (r[0] == "admit" and r[1] in lost)]]
        return record

    segment.write_bytes(b"".join(frame(without_lost(r)) for r in records))
    second = new_learner(runs)

    async def resume() -> None:
        await start(second)
        # A batch a peer sampled on version 5 (of the first epoch) is still admissible, as itself.
        batch = make_batch(identity=ALICE, seq=99, version=5)
        envelope = seal(batch, ALICE)
        assert second.intake.validate(ALICE.peer_id, ALICE.peer_id, envelope)
        await second.intake.deliver(envelope, ALICE.peer_id)
        # A version number no incarnation published is refused.
        forged = seal(make_batch(identity=ALICE, seq=100, version=2, tokens=4), ALICE)
        second.state.history.versions.pop(2)
        assert not second.intake.validate(ALICE.peer_id, ALICE.peer_id, forged)

    trio.run(resume)
    assert second.resumed is not None and second.resumed.diverged is not None
    assert second.version == 6  # above every published number, although it holds version 4's weights
    history = second.state.history.versions
    assert all(history[v] == published[v] for v in published if v in history)
    assert history[6] != published[5]
    kept = [g for _, _, g in second.buffer.live() if all(v == 5 for s in g.samples for v in s.token_versions)]
    assert kept, "the old epoch's group was retagged or dropped"
    assert second.buffer.ledger.dropped.get("unpublished_version") == 8


def test_fresh_starts_over_above_the_old_numbers_and_keeps_the_members(tmp_path: Path) -> None:
    """--fresh starts S above the last number published, so a rollout of the old weights still
    on its way is stale (a counted drop), never trained as the new weights' nor a strike; the
    peers that had joined stay members (as bans stay), so that rollout is not refused as
    not_joined either: a refusal costs its sender GossipSub score, and a few in a row silenced
    an honest peer's rollouts at the gossip layer for the whole run."""
    runs = tmp_path / "run"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 2)
        first.state.checkpoint_now()  # as a stop does
        first.state.journal.close()

    trio.run(go)
    fresh = new_learner(runs)
    fresh.fresh = True
    trio.run(lambda: start(fresh, peers=()))
    staleness = fresh.cfg.rl.staleness
    assert fresh.resumed is None and fresh.version == 3 + staleness and fresh.buffer.ledger.received == 0
    assert fresh.epoch == first.epoch + 1
    assert list((runs / "run-1" / "previous").iterdir()), "the old state was not kept aside"
    assert {ALICE.peer_id, BOB.peer_id} <= set(fresh.peers.joined)
    old = make_batch(identity=ALICE, seq=99, version=2)  # sampled on the old weights' version 2
    envelope = seal(old, ALICE)

    async def arrive() -> None:
        assert fresh.intake.validate(ALICE.peer_id, ALICE.peer_id, envelope)
        await fresh.intake.deliver(envelope, ALICE.peer_id)

    trio.run(arrive)
    fresh.state.journal.close()
    assert fresh.buffer.ledger.dropped == {"stale": old.num_samples}
    assert not fresh.peers.penalties and not fresh.peers.banned


def test_resuming_with_another_training_config_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "run"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 3)

    trio.run(go)
    other = new_learner(runs, seed=7)
    with pytest.raises(ValueError, match=r"trained with another config \(seed: 0 -> 7\).*--fresh"):
        trio.run(start, other)
    # Only the seed differs from the saved config; net, time budgets and threads may.
    assert CheckpointStore(runs / "run-1").list_valid()


def test_a_restart_before_the_first_checkpoint_is_held_to_the_config_the_run_started_with(tmp_path: Path) -> None:
    """No checkpoint yet: the journal alone would be replayed under whatever config the restart
    brings (another seed, group size or learning rate: another run). The config the run
    started with is kept in its folder, and a restart is held to it."""
    runs = tmp_path / "run"
    first = new_learner(runs, checkpoint=CheckpointConfig(every_versions=1000, min_interval_s=0))

    async def go() -> None:
        await start(first)
        await run_updates(first, 2)
        first.state.journal.close()  # then the process dies

    trio.run(go)
    assert not CheckpointStore(runs / "run-1").list_valid()
    other = new_learner(runs, seed=7, checkpoint=CheckpointConfig(every_versions=1000, min_interval_s=0))
    with pytest.raises(ValueError, match=r"trained with another config \(seed: 0 -> 7\).*--fresh"):
        trio.run(start, other)
    same = new_learner(runs, checkpoint=CheckpointConfig(every_versions=1000, min_interval_s=0))
    trio.run(start, same)
    assert same.version == 2 and same.resumed is not None and same.resumed.redone == 2
    same.state.journal.close()


@pytest.mark.parametrize("fresh", [False, True])
def test_a_peer_that_joined_after_the_last_checkpoint_is_still_a_member(tmp_path: Path, fresh: bool) -> None:
    """Joins are journaled: a resume (or --fresh) after a crash knows a peer that joined since
    the last checkpoint, so its rollouts in flight are not refused as not_joined."""
    from protocol import Identity

    carol = Identity.from_seed(b"\x63" * 32)
    runs = tmp_path / "run"
    first = new_learner(runs)

    async def go() -> None:
        await start(first)
        await run_updates(first, 1)  # no checkpoint yet (every 3 versions)
        first.state.journal.append(["join", carol.peer_id])  # what serving a join writes
        await first._flush_journal()
        first.state.journal.close()  # then the process dies

    trio.run(go)
    again = new_learner(runs)
    again.fresh = fresh
    trio.run(lambda: start(again, peers=()))
    again.state.journal.close()
    assert carol.peer_id in again.peers.joined
