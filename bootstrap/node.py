"""The bootstrap peer: a DHT server others dial first. It holds no model and joins no run.

Its first line of stdout (printed by the CLI) is its full multiaddr (ending in /p2p/<peer id>), so
a script can start it and hand that line to `learn --bootstrap` and `join --bootstrap`.
"""

from __future__ import annotations

import logging

import trio

from echo_node.net.p2p import P2PNode, P2PSettings
from protocol.identity import Identity

log = logging.getLogger(__name__)


async def run_bootstrap(
    identity: Identity, settings: P2PSettings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the DHT until cancelled; ready (`task_status.started`) with the addresses it
    publishes, each ending in /p2p/<peer id> (the CLI prints the first)."""
    node = P2PNode(identity, settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        task_status.started(node.addrs)
        log.info("bootstrap peer %s serving the DHT on %s", node.peer_id, ", ".join(node.addrs))
        while True:
            await trio.sleep(60)
            log.info("bootstrap: %d connected peers", len(node.connected_peers()))
