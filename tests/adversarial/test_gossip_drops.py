"""Gossip py-libp2p drops before our validator is counted, never raised and never leaks state.

The node's `_push_msg` wraps the library's: hostile messages (garbage or empty author ids,
unsigned, a flood of them) must reach the counters, not an exception, and leave nothing behind.
"""

from __future__ import annotations

from typing import Any

import trio

from echo_node.net.p2p import ID, P2PNode, rpc_pb2
from protocol import Identity

TOPIC = "/echo-node/1/test/rollouts"
FORWARDER = ID.from_base58(Identity.from_seed(b"\x08" * 32).peer_id)


def node() -> P2PNode:
    n = P2PNode(Identity.from_seed(b"\x07" * 32))  # host built, not started
    n.gossip_drops[TOPIC] = {}  # what subscribe() sets up for a validated topic
    return n


def message(from_id: bytes, i: int = 0) -> Any:
    return rpc_pb2.Message(from_id=from_id, data=b"x" * 64, seqno=i.to_bytes(8, "big"), topicIDs=[TOPIC])


def test_unsigned_and_garbage_messages_are_counted_not_raised() -> None:
    n = node()
    author = ID.from_base58(Identity.from_seed(b"\x09" * 32).peer_id).to_bytes()

    async def main() -> None:
        for i, from_id in enumerate((b"\xff\x00garbage", b"", author, b"\x00" * 4096)):
            await n._push_msg(FORWARDER, message(from_id, i))

    trio.run(main)
    assert n.gossip_drops[TOPIC] == {"signature": 4}  # strict signing dropped them all
    assert not n._reached_validator


def test_a_flood_leaves_only_counters_behind() -> None:
    n = node()

    async def main() -> None:
        for i in range(5000):
            await n._push_msg(FORWARDER, message(b"\x01" * 38, i))

    trio.run(main)
    assert n.gossip_drops[TOPIC] == {"signature": 5000} and not n._reached_validator


def test_a_message_that_reached_the_validator_is_not_counted_as_dropped() -> None:
    n = node()

    async def library(forwarder: Any, msg: Any) -> None:
        n._reached_validator.add(id(msg))  # what our topic validator records when called

    n._library_push_msg = library  # type: ignore[method-assign]
    trio.run(n._push_msg, FORWARDER, message(b"\x01" * 38))
    assert n.gossip_drops[TOPIC] == {} and not n._reached_validator


def test_other_topics_are_not_ours_to_count() -> None:
    n = node()
    msg = rpc_pb2.Message(from_id=b"\x01", data=b"x", seqno=b"\0" * 8, topicIDs=["/someone/elses"])
    trio.run(n._push_msg, FORWARDER, msg)
    assert n.gossip_drops == {TOPIC: {}}
