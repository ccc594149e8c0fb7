"""Real libp2p hosts in one process: what a node publishes through identify and the DHT is its
advertised address, never the wildcard it listens on, and a dial that cannot succeed says, per
address, what happened (refused, another peer id, skipped as unroutable)."""

from __future__ import annotations

import gc

import pytest
import trio

from echo_node.net.discovery import DialError
from echo_node.net.transport import PeerAddr
from echo_node.net.p2p import P2PNode, P2PSettings, provider_key
from protocol import Identity
from tests.factories import closed_port, silent_listener

pytestmark = pytest.mark.integration


# py-libp2p 0.8.1 leaves some TCP sockets of a closed in-process host to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_wildcard_listener_publishes_its_advertised_address_in_the_dht() -> None:
    found: list[PeerAddr] = []
    published: list[str] = []

    async def main() -> None:
        boot = P2PNode(Identity.generate())
        # Listens on every interface; others must be told 127.0.0.1 (this test's "public" address).
        learner = P2PNode(Identity.generate(), P2PSettings(listen="/ip4/0.0.0.0/tcp/0", advertise_host="127.0.0.1"))
        peer = P2PNode(Identity.generate())
        async with trio.open_nursery() as nursery:
            for node in (boot, learner, peer):
                await nursery.start(node.run)
            published.extend(learner.addrs)
            await learner.connect_multiaddr(boot.addrs[0])
            await peer.connect_multiaddr(boot.addrs[0])
            with trio.fail_after(30):
                await learner.provide(provider_key("addr-run"))
                while not found:
                    found.extend(await peer.find_providers(provider_key("addr-run")))
                await peer.connect(found[0])  # dials what the record says
            nursery.cancel_scope.cancel()

    trio.run(main)
    gc.collect()  # collect the hosts' leaked sockets here, under this test's warning filter
    assert published and all(a.startswith("/ip4/127.0.0.1/tcp/") for a in published), published
    assert found[0].addrs and not any("0.0.0.0" in a for a in found[0].addrs), found


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_failed_dial_names_each_address_and_what_happened() -> None:
    errors: list[DialError] = []

    async def main() -> None:
        target, other = Identity.generate(), P2PNode(Identity.generate())
        me = P2PNode(Identity.generate(), P2PSettings(dial_timeout_s=2.0))

        async with trio.open_nursery() as nursery:
            await nursery.start(other.run)
            await nursery.start(me.run)
            nobody = await closed_port()
            mute = await silent_listener(nursery)  # accepts, never says a word
            other_port = other.addrs[0].split("/")[4]
            addrs = (f"/ip4/0.0.0.0/tcp/{other_port}", f"/ip4/127.0.0.1/tcp/{nobody}", f"/ip4/127.0.0.1/tcp/{other_port}",
                     f"/ip4/127.0.0.1/tcp/{mute}")
            with pytest.raises(DialError) as info:
                await me.connect(PeerAddr(target.peer_id, addrs))
            errors.append(info.value)
            with pytest.raises(DialError) as info:
                await me.connect(PeerAddr(target.peer_id, addrs[:1]))
            errors.append(info.value)
            nursery.cancel_scope.cancel()

    trio.run(main)
    gc.collect()  # as above
    outcomes = dict(errors[0].outcomes)
    assert "unspecified" in next(v for k, v in outcomes.items() if "0.0.0.0" in k)
    assert list(outcomes.values())[1] == "connection refused"
    assert list(outcomes.values())[2].startswith("wrong peer: the handshake reached 12D3KooW")
    assert list(outcomes.values())[3] == "timed out"
    assert errors[0].hint == ""
    assert "--advertise-host" in errors[1].hint and "\n" not in str(errors[1])
