"""Discrete-event simulation of an echo-node swarm at scale, driving the real protocol logic.

`events`: the clock. `net`: hosts and links. `broadcast`: one weight version's broadcast,
decided by `protocol.weights.pieces.PieceSwarm` and `protocol.weights.relay.SourcePull`
(`simulate_broadcast` for one version alone). `swarm`: learner, workers, churn and the real
`protocol.capacity.Scheduler` (`run_swarm`). `population`: the heterogeneous workers drawn.
"""

from echo_node.sim.broadcast import SimBroadcast, simulate_broadcast
from echo_node.sim.events import EventLoop
from echo_node.sim.population import GPU_TIERS, MBIT, PeerSpec, draw_peer, draw_peers
from echo_node.sim.swarm import BroadcastRecord, SwarmConfig, SwarmResult, SwarmSim, run_swarm

__all__ = [
    "GPU_TIERS",
    "MBIT",
    "BroadcastRecord",
    "EventLoop",
    "PeerSpec",
    "SimBroadcast",
    "SwarmConfig",
    "SwarmResult",
    "SwarmSim",
    "draw_peer",
    "draw_peers",
    "run_swarm",
    "simulate_broadcast",
]
