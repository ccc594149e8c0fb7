"""Silent connections cannot take a node's descriptors or lock honest peers out.

Real sockets on loopback: a stranger with no key opens far more connections than a listener's
pending budget to the data channel and to the libp2p host, and never says a word; the listener
holds at most its budget, cuts the oldest, and an honest peer arriving during the flood is
served. Other loopback addresses (127.0.0.2, ...) stand for other hosts where a test needs
per-source caps (`exempt_loopback=False`).
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable

import pytest
import trio

from echo_node.net.budget import CUT_AGE_S, Caps, Inbound
from echo_node.net.transport import PeerAddr
from echo_node.net.p2p import P2PNode, P2PSettings
from echo_node.weights.broadcast import DataServer, probe
from protocol import Identity
from tests.factories import closed_by_server

SERVER = Identity.from_seed(b"\x61" * 32)
HONEST = Identity.from_seed(b"\x62" * 32)
SMALL = Caps(pending=16, pending_per_source=4, open=32, open_per_source=8)
FLOOD = 200


def from_address(source: str) -> Callable[[str, int], Awaitable[trio.abc.Stream]]:
    async def connect(host: str, port: int) -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, port, local_address=source)

    return connect


async def flood(port: int, n: int, source: str, held: list[trio.SocketStream]) -> None:
    """`n` connections from `source` that never send a byte, all held open."""
    for _ in range(n):
        held.append(await trio.open_tcp_stream("127.0.0.1", port, local_address=source))


def test_a_silent_flood_holds_at_most_the_pending_budget_and_an_honest_probe_is_answered() -> None:
    server = DataServer(SERVER, "run-1", caps=SMALL)
    result: dict[str, int] = {}

    async def main() -> None:
        held: list[trio.SocketStream] = []
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.run)
            await flood(port, FLOOD, "127.0.0.2", held)
            await trio.sleep(CUT_AGE_S + 0.1)  # the flood's connections are old enough to be cut
            result["pending"] = server.inbound.pending
            with trio.fail_after(5):  # the honest dial-back proves who is there, mid-flood
                await probe(HONEST, "run-1", SERVER.peer_id, "127.0.0.1", port)
            result["cut"] = await closed_by_server(held)
            nursery.cancel_scope.cancel()
        for stream in held:
            await stream.aclose()

    trio.run(main)
    assert result["pending"] <= SMALL.pending
    assert result["cut"] >= FLOOD - SMALL.pending
    assert server.inbound.cut + server.inbound.refused >= FLOOD - SMALL.pending


def test_one_source_flooding_cuts_only_its_own_connections() -> None:
    """A slow honest peer from another address keeps its pending slot while the flood's source
    is cut to its own per-source cap."""
    server = DataServer(SERVER, "run-1", caps=SMALL)
    server.inbound.exempt_loopback = False
    answered: list[bool] = []
    flooded = trio.Event()

    async def slow_honest(port: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.3")
        await flooded.wait()  # connected first, says its hello only after the flood
        await stream.aclose()
        await probe(HONEST, "run-1", SERVER.peer_id, "127.0.0.1", port, connect=from_address("127.0.0.3"))
        answered.append(True)

    async def main() -> None:
        held: list[trio.SocketStream] = []
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.run)
            nursery.start_soon(slow_honest, port)
            with trio.fail_after(30):  # events, not time: steady on a loaded machine
                while server.inbound._pending_by.get("127.0.0.3") != 1:
                    await trio.sleep(0.01)
                await flood(port, 50, "127.0.0.2", held)
                while server.inbound._pending_by.get("127.0.0.2", 0) < SMALL.pending_per_source:
                    await trio.sleep(0.01)
                await trio.sleep(0.2)  # the rest of the flood is cut, not admitted
            assert server.inbound._pending_by["127.0.0.2"] <= SMALL.pending_per_source
            assert server.inbound._pending_by["127.0.0.3"] == 1  # not cut by the other source's flood
            flooded.set()
            with trio.fail_after(30):
                while not answered:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        for stream in held:
            await stream.aclose()

    trio.run(main)
    assert answered == [True]


def test_the_open_cap_is_a_refusal_and_a_closed_connection_gives_its_slot_back() -> None:
    async def main() -> None:
        budget = Inbound(Caps(pending=4, pending_per_source=4, open=2, open_per_source=2), exempt_loopback=False)
        tickets = [budget.arrive("10.0.0.1", trio.CancelScope(), 0.0) for _ in range(3)]
        assert [budget.promote(t) for t in tickets if t is not None] == [True, True, False]
        budget.leave(tickets[0])  # type: ignore[arg-type]
        again = budget.arrive("10.0.0.1", trio.CancelScope(), 0.0)
        assert again is not None and budget.promote(again) and budget.opened == 2
        # A full pending budget refuses a newcomer while its oldest is young, and cuts the
        # oldest (only a pending one) once it has waited CUT_AGE_S.
        pending = [budget.arrive("10.0.0.2", trio.CancelScope(), 0.0) for _ in range(5)]
        assert pending[4] is None and budget.refused == 2
        late = budget.arrive("10.0.0.3", trio.CancelScope(), CUT_AGE_S)
        assert late is not None and pending[0] is not None and pending[0].scope.cancel_called
        assert not any(t.scope.cancel_called for t in pending[1:4] if t is not None)
        assert budget.pending == 4 and budget.opened == 2

    trio.run(main)


def node(identity: Identity, caps: Caps | None = None) -> P2PNode:
    return P2PNode(identity, P2PSettings(inbound_caps=caps))


# py-libp2p can leave one socket of a host stopped mid-dial for the garbage collector (as in
# tests/node/test_gossip_restart.py); collected inside the test, where this mark applies.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_silent_flood_on_the_libp2p_port_does_not_keep_an_honest_peer_out() -> None:
    server = node(SERVER, SMALL)
    connected: list[str] = []

    async def main() -> None:
        held: list[trio.SocketStream] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            port = int(server.addrs[0].split("/tcp/")[1].split("/")[0])
            await flood(port, FLOOD, "127.0.0.2", held)
            await trio.sleep(CUT_AGE_S + 0.1)  # a peer arriving sooner is refused and dials again
            client = node(HONEST)
            await nursery.start(client.run)
            with trio.fail_after(10):
                await client.connect(PeerAddr(SERVER.peer_id, tuple(server.addrs)))
            connected.extend(server.connected_peers())
            assert server.inbound.pending <= SMALL.pending
            nursery.cancel_scope.cancel()
        for stream in held:
            await stream.aclose()

    trio.run(main)
    gc.collect()
    assert connected == [HONEST.peer_id]
    assert server.inbound.cut + server.inbound.refused >= FLOOD - SMALL.pending


def test_libp2p_slots_come_back_when_connections_close() -> None:
    """py-libp2p's own handler kept a slot per inbound connection until the host stopped: after
    250 in a process's life, every later one was refused. With 2 open slots, 12 peers that come
    and go one after the other all get in."""
    server = node(SERVER, Caps(pending=4, pending_per_source=4, open=2, open_per_source=2))
    joined: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            for i in range(12):
                client = node(Identity.from_seed(bytes([0x70 + i]) * 32))
                async with trio.open_nursery() as inner:
                    await inner.start(client.run)
                    with trio.fail_after(10):
                        await client.connect(PeerAddr(SERVER.peer_id, tuple(server.addrs)))
                        joined.append(i)
                        await client.disconnect(SERVER.peer_id)
                        while server.inbound.opened:
                            await trio.sleep(0.02)
                    inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert joined == list(range(12))

