"""P2P weight broadcast on loopback TCP: every peer goes live with verified bytes, the learner
uploads about one copy, bad pieces are caught before use and their sender penalized, and a
relay killed mid-transfer costs the others only a re-request."""

from __future__ import annotations

import hashlib
import os
from functools import partial

import pytest
import trio

from echo_node.broadcast import Membership, Receiver, Source, split_list
from protocol import Identity
from protocol.errors import RemoteProtocolError
from protocol.manifest import build_manifest

PIECE = 16 * 1024
PAYLOAD = os.urandom(64 * PIECE + 123)
LEARNER = Identity.from_seed(b"\x01" * 32)
PEERS = [Identity.from_seed(bytes([0x10 + i]) * 32) for i in range(3)]


def manifest():
    return build_manifest(run_id="run-1", version=7, payload=PAYLOAD, piece_size=PIECE)


async def start_swarm(
    nursery: trio.Nursery, receivers: dict[str, Receiver], source: Source
) -> dict[str, int]:
    ports: dict[str, int] = {}
    listeners = await nursery.start(partial(trio.serve_tcp, source.serve, 0, host="127.0.0.1"))
    ports[source.identity.peer_id] = listeners[0].socket.getsockname()[1]
    for pid, r in receivers.items():
        listeners = await nursery.start(partial(trio.serve_tcp, r.accept, 0, host="127.0.0.1"))
        ports[pid] = listeners[0].socket.getsockname()[1]

    async def connect(peer_id: str) -> trio.abc.Stream:
        return await trio.open_tcp_stream("127.0.0.1", ports[peer_id])

    for pid, r in receivers.items():
        dial, _ = split_list(list(receivers), pid)
        for other in dial:
            await r.dial(nursery, other, connect)
    for r in receivers.values():
        await r.dial(nursery, source.identity.peer_id, connect)
    return ports


def run_broadcast(kill_after: int | None = None):
    members = Membership([p.peer_id for p in PEERS] + [LEARNER.peer_id])
    source = Source(LEARNER, manifest(), PAYLOAD, members)
    receivers = {p.peer_id: Receiver(p, manifest(), members, source_id=LEARNER.peer_id, request_timeout=2.0) for p in PEERS}
    results: dict[str, bytes] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await start_swarm(nursery, receivers, source)
            with trio.fail_after(30):
                async with trio.open_nursery() as inner:
                    for pid, r in receivers.items():
                        async def fetch(pid: str = pid, r: Receiver = r) -> None:
                            results[pid] = await r.run()
                        if kill_after is not None and pid == PEERS[0].peer_id:
                            async def killer(r: Receiver = r) -> None:
                                while r.store.count < kill_after:
                                    await trio.sleep(0.001)
                                for link in list(r.links.values()):
                                    await link.stream.aclose()
                            inner.start_soon(killer)
                            continue
                        inner.start_soon(fetch)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return source, receivers, results


def test_all_peers_go_live_and_the_learner_uploads_about_one_copy() -> None:
    source, receivers, results = run_broadcast()
    assert all(hashlib.sha256(v).digest() == hashlib.sha256(PAYLOAD).digest() for v in results.values())
    assert len(results) == 3
    # Three full copies in a star; here each piece leaves the learner about once.
    assert source.stats.bytes_up < 1.2 * len(PAYLOAD)
    assert sum(r.stats.bytes_up for r in receivers.values()) >= 1.5 * len(PAYLOAD)


def test_a_corrupt_relay_is_caught_before_use_and_penalized() -> None:
    # A relay (or the learner) whose bytes do not match the signed manifest.
    members = Membership([p.peer_id for p in PEERS] + [LEARNER.peer_id])
    r = Receiver(PEERS[1], manifest(), members, source_id=LEARNER.peer_id)

    class FakeLink:
        remote = PEERS[0].peer_id

        def send(self, *a):  # type: ignore[no-untyped-def]
            pass

    async def main() -> None:
        r._on_piece(FakeLink(), 3, b"\0" * PIECE)  # type: ignore[arg-type]

    trio.run(main)
    assert r.store.pieces[3] is None
    assert r.stats.bad_pieces == {PEERS[0].peer_id: 1}
    assert r.swarm.penalties[PEERS[0].peer_id] == 1


def test_a_relay_killed_mid_transfer_costs_only_re_requests() -> None:
    source, receivers, results = run_broadcast(kill_after=10)
    survivors = [p.peer_id for p in PEERS[1:]]
    assert sorted(results) == sorted(survivors)
    assert all(results[p] == PAYLOAD for p in survivors)


def test_membership_rejects_strangers_replays_and_wrong_targets() -> None:
    members = Membership([PEERS[0].peer_id])
    hello = members.hello(PEERS[0], target=LEARNER.peer_id, run_id="run-1", version=7)
    assert members.check(hello, me=LEARNER.peer_id, run_id="run-1", version=7) == PEERS[0].peer_id
    with pytest.raises(RemoteProtocolError, match="replayed"):
        members.check(hello, me=LEARNER.peer_id, run_id="run-1", version=7)
    stranger = members.hello(PEERS[1], target=LEARNER.peer_id, run_id="run-1", version=7)
    with pytest.raises(RemoteProtocolError, match="not a member"):
        members.check(stranger, me=LEARNER.peer_id, run_id="run-1", version=7)
    other = members.hello(PEERS[0], target=PEERS[2].peer_id, run_id="run-1", version=7)
    with pytest.raises(RemoteProtocolError, match="another target"):
        members.check(other, me=LEARNER.peer_id, run_id="run-1", version=7)
    with pytest.raises(RemoteProtocolError):
        members.check(b"garbage", me=LEARNER.peer_id, run_id="run-1", version=7)
