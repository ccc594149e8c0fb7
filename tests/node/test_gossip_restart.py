"""A node restarted under the same peer id is heard again by its subscribers at once.

py-libp2p names a message by (author, seqno) and starts the seqno at the Unix time in seconds,
+1 per message: a learner that published several announcements a second and was restarted
reused seqnos its peers had seen, and they dropped its announcements as duplicates for up to two
minutes (the peers then learned of versions only by status checks, every 5 s). The end-to-end
case, with real processes, is tests/integration/test_restart.py.
"""

from __future__ import annotations

import gc

import pytest
import trio

from echo_node.net.p2p import ID, P2PNode, StreamUnavailable, multiaddr  # libp2p only via the adapter
from protocol import Identity

PUBLISHER = Identity.from_seed(b"\x31" * 32)


def test_a_restarted_node_never_reuses_a_message_id_of_its_previous_process() -> None:
    first = P2PNode(PUBLISHER)  # hosts built, not started: the ids are the adapter's choice
    used = {first._pubsub._next_seqno() for _ in range(10_000)}  # a busy first process
    second = P2PNode(PUBLISHER)  # the same key, started again right away
    assert int.from_bytes(second._pubsub._next_seqno(), "big") > max(int.from_bytes(s, "big") for s in used)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stream_to_a_peer_that_is_gone_is_an_oserror() -> None:
    """Real host. A peer id nobody serves: the adapter raises StreamUnavailable (an OSError,
    what every link-failure handler catches), never one of py-libp2p's own exception types. A
    listener that accepts and never answers: the caller's deadline ends the attempt."""
    import socket

    async def main() -> None:
        node = P2PNode(Identity.from_seed(b"\x33" * 32))
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts the TCP connection, never speaks
        gone = Identity.from_seed(b"\x34" * 32).peer_id
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            with pytest.raises(StreamUnavailable):
                await node.open_stream(gone, "/echo-node/status/1")
            node._host.get_peerstore().add_addrs(
                ID.from_base58(gone), [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}")], 60
            )
            # A listener that never speaks is not a failure py-libp2p reports: the caller's
            # deadline ends the attempt (rpc.call's contract), promptly and cleanly.
            start = trio.current_time()
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(3):
                    await node.open_stream(gone, "/echo-node/status/1")
            assert trio.current_time() - start < 4
            nursery.cancel_scope.cancel()
        silent.close()

    trio.run(main)
    gc.collect()
