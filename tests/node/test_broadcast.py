"""P2P weight broadcast on loopback TCP: every peer goes live with verified bytes, the learner
uploads about one copy, bad pieces are caught before use and their sender penalized, a relay
killed mid-transfer costs the others only re-requests, and only swarm members are served."""

from __future__ import annotations

import os
import time
from functools import partial

import msgpack
import pytest
import trio
import trio.testing

from benchmarks.trickle import Trickle
from echo_node.net.framing import read_frame
from echo_node.weights import broadcast
from echo_node.weights.broadcast import (
    BACKLOG_PIECES,
    LAGGARD_PIECES,
    LINK_IDLE_S,
    LINK_STALL_S,
    DataServer,
    Link,
    ProbeFailed,
    Receiver,
    Source,
    Stats,
    encode_frame,
    probe,
    tcp_connect,
)
from echo_node.weights.fetch import Unavailable, fetch_version, open_version
from protocol import Identity, seal
from protocol.errors import RemoteProtocolError
from protocol.framing import LengthPrefixedReader, encode_length_prefixed
from protocol.weights.datachannel import (
    MAX_WIRE_FRAME,
    Direct,
    Get,
    HelloChecker,
    More,
    Next,
    Piece,
    decode_frame,
    make_hello,
)
from protocol.weights.delta import decode_delta, encode_delta
from protocol.weights.manifest import build_manifest
from tests.factories import closed_port, silent_listener

PIECE = 16 * 1024
PAYLOAD = os.urandom(64 * PIECE + 123)
LEARNER = Identity.from_seed(b"\x01" * 32)
PEERS = [Identity.from_seed(bytes([0x10 + i]) * 32) for i in range(3)]
MANIFEST = build_manifest(run_id="run-1", version=7, payload=PAYLOAD, piece_size=PIECE)


async def serve_version(nursery: trio.Nursery, source: Source, peers: list[Identity]) -> tuple[DataServer, dict[str, DataServer]]:
    """The learner's data server with `source` registered as version 7, and one per peer."""
    learner = DataServer(LEARNER, "run-1")
    learner.register(7, source)
    await nursery.start(learner.run)
    servers = {p.peer_id: DataServer(p, "run-1") for p in peers}
    for server in servers.values():
        await nursery.start(server.run)
    return learner, servers


def run_broadcast(
    *, peers: list[Identity] = PEERS, kill_after: int | None = None, gather: bool = True, unreachable: frozenset[str] = frozenset(),
    silent: str | None = None,
):
    # What the learner's dial-back proved: every peer but the `unreachable` ones (behind a NAT).
    relays: dict[str, tuple[str, int]] = {}
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, {p.peer_id for p in PEERS}, relays)
    results: dict[str, bytes] = {}
    receivers: dict[str, Receiver] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if gather:
                source.gate = trio.Event()
            learner, servers = await serve_version(nursery, source, peers)
            for pid, server in servers.items():
                if pid not in unreachable:
                    relays[pid] = ("127.0.0.1", server.port)

            async def fetch(p: Identity) -> None:
                async with trio.open_nursery() as links:
                    _, payload, receivers[p.peer_id] = await fetch_version(
                        servers[p.peer_id], links, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7
                    )
                    results[p.peer_id] = payload
                    await trio.sleep(1)  # keep relaying for the others
                    links.cancel_scope.cancel()

            async def kill(p: Identity) -> None:
                # The victim vanishes (every link drops at once) right after its 10th piece,
                # while the others may still need what it was relaying.
                with trio.CancelScope() as scope:
                    original = Receiver._on_piece

                    def on_piece(self: Receiver, link: object, index: int, data: bytes, **kw: bool) -> None:
                        original(self, link, index, data, **kw)  # type: ignore[arg-type]
                        if self.identity.peer_id == p.peer_id and self.store.count >= (kill_after or 0):
                            scope.cancel()

                    Receiver._on_piece = on_piece  # type: ignore[method-assign]
                    try:
                        await fetch(p)
                    finally:
                        Receiver._on_piece = original  # type: ignore[method-assign]

            async def never_reads(p: Identity) -> None:
                # `silent` joins and asks like anyone, but nothing sent to it is ever read: every
                # queue towards it only grows. It runs until the others are done.
                with trio.CancelScope() as scope:
                    original = Link.sender

                    async def sender(self: Link) -> None:
                        if self.remote == p.peer_id:
                            await trio.sleep_forever()
                        await original(self)

                    Link.sender = sender  # type: ignore[method-assign]
                    try:
                        async with trio.open_nursery() as watch:
                            watch.start_soon(fetch, p)
                            while len(results) < len(peers) - 1:
                                await trio.sleep(0.01)
                            scope.cancel()
                    finally:
                        Link.sender = original  # type: ignore[method-assign]

            with trio.fail_after(30):
                async with trio.open_nursery() as inner:
                    for i, p in enumerate(peers):
                        if p.peer_id == silent:
                            inner.start_soon(never_reads, p)
                        else:
                            inner.start_soon(kill if (kill_after is not None and i == 0) else fetch, p)
                    if gather:
                        while len(source.swarm) < len(peers):
                            await trio.sleep(0.001)
                        source.gate.set()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return source, receivers, results


