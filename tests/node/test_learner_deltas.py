"""The learner cuts deltas against any version it still keeps, on demand, and refuses the rest."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio

from echo_node import offload
from echo_node.learner import weight_publisher as publisher_module
from echo_node.learner.learner import Learner
from echo_node.ml.model import state_to_bytes
from echo_node.weights.broadcast import FULL, DataServer
from echo_node.weights.fetch import Unavailable, open_version, receive_version
from protocol import Identity
from protocol.weights.delta import decode_delta

PEER = Identity.from_seed(b"\x07" * 32)


def next_weights(learner: Learner, step: int) -> bytes:
    """A small update to one tensor, like one optimizer step at a low learning rate."""
    with torch.no_grad():
        param = list(learner.policy.model.parameters())[step % 3]
        param.view(-1)[:64].add_(1e-3)
    return state_to_bytes(learner.policy.model)


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
def test_delta_against_an_older_base_on_demand(learner: Learner, inline: bool) -> None:
    """Also with blocking work inline (echo_node/offload.py, as a swarm on virtual time runs it):
    the encoder's cancellation poll must not fail the encode there."""
    learner.peers.join(PEER.peer_id, 0.0)
    blobs: list[bytes] = []

    async def fetch(peer: DataServer, version: int, base: int) -> tuple[int | None, bytes]:
        manifest, stream = await open_version(
            peer, learner_id=learner.identity.peer_id, host="127.0.0.1", port=learner.data.port, version=version, base=base
        )
        async with trio.open_nursery() as links:
            payload, _ = await receive_version(peer, links, manifest, stream, learner_id=learner.identity.peer_id)
            links.cancel_scope.cancel()
        peer.unregister(version)
        return manifest.base_version, bytes(payload)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(learner.data.run)
            peer = DataServer(PEER, learner.cfg.run_id)
            await nursery.start(peer.run)
            blobs.append(state_to_bytes(learner.policy.model))
            learner.weights.offer(0, blobs[0])
            for step in range(1, 4):
                blobs.append(next_weights(learner, step))
                learner.trainer.version += 1
                await learner.weights.publish(learner.version, blobs[-1])
            offered_up_front = learner.weights.deltas_offered
            with trio.fail_after(10):
                base, payload = await fetch(peer, 3, 1)
            assert base == 1 and decode_delta(payload, blobs[1], max_size=len(blobs[3])) == blobs[3]
            assert len(payload) < 0.05 * len(blobs[3])
            assert learner.weights.deltas_offered == offered_up_front + 1  # cut once, on demand
            with trio.fail_after(10):
                again, _ = await fetch(peer, 3, 1)
            assert again == 1 and learner.weights.deltas_offered == offered_up_front + 1  # reused
            # Two more versions: with keep_versions = 4 the learner keeps 2..5, so base 0 is gone.
            for step in range(4, 6):
                blobs.append(next_weights(learner, step))
                learner.trainer.version += 1
                await learner.weights.publish(learner.version, blobs[-1])
            with trio.fail_after(10), pytest.raises(Unavailable):
                await fetch(peer, 5, 0)
            base, payload = await fetch(peer, 5, 2)
            assert decode_delta(payload, blobs[2], max_size=len(blobs[5])) == blobs[5]
            nursery.cancel_scope.cancel()

    with offload.inline() if inline else contextlib.nullcontext():
        trio.run(main)


