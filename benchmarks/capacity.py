"""Capacity at scale: broadcast time against its bound, the learner's idle time against the
capacity model, and what cost-aware activation saves, in a simulated swarm.

Section `sim`: the discrete-event swarm of `echo_node.sim`, which drives the real
protocol logic (weight broadcasts decided by `PieceSwarm` and `SourcePull`, activation by the real
`protocol.capacity.Scheduler`) over modelled links and GPUs. Workers come from the distributions
of `echo_node.sim.population` (home links 20-200 Mbit/s down and 5-40 up, lognormal; five GPU
tiers with their own μ and price); 20 % churn per hour unless said otherwise. Measured:

- `bcast_ratio_n100`, `bcast_ratio_n1000`: median over versions of (publication until every
  member that joined at publication and stayed holds the version) ÷ `broadcast_bound` over those
  members (every present worker follows the weights, standby or not); a version is published
  every 240 s, which leaves the broadcast of a 64 MiB model to 100 peers (~50 s) room. N = 100:
  a 64 MiB model (1,024 pieces of 64 KiB, `choose_piece_size`). N = 1,000: the model of `--n1000-mib` (default 64 MiB)
  for as many versions as `--n1000-budget-s` of wall time allows (the real state machines make
  the cost per version at least N × pieces deliveries: minutes per version here); when none
  completes, the first version's ratio so far, a lower bound (`bcast_ratio_n1000_is_lower_bound`).
- `idle_pred_abs_error`: a pool of 30 workers, no churn, its μ scaled to 0.5, 0.8, 1.0, 1.2 and
  2.0 × μ_min (μ_min from a pilot run's measured T_bcast; κ = `choose_kappa(S, T_train,
  T_bcast)`); the largest |predicted_idle − simulated idle|, where predicted_idle takes the run's
  own measured T_bcast and the μ of its active set.
- `cost_saving_vs_random`, `idle_cost_aware`, `idle_random`: the same pool size with churn, the
  real Scheduler's active set vs `random_activation` of capable workers at the Scheduler's own
  target (with the same hysteresis), averaged over `--seeds` seeds that give both policies the
  same churn: 1 − mean cost/h (cost-aware) ÷ mean cost/h (random), and each policy's mean idle.
- `sim_wall_s`: the wall time 1,000 peers x 100 versions would take, projected from the N = 1,000
  run (its wall time per version, counting a version still under way by the share of pieces
  its members hold; `sim_wall_measured_s` and `sim_wall_measured_versions` are what ran). A
  smaller model does not make it cheap: with fewer pieces than peers most peers take nothing
  from the learner and the mesh degrades (4 MiB, 64 pieces, 1,000 peers: 8x the bound and 770
  learner uploads per version, in 95 s for 11 versions).

Targets: bcast ratios <= 1.2, idle error <= 0.1, saving >= 30 % at equal or lower idle,
sim_wall_s <= 300 s for 1,000 peers x 100 versions. This process is pinned to one core.

Section `mesh`: the bounded-degree overlay of `echo_node.sim.mesh`, driving the real
`protocol.weights.overlay.Overlay` (k = 16 links per peer, chosen by the learner),
`protocol.weights.exchange.Exchange` (have, requests, rarest first, endgame) and `SeedPlan` (the
learner's sends) over the same link model. `mesh_n1000`: 1,000 workers of the population, no
churn; `mesh_n1000_churn`: uplinks uniform in 5-35 Mbit/s, 10 % churn per hour (each leave
replaced by a newcomer); `mesh_n10000` with `--n10000-versions`. Each: median and max over
versions of (publication until every member present at publication that stayed holds it) ÷
the bound over the members at publication, the last peer's (newcomers included) separately,
links per peer, the learner's copies, CPU and wall seconds per version. Targets: ratios <= 1.05
(no churn) and <= 1.10 (churn), links per peer <= 24, <= 30 s of wall per version at 1,000, and
the two 1,000-peer runs (side by side, one core each: `mesh_wall_s_n1000`) within 300 s; the
10,000-peer run within 600 s.

Section `simcheck` (root: network namespaces): the simulator against live broadcasts of real
receivers over the same shaped links (3 and 4 peers, 4 MiB); `sim_vs_live_bcast` is the largest
|live / simulated - 1|. Then the bounded-degree mesh the same way (`simcheck_mesh`: 8 peers on
symmetric 100 Mbit/s links with 64 MiB, 8 and 16 peers on home links, 100 down / 10 up, with
16 MiB; the learner at 100 Mbit/s); `sim_vs_live_mesh` is its largest |live / simulated - 1|
(target 0.10).

Section `live`: real processes on this machine. A learner whose update takes >= 3 s (a larger
model's step, `benchmarks.paced`) and four peers with known rates (a floor per group sampled)
and prices, run twice for the same time: with the capacity controller, then with every peer
active. `live_chosen_equals_optimal`: the controller's last active set equals the cheapest set
that covers its own target over the same measured μ (`optimal_cost`, computed here);
`live_idle_controller`, `live_idle_all_active`: the learner's idle share over the steady window
(after `--live-settle` s); also the cost rate of each. Nothing else may run meanwhile: the peers'
real work shares the two cores, and a busy machine lowers their measured μ.

    .venv/bin/python -m benchmarks.capacity --out benchmarks/results/capacity.json \\
        --png benchmarks/results/capacity.png
    .venv/bin/python -m benchmarks.capacity --quick          # minutes: smaller runs, same keys

Sections are functions of the parsed arguments returning a dict; `main` merges them into one JSON
object, printed as the last stdout line (and written to --out). `--sections sim` runs this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo_node.sim import MBIT, PeerSpec, SwarmConfig, SwarmResult, draw_peers, population, run_swarm
from echo_node.sim.mesh import MeshResult, MeshSim, VersionResult
from protocol.capacity import choose_kappa, mu_min

IDLE_FACTORS = (0.5, 0.8, 1.0, 1.2, 2.0)
# The learner's side of every run: R rollouts per update, T_train s each, staleness S, B per batch.
LEARNER: dict[str, Any] = dict(rollouts_per_update=256, t_train=30.0, staleness=4, batch=8)
DEFAULT_OUT = Path("benchmarks/results/capacity.json")


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def _broadcasts(result: SwarmResult) -> dict[str, Any]:
    done = [b for b in result.broadcasts if b.t_all is not None and b.members]
    ratios = [b.t_all / b.bound_s for b in done]  # type: ignore[operator]
    # A version still under way when the run stopped: its ratio is at least this.
    unfinished = [b for b in result.broadcasts if b.t_all is None and b.members]
    return {
        "ratio_median": _round(statistics.median(ratios)) if ratios else None,
        "ratio_at_least_unfinished": [
            _round((result.sim_s - b.published_at) / b.bound_s) for b in unfinished
        ],
        "held_at_end_unfinished": [_round(b.held_at_end, 3) for b in unfinished],
        "ratio_max": _round(max(ratios)) if ratios else None,
        "versions_measured": len(done),
        "members_median": statistics.median(b.members for b in done) if done else None,
        "t_all_s": [_round(b.t_all, 2) for b in done],
        "bound_s": [_round(b.bound_s, 2) for b in done],
        "link_overflows": sum(b.overflows for b in result.broadcasts),
        "duplicate_share": _round(sum(b.duplicates for b in result.broadcasts) / max(1, sum(b.deliveries for b in result.broadcasts))),
        "learner_uploads_per_version": _round(result.learner_bytes_up / result.config.model_bytes / max(1, result.versions_published), 2),
        "sim_s": _round(result.sim_s, 1),
        "wall_s": _round(result.wall_s, 1),
        "events": result.events,
        "churn": result.churn,
    }


def bcast_run(n: int, model_bytes: int, versions: int, seed: int, max_wall_s: float = math.inf) -> SwarmResult:
    """A publication every 2 x 120 s (spaced: module doc). Every present worker follows the
    weights, standby or not; the cost-aware policy keeps few generating, which the broadcast
    does not depend on (the simulated rollouts take no bandwidth) and which saves events."""
    cfg = SwarmConfig(
        model_bytes=model_bytes, policy="cost_aware", versions=versions, churn_per_hour=0.2, seed=seed,
        **{**LEARNER, "t_train": 120.0}, kappa=2, max_wall_s=max_wall_s,
    )
    return run_swarm(cfg, draw_peers(random.Random(seed), n))


def sim_broadcast(args: argparse.Namespace) -> dict[str, Any]:
    small = bcast_run(100, 64 << 20, args.n100_versions, args.seed)
    big = bcast_run(1000, args.n1000_mib << 20, 100, args.seed, max_wall_s=args.n1000_budget_s)
    big_stats = _broadcasts(big)
    done = sum(1 for b in big.broadcasts if b.t_all is not None and b.members)
    under_way = sum(h for h in big_stats["held_at_end_unfinished"] if h is not None)
    # No version done within the budget: the first one's ratio so far, a lower bound (flagged).
    n1000 = big_stats["ratio_median"]
    lower = n1000 is None and bool(big_stats["ratio_at_least_unfinished"])
    return {
        "bcast_ratio_n100": _broadcasts(small)["ratio_median"],
        "bcast_ratio_n1000": big_stats["ratio_at_least_unfinished"][0] if lower else n1000,
        "bcast_ratio_n1000_is_lower_bound": lower,
        "sim_wall_s": _round(100 * big.wall_s / (done + under_way), 1) if done + under_way else None,
        "sim_wall_s_projected": True,
        "sim_wall_measured_s": _round(big.wall_s, 1),
        "sim_wall_measured_versions": _round(done + under_way, 2),
        "bcast_n100": {"model_mib": 64, **_broadcasts(small)},
        "bcast_n1000": {"model_mib": args.n1000_mib, "budget_s": args.n1000_budget_s, **big_stats},
    }


def _mesh_stats(result: MeshResult) -> dict[str, Any]:
    ratios = [r for r in (v.ratio for v in result.versions) if r is not None]
    last = [v.last_s / v.bound_s for v in result.versions if v.last_s is not None]
    return {
        "ratio_median": _round(statistics.median(ratios)) if ratios else None,
        "ratio_max": _round(max(ratios)) if ratios else None,
        "last_peer_ratio_median": _round(statistics.median(last)) if last else None,
        "last_peer_ratio_max": _round(max(last)) if last else None,
        "versions": len(result.versions),
        "versions_unfinished": len(result.versions) - len(ratios),
        "bound_s": [_round(v.bound_s, 2) for v in result.versions],
        "learner_copies_median": _round(statistics.median(v.learner_copies for v in result.versions), 2) if result.versions else None,
        "duplicate_share": _round(sum(v.duplicates for v in result.versions) / max(1, sum(v.deliveries for v in result.versions))),
        "links_per_peer_max": result.links_per_peer_max,
        "links_per_peer_mean": _round(result.links_per_peer_mean, 2),
        "cpu_s_per_version": _round(result.cpu_s / max(1, len(result.versions)), 1),
        "wall_s_per_version": _round(result.wall_s / max(1, len(result.versions)), 1),
        "events": result.events,
    }


def mesh_run(n: int, model_mib: int, versions: int, seed: int, *, churn_per_hour: float = 0.0,
             uplink_mbit: tuple[float, float] | None = None) -> MeshResult:
    """N workers of the population (or with uplinks uniform in `uplink_mbit`, never above their
    downlink) on the bounded-degree overlay; under churn, each leave is replaced by a newcomer."""
    rng = random.Random(seed)
    specs = draw_peers(rng, n + n // 2)
    def row(p: PeerSpec) -> tuple[str, float, float, float]:
        up = p.up if uplink_mbit is None else min(p.down, rng.uniform(*uplink_mbit) * MBIT)
        return (p.peer_id, p.down, up, p.lat)
    rows = [row(p) for p in specs]
    sim = MeshSim(1000 * MBIT, rows[:n], size_bytes=model_mib << 20, churn_per_hour=churn_per_hour, spare=rows[n:], seed=seed)
    label = f"mesh n={n}" + (f" churn={churn_per_hour:g}/h" if churn_per_hour else "")

    def progress(v: VersionResult) -> None:  # one line per version on stderr: a long run shows progress
        print(json.dumps({"run": label, "version": v.version, "ratio": _round(v.ratio), "last_peer_ratio": _round(
            None if v.last_s is None else v.last_s / v.bound_s), "learner_copies": _round(v.learner_copies, 2),
            "cpu_s": _round(v.cpu_s, 1), "wall_s": _round(v.wall_s, 1)}), file=sys.stderr, flush=True)

    return sim.run(versions, on_version=progress)


# The simulator's time goes to memory latency over many small objects (a `have` touches about
# ten of each neighbour's: benchmarks/results/measurements.md), so its processes run with
# transparent huge pages for their heap (glibc's malloc; THP in `madvise` mode or `always`).
SIM_ENV = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def _pin_from(cores: Any) -> None:
    """A worker process's initializer: the next free core of `cores` (a queue) is its own."""
    os.sched_setaffinity(0, {cores.get()})