def test_all_peers_go_live_and_the_learner_uploads_about_one_copy() -> None:
    source, receivers, results = run_broadcast()
    assert sorted(results) == sorted(p.peer_id for p in PEERS)
    assert all(v == PAYLOAD for v in results.values())
    # A star would upload three full copies; here each piece leaves the learner about once.
    assert source.stats.bytes_up < 1.2 * len(PAYLOAD)
    assert sum(r.stats.bytes_up for r in receivers.values()) >= 1.5 * len(PAYLOAD)
    # Each receiver counts every piece once as new, by how it came (the `installed` record's
    # breakdown); first copies from the learner are what the peers relayed to each other.
    for r in receivers.values():
        new = {k: n for k, n in r.stats.pieces.items() if k != "duplicate"}
        assert set(new) <= {"next", "direct", "repair", "peers"} and sum(new.values()) == MANIFEST.num_pieces, r.stats.pieces
    nexts = sum(r.stats.pieces["next"] for r in receivers.values())
    assert nexts >= MANIFEST.num_pieces // 2 and sum(r.stats.pieces["peers"] for r in receivers.values()) >= nexts


def test_a_peer_nobody_can_dial_dials_the_others_and_still_relays() -> None:
    nat = PEERS[2].peer_id
    source, receivers, results = run_broadcast(unreachable=frozenset({nat}))
    assert all(results[p.peer_id] == PAYLOAD for p in PEERS)
    # The source listed it without an address (it learns so from its own entry), the others with.
    assert not receivers[nat].reachable and all(receivers[p.peer_id].reachable for p in PEERS[:2])
    # It relays over the links it dialed (the only ones it has): the learner still sends ~one copy.
    assert receivers[nat].stats.bytes_up > 0.2 * len(PAYLOAD)
    assert source.stats.bytes_up < 1.2 * len(PAYLOAD)


def test_two_peers_behind_nats_get_from_the_source_what_they_cannot_get_from_each_other() -> None:
    nats = frozenset({PEERS[1].peer_id, PEERS[2].peer_id})
    source, receivers, results = run_broadcast(unreachable=nats)
    assert all(results[p.peer_id] == PAYLOAD for p in PEERS)
    # The pieces the source handed to one of them first reach the other only from the source
    # (the reachable peer does not re-push what it was pushed): m NAT'd peers of N cost the
    # learner about m(m-1)/N extra copies, 2/3 here.
    assert source.stats.bytes_up < (1 + 2 / 3 + 0.2) * len(PAYLOAD)


def test_a_relay_killed_mid_transfer_costs_only_re_requests() -> None:
    _, _, results = run_broadcast(kill_after=10)
    survivors = [p.peer_id for p in PEERS[1:]]
    assert sorted(results) == sorted(survivors)
    assert all(results[p] == PAYLOAD for p in survivors)


def test_a_peer_that_never_reads_cannot_stop_the_others() -> None:
    """Its queues never drain, so the pull rule (backlog, drain time) stops the others taking
    from the source; they must still finish, through repair."""
    _, _, results = run_broadcast(silent=PEERS[2].peer_id)  # within run_broadcast's 30 s
    assert sorted(results) == sorted(p.peer_id for p in PEERS[:2])
    assert all(v == PAYLOAD for v in results.values())


def test_a_late_joiner_catches_up() -> None:
    _, _, results = run_broadcast(peers=PEERS[:1], gather=False)
    assert results == {PEERS[0].peer_id: PAYLOAD}