def test_deltas_that_never_pay_are_tried_ever_less_often(learner: Learner) -> None:
    """Every weight moves (a large step on fp32): whether the up-front delta pays is checked at
    the first version, then again after 50, 100 and 200 more versions, never per version; the
    estimate says no, so no delta is ever cut."""
    tried: list[int] = []
    estimate = publisher_module.estimate_delta_ratio

    def counting_estimate(blob: bytes, previous: bytes) -> float:
        tried.append(learner.version)
        return estimate(blob, previous)

    def no_encode(blob: bytes, previous: bytes, **kwargs: object) -> bytes:
        raise AssertionError("cut a delta the estimate said would not pay")

    async def main() -> None:
        learner.weights.offer(0, state_to_bytes(learner.policy.model))
        for _ in range(400):
            with torch.no_grad():
                for param in learner.policy.model.parameters():
                    param.add_(torch.randn_like(param) * 1e-2)
            learner.trainer.version += 1
            await learner.weights.publish(learner.version, state_to_bytes(learner.policy.model))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(publisher_module, "estimate_delta_ratio", counting_estimate)
        mp.setattr(publisher_module, "encode_delta", no_encode)
        trio.run(main)
    assert tried == [1, 51, 151, 351]
    assert learner.weights.deltas_offered == 0


def test_a_peer_asking_for_the_up_front_delta_while_it_is_cut_waits_for_that_encode(learner: Learner) -> None:
    """The version is fetchable (registered) before its up-front delta exists; a peer that asks
    for that delta meanwhile gets the same one, from the same single encode."""
    encodes: list[tuple[int, int]] = []
    encode = publisher_module.encode_delta

    def slow_counting_encode(blob: bytes, previous: bytes, **kwargs: Any) -> bytes:
        encodes.append((len(blob), len(previous)))
        time.sleep(0.2)  # a worker thread: long enough for the peer's request to arrive meanwhile
        return encode(blob, previous, **kwargs)

    got: list[object] = []

    async def main() -> None:
        weights = learner.weights
        weights.offer(0, state_to_bytes(learner.policy.model))
        blob = next_weights(learner, 1)
        learner.trainer.version += 1

        async def peer_asks() -> None:
            while (1, FULL) not in weights.sources:
                await trio.sleep(0.001)
            got.append(await weights.delta_on_demand(1, 0))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer_asks)
                await weights.publish(1, blob)
        got.append(weights.sources.get((1, 0)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(publisher_module, "encode_delta", slow_counting_encode)
        trio.run(main)
    assert len(encodes) == 1
    assert got[0] is not None and got[0] is got[1]
    assert learner.weights.deltas_offered == 1 and learner.weights.deltas_encoded == 1


def test_a_version_is_fetchable_and_reported_before_its_up_front_delta_is_cut(learner: Learner) -> None:
    """`nursery.start(publish)` returns (and the learner announces) once the full snapshot is
    offered; the up-front delta is cut afterwards, and a stop does not wait for that encode."""
    release = threading.Event()
    encode = publisher_module.encode_delta

    def blocked_encode(blob: bytes, previous: bytes, **kwargs: Any) -> bytes:
        release.wait(30)
        return encode(blob, previous, **kwargs)

    def endless_encode(blob: bytes, previous: bytes, *, check: Callable[[], None], **kwargs: Any) -> bytes:
        while True:  # an encode of weights far bigger than these, chunk after chunk
            check()
            time.sleep(0.01)

    async def main() -> None:
        weights = learner.weights
        weights.offer(0, state_to_bytes(learner.policy.model))
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                manifest = await nursery.start(weights.publish, 1, next_weights(learner, 1))
            assert manifest.version == 1 and weights.published == 1 and (1, FULL) in weights.sources
            assert (1, 0) not in weights.sources  # still being cut
            release.set()
            with trio.fail_after(10):
                while (1, 0) not in weights.sources:
                    await trio.sleep(0.01)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(publisher_module, "encode_delta", endless_encode)
            weights._next_delta_try = 0  # as after a delta that paid
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    await nursery.start(weights.publish, 2, next_weights(learner, 2))
                    await trio.sleep(0.1)
                    nursery.cancel_scope.cancel()  # the learner stops mid-encode
        assert (2, FULL) in weights.sources and (2, 1) not in weights.sources

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(publisher_module, "encode_delta", blocked_encode)
        trio.run(main)
