"""An impostor announcing the run id is never joined when the learner is pinned, and without a
pin a peer joins nothing while more than one provider answers as the run's learner."""

from __future__ import annotations

import gc
import logging
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
import trio.testing

from echo_node.config import load_config
from echo_node.ml.model import tiny_llama_config
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.net import rpc
from echo_node.net.discovery import (
    SECOND_LOOK_S,
    JoinError,
    PeerAddr,
    Probe,
    check_first_learner_allowed,
    find_providers,
    find_sole_learner,
)
from echo_node.net.p2p import P2PNode, provider_key
from echo_node.peer.rollout_peer import RATE_LIMITED_RETRIES_S, Session, _probe_learner, join_run
from protocol import Identity
from protocol.messages import JoinResponse, RunSpec, SamplingParams, StatusResponse

REAL = Identity.from_seed(b"\x51" * 32).peer_id
IMPOSTOR = Identity.from_seed(b"\x52" * 32).peer_id


class Dht:
    """The impostor's record comes first; the real learner's appears only after 5 s."""

    async def connect_multiaddr(self, maddr: str) -> str:
        return "boot"

    async def find_providers(self, key: str, count: int = 20) -> list[PeerAddr]:
        records = [PeerAddr(IMPOSTOR, ())]
        if trio.current_time() >= 5.0:
            records.append(PeerAddr(REAL, ()))
        return records


def lookup(pin: str | None, deadline_s: float = 30.0) -> list[str]:
    async def go() -> list[str]:
        found = await find_providers(Dht(), "k", what="learner", deadline_s=deadline_s, pin=pin)
        return [p.peer_id for p in found]

    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_pinned_lookup_waits_for_the_pinned_learner_and_returns_only_it() -> None:
    assert lookup(REAL) == [REAL]


def test_without_a_pin_every_record_is_a_candidate() -> None:
    assert lookup(None) == [IMPOSTOR]  # the peer then asks each whether it is the learner (find_sole_learner)


def test_a_pinned_learner_that_never_appears_is_a_clear_error() -> None:
    with pytest.raises(JoinError, match=f"with peer id {REAL}"):
        lookup(REAL, deadline_s=2.0)


def test_a_run_address_pins_the_learner(tmp_path: Path) -> None:
    cfg = load_config(None, run_id=f"demo@{REAL}")
    assert (cfg.run_id, cfg.net.learner) == ("demo", REAL)
    assert load_config(None, run_id="demo", net__learner=REAL).net.learner == REAL
    with pytest.raises(ValueError, match="names learner"):
        load_config(None, run_id=f"demo@{REAL}", net__learner=IMPOSTOR)
    with pytest.raises(ValueError, match="not a libp2p"):
        load_config(None, run_id="demo@nobody")


# -- without a pin: nothing is joined until exactly one provider answers as the learner ----------

RUN = "demo"


class Answers:
    """A probe: the peers in `learners` answer for the run, the rest do not; records who was asked."""

    def __init__(self, *learners: str) -> None:
        self.learners = set(learners)
        self.asked: list[tuple[float, str]] = []

    async def __call__(self, peer: PeerAddr) -> Probe:
        self.asked.append((trio.current_time(), peer.peer_id))
        if peer.peer_id in self.learners:
            return Probe(answers=True)
        return Probe(answers=False, why="wrong_run: this learner serves run 'other'")


class LateDht:
    """The impostor's record from the start; the real learner's from `real_at` (virtual s)."""

    def __init__(self, real_at: float) -> None:
        self.real_at = real_at

    async def connect_multiaddr(self, maddr: str) -> str:
        return "boot"

    async def find_providers(self, key: str, count: int = 20) -> list[PeerAddr]:
        late = [PeerAddr(REAL, ())] if trio.current_time() >= self.real_at else []
        return [PeerAddr(IMPOSTOR, ()), *late]


def sole(dht: Any, probe: Answers, deadline_s: float = 30.0) -> tuple[str, float]:
    async def go() -> tuple[str, float]:
        found = await find_sole_learner(dht, "k", run_id=RUN, deadline_s=deadline_s, probe=probe)
        return found.peer_id, trio.current_time()

    return trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))


def test_two_providers_answering_for_the_run_is_a_refusal_naming_both_and_how_to_pin() -> None:
    probe = Answers(REAL, IMPOSTOR)
    with pytest.raises(JoinError) as info:
        sole(LateDht(real_at=0.0), probe)
    message = str(info.value)
    assert REAL in message and IMPOSTOR in message and "\n" not in message
    assert f"--run-id {RUN}@PEER_ID" in message and "joins none" in message
    assert sorted(pid for _, pid in probe.asked) == sorted([IMPOSTOR, REAL])  # each asked once


def test_a_learner_record_that_appears_a_moment_later_is_seen_before_deciding() -> None:
    # The impostor answers at once; the real learner's record reaches the DHT a second later.
    with pytest.raises(JoinError, match=REAL):
        sole(LateDht(real_at=1.0), Answers(REAL, IMPOSTOR))


