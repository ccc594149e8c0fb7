"""The learner's dial-back of joining peers: a relay only where a peer proved to be, never an
address of the joiner's choosing on the learner's own machine, and a flood of joins whose
addresses never answer neither delays join answers nor queues probes without bound."""

from __future__ import annotations

import pytest
import trio

from echo_node.learner import door as door_module
from echo_node.learner.learner import Learner
from echo_node.weights.broadcast import DataServer
from protocol import Identity
from protocol.messages import JoinRequest, JoinResponse
from tests.factories import silent_listener


def join(learner: Learner, identity: Identity, host: str, port: int) -> JoinRequest:
    return JoinRequest(run_id="run-1", peer_id=identity.peer_id, data_host=host, data_port=port)


async def attach(learner: Learner, nursery: trio.Nursery) -> None:
    """What `Learner.run` sets up that a join needs: its door open (the nursery of probes), a
    data port to name (its data server is not started here)."""
    learner.data.port = 4002
    await nursery.start(learner.door.run)


def test_only_the_address_a_join_came_from_is_dialed_back_at_the_port_it_named(learner: Learner) -> None:
    peer = Identity.generate()
    dialed: list[tuple[str, list[tuple[str, int]]]] = []
    learner.door._schedule_probe = lambda peer_id, targets: dialed.append((peer_id, targets))  # type: ignore[method-assign]
    learner.data.host, learner.data.port = "203.0.113.1", 4002
    learner.door.dial_back(peer.peer_id, "198.51.100.7", 4003, 0.0)
    assert dialed == [(peer.peer_id, [("198.51.100.7", 4003)])]
    # Unknown source, or the learner's own data address: nobody is dialed.
    learner.door.dial_back(Identity.generate().peer_id, None, 4003, 0.0)
    learner.door.dial_back(Identity.generate().peer_id, "203.0.113.1", 4002, 0.0)
    assert len(dialed) == 1 and len(learner.peers.unreachable) == 2


def test_a_peer_proves_its_address_and_one_that_never_answers_is_not_a_relay(
    learner: Learner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(door_module, "PROBE_TIMEOUT_S", 0.3)
    honest, silent = Identity.generate(), Identity.generate()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            server = DataServer(honest, "run-1")
            await nursery.start(server.run)
            hold_port = await silent_listener(nursery)
            answer = await learner.door.on_join(join(learner, honest, "127.0.0.1", server.port), honest.peer_id, observed="127.0.0.1")
            assert isinstance(answer, JoinResponse)
            await learner.door.on_join(join(learner, silent, "127.0.0.1", hold_port), silent.peer_id, observed="127.0.0.1")
            with trio.fail_after(door_module.PROBE_TIMEOUT_S + 5):
                while len(learner.peers.relays) + len(learner.peers.unreachable) < 2:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert learner.peers.relays == {honest.peer_id: ("127.0.0.1", learner.peers.relays[honest.peer_id][1])}
    assert "no answer" in learner.peers.unreachable[silent.peer_id]
    assert not learner.door._probing


def test_a_flood_of_joins_that_never_answer_is_bounded(learner: Learner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door_module, "MAX_PENDING_PROBES", 16)
    monkeypatch.setattr(door_module, "PROBE_TIMEOUT_S", 0.2)
    joiners = [Identity.generate() for _ in range(40)]
    pending: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            port = await silent_listener(nursery)
            with trio.fail_after(2):  # every join is answered at once, probes or not
                for i, peer in enumerate(joiners + joiners[:5]):  # a repeated join does not add a probe
                    # Each from its own loopback address: one source's join budget is not the point here.
                    await learner.door.on_join(join(learner, peer, "127.0.0.1", port), peer.peer_id, observed=f"127.0.0.{1 + i % 40}")
            pending.append(len(learner.door._probing))
            with trio.fail_after(10):
                while learner.door._probing:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert pending == [16]
    assert set(learner.peers.unreachable) == {p.peer_id for p in joiners} and not learner.peers.relays
    assert sum("not probed" in why for why in learner.peers.unreachable.values()) == 24
