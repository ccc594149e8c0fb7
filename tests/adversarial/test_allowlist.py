"""A private swarm: with an allowlist the learner takes joins from the listed peers only."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from echo_node.cli import _read_peer_list
from echo_node.config import load_config
from echo_node.learner.learner import Learner
from echo_node.net import rpc
from protocol import Identity, JoinRequest
from tests.factories import ALICE, MALLORY


def test_only_listed_peers_join(learner: Learner) -> None:
    learner.door._allowed = frozenset({ALICE.peer_id})
    learner.data.port = 4002  # as if its data channel listened (not started here)

    async def join(who: Identity) -> object:
        request = JoinRequest(run_id="run-1", peer_id=who.peer_id, data_host="127.0.0.1", data_port=9)
        try:
            return await learner.door.on_join(request, who.peer_id)
        except rpc.RequestRefused as exc:
            return exc.code

    assert trio.run(join, MALLORY) == "not_allowed" and MALLORY.peer_id not in learner.peers.joined
    assert trio.run(join, ALICE) != "not_allowed" and ALICE.peer_id in learner.peers.joined


def test_the_list_file_and_its_validation(tmp_path: Path) -> None:
    path = tmp_path / "peers.txt"
    path.write_text(f"# volunteers we know\n{ALICE.peer_id}  # alice\n\n{MALLORY.peer_id}\n")
    peers = _read_peer_list(path)
    assert peers == [ALICE.peer_id, MALLORY.peer_id]
    assert load_config(None, net__allow_peers=peers).net.allow_peers == peers
    with pytest.raises(ValueError, match="not a libp2p"):
        load_config(None, net__allow_peers=["alice"])
    with pytest.raises(ValueError, match="cannot read"):
        _read_peer_list(tmp_path / "missing.txt")