def test_a_corrupt_piece_is_refused_before_use_and_its_sender_penalized() -> None:
    server = DataServer(PEERS[1], "run-1")
    r = Receiver(server, MANIFEST, source_id=LEARNER.peer_id)

    class Relay:
        remote = PEERS[0].peer_id

        def send(self, *frame: object) -> None:
            raise AssertionError("a bad piece must never be relayed")

    async def main() -> None:
        # Raised to the link's reader, which cuts the link and bans the sender (tests/adversarial).
        with pytest.raises(RemoteProtocolError, match="bad piece 3"):
            r._on_piece(Relay(), 3, b"\0" * PIECE)  # type: ignore[arg-type]

    trio.run(main)
    assert r.store.get(3) is None
    assert r.stats.bad_pieces == {PEERS[0].peer_id: 1}
    assert r.swarm.penalties[PEERS[0].peer_id] == 1


def test_hellos_from_strangers_replays_and_other_targets_are_refused() -> None:
    checker = HelloChecker(LEARNER.peer_id, "run-1")
    now = time.time()
    hello = make_hello(PEERS[0], target=LEARNER.peer_id, run_id="run-1", version=7, host="10.0.0.2", port=4000, now=now)
    parsed = checker.check(hello, now)
    assert (parsed.sender, parsed.version, parsed.host, parsed.port) == (PEERS[0].peer_id, 7, "10.0.0.2", 4000)
    with pytest.raises(RemoteProtocolError, match="replayed"):
        checker.check(hello, now)
    with pytest.raises(RemoteProtocolError, match="another target"):
        checker.check(make_hello(PEERS[0], target=PEERS[2].peer_id, run_id="run-1", version=7, now=now), now)
    with pytest.raises(RemoteProtocolError, match="another target or run"):
        checker.check(make_hello(PEERS[0], target=LEARNER.peer_id, run_id="run-2", version=7, now=now), now)
    with pytest.raises(RemoteProtocolError):
        checker.check(b"garbage", now)
    # A member list is enforced by the version's handler: the learner serves only joined peers.
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, [PEERS[0].peer_id])
    stranger = checker.check(make_hello(PEERS[1], target=LEARNER.peer_id, run_id="run-1", version=7, now=now), now)

    async def main() -> None:
        a, _ = trio.testing.memory_stream_pair()
        with pytest.raises(RemoteProtocolError, match="not a member"):
            await source.serve(a, stranger)

    trio.run(main)


def test_a_freed_relay_backlog_reopens_the_pull_from_the_source() -> None:
    """A relay link dies with our pushes queued: nothing arrives any more to trigger a refill,
    so the download loop itself must ask the source again (it once waited forever here)."""
    r = Receiver(DataServer(PEERS[1], "run-1"), MANIFEST, source_id=LEARNER.peer_id)
    sent: list[tuple[str, tuple[object, ...]]] = []

    class FakeLink:
        def __init__(self, remote: str, queued: int = 0) -> None:
            self.remote, self.queued_pieces, self.queued_bytes = remote, queued, queued * PIECE
            self.behind_since: float | None = None

        def send(self, *frame: object) -> None:
            sent.append((self.remote, frame))

    r.links = {LEARNER.peer_id: FakeLink(LEARNER.peer_id), PEERS[0].peer_id: FakeLink(PEERS[0].peer_id, BACKLOG_PIECES)}  # type: ignore[dict-item]
    r._refill_source()
    assert sent == []  # our uplink to the relay is full: do not take more from the source
    del r.links[PEERS[0].peer_id]  # the relay died

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(0.05):
                await r.run(nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)
    # One `next` (SourcePull rule 1: one piece until a relay of ours has measured the uplink).
    assert sent == [(LEARNER.peer_id, (Next(),))]


