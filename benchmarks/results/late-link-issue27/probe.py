"""SmolLM2-sized version (540 MiB, fp32 publication of 135M params: 2160 pieces of 256 KiB):
3 honest peers fetch, then a member dials late and reads at 40 MB/s. Longest queue to it."""
import os, sys, time, json
import trio
sys.path.insert(0, ".")
from tests.node import test_broadcast as tb
from echo_node.weights.broadcast import Receiver, LAGGARD_PIECES
from protocol import Identity, seal
from protocol.weights.manifest import build_manifest, choose_piece_size
size = 540 * 2**20
piece = choose_piece_size(size)
payload = os.urandom(size)
manifest = build_manifest(run_id="run-1", version=7, payload=payload, piece_size=piece)
honest, late = tb.PEERS, Identity.from_seed(b"\x2e" * 32)
relays = {}
source = tb.Source(tb.LEARNER, manifest, seal(manifest, tb.LEARNER), payload, {p.peer_id for p in [*honest, late]}, relays)
results, relayed, longest = {}, {}, 0
orig = Receiver._refill_source
def refill(self, _sent=None):
    global longest
    link = self.links.get(late.peer_id)
    if link is not None and self.identity.peer_id != late.peer_id:
        longest = max(longest, link.queued_pieces); relayed[self.identity.peer_id] = len(self.relaying)
    orig(self, _sent)
async def main():
    async with trio.open_nursery() as n:
        learner, servers = await tb.serve_listed(n, source, honest, late, relays)
        async with trio.open_nursery() as inner:
            for p in honest: inner.start_soon(tb.fetch_and_serve, servers[p.peer_id], learner, results)
            while len(results) < 3: await trio.sleep(0.05)
            t0 = time.monotonic()
            inner.start_soon(tb.fetch_and_serve, servers[late.peer_id], learner, results, 40_000_000)
            while len(results) < 4: await trio.sleep(0.05)
            print("late member done in", round(time.monotonic() - t0, 1), "s", file=sys.stderr)
            inner.cancel_scope.cancel()
        n.cancel_scope.cancel()
Receiver._refill_source = refill
trio.run(main)
assert all(v == payload for v in results.values())
print(json.dumps({"pieces": manifest.num_pieces, "piece_kib": piece // 1024, "relayed_per_peer": sorted(relayed.values()),
                  "longest_queue_to_late_link": longest, "queue_mib": round(longest * piece / 2**20, 1),
                  "before_fix_queue_mib_would_be": round(max(relayed.values()) * piece / 2**20, 1), "laggard_pieces": LAGGARD_PIECES}))
