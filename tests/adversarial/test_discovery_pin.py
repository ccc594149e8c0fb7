"""An impostor announcing the run id is never joined when the learner is pinned."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from echo_node.config import load_config
from echo_node.net.discovery import JoinError, PeerAddr, find_providers
from protocol import Identity

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
    assert lookup(None) == [IMPOSTOR]  # the peer then tries each and checks what it answers


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