def test_a_peer_holding_the_base_fetches_the_delta_and_others_fall_back_to_full() -> None:
    # Two versions of 16-bit weights where 2% of the elements moved by one unit.
    old = bytearray(os.urandom(32 * PIECE))
    new = bytearray(old)
    for i in range(0, len(new) - 1, 100):
        new[i] = (new[i] + 1) % 256
    old_b, new_b = bytes(old), bytes(new)
    full = build_manifest(run_id="run-1", version=8, payload=new_b, piece_size=PIECE)
    delta = encode_delta(new_b, old_b)
    assert len(delta) < 0.3 * len(new_b)
    delta_manifest = build_manifest(
        run_id="run-1", version=8, payload=delta, codec="xor-zstd", base_version=7,
        weights_size=len(new_b), weights_sha256=full.weights_sha256, piece_size=PIECE,
    )
    members = [p.peer_id for p in PEERS]
    got: dict[str, bytes] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner = DataServer(LEARNER, "run-1")
            learner.register(8, Source(LEARNER, full, seal(full, LEARNER), new_b, members))
            learner.register(8, Source(LEARNER, delta_manifest, seal(delta_manifest, LEARNER), delta, members), base=7)
            await nursery.start(learner.run)
            peer = DataServer(PEERS[0], "run-1")
            await nursery.start(peer.run)
            with trio.fail_after(10):
                async with trio.open_nursery() as links:
                    m, payload, _ = await fetch_version(peer, links, learner_id=LEARNER.peer_id, host="127.0.0.1",
                                                        port=learner.port, version=8, base=7, weights_sha256=full.weights_sha256)
                    assert m.codec == "xor-zstd" and len(payload) == len(delta)
                    got["delta"] = decode_delta(payload, old_b, max_size=len(new_b))
                    # Nobody offers a delta against version 5: refused at once, not timed out.
                    start = trio.current_time()
                    with pytest.raises(Unavailable):
                        await fetch_version(peer, links, learner_id=LEARNER.peer_id, host="127.0.0.1",
                                            port=learner.port, version=8, base=5)
                    assert trio.current_time() - start < 1.0
                    links.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert got["delta"] == new_b


def test_a_dial_back_proves_who_listens_where() -> None:
    outcomes: dict[str, str] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            peer, other = DataServer(PEERS[0], "run-1"), DataServer(PEERS[1], "run-1")
            await nursery.start(peer.run)
            await nursery.start(other.run)
            nobody = await closed_port()
            cases = {"right": peer.port, "impostor": other.port, "nobody": nobody}
            for name, port in cases.items():
                with trio.fail_after(5):
                    try:
                        await probe(LEARNER, "run-1", PEERS[0].peer_id, "127.0.0.1", port)
                        outcomes[name] = "ok"
                    except ProbeFailed as exc:
                        outcomes[name] = str(exc)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert outcomes["right"] == "ok"
    # Another node at that address does not answer a probe meant for someone else.
    assert outcomes["impostor"].startswith("127.0.0.1:") and "did not answer" in outcomes["impostor"]
    assert "127.0.0.1" in outcomes["nobody"]


@pytest.mark.parametrize(
    ("host", "port"),
    [("a..b", 4002), ("0.0.0.0", 4002), ("224.0.0.1", 4002), ("learner.example", 4002), ("10.0.0.1", 0),
     ("10.0.0.1", 2**63), ("10.0.0.1", -1), ("", 4002), ("x" * 300, 1)],
)
def test_hellos_naming_an_address_nobody_can_dial_are_refused(host: str, port: int) -> None:
    checker = HelloChecker(LEARNER.peer_id, "run-1")
    try:
        hello = make_hello(PEERS[0], target=LEARNER.peer_id, run_id="run-1", version=1, host=host, port=port, now=time.time())
    except OverflowError:
        return  # not even encodable (msgpack's ints end at 2**64): nothing a peer can send
    with pytest.raises(RemoteProtocolError, match="malformed data-channel hello"):
        checker.check(hello, time.time())


def test_a_source_swarm_list_with_a_bad_address_is_refused_whole() -> None:
    p = PEERS[2].peer_id
    for entry in (["p", "10.0.0.1", 4000], [p, "a..b", 1], [p, "10.0.0.1", 70000], [p, "", 5], [p, "0.0.0.0", 4002],
                  [p, "10.0.0.1", True]):
        with pytest.raises(RemoteProtocolError):
            decode_frame(msgpack.packb(["peers", [[PEERS[0].peer_id, "10.0.0.2", 4000], entry]]), from_source=True)


# What a hostile (or confused) listener at a joiner's data address may answer a dial-back with.
_SIG = b"\0" * 64
HOSTILE_ANSWERS = {
    "closes at once": None,
    "garbage frame": encode_length_prefixed(b"\xc1\xc1\xc1", max_len=1024),
    "oversized frame": (1 << 20).to_bytes(4, "big") + b"x" * 64,
    "not a list": encode_length_prefixed(msgpack.packb({"reachable": True}), max_len=1024),
    "wrong signature": encode_length_prefixed(msgpack.packb(["reachable", _SIG]), max_len=1024),
    "signature not bytes": encode_length_prefixed(msgpack.packb(["reachable", "sig"]), max_len=1024),
    "cut off mid-frame": encode_length_prefixed(msgpack.packb(["reachable", _SIG]), max_len=1024)[:20],
}


