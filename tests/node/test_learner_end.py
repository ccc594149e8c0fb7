"""The end of a run reaches a peer that subscribed after the learner first said it.

Real libp2p hosts on loopback: the learner's own host, closed when its announcement returns as
at exit, and a peer's, with the peer's real weight follower judging the messages (the hostile
cases, forged and replayed ends, are in tests/adversarial/test_run_end.py).

What this does not show: that the repeats are what reached the peer. With one word, GossipSub's
lazy gossip (IHAVE at the next heartbeat) delivered it too in this two-host swarm. The repeats
push the word to every subscriber instead of to the few peers a heartbeat's gossip samples.
"""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

import echo_node.learner.learner as learner_module
from echo_node.config import RunConfig
from echo_node.learner.learner import Learner
from echo_node.ml.model import build_model, tiny_llama_config
from echo_node.ml.tasks import get_task
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.net.transport import PeerAddr
from echo_node.net.p2p import P2PNode  # libp2p only via the adapter
from echo_node.peer.weight_follower import WeightFollower
from echo_node.policy import Policy
from echo_node.topics import versions_topic
from echo_node.weights.broadcast import DataServer
from protocol import Identity
from protocol.messages import RunEnded

PEER = Identity.from_seed(b"\x52" * 32)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_peer_that_subscribed_after_the_first_word_hears_the_end_and_takes_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that subscribed after the first word still stops instead of looking for the
    learner for half an hour, and its follower takes the repeated word once."""
    # Built here, not by the `learner` fixture: the fixture would keep its host, and the host's
    # sockets, alive past this test.
    tok = CharTokenizer()
    arch = tiny_llama_config(tok.vocab_size)
    policy = Policy(build_model(arch), tok, get_task("addition"), {"kind": "embedded", **arch}, tok.to_dict())
    learner = Learner(RunConfig(run_id="run-1", runs_dir=tmp_path), Identity.from_seed(b"\x01" * 32), policy)
    # Wide margins for a loaded machine: three words 1.5 s apart, all within the bound.
    monkeypatch.setattr(learner_module, "END_DRAIN_S", 1.5)
    monkeypatch.setattr(learner_module, "END_ANNOUNCE_S", 30.0)
    said: list[float] = []
    publish = learner.node.publish

    async def spy(topic: str, data: bytes) -> None:
        said.append(trio.current_time())
        await publish(topic, data)

    learner.node.publish = spy  # type: ignore[method-assign]

    async def main() -> None:
        peer = P2PNode(PEER)
        f = WeightFollower(
            RunConfig(run_id=learner.cfg.run_id, runs_dir=tmp_path / "peer"), peer, DataServer(PEER, learner.cfg.run_id),
            SimpleNamespace(engine=SimpleNamespace(version=-1), spec=SimpleNamespace(sync_mode="async", epoch=learner.epoch),
                            learner=PeerAddr(learner.identity.peer_id, [])),  # type: ignore[arg-type]
        )
        taken: list[RunEnded] = []
        end = f.end

        def counted(msg: RunEnded) -> bool:
            took = end(msg)
            if took:
                taken.append(msg)
            return took

        f.end = counted  # type: ignore[method-assign]
        topic = versions_topic(learner.cfg.run_id)
        async def learner_until_it_has_said_it(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            # As at exit: the learner's host closes once the announcement returns.
            async with trio.open_nursery() as host:
                await host.start(learner.node.run)
                task_status.started()
                await learner._announce_end("finished")
                host.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            await nursery.start(peer.run)
            learner.report.open()
            await nursery.start(learner_until_it_has_said_it)
            with trio.fail_after(30):
                while not said:
                    await trio.sleep(0.01)
            # Only now does the peer subscribe and connect: the first word went to nobody.
            await peer.subscribe(topic, f._validate_announce)
            nursery.start_soon(f._follow_announcements)
            await learner.node.connect(PeerAddr(peer.peer_id, peer.addrs))
            with trio.fail_after(30):
                while len(said) < learner_module.END_REPEATS:
                    await trio.sleep(0.05)
            await trio.sleep(learner_module.END_DRAIN_S + 1.0)  # the host is closed by now
            assert f.ended is not None and f.ended.reason == "finished" and f.ended.run_id == learner.cfg.run_id
            assert len(taken) == 1, "the repeats are the same word: taken once"
            nursery.cancel_scope.cancel()

    trio.run(main)
    learner.report.close()
    del learner, publish, spy  # the host's sockets go with it, inside this test
    gc.collect()
