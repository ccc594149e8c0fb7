"""Attacks on the weight data channel over real loopback sockets.

The victim (a rollout peer's receiver, or the learner's source) must stay up, finish or keep
serving honest peers, and cut and ban the attacker; nothing a peer sends is buffered without
bound.
"""

from __future__ import annotations

import os
import time
from functools import partial

import msgpack
import pytest
import trio
import trio.testing

from echo_node.net.framing import read_frame, write_frame
from echo_node.net.memory import MemorySwarm
from echo_node.weights.broadcast import LINK_IDLE_S, DataServer, Link, Source, Stats
from echo_node.weights.fetch import fetch_version, open_version
from protocol import Identity, seal
from protocol.errors import RemoteProtocolError
from protocol.framing import encode_length_prefixed
from protocol.weights.datachannel import Get, encode, make_hello
from protocol.weights.manifest import build_manifest

PIECE = 16 * 1024
PAYLOAD = os.urandom(64 * PIECE)
LEARNER = Identity.from_seed(b"\x01" * 32)
HONEST = Identity.from_seed(b"\x21" * 32)
ATTACKER = Identity.from_seed(b"\x22" * 32)
MANIFEST = build_manifest(run_id="run-1", version=7, payload=PAYLOAD, piece_size=PIECE)


def frame(*fields: object) -> bytes:
    return encode_length_prefixed(msgpack.packb(list(fields)), max_len=1 << 22)


@pytest.mark.parametrize(
    "bad",
    [
        frame("piece", 10**6, b"x"),  # out-of-range index: once ended the peer
        frame("piece", 3, b"\0" * PIECE),  # a piece that does not verify
        frame("peers", [[LEARNER.peer_id, "127.0.0.1", 1]]),  # control frames are the learner's
        frame("none"),
        frame("get", -1),
        frame("what"),
        b"\xff\xff\xff\xff",  # a length prefix beyond any frame
    ],
    ids=["index", "corrupt", "peers", "none", "get-1", "unknown", "oversize"],
)
def test_a_peer_sending_a_bad_frame_is_cut_and_banned_and_the_download_completes(bad: bytes) -> None:
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, {HONEST.peer_id, ATTACKER.peer_id})
    source.gate = trio.Event()  # hold the pieces until the attack is done
    got: list[bytes] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(7, source)
            await nursery.start(learner.run)
            honest, evil = DataServer(HONEST, "run-1"), DataServer(ATTACKER, "run-1")
            await nursery.start(honest.run)
            await nursery.start(evil.run)

            async def fetch() -> None:
                async with trio.open_nursery() as links:
                    _, payload, _ = await fetch_version(
                        honest, links, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7
                    )
                    got.append(bytes(payload))
                    links.cancel_scope.cancel()

            nursery.start_soon(fetch)
            with trio.fail_after(10):
                while HONEST.peer_id not in source.swarm:
                    await trio.sleep(0.01)
                # The attacker joins the version too, so the honest peer takes its connection.
                _, to_source = await open_version(evil, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7)
                while ATTACKER.peer_id not in source.swarm:
                    await trio.sleep(0.01)
                await trio.sleep(0.05)  # the source's peers frame reaches the honest peer
                stream = await trio.open_tcp_stream("127.0.0.1", honest.port)
                await write_frame(stream, evil.hello(target=HONEST.peer_id, version=7))
                await stream.send_all(bad)
                assert await stream.receive_some(1 << 16) == b""  # cut
                await stream.aclose()
                assert honest.is_banned(ATTACKER.peer_id)
                # Banned for every version: a new connection is refused at the hello.
                again = await trio.open_tcp_stream("127.0.0.1", honest.port)
                await write_frame(again, evil.hello(target=HONEST.peer_id, version=8))
                assert await again.receive_some(1 << 16) == b""
                await again.aclose()
                source.gate.set()
                while not got:
                    await trio.sleep(0.01)
            await to_source.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert got == [PAYLOAD]