def test_the_second_look_is_one_look_and_bounded_in_time() -> None:
    probe = Answers(IMPOSTOR)
    peer, decided_at = sole(LateDht(real_at=1e9), probe)
    assert (peer, decided_at) == (IMPOSTOR, SECOND_LOOK_S)  # a pin is what keeps an early impostor out
    assert probe.asked == [(0.0, IMPOSTOR)]


def test_a_provider_that_does_not_answer_for_the_run_is_not_taken_or_counted() -> None:
    assert sole(LateDht(real_at=0.0), Answers(REAL))[0] == REAL


def test_no_provider_answering_is_a_clear_error_at_the_deadline() -> None:
    with pytest.raises(JoinError, match=f"no provider of run '{RUN}' answered as its learner within 20s: {IMPOSTOR}: wrong_run"):
        sole(LateDht(real_at=1e9), Answers(), deadline_s=20.0)


class FloodedLearner:
    """A learner whose budget for strangers' status requests an impostor's flood used up: each
    status stream is answered `rate_limited` (after the run id was checked, as learner.py does)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.asked: list[float] = []

    async def connect(self, peer: PeerAddr) -> None:
        pass

    async def open_stream(self, peer_id: str, protocol_id: str) -> Any:
        self.asked.append(trio.current_time())
        mine, theirs = trio.testing.memory_stream_pair()
        theirs.remote_peer_id = "the-peer"  # type: ignore[attr-defined]
        self.nursery.start_soon(partial(rpc.serve_one, cast(Any, theirs), self._refuse, on_bad=lambda peer, exc: None))
        return mine

    async def _refuse(self, request: Any, remote: str) -> Any:
        raise rpc.RequestRefused("rate_limited", "too many status requests; peers that joined get their own budget")


def test_a_rate_limited_learner_still_counts_as_answering_for_the_run() -> None:
    """Else an impostor that floods the real learner with status requests would be the only
    provider that answers, and be joined."""

    async def go() -> tuple[Probe, list[float]]:
        async with trio.open_nursery() as nursery:
            flooded = FloodedLearner(nursery)
            probe = await _probe_learner(load_config(None, run_id=RUN), cast(Any, flooded), PeerAddr(REAL, ()))
        return probe, flooded.asked

    probe, asked = trio.run(go, clock=trio.testing.MockClock(autojump_threshold=0))
    assert probe.answers and probe.why.startswith("rate_limited:")
    assert len(asked) == len(RATE_LIMITED_RETRIES_S) + 1 and asked[-1] == sum(RATE_LIMITED_RETRIES_S)  # asked again, bounded


# -- --insecure-first-learner: the old first-that-answers, on loopback only ------------------------

PUBLIC_BOOT = f"/ip4/203.0.113.10/tcp/4001/p2p/{REAL}"


def test_insecure_first_learner_is_a_typed_config_bool() -> None:
    assert load_config(None, run_id=RUN, net__insecure_first_learner=True).net.insecure_first_learner is True
    assert load_config(None, run_id=RUN).net.insecure_first_learner is False
    with pytest.raises(ValueError, match="net.insecure_first_learner must be bool"):
        load_config(None, run_id=RUN, net__insecure_first_learner="yes")


def test_insecure_first_learner_off_loopback_is_refused_before_anything_is_dialed() -> None:
    check_first_learner_allowed([f"/ip4/127.0.0.1/tcp/4001/p2p/{REAL}", f"/ip6/::1/tcp/4001/p2p/{REAL}"])
    for boot in ([PUBLIC_BOOT], [f"/ip4/127.0.0.1/tcp/1/p2p/{REAL}", PUBLIC_BOOT], [f"/dns4/localhost/tcp/1/p2p/{REAL}"], []):
        with pytest.raises(ValueError, match="--insecure-first-learner") as info:
            check_first_learner_allowed(boot)
        assert "\n" not in str(info.value) and "--run-id RUN_ID@PEER_ID" in str(info.value)
    cfg = load_config(None, run_id=RUN, net__bootstrap=[PUBLIC_BOOT], net__insecure_first_learner=True)
    with pytest.raises(ValueError, match="not /ip4/203.0.113.10"):
        trio.run(join_run, cfg, cast(Any, None), cast(Any, None))  # no node: it never gets to dial


def test_insecure_first_learner_off_loopback_is_one_line_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from echo_node.cli import EXIT_USER_ERROR, main

    argv = ["join", "--bootstrap", PUBLIC_BOOT, "--run-id", RUN, "--insecure-first-learner", "--key-file", str(tmp_path / "k.key")]
    assert main(argv) == EXIT_USER_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("echo-node join: error: --insecure-first-learner"), lines


# -- real libp2p hosts on loopback: the learner and an impostor, both announcing the run -----------


class LearnerLike:
    """A libp2p host that announces RUN and answers status and join for it as its learner, in
    its own name (the stream authenticates it); records who asked what."""

    def __init__(self, identity: Identity) -> None:
        self.node = P2PNode(identity)
        self.asked: list[tuple[str, str]] = []  # (rpc, remote peer id)

    async def serve(self, boot: str) -> None:
        self.node.set_stream_handler(rpc.STATUS, partial(self._serve, self._on_status))
        self.node.set_stream_handler(rpc.JOIN, partial(self._serve, self._on_join))
        await self.node.connect_multiaddr(boot)
        await self.node.provide(provider_key(RUN))

    async def _serve(self, handler: Any, stream: Any) -> None:
        with trio.move_on_after(10):
            await rpc.serve_one(stream, handler, on_bad=lambda peer, exc: None)

    async def _on_status(self, request: Any, remote: str) -> StatusResponse:
        self.asked.append(("status", remote))
        return StatusResponse(run_id=RUN, version=0, weights_size=1, weights_sha256=b"\x00" * 32, demand_groups=1, epoch=1)

    async def _on_join(self, request: Any, remote: str) -> JoinResponse:
        self.asked.append(("join", remote))
        return JoinResponse(spec=tiny_spec(self.node.peer_id), data_host="127.0.0.1", data_port=9)


def tiny_spec(learner: str) -> RunSpec:
    tok = CharTokenizer()
    return RunSpec(
        run_id=RUN, model={"kind": "embedded", **tiny_llama_config(tok.vocab_size)}, tokenizer=tok.to_dict(), task="addition",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), sync_mode="async", staleness=2, group_size=2,
        current_version=0, learner_peer_id=learner, epoch=1,
    )


Asked = list[tuple[str, str]]


def on_loopback_swarm(
    tmp_path: Path, pin: str | None, *, impostor_up: bool = True, first_learner: bool = False
) -> tuple[Session | str, Asked, Asked, str]:
    """Boot, the real learner and the impostor (both announced), then one peer's `join_run`:
    what it returned (a Session, or the JoinError's message), what the real learner and the
    impostor were asked, and the peer's id. No host outlives it (their sockets are collected
    here, under the caller's warning filter)."""
    real, impostor = LearnerLike(Identity.from_seed(b"\x51" * 32)), LearnerLike(Identity.from_seed(b"\x52" * 32))
    outcome: list[Session | str] = []
    peer = P2PNode(Identity.from_seed(b"\x53" * 32))

    async def main() -> None:
        boot = P2PNode(Identity.from_seed(b"\x54" * 32))
        async with trio.open_nursery() as nursery:
            for node in (boot, real.node, impostor.node, peer):
                await nursery.start(node.run)
            with trio.fail_after(60):
                if impostor_up:
                    await impostor.serve(boot.addrs[0])  # announced first
                await real.serve(boot.addrs[0])
                cfg = load_config(None, run_id=RUN, runs_dir=str(tmp_path), net__bootstrap=[boot.addrs[0]],
                                  net__learner=pin, net__join_deadline_s=30.0, net__insecure_first_learner=first_learner)
                try:
                    outcome.append(await join_run(cfg, peer, cast(Any, SimpleNamespace(host="127.0.0.1", port=9))))
                except JoinError as exc:
                    outcome.append(str(exc))
            nursery.cancel_scope.cancel()

    trio.run(main)
    result = outcome[0], real.asked, impostor.asked, peer.peer_id
    del real, impostor, peer
    gc.collect()
    return result


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_on_real_hosts_an_unpinned_peer_refuses_two_learners_and_joins_neither(tmp_path: Path) -> None:
    outcome, real, impostor, me = on_loopback_swarm(tmp_path, pin=None)
    assert isinstance(outcome, str), outcome
    assert REAL in outcome and IMPOSTOR in outcome and f"--run-id {RUN}@PEER_ID" in outcome
    assert real == [("status", me)] and impostor == [("status", me)]  # asked, never joined


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_on_real_hosts_a_pinned_peer_joins_only_the_real_learner(tmp_path: Path) -> None:
    session, real, impostor, me = on_loopback_swarm(tmp_path, pin=REAL)
    assert isinstance(session, Session) and session.learner.peer_id == REAL and session.spec.learner_peer_id == REAL
    assert real == [("join", me)] and impostor == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_on_real_hosts_an_unpinned_peer_joins_the_only_learner_and_logs_the_pin(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="echo_node.peer.rollout_peer"):
        session, real, impostor, me = on_loopback_swarm(tmp_path, pin=None, impostor_up=False)
    assert isinstance(session, Session) and session.learner.peer_id == REAL
    assert real == [("status", me), ("join", me)] and impostor == []  # asked first, then joined
    assert f"pass --run-id {RUN}@{REAL}" in caplog.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_on_real_hosts_insecure_first_learner_on_loopback_joins_the_first_that_answers(tmp_path: Path) -> None:
    session, real, impostor, me = on_loopback_swarm(tmp_path, pin=None, first_learner=True)
    assert isinstance(session, Session), session
    joined = {REAL: real, IMPOSTOR: impostor}
    assert joined.pop(session.learner.peer_id) == [("join", me)] and list(joined.values()) == [[]]  # the old behaviour
