"""The endgame's quiet period (SourcePull rule 4) and the learner's idle rule (SourcePlan rule
4) in the simulator: the broadcast's time over its bound with a quiet period of 0.1 s and no idle
rule (before), 10 ms without it, and 10 ms with it (now), on the links of `benchmarks.wan_swarm`,
ten and thirty such peers, `benchmarks.wan_broadcast --bup 10` and its symmetric default. One
JSON line per case.

    PYTHONPATH=. .venv/bin/python benchmarks/results/wan-issue27/endgame_sweep.py
"""

from __future__ import annotations

import json

import echo_node.sim.broadcast as sim
from benchmarks.wan.bound import bound_s
from echo_node.sim import simulate_broadcast

MBIT = 1e6 / 8
START_WATCH = sim.SimSource.start_watch
TOY = 3_424_664  # the embedded model's full version
CASES = {  # name: (bytes, learner Mbit/s, [(down, up) Mbit/s per peer], piece sizes)
    "wan_swarm": (TOY, 1000.0, [(100.0, 20.0)] * 3, (64 << 10, 256 << 10)),
    "wan_swarm_x10": (TOY, 1000.0, [(100.0, 20.0)] * 10, (64 << 10, 256 << 10)),
    "home_x30_64MiB": (64 << 20, 1000.0, [(100.0, 20.0)] * 30, (64 << 10,)),
    "bup10": (64 << 20, 100.0, [(100.0, 10.0)] * 8, (64 << 10,)),
    "symmetric": (64 << 20, 100.0, [(100.0, 100.0)] * 8, (64 << 10,)),
}


def main() -> None:
    for name, (size, learner, peers, piece_sizes) in CASES.items():
        bound = bound_s(size, learner, [u for _, u in peers], [d for d, _ in peers], efficiency=1.0)
        for piece in piece_sizes:
            row: dict[str, object] = {"case": name, "piece_kib": piece >> 10}
            for label, quiet, idle_rule in (("before", 0.1, False), ("quiet_10ms", 0.01, False), ("now", 0.01, True)):
                sim.ENDGAME_QUIET_S = quiet
                setattr(sim.SimSource, "start_watch", START_WATCH if idle_rule else lambda self: None)
                worst = max(
                    simulate_broadcast(size, learner * MBIT, [(d * MBIT, u * MBIT) for d, u in peers],
                                       piece_size=piece, seed=seed, latency_s=0.002)
                    for seed in range(2)
                )
                row[label] = round(worst / bound, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