@pytest.mark.parametrize("answer", list(HOSTILE_ANSWERS), ids=list(HOSTILE_ANSWERS))
def test_a_dial_back_refuses_every_answer_but_the_right_signature(answer: str) -> None:
    failures: list[str] = []

    async def hostile(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)  # the probe hello
        if HOSTILE_ANSWERS[answer] is not None:
            await stream.send_all(HOSTILE_ANSWERS[answer])
        await stream.aclose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, hostile, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            with trio.fail_after(5):
                with pytest.raises(ProbeFailed) as info:
                    await probe(LEARNER, "run-1", PEERS[0].peer_id, "127.0.0.1", port)
            failures.append(str(info.value))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert failures[0].startswith("127.0.0.1:")


def test_a_dial_back_that_never_answers_is_cut_by_the_callers_deadline() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await silent_listener(nursery)
            with trio.move_on_after(0.3) as scope:
                await probe(LEARNER, "run-1", PEERS[0].peer_id, "127.0.0.1", port)
            assert scope.cancelled_caught
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_relay_link_whose_peer_never_reads_is_cut_once_it_makes_no_progress() -> None:
    """Our pushes fill the kernel's buffers towards a peer that never reads: the link is cut
    LINK_STALL_S later (not LINK_IDLE_S), which frees our relay backlog and with it our pull."""
    r = Receiver(DataServer(PEERS[1], "run-1"), MANIFEST, source_id=LEARNER.peer_id)
    silent = PEERS[2].peer_id

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await silent_listener(nursery)
            nursery.start_soon(r._run_link, await trio.open_tcp_stream("127.0.0.1", port), silent)
            while silent not in r.links:
                await trio.sleep(0.01)
            link = r.links[silent]
            push = encode_frame(Piece(0, PAYLOAD[:PIECE]))
            for _ in range(1024):  # 16 MiB: more than any socket buffers hold
                link.send_packed(True, push)
            start = trio.current_time()
            while silent in r.links:
                await trio.sleep(0.1)
            assert link.stalled
            assert LINK_STALL_S <= trio.current_time() - start < LINK_STALL_S + 1 < LINK_IDLE_S
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_slow_reader_is_not_cut() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, slow_reader, 0, host="127.0.0.1"))
            async with await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1]) as stream:
                link = Link(stream, "slow", Stats(), num_pieces=1, piece_size=PIECE)
                nursery.start_soon(link.sender)
                data = encode_frame(Piece(0, PAYLOAD[:PIECE]))
                for _ in range(256):  # 4 MiB, read at 256 KiB per (virtual) 2 s
                    link.send_packed(True, data)
                while link.queued_bytes:
                    await trio.sleep(1)
                assert not link.stalled and trio.current_time() > 20  # it took a while
                nursery.cancel_scope.cancel()

    async def slow_reader(stream: trio.SocketStream) -> None:
        while True:
            await trio.sleep(2)
            got = 0
            while got < 256 * 1024:
                got += len(await stream.receive_some(256 * 1024 - got))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_peer_that_claims_to_lack_everything_gets_one_copy_from_the_learner_at_most() -> None:
    """It asks `get` for every piece twice, `more` a hundred times and reads all it is sent,
    while two honest peers fetch the version: the learner sends it each piece at most once,
    and the others finish."""
    greedy = PEERS[2]
    members = {p.peer_id for p in PEERS}
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, members, {})
    results: dict[str, bytes] = {}
    received: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner, servers = await serve_version(nursery, source, PEERS)

            async def honest(p: Identity) -> None:
                async with trio.open_nursery() as links:
                    _, results[p.peer_id], _ = await fetch_version(
                        servers[p.peer_id], links, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7
                    )
                    links.cancel_scope.cancel()

            async def claims_nothing() -> None:
                _, stream = await open_version(
                    servers[greedy.peer_id], learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7
                )
                async with stream:
                    reader = LengthPrefixedReader(max_len=MAX_WIRE_FRAME)

                    async def read_for(seconds: float) -> None:
                        with trio.move_on_after(seconds):
                            while True:
                                while (data := reader.next_message()) is not None:
                                    frame = decode_frame(data, num_pieces=MANIFEST.num_pieces, from_source=True)
                                    if isinstance(frame, (Piece, Direct)):
                                        received.append(frame.index)
                                reader.feed(await stream.receive_some(1 << 16))

                    for _ in range(100):
                        await stream.send_all(encode_frame(More()))
                    for index in [*range(MANIFEST.num_pieces)] * 2:
                        await stream.send_all(encode_frame(Get(index)))
                        await read_for(0.01)  # one answer at a time: it reads all it asks for
                    await read_for(0.5)

            with trio.fail_after(30):
                async with trio.open_nursery() as inner:
                    inner.start_soon(claims_nothing)
                    for p in PEERS[:2]:
                        inner.start_soon(honest, p)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert all(results[p.peer_id] == PAYLOAD for p in PEERS[:2])
    assert len(received) == len(set(received)) <= MANIFEST.num_pieces  # each piece once at most
    assert source.stats.bytes_up < (2 + 1.2) * len(PAYLOAD)


