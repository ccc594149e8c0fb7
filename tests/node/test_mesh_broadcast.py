"""A version on the bounded-degree overlay, live (echo_node/weights/mesh.py): real data servers,
the learner's SeedSource and peers' MeshReceivers over the in-memory network on virtual time."""

from __future__ import annotations

import trio

from echo_node.learner.weight_publisher import WeightPublisher
from echo_node.weights.broadcast import DataServer, Source
from echo_node.weights.mesh import PeerOverlay, SeedSource
from tests.mesh_swarm import LEARNER, Recording, run_mesh
from tests.mesh_swarm import peers as make_peers


def test_a_version_reaches_every_peer_over_links_the_learner_chose() -> None:
    """30 peers at degree 12 (more than a full mesh of 12 + 1), the learner serving 4 of them:
    every peer holds the exact payload; most pieces came from other peers over many hops; no peer
    held more links than the overlay's largest degree, and each linked only with peers the
    learner made its neighbours at some point of the version."""
    ids = make_peers(30)
    run = run_mesh(ids)
    assert set(run.results) == {p.peer_id for p in ids} and not run.errors
    assert all(data == run.payload for data in run.results.values())
    receivers = [r for r in run.receivers.values() if isinstance(r, Recording)]
    pieces = sum((r.stats.pieces for r in receivers), start=type(receivers[0].stats.pieces)())
    first_copies = pieces["peers"] + pieces["seed"] + pieces["repair"]
    assert first_copies == 30 * run.source.store.manifest.num_pieces
    assert pieces["peers"] > 0.75 * first_copies, pieces
    max_degree = run.overlay.overlay.max_degree
    for r in receivers:
        assert 1 <= r.most <= max_degree, (r.most, max_degree)
        assert r.linked <= r.listed
    # The learner fed at most its served set at a time and each piece at most once per peer.
    assert run.source.plan.total_sent <= 30 * run.source.store.manifest.num_pieces
    # What each neighbour's answers took is kept for the next version's links to it (a peer the
    # learner fed every piece itself timed nobody).
    timed = 0
    for pid, r in run.receivers.items():
        assert isinstance(r, Recording)
        timings = {p.peer_id: t for p in ids if (t := run.servers[pid].link_timing(p.peer_id)) is not None}
        assert set(timings) <= r.linked and all(t >= 0 for t in timings.values())
        timed += bool(timings) == bool(r.stats.pieces["peers"])
    assert timed == 30


def test_peers_behind_a_nat_dial_out_and_late_peers_fetch_from_the_early_ones() -> None:
    """A third of the peers cannot be dialed: they link only with dialable ones (two of them are
    never neighbours) and still complete. Ten more start after the others finished; they get
    their pieces mostly from the early peers, not from the learner."""
    ids = make_peers(30)
    late_ids = make_peers(10, first=0x80)
    nat = frozenset(p.peer_id for p in ids[::3])
    run = run_mesh([*ids, *late_ids], unreachable=nat, late=frozenset(p.peer_id for p in late_ids))
    assert len(run.results) == 40 and not run.errors
    assert all(data == run.payload for data in run.results.values())
    for pid in nat:
        r = run.receivers[pid]
        assert isinstance(r, Recording) and r.linked and not r.linked & nat
    late = [run.receivers[p.peer_id] for p in late_ids]
    from_peers = sum(r.stats.pieces["peers"] for r in late)
    from_learner = sum(r.stats.pieces["seed"] + r.stats.pieces["repair"] for r in late)
    assert from_peers > 3 * from_learner, (from_peers, from_learner)


def test_the_learner_serves_by_the_overlay_at_every_size_unless_push_is_forced() -> None:
    """`auto` and `mesh`: the overlay, from one member to beyond a full mesh of its degree;
    `push` forces the push mesh."""
    members: dict[str, float] = {}
    relays: dict[str, tuple[str, int]] = {}

    async def main() -> None:
        def publisher(mode: str) -> WeightPublisher:
            return WeightPublisher(LEARNER, "run-1", members=members, relays=relays, keep_versions=4,
                                   data_server=lambda **kw: DataServer(LEARNER, "run-1", **kw),
                                   overlay=PeerOverlay(members, relays, mode=mode, degree=12))

        auto, push = publisher("auto"), publisher("push")
        for version, n in enumerate((1, 12, 1), start=1):
            for p in make_peers(n, first=0x10 * version):
                members[p.peer_id] = 0.0
            assert isinstance(auto.offer(version, bytes([version]) * 5000), SeedSource), len(members)
            assert isinstance(push.offer(version, bytes([version]) * 5000), Source), len(members)
        assert PeerOverlay({}, relays, mode="mesh").use_mesh() and PeerOverlay({}, relays).use_mesh()

    trio.run(main)