def test_a_peer_that_asks_without_reading_is_cut_not_buffered() -> None:
    """`get` requests that are never read once grew the learner by ~300 MB; now the link's
    queue is capped and the asker is disconnected and banned (and charged a strike)."""
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, {ATTACKER.peer_id})
    charged: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.on_ban = lambda peer, why: charged.append(peer)
            learner.register(7, source)
            await nursery.start(learner.run)
            evil = DataServer(ATTACKER, "run-1")
            await nursery.start(evil.run)
            _, stream = await open_version(evil, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7)
            gets = b"".join(encode_length_prefixed(encode(Get(i % 64)), max_len=64) for i in range(4000))
            with trio.fail_after(10):
                try:
                    for _ in range(20):  # 80,000 gets: 1.3 GB of answers if all were queued
                        await stream.send_all(gets)
                except trio.BrokenResourceError:
                    pass  # cut mid-flood
                while not charged:
                    await trio.sleep(0.01)
            await stream.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert charged == [ATTACKER.peer_id]


def test_an_impostor_at_the_learners_address_is_refused() -> None:
    """Somebody answering at the learner's data address with a (replayed) manifest the learner
    signed cannot also sign the peer's fresh hello: the session check refuses it."""
    sealed = seal(MANIFEST, LEARNER)

    async def impostor(stream: trio.SocketStream) -> None:
        await read_frame(stream, max_len=1024)
        await write_frame(stream, msgpack.packb(["manifest", sealed, b"\0" * 64]))
        await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, impostor, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            with pytest.raises(RemoteProtocolError, match="signature"):
                await open_version(DataServer(HONEST, "run-1"), learner_id=LEARNER.peer_id, host="127.0.0.1", port=port, version=7)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_an_idle_link_ends() -> None:
    async def main() -> float:
        ours, _theirs = trio.testing.memory_stream_pair()
        link = Link(ours, "peer", Stats(), num_pieces=4, piece_size=PIECE)
        start = trio.current_time()
        async for _ in link.frames():
            raise AssertionError("no frame was sent")
        return trio.current_time() - start

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == pytest.approx(LINK_IDLE_S)


def test_a_replayed_hello_is_refused() -> None:
    server = DataServer(HONEST, "run-1")
    hello = make_hello(ATTACKER, target=HONEST.peer_id, run_id="run-1", version=7, now=time.time())
    server.checker.check(hello, time.time())
    with pytest.raises(RemoteProtocolError, match="replayed"):
        server.checker.check(hello, time.time())


def test_a_data_channel_ban_lasts_ban_s_on_trio_clock_then_the_peer_is_served_again() -> None:
    """Over the in-memory network on virtual time (echo_node/net/memory.py): a peer that sends
    the learner's source a frame only a source may send is cut and banned; its hellos are
    refused for `ban_s`, and served again once the ban ran out (a deadline of trio's clock)."""
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, {ATTACKER.peer_id})
    ban_s = 600.0

    async def main() -> None:
        swarm = MemorySwarm()
        _, learner_net = swarm.node(LEARNER)
        _, evil_net = swarm.node(ATTACKER)
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1", advertise_host=learner_net.address, ban_s=ban_s, net=learner_net)
            learner.register(7, source)
            await nursery.start(learner.run)
            evil = DataServer(ATTACKER, "run-1", advertise_host=evil_net.address, net=evil_net)
            await nursery.start(evil.run)  # a hello names the sender's own, listening, data address
            with trio.fail_after(10):
                _, stream = await open_version(evil, learner_id=LEARNER.peer_id, host=learner.host, port=learner.port, version=7)
                await stream.send_all(frame("peers", [[HONEST.peer_id, "127.0.0.9", 1]]))
                while not learner.is_banned(ATTACKER.peer_id):
                    await trio.sleep(0.01)
                await stream.aclose()
            banned_at = trio.current_time()
            await trio.sleep(ban_s - 60)  # still banned: the hello is refused, the stream cut
            with trio.fail_after(10), pytest.raises(RemoteProtocolError):
                await open_version(evil, learner_id=LEARNER.peer_id, host=learner.host, port=learner.port, version=7)
            await trio.sleep(banned_at + ban_s + 1 - trio.current_time())
            with trio.fail_after(10):
                manifest, again = await open_version(evil, learner_id=LEARNER.peer_id, host=learner.host, port=learner.port, version=7)
            assert manifest.version == 7 and not learner.is_banned(ATTACKER.peer_id)
            await again.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
