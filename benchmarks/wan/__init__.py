"""A simulated WAN on one machine: network namespaces joined by a bridge, each link rate-shaped.

`netns.Topology` builds it (learner `h0`, peers `h1..hN`), starts pinned processes inside it and
always tears it down; `calibrate` measures the goodput of one shaped link; `star` is the naive
broadcast baseline; `bound.bound_s` is the lower bound on broadcast time that both are judged by.
Traffic exists only inside namespaces this package creates; nothing is routed out of them.
"""

from benchmarks.wan.bound import bound_s
from benchmarks.wan.netns import Rates, Topology, cleanup_stale, python_argv

__all__ = ["Rates", "Topology", "bound_s", "cleanup_stale", "python_argv"]
