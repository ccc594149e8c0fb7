"""Batches waiting for a spot check are bounded by what they hold, not by count.

Joined identities publish well-formed batches with invented log-probs as fast as gossip takes
them while a spot check runs. Each is on probation (all its batches checked), so each may have
one batch queued or in its check; the rest are counted `overload` drops, and what waits stays
within its byte budgets. The queue here is the one py-libp2p delivers validated messages into
(`echo_node.net.p2p._Delivery` over a trio channel), fed as py-libp2p feeds it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from echo_node.config import RunConfig, VerifyConfig
from echo_node.learner import intake as intake_module
from echo_node.learner.learner import Learner
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.net.p2p import ID, _Delivery, rpc_pb2
from echo_node.policy import Policy
from protocol import Identity, seal
from tests.factories import make_batch

ATTACKERS = [Identity.from_seed(bytes([0x90 + i]) * 32) for i in range(8)]
BATCHES_EACH = 30


def checking_learner(tmp_path: Path) -> Learner:
    """A learner whose spot checks run (the tiny model's log-probs), unlike the shared fixture."""
    tok = CharTokenizer()
    arch = tiny_llama_config(tok.vocab_size)
    policy = Policy(build_model(arch), tok, get_task("addition"), {"kind": "embedded", **arch}, tok.to_dict())
    cfg = RunConfig(run_id="run-1", runs_dir=tmp_path, verify=VerifyConfig(logprobs=True))
    learner = Learner(cfg, Identity.from_seed(b"\x01" * 32), policy)
    assert learner.verifier is not None
    learner.verifier.remember(0, policy.publication())
    return learner


def message(identity: Identity, data: bytes) -> rpc_pb2.Message:
    return rpc_pb2.Message(from_id=ID.from_base58(identity.peer_id).to_bytes(), data=data)


def publish(learner: Learner, delivery: _Delivery, identity: Identity, seq: int, groups: int = 2) -> bool:
    """One message as py-libp2p handles it: the validator, then the subscription queue."""
    data = seal(make_batch(identity=identity, seq=seq, groups=groups), identity)
    if not learner.intake.validate(identity.peer_id, identity.peer_id, data):
        return False
    try:
        delivery.send_nowait(message(identity, data))
    except trio.WouldBlock:
        return False
    return True


def test_peers_on_probation_queue_one_batch_each_and_the_rest_are_counted_drops(tmp_path: Path) -> None:
    learner = checking_learner(tmp_path)
    intake = learner.intake
    for a in ATTACKERS:
        learner.peers.join(a.peer_id, 0.0)
    queued: list[int] = []
    held: list[int] = []

    async def main() -> None:
        send, receive = trio.open_memory_channel[rpc_pb2.Message](4096)
        delivery = _Delivery(send, intake.overflowed, intake.queue_admits)
        async with trio.open_nursery() as nursery:
            async with intake._spot_lock:  # a long check runs: nothing leaves the queue
                for seq in range(1, BATCHES_EACH + 1):
                    for a in ATTACKERS:
                        publish(learner, delivery, a, seq)
                queued.append(receive.statistics().current_buffer_used)
                held.append(intake.unchecked_bytes)
                send.close()

                async def consume() -> None:
                    async for msg in receive:
                        await intake.deliver(msg.data, ID(msg.from_id).to_base58())

                nursery.start_soon(consume)
            # The lock is free: the queued batches are checked, and their publishers caught.

    trio.run(main)
    assert queued == [len(ATTACKERS)]
    assert 0 < held[0] <= intake_module.MAX_UNCHECKED_BYTES
    dropped = learner.buffer.ledger.dropped
    per_batch = 2 * make_batch(groups=1).groups[0].samples.__len__()
    assert dropped["overload"] == len(ATTACKERS) * (BATCHES_EACH - 1) * per_batch
    assert set(learner.peers.banned_until_version) == {a.peer_id for a in ATTACKERS}  # invented log-probs
    assert intake.unchecked_bytes == 0 and not intake._in_flight and not intake._queued


def test_a_peer_past_probation_is_bounded_by_its_byte_budget_and_others_still_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(intake_module, "MAX_UNCHECKED_PER_PEER", 64 << 10)
    monkeypatch.setattr(intake_module, "MAX_UNCHECKED_BYTES", 1 << 20)
    learner = checking_learner(tmp_path)
    intake = learner.intake
    assert learner.verifier is not None
    flooder, others = ATTACKERS[0], ATTACKERS[1:]
    for a in ATTACKERS:
        learner.peers.join(a.peer_id, 0.0)
        learner.verifier._probation[a.peer_id] = 0  # trusted so far: spot-checked at spot_rate only

    async def main() -> tuple[int, int]:
        send, receive = trio.open_memory_channel[rpc_pb2.Message](100_000)
        delivery = _Delivery(send, intake.overflowed, intake.queue_admits)
        taken = sum(publish(learner, delivery, flooder, seq, groups=8) for seq in range(1, 200))
        others_taken = sum(publish(learner, delivery, a, 1, groups=8) for a in others)
        return taken, others_taken

    taken, others_taken = trio.run(main)
    assert 0 < taken < 199
    assert intake._unchecked_by[flooder.peer_id] <= intake_module.MAX_UNCHECKED_PER_PEER
    assert others_taken == len(others)  # the flooder's backlog is its own
    assert intake.unchecked_bytes <= intake_module.MAX_UNCHECKED_BYTES


def test_the_same_bytes_queued_twice_are_released_twice_so_a_replay_cannot_leak_the_budget(tmp_path: Path) -> None:
    """A publisher republishing one batch's bytes under new gossip seqnos gets each copy
    accounted and released on its own: after the consumer drained the queue nothing is held,
    and the budget is whole for everyone."""
    learner = checking_learner(tmp_path)
    intake = learner.intake
    assert learner.verifier is not None
    replayer = ATTACKERS[0]
    learner.peers.join(replayer.peer_id, 0.0)
    learner.verifier._probation[replayer.peer_id] = 0  # past probation: several may wait
    data = seal(make_batch(identity=replayer, seq=1, groups=2), replayer)

    async def main() -> int:
        send, receive = trio.open_memory_channel[rpc_pb2.Message](2)  # room for two copies only
        delivery = _Delivery(send, intake.overflowed, intake.queue_admits)
        queued = 0
        for _ in range(5):
            if intake.validate(replayer.peer_id, replayer.peer_id, data):
                try:
                    delivery.send_nowait(message(replayer, data))
                    queued += 1
                except trio.WouldBlock:
                    pass
        send.close()
        async for msg in receive:
            await intake.deliver(msg.data, ID(msg.from_id).to_base58())
        return queued

    assert trio.run(main) == 2
    assert intake.unchecked_bytes == 0 and not intake._queued and not intake._in_flight and not intake._unchecked_by


def test_a_check_past_probation_runs_beside_the_intake(tmp_path: Path) -> None:
    """While a batch of a peer past probation is being checked, other peers' batches go on
    reaching the buffer (the learner no longer waits behind each check); one chosen while the
    checker is busy goes unchecked and is counted (`checker_busy`) when its publisher earned
    trust; the checked batch is taken once its check passed. The check itself is held here (its
    verdict is other tests' subject)."""
    learner = checking_learner(tmp_path)
    intake, verifier = learner.intake, learner.verifier
    assert verifier is not None
    held, other = ATTACKERS[0], ATTACKERS[1]
    for who in (held, other):
        learner.peers.join(who.peer_id, 0.0)
        verifier._probation[who.peer_id] = 0  # past probation
    verifier._trusted_tokens[other.peer_id] = 1 << 30  # trusted: checked at spot_rate
    verifier._rng = SimpleNamespace(random=lambda: 0.0)  # type: ignore[assignment]  # every batch is chosen
    release, checking = threading.Event(), threading.Event()

    def spot(batch: Any, indices: list[int], *, rows: int | None = None, budgeted: bool = False) -> None:
        if batch.peer_id == held.peer_id:
            checking.set()
            assert release.wait(30)
        return None

    verifier.spot = spot  # type: ignore[method-assign]

    def origins() -> set[str]:
        return {learner.buffer.origin(g) for g in learner.buffer._groups}

    async def main() -> None:
        send, receive = trio.open_memory_channel[Any](16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(intake.consume, receive)
            for who in (held, other):
                data = seal(make_batch(identity=who, seq=1, groups=2), who)
                assert intake.validate(who.peer_id, who.peer_id, data)
                await send.send(SimpleNamespace(data=data, sender=who.peer_id))
            with trio.fail_after(10):
                while other.peer_id not in origins():
                    await trio.sleep(0.01)
            assert checking.is_set() and held.peer_id not in origins()
            assert verifier.stats.checker_busy == 1
            release.set()
            with trio.fail_after(10):
                while held.peer_id not in origins():
                    await trio.sleep(0.01)
            await send.aclose()

    trio.run(main)
    assert learner.buffer.ledger.received == 2 * 2 * 8


def test_a_young_peers_batch_waits_for_a_busy_checker(tmp_path: Path) -> None:
    """A publisher with no trust earned cannot slip a batch past the checks by sending it while
    the checker is busy: its batch waits beside the intake for the checker, and enters the
    buffer only once its own check passed (`checker_busy` stays 0)."""
    learner = checking_learner(tmp_path)
    intake, verifier = learner.intake, learner.verifier
    assert verifier is not None
    held, young = ATTACKERS[0], ATTACKERS[1]
    for who in (held, young):
        learner.peers.join(who.peer_id, 0.0)
        verifier._probation[who.peer_id] = 0  # past probation, no trust yet
    release, checking = threading.Event(), threading.Event()
    checked: list[str] = []

    def spot(batch: Any, indices: list[int], *, rows: int | None = None, budgeted: bool = False) -> None:
        if batch.peer_id == held.peer_id:
            checking.set()
            assert release.wait(30)
        checked.append(batch.peer_id)
        return None

    verifier.spot = spot  # type: ignore[method-assign]

    def origins() -> set[str]:
        return {learner.buffer.origin(g) for g in learner.buffer._groups}

    async def main() -> None:
        send, receive = trio.open_memory_channel[Any](16)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(intake.consume, receive)
            for who in (held, young):
                data = seal(make_batch(identity=who, seq=1, groups=2), who)
                assert intake.validate(who.peer_id, who.peer_id, data)
                await send.send(SimpleNamespace(data=data, sender=who.peer_id))
            with trio.fail_after(10):
                while not checking.is_set():
                    await trio.sleep(0.01)
            await trio.sleep(0.2)
            assert not origins() and verifier.stats.checker_busy == 0
            release.set()
            with trio.fail_after(10):
                while origins() != {held.peer_id, young.peer_id}:
                    await trio.sleep(0.01)
            await send.aclose()

    trio.run(main)
    assert checked == [held.peer_id, young.peer_id]