def _mesh_runs(runs: dict[str, dict[str, Any]]) -> dict[str, MeshResult]:
    """`mesh_run(**kwargs)` for each named run, in worker processes pinned one per core of this
    machine (the runs are independent: the section's wall time is the longest, not the sum)."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    cores = ctx.Queue()
    available = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))
    workers = max(1, min(len(runs), len(available)))
    for core in available[:workers]:
        cores.put(core)
    saved = {k: os.environ.get(k) for k in SIM_ENV}
    os.environ.update(SIM_ENV)  # the workers' interpreters start with it
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_pin_from, initargs=(cores,)) as pool:
            futures = {name: pool.submit(mesh_run, **kwargs) for name, kwargs in runs.items()}
            return {name: f.result() for name, f in futures.items()}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sim_mesh(args: argparse.Namespace) -> dict[str, Any]:
    """The bounded-degree overlay (echo_node.sim.mesh): 1,000 peers without churn, 1,000 with
    uplinks of 5-35 Mbit/s and 10 % churn per hour, side by side (one core each), then 10,000
    peers when asked."""
    started = time.perf_counter()
    out: dict[str, Any] = {}
    n1000 = _mesh_runs({
        "mesh_n1000": dict(n=1000, model_mib=args.n1000_mib, versions=args.mesh_versions, seed=args.seed),
        "mesh_n1000_churn": dict(n=1000, model_mib=args.n1000_mib, versions=args.mesh_versions, seed=args.seed + 1,
                                 churn_per_hour=0.1, uplink_mbit=(5.0, 35.0)),
    })
    out.update({name: _mesh_stats(result) for name, result in n1000.items()})
    out["mesh_wall_s_n1000"] = _round(time.perf_counter() - started, 1)
    if args.n10000_versions:
        big = _mesh_runs({"mesh_n10000": dict(n=10000, model_mib=args.n1000_mib, versions=args.n10000_versions, seed=args.seed + 2)})
        out["mesh_n10000"] = _mesh_stats(big["mesh_n10000"])
    out["mesh_ratio_n1000"] = out["mesh_n1000"]["ratio_median"]
    out["mesh_ratio_n1000_churn"] = out["mesh_n1000_churn"]["ratio_median"]
    out["mesh_links_per_peer_max"] = max(out[k]["links_per_peer_max"] for k in out if k.startswith("mesh_n"))
    out["mesh_section_wall_s"] = _round(time.perf_counter() - started, 1)
    return out


def section_mesh(args: argparse.Namespace) -> dict[str, Any]:
    return sim_mesh(args)


def _scaled(pool: list[PeerSpec], total_mu: float) -> list[PeerSpec]:
    k = total_mu / math.fsum(p.mu for p in pool)
    return [dataclasses.replace(p, mu=p.mu * k) for p in pool]


def sim_idle(args: argparse.Namespace) -> dict[str, Any]:
    pool = draw_peers(random.Random(args.seed + 100), args.pool)
    common = dict(model_bytes=16 << 20, churn_per_hour=0.0, policy="all", seed=args.seed, **LEARNER)
    pilot = run_swarm(SwarmConfig(**common, kappa=2, versions=8), pool)
    kappa = choose_kappa(LEARNER["staleness"], LEARNER["t_train"], pilot.t_bcast_median).kappa
    floor = mu_min(kappa, LEARNER["rollouts_per_update"], LEARNER["t_train"], pilot.t_bcast_median)
    rows: list[dict[str, Any]] = []
    for f in IDLE_FACTORS:
        r = run_swarm(SwarmConfig(**common, kappa=kappa, versions=args.idle_versions), _scaled(pool, f * floor))
        measured_floor = mu_min(kappa, LEARNER["rollouts_per_update"], LEARNER["t_train"], r.t_bcast_median)
        rows.append({
            "factor": f, "mu_pool": _round(r.mu_active_mean, 3), "mu_min_measured": _round(measured_floor, 3),
            "t_bcast_s": _round(r.t_bcast_median, 2), "idle_sim": _round(r.idle_sim), "idle_pred": _round(r.idle_pred),
            "abs_error": _round(abs(r.idle_pred - r.idle_sim)), "stale": r.ledger["stale"], "trained": r.ledger["trained"],
            "wall_s": _round(r.wall_s, 1),
        })
    return {
        "idle_pred_abs_error": max(row["abs_error"] for row in rows),
        "idle_pools": {"kappa": kappa, "pilot_t_bcast_s": _round(pilot.t_bcast_median, 2), "mu_min": _round(floor, 3),
                       "workers": args.pool, "model_mib": 16, "rows": rows},
    }


def sim_cost(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, SwarmResult]]:
    """Also returns seed 0's runs, for the plot."""
    runs: dict[str, list[SwarmResult]] = {"cost_aware": [], "random": []}
    pilot_pool = draw_peers(random.Random(args.seed + 200), args.pool)
    pilot = run_swarm(SwarmConfig(model_bytes=16 << 20, policy="all", kappa=2, versions=8, churn_per_hour=0.0,
                                  seed=args.seed, **LEARNER), pilot_pool)
    kappa = choose_kappa(LEARNER["staleness"], LEARNER["t_train"], pilot.t_bcast_median).kappa
    for i in range(args.seeds):
        seed = args.seed + i
        pool = draw_peers(random.Random(seed + 200), args.pool)
        for policy in runs:
            cfg = SwarmConfig(model_bytes=16 << 20, policy=policy, kappa=kappa, versions=args.cost_versions,  # type: ignore[arg-type]
                              churn_per_hour=0.2, seed=seed, **LEARNER)
            runs[policy].append(run_swarm(cfg, pool))
    cost = {p: statistics.fmean(r.cost_per_hour_mean for r in rs) for p, rs in runs.items()}
    idle = {p: statistics.fmean(r.idle_sim for r in rs) for p, rs in runs.items()}
    per_seed = [
        {p: {"cost_per_hour": _round(runs[p][i].cost_per_hour_mean, 3), "idle": _round(runs[p][i].idle_sim),
             "mu_active": _round(runs[p][i].mu_active_mean, 2), "stale": runs[p][i].ledger["stale"],
             "churn": runs[p][i].churn, "wall_s": _round(runs[p][i].wall_s, 1)} for p in runs}
        for i in range(args.seeds)
    ]
    summary = {
        "cost_saving_vs_random": _round(1 - cost["cost_aware"] / cost["random"]),
        "idle_cost_aware": _round(idle["cost_aware"]),
        "idle_random": _round(idle["random"]),
        "cost": {"kappa": kappa, "workers": args.pool, "seeds": args.seeds, "versions": args.cost_versions,
                 "cost_per_hour": {p: _round(c, 3) for p, c in cost.items()}, "per_seed": per_seed},
    }
    return summary, {p: rs[0] for p, rs in runs.items()}


