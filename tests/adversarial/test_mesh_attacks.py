"""Hostile neighbours on the bounded-degree overlay (echo_node/weights/mesh.py), among honest
peers over the in-memory network on virtual time: each attack ends with every honest peer
holding the exact payload within a bounded delay, and the attacker cut or banned."""

from __future__ import annotations

import trio

from echo_node.net.framing import read_frame
from echo_node.weights.broadcast import ROUTE_WAIT_S, DataServer, Link, encode_frame
from echo_node.weights.mesh import MAX_STALLS, REQUEST_TIMEOUT_S, MeshReceiver
from protocol.weights.datachannel import MAX_WIRE_FRAME, Cancel, Get, Have, PeerEntry, Piece, decode_frame, mask_indices
from protocol.weights.manifest import piece_range
from tests.mesh_swarm import MeshRun, Recording, run_mesh
from tests.mesh_swarm import peers as make_peers

HONEST = make_peers(16)
EVIL = make_peers(1, first=0x70)[0]


def attacked(cls: type[MeshReceiver], **kwargs: object) -> MeshRun:
    run = run_mesh([*HONEST, EVIL], classes={EVIL.peer_id: cls}, **kwargs)  # type: ignore[arg-type]
    honest = {p.peer_id for p in HONEST}
    assert honest <= run.results.keys(), f"honest peers left without the version: {honest - run.results.keys()}"
    assert all(run.results[p] == run.payload for p in honest)
    return run


def banned_by(run: MeshRun) -> int:
    return sum(EVIL.peer_id in server.bans for pid, server in run.servers.items() if pid != EVIL.peer_id)


def honest_finish(run: MeshRun) -> float:
    return max(t for pid, t in run.finished_at.items() if pid != EVIL.peer_id)


class Liar(MeshReceiver):
    """Announces every piece on every link and never sends one."""

    def _ask(self, link: Link) -> None:
        if link is not self._source and not getattr(link, "lied", False):
            link.lied = True  # type: ignore[attr-defined]
            link.send(Have((1 << self.manifest.num_pieces) - 1))

    def _answer(self, link: Link, index: int) -> None:
        pass


def test_a_neighbour_that_announces_pieces_it_never_sends_is_cut_and_delays_no_one_for_long() -> None:
    run = attacked(Liar)
    cut = sum(r.cut["stalled"] for pid, r in run.receivers.items() if pid != EVIL.peer_id)
    # The pieces it holds requested are asked again elsewhere: in the endgame at once (so the
    # version may end before any of its requests times out), else after REQUEST_TIMEOUT_S, and
    # after MAX_STALLS timeouts its neighbour cuts it. Either way a bounded delay, not a stall.
    assert cut >= 1 or honest_finish(run) < REQUEST_TIMEOUT_S
    assert honest_finish(run) <= (MAX_STALLS + 1) * REQUEST_TIMEOUT_S


class Trickler(MeshReceiver):
    """Answers every request, each just before the requester would give up on it."""

    def _answer(self, link: Link, index: int) -> None:
        data = self.store.get(index)
        if data is None or self._nursery is None:
            return

        async def later() -> None:
            await trio.sleep(REQUEST_TIMEOUT_S * 0.9)
            link.answer(Piece(index, bytes(data)))

        self._nursery.start_soon(later)


def test_a_neighbour_that_answers_at_a_trickle_holds_back_only_its_own_requests() -> None:
    plain = run_mesh(HONEST)
    run = attacked(Trickler)
    # Its neighbours ask others for all but the few pieces it holds in their pipelines.
    assert honest_finish(run) <= honest_finish(plain) + 4 * REQUEST_TIMEOUT_S


class BadPieces(Liar):
    """Announces every piece on every link (so its neighbours ask it, whatever it got) and
    answers each request with bytes of the right length that fail the manifest's hash."""

    def _answer(self, link: Link, index: int) -> None:
        data = self.store.get(index)
        body = bytes(data) if data is not None else bytes(piece_range(self.manifest, index)[1])
        link.answer(Piece(index, bytes(b ^ 0xFF for b in body[:64]) + body[64:]))


def test_a_neighbour_sending_bad_pieces_is_banned_at_its_first() -> None:
    run = attacked(BadPieces)
    assert banned_by(run) >= 1
    assert all(r.stats.bad_pieces.get(EVIL.peer_id, 0) <= 1 for pid, r in run.receivers.items() if pid != EVIL.peer_id)


class Pusher(MeshReceiver):
    """Pushes every piece it verifies to every neighbour, asked or not (spends their downlinks)."""

    def _on_piece(self, link: Link, index: int, data: bytes) -> None:
        super()._on_piece(link, index, data)
        frame = encode_frame(Piece(index, data))
        for other in self.links.values():
            other.send_packed(True, frame)


def test_a_neighbour_pushing_pieces_nobody_asked_for_is_banned() -> None:
    run = attacked(Pusher)
    assert banned_by(run) >= 1


class Greedy(MeshReceiver):
    """Asks each neighbour for pieces it never announced, and for the same piece again and again."""

    def _ask(self, link: Link) -> None:
        if link is not self._source:
            for _ in range(8):
                link.send(Get(0))


def test_a_neighbour_asking_for_what_we_never_announced_or_over_and_over_is_banned() -> None:
    run = attacked(Greedy)
    assert banned_by(run) >= 1
    # Whatever it drew before the ban: no honest peer answered it a copy of the version.
    n = run.source.store.manifest.num_pieces
    for pid, r in run.receivers.items():
        if pid != EVIL.peer_id:
            assert r._answers[EVIL.peer_id] <= 2 * n


