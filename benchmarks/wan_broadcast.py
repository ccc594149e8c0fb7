"""Weight broadcast over a shaped WAN: echo-node's P2P mesh vs a naive star vs the bound.

Real processes in network namespaces joined through a bridge, `tbf` on both ends of every link
(benchmarks/wan/netns.py). In one run: the goodput of one shaped link (calibration), echo-node's
broadcast until the version verifies on every surviving peer, the star (the learner uploads to
each peer itself), and the bound T* = max(G/B0, G/Bdown, N*G/(B0 + N*Bup)) with the configured
and with the calibrated rates. Also the lossless delta's size for bf16 weights after one Adam step.
Prints one JSON object as its last line. Must run as root (namespaces); traffic stays inside them.

    .venv/bin/python -m benchmarks.wan_broadcast                       # N=8, 64 MiB, 100 Mbit/s
    .venv/bin/python -m benchmarks.wan_broadcast --peers 4 --slow-half
    .venv/bin/python -m benchmarks.wan_broadcast --kill 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks.wan import scenario as sc
from benchmarks.wan.calibrate import measure_goodput
from benchmarks.wan.netns import cleanup_stale
from benchmarks.wan.p2p import run_p2p
from benchmarks.wan.star import run_star


def delta_ratio(model: Any) -> float:
    """Delta bytes / full bytes for the bf16 snapshot before and after one Adam step at lr 1e-6.

    The optimizer keeps fp32 master weights (as mixed-precision training does); what is
    published is their bf16 rounding, so only weights that cross a rounding boundary change.
    """
    import torch
    from safetensors.torch import save

    from protocol.weights.delta import decode_delta, encode_delta

    torch.manual_seed(0)
    params = list(model.parameters())
    snapshot = lambda: save({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()})  # noqa: E731
    before = snapshot()
    opt = torch.optim.Adam(params, lr=1e-6)
    loss = sum((p * torch.randn_like(p)).sum() for p in params)
    loss.backward()
    opt.step()
    after = snapshot()
    delta = encode_delta(after, before)
    if decode_delta(delta, before, max_size=len(before)) != after:  # a ratio only counts if lossless
        raise AssertionError("delta round trip is not bit-exact")
    return len(delta) / len(after)


def delta_ratios() -> dict[str, float]:
    import torch

    from echo_node.ml.model import build_model, tiny_llama_config

    torch.set_num_threads(1)
    synthetic = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])  # 100.7M params
    return {
        "delta_bytes_ratio_default_model": round(delta_ratio(build_model(tiny_llama_config(16))), 4),
        "delta_bytes_ratio": round(delta_ratio(synthetic), 4),
        "synthetic_params": sum(p.numel() for p in synthetic.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sc.add_arguments(p)
    p.add_argument("--skip-star", action="store_true")
    p.add_argument("--skip-delta", action="store_true")
    s = sc.from_args(p.parse_args(argv))
    t0 = time.monotonic()
    cleanup_stale()
    with s.topology() as topo:
        cal = measure_goodput(topo, src=1, dst=0, nbytes=16 << 20, src_cpus=s.peer_cpus, dst_cpus=s.learner_cpus)
        eff = cal["efficiency"]
        kill_after = s.resolved_kill_after_s(eff)
        p2p = run_p2p(topo, s, tag=f"bench-{time.time_ns()}", kill_after_s=kill_after,
                      timeout=min(300.0, 60 + 10 * s.bound_s(eff)))
        star = None if args_skip(argv, "--skip-star") else run_star(
            topo, s, kill_after_s=kill_after, timeout=min(540.0, 60 + 3 * s.star_ideal_s(eff)))
    bound_cal = s.survivors_bound_s(kill_after, eff) if s.kill else s.bound_s(eff)
    desc = s.describe()
    result = {
        **desc,
        "link_goodput_mbit": cal["mbit_s"],
        "p2p_s": round(p2p["seconds"], 3),
        "star_s": round(star["seconds"], 3) if star else None,
        "bound_s": round(bound_cal, 3),
        "bound_configured_s": round(s.bound_s(), 3),
        "ratio_p2p_bound": round(p2p["seconds"] / bound_cal, 4),
        "ratio_star_p2p": round(star["seconds"] / p2p["seconds"], 3) if star else None,
        "learner_upload_copies": round(p2p["learner_bytes_up"] / s.size_bytes, 3),
        "p2p_all_verified": p2p["all_verified"],
        "p2p_per_peer_s": p2p["per_peer_s"],
        # CPU a peer spends from its first hello to the version verifying, per GiB it received
        # (each peer also uploads about (N-1)/N of a copy while relaying).
        "p2p_cpu_s_per_gib_per_peer": round(
            p2p["peers_cpu_s"] / max(1, len(s.survivors)) / (s.size_bytes / (1 << 30)), 2),
        "p2p_cpu_busy": p2p["cpu_busy"],
        **{f"p2p_{key}": p2p[key] for key in ("stalls", "cut", "wasted", "withdrawn") if key in p2p},
        **({} if args_skip(argv, "--skip-delta") else delta_ratios()),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result))
    return 0


def args_skip(argv: list[str] | None, flag: str) -> bool:
    return flag in (argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
