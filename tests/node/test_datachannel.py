"""The weight data channel on loopback TCP: tokens, hash checks, truncation."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from echo_node.net.datachannel import WeightServer, fetch_weights
from protocol.errors import RemoteProtocolError

BLOB = os.urandom(3 * (1 << 20) + 17)
SHA = hashlib.sha256(BLOB).digest()


async def serve(nursery: trio.Nursery) -> tuple[WeightServer, bytes]:
    server = WeightServer("run-1")
    server.publish(3, BLOB)
    await nursery.start(server.run)
    return server, server.issue_token("peer-a")


def test_fetch_verifies_size_and_hash() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server, token = await serve(nursery)
            got = await fetch_weights("127.0.0.1", server.port, token, run_id="run-1", version=3, size=len(BLOB), sha256=SHA)
            assert got == BLOB and server.bytes_sent == len(BLOB)
            # The learner's announcement says another hash: the bytes are refused.
            with pytest.raises(RemoteProtocolError, match="offered"):
                await fetch_weights("127.0.0.1", server.port, token, run_id="run-1", version=3, size=len(BLOB), sha256=b"\0" * 32)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_unknown_token_and_version_get_nothing() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            server, token = await serve(nursery)
            for tok, version in ((os.urandom(32), 3), (token, 4)):
                with pytest.raises(RemoteProtocolError, match="stream ended"):
                    await fetch_weights("127.0.0.1", server.port, tok, run_id="run-1", version=version, size=len(BLOB), sha256=SHA)
            server.revoke_peer("peer-a")
            with pytest.raises(RemoteProtocolError):
                await fetch_weights("127.0.0.1", server.port, token, run_id="run-1", version=3, size=len(BLOB), sha256=SHA)
            assert server.bytes_sent == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sender_dying_mid_transfer_is_an_error_not_a_short_blob() -> None:
    async def truncating(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(4096)
            from echo_node.net.framing import write_frame
            from protocol.messages import WeightsHeader, encode_message

            await write_frame(stream, encode_message(WeightsHeader(run_id="run-1", version=3, size=len(BLOB), sha256=SHA)))
            await stream.send_all(BLOB[: len(BLOB) // 2])  # then the "learner" dies

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, truncating, 0)
            port = listeners[0].socket.getsockname()[1]
            with pytest.raises(RemoteProtocolError, match=f"stream ended after .* of {len(BLOB)} bytes"):
                await fetch_weights("127.0.0.1", port, b"t" * 32, run_id="run-1", version=3, size=len(BLOB), sha256=SHA)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_old_versions_are_freed() -> None:
    server = WeightServer("run-1")
    for v in range(10):
        server.publish(v, bytes([v]))
    latest = server.latest()
    assert latest is not None and latest.version == 9
    assert sorted(server._snapshots) == [6, 7, 8, 9]