class Canceller(MeshReceiver):
    """Calls off pieces it never asked for: nothing it could withdraw (a link holds only its
    remote's own answers), but no honest peer does it, so a protocol violation."""

    def _ask(self, link: Link) -> None:
        if link is not self._source:
            for index in range(self.manifest.num_pieces):
                link.send(Cancel(index))
        super()._ask(link)


class OverCanceller(MeshReceiver):
    """Asks like an honest peer and calls off every request twice (a cancel flood, each one
    naming a piece it did ask for)."""

    def _ask(self, link: Link) -> None:
        before = self._asked_of.get(link.remote, 0)
        super()._ask(link)
        for index in mask_indices(self._asked_of.get(link.remote, 0) & ~before):
            link.send(Cancel(index))
            link.send(Cancel(index))


def test_a_neighbour_calling_off_what_it_never_asked_or_twice_is_banned() -> None:
    for attacker in (Canceller, OverCanceller):
        run = attacked(attacker)
        assert banned_by(run) >= 1, attacker.__name__


class Deaf(MeshReceiver):
    """Reads its neighbours' announcements until one names a piece, then asks for those pieces
    over and over and never reads another byte (its answers pile up at the other end)."""

    async def _run_link(self, stream: trio.abc.Stream, remote: str) -> None:
        if remote == self.source_id:
            await super()._run_link(stream, remote)
            return
        n = self.manifest.num_pieces
        held: list[int] = []
        with trio.move_on_after(30):
            while not held:
                frame = decode_frame(await read_frame(stream, max_len=MAX_WIRE_FRAME), num_pieces=n)
                if isinstance(frame, Have):
                    held = mask_indices(frame.bits)
        try:
            for _ in range(100):
                for index in held:
                    await stream.send_all(encode_frame(Get(index)))
            await trio.sleep_forever()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def test_a_neighbour_that_asks_and_never_reads_is_cut_and_the_others_finish() -> None:
    run = attacked(Deaf, size=200 * 16 * 1024)
    assert banned_by(run) >= 1  # it asked more than a link may hold unread (LinkOverflow)
    assert honest_finish(run) <= 60.0


def test_a_member_the_learner_did_not_make_our_neighbour_cannot_link_with_us() -> None:
    """A Sybil dialing every honest peer, whatever the learner listed, is refused by those that
    were not given it as a neighbour (not banned: a dial racing an honest rewire looks the
    same); every honest peer's links stay among those the learner listed."""
    servers: dict[str, DataServer] = {}

    class Intruder(MeshReceiver):
        def _set_neighbours(self, entries: tuple[PeerEntry, ...]) -> None:
            super()._set_neighbours(entries)
            for p in HONEST:
                server = servers[p.peer_id]
                if p.peer_id not in self.members and self._nursery is not None:
                    self.members.add(p.peer_id)
                    self._nursery.start_soon(self._dial, PeerEntry(p.peer_id, server.host, server.port))

    # (run past ROUTE_WAIT_S: a dial from a stranger is held that long in case the learner's
    # word that it is a neighbour is on its way)
    run = attacked(Intruder, on_ready=lambda r: servers.update(r.servers),
                   wait_for=lambda r: len(r.results) >= len(HONEST) and trio.current_time() > ROUTE_WAIT_S + 1)
    refused = sum(s.closed["RemoteProtocolError"] for pid, s in run.servers.items() if pid != EVIL.peer_id)
    assert refused >= 1 and banned_by(run) == 0
    for pid, r in run.receivers.items():
        if pid != EVIL.peer_id:
            assert isinstance(r, Recording) and r.linked <= r.listed


def test_a_peer_claiming_to_hold_nothing_draws_no_more_than_its_share_of_the_learner() -> None:
    """It never announces a piece to the learner and asks it for every piece: it is answered at
    most the repair allowance, then `none`, and pushed no more than the fair share."""

    class Empty(MeshReceiver):
        asked = False

        def _flush(self) -> None:
            fresh, self._fresh, self._flush_at = self._fresh, 0, None
            for link in self.links.values():  # to its neighbours only, never to the learner
                if fresh:
                    link.send(Have(fresh))
            source = self._source
            if source is not None and not self.asked:  # and the learner is asked for everything
                self.asked = True
                for i in range(self.manifest.num_pieces):
                    source.send(Get(i))

    run = attacked(Empty, wait_for=lambda r: len(r.results) >= len(HONEST) and trio.current_time() > 2)
    src = run.source
    assert 1 <= src.repairs[EVIL.peer_id] <= src.repair_allowance
    # It went on asking after `none`: the learner banned it.
    assert run.learner is not None and EVIL.peer_id in run.learner.bans
    n_peers = len(HONEST) + 1
    fair = src.plan.total_sent / n_peers + src.plan.fair_slack
    assert src.plan.sent_to(EVIL.peer_id) <= fair + 1


def test_a_peer_repeating_its_haves_to_the_learner_is_banned() -> None:
    """A `have` costs the learner a pass over the pieces it names new on that link only, and
    more haves naming none new than the version has pieces is a ban: the learner's work for
    that peer stays bounded by the version's size."""

    class Repeater(MeshReceiver):
        def _flush(self) -> None:
            super()._flush()
            source = self._source
            if source is not None:
                for _ in range(1000):
                    source.send(Have(self._told_source))

    run = attacked(Repeater)
    assert run.learner is not None and EVIL.peer_id in run.learner.bans
    assert banned_by(run) == 0  # its neighbours saw only honest haves