def plot(runs: dict[str, SwarmResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), dpi=110, sharex=True)
    for policy, r in runs.items():
        t = [row["t"] / 60 for row in r.timeline]
        style = "-" if policy == "cost_aware" else "--"
        if policy == "cost_aware":
            axes[0].step(t, [row["mu_pool"] for row in r.timeline], where="post", label="μ_pool (present workers)")
            axes[0].step(t, [row["mu_min"] for row in r.timeline], where="post", label="μ_min (measured T_bcast)")
            axes[0].step(t, [row["target"] for row in r.timeline], where="post", label="target γ·μ_min")
        axes[0].step(t, [row["mu_active"] for row in r.timeline], style, where="post", label=f"μ_active ({policy})")
        axes[1].step(t, [row["active"] for row in r.timeline], style, where="post", label=f"active ({policy})")
        axes[2].step(t, [row["cost_per_hour"] for row in r.timeline], style, where="post", label=f"{policy}")
    axes[1].step([row["t"] / 60 for row in runs["cost_aware"].timeline], [row["pool"] for row in runs["cost_aware"].timeline],
                 ":", where="post", label="present")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("rollouts/s (log)")
    axes[1].set_ylabel("workers")
    axes[2].set_ylabel("$ / hour")
    axes[2].set_xlabel("simulated minutes")
    axes[0].set_title(f"capacity scheduler in a simulated swarm ({runs['cost_aware'].config.churn_per_hour:.0%} churn/h, seed "
                      f"{runs['cost_aware'].config.seed})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def section_sim(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out: dict[str, Any] = {}
    cost, plot_runs = sim_cost(args)
    out.update(cost)
    out.update(sim_idle(args))
    out.update(sim_broadcast(args))
    if args.png is not None:
        plot(plot_runs, args.png)
        out["png"] = str(args.png)
    out["sim_section_wall_s"] = _round(time.perf_counter() - started, 1)
    out["distributions"] = population.__doc__
    out["learner"] = LEARNER
    return out


# --- live: four priced peers of known speeds on this machine ------------------------------------

# (name, seconds per group of 8 rollouts, $/h): μ = 8 / group_s rollouts/s, 32, 21, 16 and 26,
# unless the peer's real work (sharing two cores with the others) is slower.
LIVE_PEERS = (("fast-dear", 0.25, 2.0), ("mid-cheap", 0.375, 0.5), ("slow-cheapest", 0.5, 0.1), ("mid", 0.3125, 1.0))
# The learner's update takes >= this long (a larger model's step; the tiny one takes ~30 ms).
LIVE_TRAIN_S = 3.0
LIVE_STALENESS = 4


def _live_run(enabled: bool, seconds: float, settle_s: float) -> dict[str, Any]:
    import tempfile

    from benchmarks.swarm import metrics_path, start_learner, start_peer
    from benchmarks.utilization import steady_window
    from echo_node.demo import Swarm
    from echo_node.metrics import read_metrics
    from protocol.identity import load_or_create_key_file

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "run.toml").write_text(f"[capacity]\nenabled = {str(enabled).lower()}\ntick_s = 15.0\nwindow_s = 30.0\n")
        names = {load_or_create_key_file(root / f"peer{i}.key").peer_id: name for i, (name, _, _) in enumerate(LIVE_PEERS)}
        swarm = Swarm(root)
        run_id = f"capacity-{'controller' if enabled else 'all'}"
        args = ["--mode", "async", "--staleness", str(LIVE_STALENESS), "--publish-every", "auto", "--seconds", str(seconds),
                "--config", str(root / "run.toml")]
        try:
            common, learner = start_learner(swarm, root, run_id, args, cpus={0}, module="benchmarks.paced",
                                            module_args=["--train-s", str(LIVE_TRAIN_S)])
            for i, (_, group_s, price) in enumerate(LIVE_PEERS):
                start_peer(swarm, root, common, i, cpus={0, 1}, args=["--price-per-hour", str(price)],
                           module="benchmarks.paced", module_args=["--group-s", str(group_s)])
            deadline = time.monotonic() + seconds + 180
            while learner.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
        finally:
            swarm.stop_all()
        records = read_metrics(metrics_path(root, run_id))
    window = steady_window(records, settle_s)
    steps = [r for r in records if r.get("event") == "train"]
    start_wall = steps[0]["wall"] + settle_s  # where steady_window's window starts
    decisions = [r for r in records if r.get("event") == "capacity"]
    in_window = [d for d in decisions if d["wall"] >= start_wall]
    out: dict[str, Any] = {"learner_idle": window["learner_idle"], "samples_per_s": window["samples_per_s"],
                           "updates": window["updates"], "window_s": window["window_s"], "decisions": len(decisions)}
    if decisions:
        last = decisions[-1]
        # The cost rate over the window: each decision's active set, weighted by how long it held.
        marks = [(d["wall"], d["cost_per_hour"]) for d in in_window] or [(start_wall, last["cost_per_hour"])]
        end = steps[-1]["wall"]
        spans = [(max(start_wall, a[0]), b[0] if b else end, a[1]) for a, b in zip(marks, [*marks[1:], None])]
        earlier = [d for d in decisions if d["wall"] < start_wall]
        if earlier and marks[0][0] > start_wall:
            spans.insert(0, (start_wall, marks[0][0], earlier[-1]["cost_per_hour"]))
        total = sum(b - a for a, b, _ in spans)
        out.update({
            "cost_per_hour_window": _round(sum((b - a) * c for a, b, c in spans) / total, 3) if total > 0 else None,
            "last_decision": {
                "active": sorted(names.get(p, p) for p in last["active"]),
                "standby": sorted(names.get(p, p) for p in last["standby"]),
                "workers": {names.get(p, p): w for p, w in last["workers"].items()},
                **{k: last[k] for k in ("kappa", "t_train", "t_bcast", "mu_min", "target", "mu_pool", "mu_active",
                                         "cost_per_hour", "idle_predicted", "delta_max_predicted", "feasible")},
            },
            "active_sets": sorted({",".join(sorted(names.get(p, p) for p in d["active"])) for d in in_window}),
        })
    return out


