"""A joiner cannot turn the learner into a reflector: it is dialed back only where its join came
from, once per address within a window, joins are rate-limited per identity, per source and in
all, a re-join costs no journal record, and private or link-local targets are refused unless the
learner is on such a network itself."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from echo_node.learner.learner import Learner
from echo_node.net import rpc
from echo_node.net.ratelimit import JOINS_ALL, JOINS_PER_PEER, JOINS_PER_SOURCE
from protocol import Identity
from protocol.addresses import dial_back_refusal
from protocol.messages import JoinRequest


def request(identity: Identity, host: str, port: int) -> JoinRequest:
    return JoinRequest(run_id="run-1", peer_id=identity.peer_id, data_host=host, data_port=port)


async def counting_listener(nursery: trio.Nursery, host: str) -> tuple[int, list[str]]:
    """A TCP port on `host` that counts who connects (and says nothing)."""
    seen: list[str] = []

    async def count(stream: trio.SocketStream) -> None:
        seen.append(stream.socket.getpeername()[0])
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, count, 0, host=host))
    return listeners[0].socket.getsockname()[1], seen


async def attach(learner: Learner, nursery: trio.Nursery) -> None:
    """What `Learner.run` sets up that a join needs: its door open (the nursery of probes), a
    data port to name."""
    learner.data.port = 4002
    await nursery.start(learner.door.run)


async def join(learner: Learner, identity: Identity, observed: str, host: str, port: int) -> str:
    """One join as the learner's handler sees it: "ok", or the refusal's code."""
    try:
        await learner.door.on_join(request(identity, host, port), identity.peer_id, observed=observed)
    except rpc.RequestRefused as exc:
        return exc.code
    return "ok"


def test_a_named_third_party_is_never_dialed_only_the_joiners_own_address(learner: Learner) -> None:
    """The joiner names a victim's address (another host, here 127.0.0.2) with its port; the
    learner dials the joiner's own address (127.0.0.1) at that port, and the victim sees nothing."""
    attacker = Identity.generate()

    async def main() -> tuple[list[str], list[str]]:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            port, victim = await counting_listener(nursery, "127.0.0.2")
            _, own = await counting_listener(nursery, "127.0.0.1")
            assert await join(learner, attacker, "127.0.0.1", "127.0.0.2", port) == "ok"
            with trio.fail_after(10):
                while attacker.peer_id not in learner.peers.unreachable:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return victim, own

    victim, _ = trio.run(main)
    assert victim == []
    assert "127.0.0.1" in learner.peers.unreachable[attacker.peer_id]


def test_one_identity_rejoining_in_a_loop_is_dialed_once_journaled_once_and_rate_limited(learner: Learner) -> None:
    attacker = Identity.generate()
    outcomes: list[str] = []

    async def main() -> list[str]:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            port, dialed = await counting_listener(nursery, "127.0.0.1")
            for _ in range(1000):  # as fast as the handler answers: no time passes
                outcomes.append(await join(learner, attacker, "127.0.0.1", "127.0.0.1", port))
            await trio.sleep(0.5)
            await trio.sleep(1 / JOINS_PER_PEER[0])  # later, within the dial-back window: answered, not dialed again
            outcomes.append(await join(learner, attacker, "127.0.0.1", "127.0.0.1", port))
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
        return dialed

    dialed = trio.run(main)
    assert outcomes[:1000].count("ok") == JOINS_PER_PEER[1]
    assert set(outcomes[1000:]) == {"ok"}
    assert len(dialed) == 1  # one probe for the pair (identity, address), whatever the joins
    records = learner.state.journal.take_pending()
    assert records.count(b"join") == 1


def test_many_identities_from_one_source_share_its_budget_and_all_share_one(learner: Learner) -> None:
    sybils = [Identity.generate() for _ in range(200)]

    async def main() -> tuple[list[str], list[str]]:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            one_source = [await join(learner, s, "198.51.100.7", "198.51.100.7", 4003) for s in sybils[:100]]
            # The rest from 100 addresses of their own: only the budget of all joins holds them.
            many = [await join(learner, s, f"198.51.100.{i}", "198.51.100.7", 4003) for i, s in enumerate(sybils[100:], 10)]
            nursery.cancel_scope.cancel()
        return one_source, many

    learner.door._schedule_probe = lambda peer_id, targets: None  # type: ignore[method-assign]  # no dialing out of this test
    one_source, many = trio.run(main, clock=trio.testing.MockClock())
    assert one_source.count("ok") == JOINS_PER_SOURCE[1]
    assert one_source.count("ok") + many.count("ok") == JOINS_ALL[1]


def test_private_and_link_local_targets_need_a_network_of_that_scope_or_the_operators_word() -> None:
    # (Python counts the documentation ranges 192.0.2/24, 198.51.100/24, 203.0.113/24 as private,
    # and so does this rule: globally routed addresses stand for the public internet here.
    # Pure checks: nothing is dialed.)
    public_learner = ("1.2.3.4",)
    for target in ("10.0.0.1", "192.168.1.20", "169.254.169.254", "127.0.0.1", "fd00::1", "::ffff:10.0.0.1"):
        assert dial_back_refusal(target, own_hosts=public_learner) is not None, target
    assert dial_back_refusal("5.6.7.8", own_hosts=public_learner) is None
    # A learner on a LAN dials its LAN; a one-machine swarm dials loopback; never the metadata service.
    lan_learner = ("192.168.1.2", "127.0.0.1")
    assert dial_back_refusal("10.0.0.1", own_hosts=lan_learner) is None
    assert dial_back_refusal("127.0.0.1", own_hosts=lan_learner) is None
    assert dial_back_refusal("169.254.169.254", own_hosts=lan_learner) is not None
    assert dial_back_refusal("10.0.0.1", own_hosts=public_learner, allow_private=True) is None
    assert dial_back_refusal("0.0.0.0", own_hosts=public_learner, allow_private=True) is not None


def test_a_learner_without_a_private_network_records_why_it_did_not_dial(learner: Learner) -> None:
    learner.door._own_hosts = ("1.2.3.4",)
    dialed: list[object] = []
    learner.door._schedule_probe = lambda peer_id, targets: dialed.append(targets)  # type: ignore[method-assign]
    peer = Identity.generate()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await attach(learner, nursery)
            for _ in range(3):  # re-joins within the window: one verdict, not one record and line each
                assert await join(learner, peer, "169.254.169.254", "169.254.169.254", 80) == "ok"
            nursery.cancel_scope.cancel()

    verdicts: list[str] = []
    decide = learner.door._verdict
    learner.door._verdict = lambda peer_id, relay, why: (verdicts.append(why), decide(peer_id, relay, why))  # type: ignore[method-assign,assignment,func-returns-value]
    trio.run(main)
    assert dialed == []
    assert len(verdicts) == 1 and "link-local" in learner.peers.unreachable[peer.peer_id]