def test_an_idle_learner_sends_a_peer_direct_pieces_it_never_asked_for_each_once() -> None:
    """SourcePlan rule 4: a peer that only completes its hello and reads asks neither `next` nor
    `more`; the learner's uplink idles while the whole queue is untouched, so it credits the
    peer and sends it the version in direct pieces, each piece once."""
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, {PEERS[0].peer_id}, {})
    received: list[int] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner, servers = await serve_version(nursery, source, PEERS[:1])
            _, stream = await open_version(
                servers[PEERS[0].peer_id], learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7
            )
            reader = LengthPrefixedReader(max_len=MAX_WIRE_FRAME)
            with trio.fail_after(20):
                async with stream:
                    while True:
                        while (data := reader.next_message()) is not None:
                            frame = decode_frame(data, num_pieces=MANIFEST.num_pieces, from_source=True)
                            assert not isinstance(frame, Piece)  # nothing was asked: no answers
                            if isinstance(frame, Direct):
                                received.append(frame.index)
                        if len(received) >= MANIFEST.num_pieces:
                            break
                        reader.feed(await stream.receive_some(1 << 16))
                    await trio.sleep(0.1)  # nothing more comes: the queue is spent
                    assert reader.next_message() is None
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sorted(received) == list(range(MANIFEST.num_pieces))
    assert source.idle_credits >= 1 and not source.plan.queue


def test_the_uplink_is_idle_only_when_no_link_holds_bytes_to_send() -> None:
    """SourcePlan rule 4 looks at every link: a link that holds bytes (a slow reader's) keeps
    the rule off, and the broadcast runs on `more` as it would without it."""
    members = {p.peer_id for p in PEERS}
    source = Source(LEARNER, MANIFEST, seal(MANIFEST, LEARNER), PAYLOAD, members, {})

    async def main() -> None:
        for peer in sorted(members):
            stream = trio.testing.memory_stream_pair()[0]
            source._links[peer] = Link(stream, peer, source.stats, num_pieces=MANIFEST.num_pieces, piece_size=PIECE)
        assert source._uplink_idle()
        next(iter(source._links.values())).queued_bytes = PIECE
        assert not source._uplink_idle()

    trio.run(main)


async def serve_listed(
    nursery: trio.Nursery, source: Source, listed: list[Identity], extra: Identity, relays: dict[str, tuple[str, int]]
) -> tuple[DataServer, dict[str, DataServer]]:
    """`serve_version` for `listed` and `extra`, the `listed` ones handed out as relays (in
    `relays`, the source's table); `extra` is not listed: it dials the others."""
    learner, servers = await serve_version(nursery, source, [*listed, extra])
    for p in listed:
        relays[p.peer_id] = ("127.0.0.1", servers[p.peer_id].port)
    return learner, servers


async def fetch_and_serve(server: DataServer, learner: DataServer, results: dict[str, bytes], rate: float = 0) -> None:
    """Fetch version 7 through `server` (reading at `rate` B/s, 0: as fast as it comes), record it
    in `results`, then serve the others until cancelled."""

    async def connect(host: str, port: int) -> trio.abc.Stream:
        stream = await tcp_connect(host, port)
        return Trickle(stream, rate) if rate else stream

    async with trio.open_nursery() as links:
        _, data, _ = await fetch_version(
            server, links, learner_id=LEARNER.peer_id, host="127.0.0.1", port=learner.port, version=7, connect=connect,
        )
        results[server.identity.peer_id] = bytes(data)
        await trio.sleep_forever()