def section_live(args: argparse.Namespace) -> dict[str, Any]:
    """The controller vs every peer active, on the same swarm: chosen set, optimum, idle, cost."""
    from protocol.capacity import Worker, optimal_cost

    controller = _live_run(True, args.live_seconds, args.live_settle)
    every = _live_run(False, args.live_seconds, args.live_settle)
    last = controller.get("last_decision")
    chosen_eq: bool | None = None
    if last is not None and last["target"] is not None:
        # The optimum over the same measured μ and the same target, computed offline.
        pool = [Worker(name, w["mu"], w["price"]) for name, w in last["workers"].items()]
        cost, best = optimal_cost(pool, last["target"])
        last["optimal"] = sorted(w.peer_id for w in best)
        last["optimal_cost_per_hour"] = _round(cost, 4)
        chosen_eq = last["optimal"] == last["active"]
    return {
        "live_chosen_equals_optimal": chosen_eq,
        "live_idle_controller": controller["learner_idle"],
        "live_idle_all_active": every["learner_idle"],
        "live_cost_per_hour_controller": controller.get("cost_per_hour_window"),
        "live_cost_per_hour_all_active": round(sum(price for _, _, price in LIVE_PEERS), 3),
        "live": {
            "peers": [{"name": n, "group_s": g, "price_per_hour": c} for n, g, c in LIVE_PEERS],
            "train_s_floor": LIVE_TRAIN_S, "staleness": LIVE_STALENESS, "seconds": args.live_seconds,
            "settle_s": args.live_settle, "controller": controller, "all_active": every,
        },
    }


