"""The bootstrap peer: a DHT server others dial first. It holds no model and joins no run.

Its first line of stdout is its full multiaddr (ending in /p2p/<peer id>), so a script can start
it and hand that line to `learn --bootstrap` and `join --bootstrap`.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import trio

from echo_node.net.p2p import P2PNode, P2PSettings
from protocol.identity import Identity

log = logging.getLogger(__name__)


async def run_bootstrap(identity: Identity, settings: P2PSettings, *, stdout: TextIO = sys.stdout) -> None:
    node = P2PNode(identity, settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        stdout.write(node.addrs[0] + "\n")
        stdout.flush()
        log.info("bootstrap peer %s serving the DHT on %s", node.peer_id, ", ".join(node.addrs))
        while True:
            await trio.sleep(60)
            log.info("bootstrap: %d connected peers", len(node.connected_peers()))