def test_a_neighbour_that_trickles_does_not_hold_the_others_to_its_pace() -> None:
    """A member that dials every honest peer and reads what they push at 500 KB/s. Its link is
    soon the longest queue of each of them; counted in the pull rule (no `next` while any link
    holds BACKLOG_PIECES), it held the whole swarm near its pace (a 16 MiB version took the
    others 1.3-5.1 s instead of 0.5 s on loopback, or the learner sent 2.4 copies directly). A
    link that stays behind for LAGGARD_HOLD_S while most links keep up is a laggard: left out of
    the rule and pushed nothing more past LAGGARD_PIECES. Checked: the honest peers go on asking
    the source while the trickler's link holds BACKLOG_PIECES or more, and its queue stays
    bounded."""
    piece = 64 * 1024
    payload = os.urandom(256 * piece)
    manifest = build_manifest(run_id="run-1", version=7, payload=payload, piece_size=piece)
    honest, trickler = PEERS, Identity.from_seed(b"\x2f" * 32)
    relays: dict[str, tuple[str, int]] = {}  # the trickler is not listed: it dials the others
    source = Source(LEARNER, manifest, seal(manifest, LEARNER), payload, {p.peer_id for p in [*honest, trickler]}, relays)
    source.gate = trio.Event()
    results: dict[str, bytes] = {}
    asked_past_laggard = 0
    longest = 0
    original = Receiver._refill_source

    def refill(self: Receiver, sent: object = None) -> None:
        nonlocal asked_past_laggard, longest
        link = self.links.get(trickler.peer_id)
        held = link is not None and self.identity.peer_id != trickler.peer_id and link.queued_pieces >= BACKLOG_PIECES
        before = self.pull.outstanding
        original(self, sent)
        if held:
            assert link is not None
            longest = max(longest, link.queued_pieces)
            asked_past_laggard += self.pull.outstanding > before

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner, servers = await serve_listed(nursery, source, honest, trickler, relays)

            with trio.fail_after(60):
                async with trio.open_nursery() as inner:
                    for p in honest:
                        inner.start_soon(fetch_and_serve, servers[p.peer_id], learner, results)
                    inner.start_soon(fetch_and_serve, servers[trickler.peer_id], learner, results, 500_000)
                    while len(source.swarm) < len(honest) + 1:
                        await trio.sleep(0.001)
                    source.gate.set()
                    while len(results) < len(honest):
                        await trio.sleep(0.01)
                    inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    Receiver._refill_source = refill  # type: ignore[method-assign]
    try:
        with pytest.MonkeyPatch.context() as patch:
            # Shorter than the default, so the rule shows within this small version's download.
            patch.setattr(broadcast, "LAGGARD_HOLD_S", 0.5)
            trio.run(main)
    finally:
        Receiver._refill_source = original  # type: ignore[method-assign]
    assert all(results[p.peer_id] == payload for p in honest)
    assert asked_past_laggard > 0  # the trickler's queue did not stop the pull
    # What its link holds: LAGGARD_PIECES and a piece, plus answers to its repairs (a reference
    # fetcher keeps at most 4 `get`s in flight per link); never the whole version.
    assert longest <= LAGGARD_PIECES + 1 + 4 < manifest.num_pieces


def test_a_link_bans_a_remote_that_asks_without_reading_but_not_for_our_own_pushes() -> None:
    """`answer` refuses to queue past `queue_cap` bytes of answers: a remote that asks faster than
    it reads is cut (LinkOverflow, a ban). Pushes queued on our own account do not count: an
    honest peer behind on a busy link, which asks for a piece it lacks, is not banned for the
    pieces we chose to send it."""
    piece = 64 * 1024
    data = bytes(piece)

    async def main() -> None:
        ours, _theirs = trio.testing.memory_stream_pair()  # the remote reads nothing; no sender runs
        link = Link(ours, PEERS[0].peer_id, broadcast.Stats(), num_pieces=1024, piece_size=piece)
        for index in range(LAGGARD_PIECES):  # 4 MiB of pushes, past the 1 MiB cap
            link.send(Piece(index, data))
        assert link.queued_bytes > link.queue_cap
        asked = 0
        with pytest.raises(broadcast.LinkOverflow):
            while True:
                link.answer(Piece(asked, data))
                asked += 1
        frame = len(broadcast.encode_frame(Piece(0, data)))
        assert link.asked_bytes == asked * frame and link.asked_bytes - frame <= link.queue_cap < link.asked_bytes

    trio.run(main)


