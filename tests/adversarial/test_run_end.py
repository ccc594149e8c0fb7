"""The end of a run (RunEnded on the versions topic) stops peers only when their learner says so.

Attacks: anyone else's "run finished" (signed by itself, unsigned, for another run, malformed)
would make every peer of a run leave at once; a learner's own end of an earlier epoch, replayed
after its restart, would stand them by. Each is refused; the learner's current word is taken.
Real libp2p hosts on loopback for the gossip case.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from echo_node.config import RunConfig
from echo_node.net.transport import PeerAddr
from echo_node.net.p2p import P2PNode  # libp2p only via the adapter
from echo_node.peer.weight_follower import WeightFollower
from echo_node.topics import versions_topic
from echo_node.weights.broadcast import DataServer
from protocol import Identity
from protocol._wire import pack
from protocol.envelope import seal
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.framing import encode_frame
from protocol.messages import SCHEMA_VERSION, RunEnded, StatusResponse, decode_message, encode_message

LEARNER = Identity.from_seed(b"\x51" * 32)
PEER = Identity.from_seed(b"\x52" * 32)
MALLORY = Identity.from_seed(b"\x53" * 32)
RUN = "run-1"


def follower(node: object = None, epoch: int = 1) -> WeightFollower:
    cfg = RunConfig(run_id=RUN, runs_dir=Path(tempfile.mkdtemp(prefix="echo-node-end-")))
    session = SimpleNamespace(engine=SimpleNamespace(version=-1), spec=SimpleNamespace(sync_mode="async", epoch=epoch),
                              learner=PeerAddr(LEARNER.peer_id, []))
    return WeightFollower(cfg, node, DataServer(PEER, RUN), session)  # type: ignore[arg-type]


def test_the_message_is_bounded_and_strict() -> None:
    msg = RunEnded(run_id=RUN, epoch=2, version=40, reason="finished")
    assert decode_message(encode_message(msg), RunEnded) == msg
    for bad in ("done", "", "finished" * 3):
        with pytest.raises(LocalProtocolError, match="RunEnded.reason"):
            RunEnded(run_id=RUN, epoch=2, version=40, reason=bad)  # type: ignore[arg-type]
    for fields in ([RUN, 2, 40, "finished", "extra"], [RUN, 2, True, "finished"], [RUN, -1, 40, "finished"],
                   [RUN, 2, 40, "restarting"], [RUN, 2, 40, 1], ["bad id!", 2, 40, "finished"]):
        with pytest.raises(RemoteProtocolError):
            decode_message(pack([SCHEMA_VERSION, "run_ended", fields]), RunEnded)


def test_an_earlier_epochs_end_replayed_is_ignored_and_activation_needs_a_newer_epoch() -> None:
    f = follower(epoch=3)
    assert not f.end(RunEnded(run_id=RUN, epoch=2, version=10, reason="finished"))
    assert f.ended is None and f.active
    assert f.end(RunEnded(run_id=RUN, epoch=3, version=30, reason="stopped"))
    assert not f.active, "a stopped run: nothing to generate for"
    # The stopping learner's own status answers (same epoch) do not wake the peer; a restart's do.
    def status(epoch: int, active: bool = True) -> StatusResponse:
        return StatusResponse(run_id=RUN, version=30, weights_size=1, weights_sha256=b"\x01" * 32, demand_groups=4,
                              epoch=epoch, active=active)

    assert not f.activated_by(status(3))
    assert f.activated_by(status(4)) and not f.activated_by(status(4, active=False))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_only_the_learners_own_end_of_run_reaches_a_peer_over_gossip() -> None:
    async def main() -> None:
        learner, peer, mallory = P2PNode(LEARNER), P2PNode(PEER), P2PNode(MALLORY)
        f = follower(peer, epoch=1)
        taken: list[RunEnded] = []
        end = f.end
        f.end = lambda msg: (taken.append(msg), end(msg))[1]  # type: ignore[method-assign]
        topic = versions_topic(RUN)
        async with trio.open_nursery() as nursery:
            for node in (learner, peer, mallory):
                await nursery.start(node.run)
            await peer.subscribe(topic, f._validate_announce)
            nursery.start_soon(f._follow_announcements)
            for node in (learner, mallory):
                await node.connect(PeerAddr(peer.peer_id, peer.addrs))
            with trio.fail_after(30):
                while not all(peer.peer_id in n.gossip_peers(topic) for n in (learner, mallory)):
                    await trio.sleep(0.05)
            finished = RunEnded(run_id=RUN, epoch=1, version=9, reason="finished")
            attacks = [
                seal(finished, MALLORY),  # signed, by someone who is not the learner
                encode_frame(encode_message(finished)),  # unsigned
                seal(RunEnded(run_id="run-2", epoch=1, version=9, reason="finished"), LEARNER)[:40] + b"\x00" * 8,  # torn
                b"\x28\xb5\x2f\xfd" + b"\xff" * 64,  # not a frame at all
            ]
            for data in attacks:
                await mallory.publish(topic, data)
            # The learner's own word on another run's topic name does not count for this run either.
            await learner.publish(topic, seal(RunEnded(run_id="run-2", epoch=1, version=9, reason="finished"), LEARNER))
            honest = RunEnded(run_id=RUN, epoch=1, version=12, reason="stopped")
            await learner.publish(topic, seal(honest, LEARNER))
            with trio.fail_after(30):
                while f.ended is None:
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # anything else in flight arrives meanwhile
            assert taken == [honest], "only the learner's own, for this run"
            assert f.ended == honest and not f.active
            nursery.cancel_scope.cancel()

    trio.run(main)
    gc.collect()
