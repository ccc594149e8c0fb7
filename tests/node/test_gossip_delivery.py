"""What py-libp2p would drop silently when a subscription queue is full is reported first."""

from __future__ import annotations

import pytest
import trio

from echo_node.net.p2p import ID, GossipMessage, _Delivery, rpc_pb2  # libp2p only via the adapter
from tests.factories import ALICE


def test_a_full_subscription_queue_reports_the_message_it_drops() -> None:
    send, receive = trio.open_memory_channel[rpc_pb2.Message](1)
    dropped: list[GossipMessage] = []
    delivery = _Delivery(send, dropped.append)
    origin = ID.from_base58(ALICE.peer_id)
    delivery.send_nowait(rpc_pb2.Message(from_id=origin.to_bytes(), data=b"first"))
    with pytest.raises(trio.WouldBlock):  # py-libp2p catches this and drops the message
        delivery.send_nowait(rpc_pb2.Message(from_id=origin.to_bytes(), data=b"second"))
    assert dropped == [GossipMessage(ALICE.peer_id, b"second")]
    assert receive.receive_nowait().data == b"first"