def test_a_withdrawn_answer_is_dropped_unsent_and_only_while_it_waits() -> None:
    """`withdraw(key)` calls off one answer queued under `key` that has not begun to leave: the
    sender skips it and the queue's counts fall as if it had left. Nothing else can be called
    off: a key never queued, one more time than it was queued, or an answer already sent."""
    piece = 64 * 1024

    async def main() -> None:
        ours, theirs = trio.testing.memory_stream_pair()
        stats = broadcast.Stats()
        link = Link(ours, PEERS[0].peer_id, stats, num_pieces=8, piece_size=piece)
        for index in (0, 1, 1, 2):
            link.answer(Piece(index, bytes([index]) * piece), key=index)
        link.send(Piece(3, bytes(piece)))  # a push: no key, nothing to withdraw
        assert link.withdraw(1) and link.withdraw(1) and not link.withdraw(1)
        assert not link.withdraw(3) and not link.withdraw(7)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.sender)
            got = [decode_frame(await read_frame(theirs, max_len=MAX_WIRE_FRAME), num_pieces=8) for _ in range(3)]
            assert [f.index for f in got] == [0, 2, 3]  # type: ignore[union-attr]
            assert stats.withdrawn == 2 and link.queued_bytes == link.asked_bytes == link.queued_pieces == 0
            assert not link.withdraw(0)  # sent already
            link.close()

    trio.run(main)


def test_a_member_that_dials_late_and_reads_slowly_is_caught_up_at_its_pace() -> None:
    """A link that comes up after a peer relayed its share of the version missed those pushes.
    Sent them all at once, each encoded anew, a member that dials late on purpose and reads slowly
    held the peer's whole relay share in its memory (and with N such members, N copies). Checked:
    each honest peer's queue to the late member stays within LAGGARD_PIECES and a piece (plus
    answers to its repairs) though it relayed more than that, and the late member still ends with
    the whole version, caught up as it reads."""
    piece = 16 * 1024
    payload = os.urandom(512 * piece)
    manifest = build_manifest(run_id="run-1", version=7, payload=payload, piece_size=piece)
    honest, late = PEERS, Identity.from_seed(b"\x2e" * 32)
    relays: dict[str, tuple[str, int]] = {}  # the late member is not listed: it dials the others
    source = Source(LEARNER, manifest, seal(manifest, LEARNER), payload, {p.peer_id for p in [*honest, late]}, relays)
    results: dict[str, bytes] = {}
    relayed: dict[str, int] = {}
    longest = 0
    original = Receiver._refill_source

    def refill(self: Receiver, _sent: object = None) -> None:
        nonlocal longest
        link = self.links.get(late.peer_id)
        if link is not None and self.identity.peer_id != late.peer_id:
            longest = max(longest, link.queued_pieces)
            relayed[self.identity.peer_id] = len(self.relaying)
        original(self, _sent)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            learner, servers = await serve_listed(nursery, source, honest, late, relays)

            with trio.fail_after(60):
                async with trio.open_nursery() as inner:
                    for p in honest:
                        inner.start_soon(fetch_and_serve, servers[p.peer_id], learner, results)
                    while len(results) < len(honest):
                        await trio.sleep(0.01)
                    inner.start_soon(fetch_and_serve, servers[late.peer_id], learner, results, 2_000_000)
                    while len(results) < len(honest) + 1:
                        await trio.sleep(0.01)
                    inner.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    Receiver._refill_source = refill  # type: ignore[method-assign]
    try:
        trio.run(main)
    finally:
        Receiver._refill_source = original  # type: ignore[method-assign]
    assert all(data == payload for data in results.values()) and len(results) == len(honest) + 1
    assert len(relayed) == len(honest) and min(relayed.values()) > LAGGARD_PIECES + 5  # a share to catch up on
    assert longest <= LAGGARD_PIECES + 1 + 4


def test_the_link_timings_a_node_keeps_are_bounded_and_the_newest_stay() -> None:
    """Neighbours come and go over a long run (and Sybils a learner lists come in numbers):
    what a node keeps of their answer times across versions is the last MAX_LINK_TIMINGS."""
    server = DataServer(PEERS[1], "run-1")
    n = broadcast.MAX_LINK_TIMINGS
    for i in range(n + 10):
        server.remember_link_timing(f"peer{i}", 0.01 * i)
    server.remember_link_timing("peer10", 0.5)  # timed again: the newest now
    assert server.link_timing("peer0") is None and server.link_timing("peer9") is None
    assert server.link_timing("peer10") == 0.5 and server.link_timing(f"peer{n + 9}") == pytest.approx(0.01 * (n + 9))
    server.remember_link_timing("late", 1.0)
    assert server.link_timing("peer10") == 0.5 and server.link_timing("peer11") is None  # the oldest went
