"""Joining with retries, backoff and one deadline, on trio's virtual clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from echo_node.net.discovery import Backoff, JoinError, connect_bootstrap, find_provider
from echo_node.net.transport import PeerAddr


@dataclass
class FlakyDialer:
    """Refuses dials until `up_at` (virtual seconds); providers appear at `provider_at`."""

    up_at: float = 0.0
    provider_at: float = 0.0
    dials: list[tuple[float, str]] = field(default_factory=list)

    async def connect_multiaddr(self, maddr: str) -> str:
        self.dials.append((trio.current_time(), maddr))
        if "never" in maddr or trio.current_time() < self.up_at:
            raise ConnectionRefusedError("connection refused")
        return "peer-" + maddr[-1]

    async def find_providers(self, key: str, count: int = 20) -> list[PeerAddr]:
        if trio.current_time() < self.provider_at:
            return []
        return [PeerAddr("learner", ())]


def run(fn):
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_bootstrap_retries_with_backoff_until_one_answers() -> None:
    dialer = FlakyDialer(up_at=5.0)

    async def main() -> list[str]:
        return await connect_bootstrap(dialer, ["/a/never", "/b/2"], deadline_s=60, backoff=Backoff(0.25, 4.0))

    assert run(main) == ["peer-2"]
    times = sorted({t for t, _ in dialer.dials})
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps == [0.25, 0.5, 1.0, 2.0, 4.0][: len(gaps)], gaps  # exponential, then capped
    assert times[-1] >= 5.0


def test_bootstrap_deadline_names_every_address_tried() -> None:
    dialer = FlakyDialer(up_at=1e9)

    async def main() -> None:
        await connect_bootstrap(dialer, ["/ip4/127.0.0.1/tcp/1/p2p/never", "/x/y"], deadline_s=10)

    with pytest.raises(JoinError) as info:
        run(main)
    message = str(info.value)
    assert "within 10s" in message
    assert "/ip4/127.0.0.1/tcp/1/p2p/never (ConnectionRefusedError: connection refused)" in message
    assert "/x/y" in message
    assert max(t for t, _ in dialer.dials) <= 10.0


def test_no_bootstrap_is_a_clear_error() -> None:
    async def main() -> None:
        await connect_bootstrap(FlakyDialer(), [], deadline_s=10)

    with pytest.raises(JoinError, match="no bootstrap address"):
        run(main)


def test_provider_lookup_waits_for_a_late_learner() -> None:
    dialer = FlakyDialer(provider_at=42.0)

    async def main() -> tuple[str, float]:
        found = await find_provider(dialer, "k", what="learner", deadline_s=120)
        return found.peer_id, trio.current_time()

    peer, when = run(main)
    assert peer == "learner" and 42.0 <= when <= 46.0


def test_provider_lookup_gives_up_at_the_deadline() -> None:
    async def main() -> None:
        await find_provider(FlakyDialer(provider_at=1e9), "k", what="learner for run 'x'", deadline_s=30)

    with pytest.raises(JoinError, match="no learner for run 'x' found in the DHT within 30s"):
        run(main)
