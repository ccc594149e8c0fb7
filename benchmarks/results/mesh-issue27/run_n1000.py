import json, sys, time, random
from benchmarks.capacity import draw_peers, MBIT
from echo_node.sim.mesh import MeshSim
kind, versions = sys.argv[1], int(sys.argv[2])
seed = 0 if kind == "plain" else 1
rng = random.Random(seed)
specs = draw_peers(rng, 1500)
def row(p):
    up = p.up if kind == "plain" else min(p.down, rng.uniform(5.0, 35.0) * MBIT)
    return (p.peer_id, p.down, up, p.lat)
rows = [row(p) for p in specs]
sim = MeshSim(1000 * MBIT, rows[:1000], size_bytes=64 << 20, churn_per_hour=0.0 if kind == "plain" else 0.1, spare=rows[1000:], seed=seed)
orig = sim._one
def one(version, tf):
    v = orig(version, tf)
    degrees = [len(sim.overlay.neighbours(p)) for p in sim.nodes]
    print(json.dumps({"kind": kind, "version": version, "ratio": v.ratio, "last_ratio": v.last_s and v.last_s / v.bound_s,
                      "bound_s": v.bound_s, "seconds": v.seconds, "learner_copies": v.learner_copies,
                      "duplicate_share": v.duplicates / max(1, v.deliveries), "members": v.members,
                      "links_max": max(degrees), "links_mean": sum(degrees) / len(degrees), "cpu_s": v.cpu_s, "wall_s": v.wall_s,
                      "left_so_far": len(sim.gone)}), flush=True)
    return v
setattr(sim, "_one", one)  # a measurement script: wraps one version to print its row
sim.run(versions)
