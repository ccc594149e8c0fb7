"""The in-memory transport (echo_node/net/memory.py) behaves like the links node code was
written against: bounded pipes, hang-ups, refused dials, validated gossip; and what a request
server does with a peer that hangs up or sends garbage is the same over it as over libp2p."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from echo_node.net import rpc
from echo_node.net.discovery import DialError
from echo_node.net.framing import write_frame
from echo_node.net.memory import PIPE_BYTES, MemoryStream, MemorySwarm
from echo_node.net.transport import GossipMessage, PeerAddr, StreamUnavailable
from protocol import Identity, StatusRequest, StatusResponse
from protocol.messages import ErrorResponse, encode_message

A = Identity.from_seed(b"\x71" * 32)
B = Identity.from_seed(b"\x72" * 32)


def run(main: object) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))  # type: ignore[arg-type]


def test_a_writer_whose_reader_never_reads_blocks_at_the_pipe_bound() -> None:
    async def main() -> None:
        ours, theirs = MemoryStream.pair("127.0.0.2", "127.0.0.3")
        await ours.send_all(b"x" * PIPE_BYTES)
        assert ours.unsent() == PIPE_BYTES
        with trio.move_on_after(60) as waited:
            await ours.send_all(b"y")
        assert waited.cancelled_caught, "a write past the bound did not wait for the reader"
        assert len(await theirs.receive_some(1000)) == 1000
        with trio.fail_after(1):
            await ours.send_all(b"y")  # room again

    run(main)


def test_a_closed_end_reads_as_eof_after_its_data_and_breaks_the_other_ends_writes() -> None:
    async def main() -> None:
        ours, theirs = MemoryStream.pair("127.0.0.2", "127.0.0.3")
        assert (ours.remote_host, theirs.remote_host) == ("127.0.0.3", "127.0.0.2")
        await ours.send_all(b"last words")
        ours.close()
        assert await theirs.receive_some(100) == b"last words"
        assert await theirs.receive_some(100) == b""
        with pytest.raises(trio.BrokenResourceError):
            await theirs.send_all(b"anyone?")
        with pytest.raises(trio.ClosedResourceError):
            await ours.send_all(b"after close")

    run(main)


def test_dials_and_streams_to_nobody_fail_with_the_errors_real_links_raise() -> None:
    async def main() -> None:
        swarm = MemorySwarm()
        (a, a_net), (b, _) = swarm.node(A), swarm.node(B)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            with pytest.raises(DialError):
                await a.connect(PeerAddr(B.peer_id, tuple(b.addrs)))  # b is not running
            with pytest.raises(StreamUnavailable):
                await a.open_stream(B.peer_id, rpc.STATUS)
            with pytest.raises(ConnectionRefusedError):
                await a_net.connect("127.0.0.9", 4242)
            await nursery.start(b.run)
            with pytest.raises(StreamUnavailable):  # running, but serving no such protocol
                await a.open_stream(B.peer_id, rpc.STATUS)
            nursery.cancel_scope.cancel()

    run(main)


def test_gossip_reaches_subscribers_through_their_validator_and_refusals_are_counted() -> None:
    async def main() -> None:
        swarm = MemorySwarm()
        (a, _), (b, _) = swarm.node(A), swarm.node(B)
        admitted: list[GossipMessage] = []
        refused: list[GossipMessage] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            await b.subscribe(
                "t", lambda forwarder, origin, data: data != b"bad", on_overflow=refused.append,
                admit=lambda msg: msg.data != b"full",
            )
            for data in (b"good", b"bad", b"full"):
                await a.publish("t", data)
            with trio.fail_after(1):
                async for msg in b.messages("t"):
                    admitted.append(msg)
                    break
            nursery.cancel_scope.cancel()
        assert admitted == [GossipMessage(A.peer_id, b"good")]
        assert refused == [GossipMessage(A.peer_id, b"full")]
        assert b.penalties[A.peer_id] == 1 and b.gossip_drops["t"] == {"invalid": 1}

    run(main)


@pytest.mark.parametrize("garbage", [b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff"])
def test_a_request_server_strikes_garbage_but_not_a_hang_up(garbage: bytes) -> None:
    """Hostile and cancelled callers against `rpc.serve_one` over the memory transport: an
    empty stream or a request cut short (what a cancelled honest call leaves) is answered and
    costs no strike; bytes that are not a request do."""
    bad: list[str] = []

    async def status(request: object, remote: str) -> StatusResponse:
        return StatusResponse(run_id="r", version=1, weights_size=1, weights_sha256=b"\0" * 32, demand_groups=1, epoch=0)

    async def main() -> None:
        swarm = MemorySwarm()
        (a, _), (b, _) = swarm.node(A), swarm.node(B)

        async def serve(stream: rpc.Stream) -> None:
            await rpc.serve_one(stream, status, on_bad=lambda peer, exc: bad.append(peer))

        b.set_stream_handler(rpc.STATUS, serve)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            for _ in range(10):  # hang-ups: opened, nothing (or half a request) sent, closed
                stream = await a.open_stream(B.peer_id, rpc.STATUS)
                await stream.aclose()
                stream = await a.open_stream(B.peer_id, rpc.STATUS)
                await stream.send_all(encode_message(StatusRequest(run_id="r"))[:3])
                await stream.aclose()
            await trio.sleep(1)
            assert bad == []
            stream = await a.open_stream(B.peer_id, rpc.STATUS)
            await stream.send_all(garbage)
            await stream.send_eof()
            await trio.sleep(1)
            assert bad == [A.peer_id]
            # And an honest call is answered as ever.
            reply = await rpc.call(a, B.peer_id, rpc.STATUS, StatusRequest(run_id="r"), StatusResponse)
            assert reply.version == 1
            nursery.cancel_scope.cancel()

    run(main)


def test_an_answer_to_a_caller_that_hung_up_is_dropped_quietly() -> None:
    async def main() -> None:
        ours, theirs = MemoryStream.pair("127.0.0.2", "127.0.0.3", b_peer=B.peer_id)
        await write_frame(ours, encode_message(StatusRequest(run_id="r")))

        async def answer(request: object, remote: str) -> ErrorResponse:
            ours.close()  # the caller gives up while the server works
            return ErrorResponse(code="busy", message="later")

        theirs.remote_peer_id = A.peer_id
        await rpc.serve_one(theirs, answer, on_bad=lambda peer, exc: pytest.fail("a hang-up is no offence"))

    run(main)