# --- simcheck: the simulator against a live broadcast over the same shaped links ------------------

# (peers, learner up, peers up / down, slow peers at SIMCHECK_SLOW_MBIT both ways), Mbit/s.
SIMCHECK = ((3, 20.0, 10.0, 40.0, 0), (4, 20.0, 10.0, 40.0, 1))
SIMCHECK_SLOW_MBIT = 15.0
# The bounded-degree mesh (echo_node/weights/mesh.py live, echo_node/sim/mesh.py simulated):
# (peers, learner up, peers up, peers down in Mbit/s, MiB): symmetric links, home links.
SIMCHECK_MESH = ((8, 100.0, 100.0, 100.0, 64), (8, 100.0, 10.0, 100.0, 16), (16, 100.0, 10.0, 100.0, 16))
SIMCHECK_MESH_VERSIONS = 3


def section_simcheck(args: argparse.Namespace) -> dict[str, Any]:
    """Live broadcasts (benchmarks.wan.p2p, real receivers in shaped namespaces; root) and the
    simulation of the same links at their measured goodput: `sim_vs_live_bcast` is the largest
    |live / simulated - 1|."""
    from benchmarks.wan.calibrate import measure_goodput
    from benchmarks.wan.netns import netns_available
    from benchmarks.wan.p2p import PIECE, run_p2p
    from benchmarks.wan.scenario import Scenario
    from echo_node.sim import simulate_broadcast
    from protocol.capacity import broadcast_bound

    why_not = netns_available()
    if why_not is not None:
        return {"sim_vs_live_bcast": None, "simcheck_skipped": why_not}
    rows = []
    for peers, b0, up, down, slow in SIMCHECK:
        s = Scenario(peers=peers, size_bytes=4 << 20, b0_mbit=b0, learner_down_mbit=down, bup_mbit=up, bdown_mbit=down,
                     slow_peers=slow, slow_mbit=SIMCHECK_SLOW_MBIT, learner_cpus=frozenset({0}), peer_cpus=frozenset({0, 1}))
        with s.topology(prefix="ecap") as topo:
            efficiency = measure_goodput(topo, src=1, dst=0, nbytes=1 << 20, timeout=30)["efficiency"]
            live = run_p2p(topo, s, tag="capacity-simcheck", timeout=120)
        mbit = 1e6 / 8 * efficiency
        links = [(s.peer_rates(i).down_mbit * mbit, s.peer_rates(i).up_mbit * mbit) for i in range(1, peers + 1)]
        simulated = simulate_broadcast(s.size_bytes, b0 * mbit, links, piece_size=PIECE)
        rows.append({**s.describe(), "efficiency": _round(efficiency, 3), "live_s": _round(live["seconds"], 3),
                     "sim_s": _round(simulated, 3), "live_over_sim": _round(live["seconds"] / simulated, 3),
                     "bound_s": _round(broadcast_bound(s.size_bytes, b0 * mbit, [d for d, _ in links], [u for _, u in links]), 3),
                     "all_verified": live["all_verified"], "peers_bytes_up": live["peers_bytes_up"]})
    mesh = simcheck_mesh()
    return {"sim_vs_live_bcast": _round(max(abs(r["live_over_sim"] - 1) for r in rows), 3), "simcheck": rows,
            "sim_vs_live_mesh": _round(max(abs(r["live_over_sim"] - 1) for r in mesh), 3), "simcheck_mesh": mesh}


