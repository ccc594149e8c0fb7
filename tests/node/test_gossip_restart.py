"""A node restarted under the same peer id is heard again by its subscribers at once.

py-libp2p names a message by (author, seqno) and starts the seqno at the Unix time in seconds,
+1 per message: a learner that published several announcements a second and was restarted
reused seqnos its peers had seen, and they dropped its announcements as duplicates for up to two
minutes (the peers then learned of versions only by status checks, every 5 s). The end-to-end
case, with real processes, is tests/integration/test_restart.py.
"""

from __future__ import annotations

from echo_node.net.p2p import P2PNode
from protocol import Identity

PUBLISHER = Identity.from_seed(b"\x31" * 32)


def test_a_restarted_node_never_reuses_a_message_id_of_its_previous_process() -> None:
    first = P2PNode(PUBLISHER)  # hosts built, not started: the ids are the adapter's choice
    used = {first._pubsub._next_seqno() for _ in range(10_000)}  # a busy first process
    second = P2PNode(PUBLISHER)  # the same key, started again right away
    assert int.from_bytes(second._pubsub._next_seqno(), "big") > max(int.from_bytes(s, "big") for s in used)