def simcheck_mesh() -> list[dict[str, Any]]:
    """The mesh simulator against the live mesh (benchmarks.wan.p2p `--exchange mesh`) over the
    same shaped links at their measured goodput, with the live receiver's request depth and
    piece size; the simulated time is the median over SIMCHECK_MESH_VERSIONS versions."""
    from benchmarks.wan.calibrate import measure_goodput
    from benchmarks.wan.p2p import PIECE, run_p2p
    from benchmarks.wan.scenario import Scenario
    from echo_node.sim.mesh import simulate_mesh
    from echo_node.weights.mesh import MESH_HORIZON_S, MESH_PIPELINE
    from protocol.weights.manifest import choose_piece_size

    rows = []
    for peers, b0, up, down, mib in SIMCHECK_MESH:
        s = Scenario(peers=peers, size_bytes=mib << 20, b0_mbit=b0, bup_mbit=up, bdown_mbit=down, exchange="mesh")
        with s.topology(prefix="ecam") as topo:
            efficiency = measure_goodput(topo, src=1, dst=0, nbytes=1 << 20, timeout=30)["efficiency"]
            live = run_p2p(topo, s, tag="capacity-simcheck-mesh", timeout=300)
        mbit = 1e6 / 8 * efficiency
        sim = simulate_mesh(s.size_bytes, b0 * mbit, [(down * mbit, up * mbit)] * peers, versions=SIMCHECK_MESH_VERSIONS,
                            latency_s=0.0, degree=s.degree, pipeline=MESH_PIPELINE, horizon=MESH_HORIZON_S,
                            piece_size=choose_piece_size(s.size_bytes, PIECE))
        simulated = statistics.median(v.seconds for v in sim.versions if v.seconds is not None)
        bound = sim.versions[0].bound_s
        rows.append({**s.describe(), "efficiency": _round(efficiency, 3), "live_s": _round(live["seconds"], 3),
                     "sim_s": _round(simulated, 3), "live_over_sim": _round(live["seconds"] / simulated, 3),
                     "bound_s": _round(bound, 3), "live_over_bound": _round(live["seconds"] / bound, 3),
                     "sim_over_bound": _round(simulated / bound, 3), "all_verified": live["all_verified"],
                     "live_learner_copies": _round(live["learner_bytes_up"] / s.size_bytes, 3),
                     "sim_learner_copies": _round(statistics.median(v.learner_copies for v in sim.versions), 3),
                     "live_cpu_busy": live["cpu_busy"]})
        print(json.dumps({"simcheck_mesh": rows[-1]}), file=sys.stderr, flush=True)
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "sim": section_sim, "mesh": section_mesh, "simcheck": section_simcheck, "live": section_live,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="sim,simcheck,live", help=f"comma-separated, of {sorted(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=3, help="seeds of the cost comparison")
    p.add_argument("--pool", type=int, default=30, help="workers in the idle and cost pools")
    p.add_argument("--cost-versions", type=int, default=120)
    p.add_argument("--idle-versions", type=int, default=30)
    p.add_argument("--n100-versions", type=int, default=10)
    p.add_argument("--n1000-mib", type=int, default=64, help="model size of the N = 1,000 run")
    p.add_argument("--n1000-budget-s", type=float, default=600.0, help="wall time for the N = 1,000 run")
    p.add_argument("--mesh-versions", type=int, default=10, help="versions of each N = 1,000 run of section mesh")
    p.add_argument("--n10000-versions", type=int, default=0, help="versions of the N = 10,000 run of section mesh (0: none)")
    p.add_argument("--live-seconds", type=float, default=180.0, help="training time of each live run")
    p.add_argument("--live-settle", type=float, default=60.0, help="seconds of updates left out (joins, first measurements)")
    p.add_argument("--quick", action="store_true", help="fewer versions and seeds, smaller budget")
    p.add_argument("--out", type=Path, default=None, help=f"also write the JSON here (e.g. {DEFAULT_OUT})")
    p.add_argument("--png", type=Path, default=None, help="μ_pool vs μ_min, active set, cost over time")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.cost_versions, args.idle_versions, args.n100_versions = 1, 15, 15, 4
        args.n1000_budget_s = min(args.n1000_budget_s, 120.0)
        args.mesh_versions = min(args.mesh_versions, 2)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # one core: wall times comparable
    report: dict[str, Any] = {}
    for name in sections:
        report.update(SECTIONS[name](args))
    report["command"] = "python -m benchmarks.capacity " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
