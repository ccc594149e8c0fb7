"""The whole swarm across shaped links, against the same swarm on loopback.

Bootstrap, learner and N rollout peers run as `echo-node` processes with the README's flags
(`benchmarks/wan/swarm_netns.py`), first in network namespaces — learner 1 Gbit/s both ways,
peers asymmetric (100 Mbit/s down, 20 up by default), the last `--nat` of them behind a NAT
that drops inbound connections — then all on loopback. Each swarm trains for `--seconds` after
its last peer started. Measured per swarm:

- `join_to_first_accept_s`: from a peer's `echo-node join` to the learner accepting its first
  rollouts (mean and max over peers);
- `versions_per_min` over the window, and the learner's upload per published version;
- `live_all_s`: from a version's publication (the learner's train record) until every peer
  installed it (verified, handed to its engine), median over the versions all peers installed;
  in the WAN case also ÷ the broadcast bound for those rates (`benchmarks/wan/bound.py`, at the
  0.956 goodput of a 1500-byte MTU, docs/platform.md);
- `installed_s`: from a version's publication until a peer installed it, median over every
  install of every peer (a steadier sample: peers skip versions while busy), and ÷ the bound;
  `install_parts_median_s` splits it: `to_fetch_s` (publication until the peer began fetching:
  the announcement reaching it, and a fetch of an older version still under way), `fetch_s`
  (the fetch, delta or full), `receive_s` (its handshake and transfer until verified).

Processes are pinned: learner on core 0, bootstrap and peers on core 1. Needs root and
nftables (`apt-get install nftables`). One JSON object as the last line.

    .venv/bin/python -m benchmarks.wan_swarm
    .venv/bin/python -m benchmarks.wan_swarm --peers 3 --nat 1 --seconds 60
    .venv/bin/python -m benchmarks.wan_swarm --exchange mesh   # the bounded-degree overlay
    .venv/bin/python -m benchmarks.wan_swarm --publish-every 2  # broadcast every other version
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.wan.bound import bound_s
from benchmarks.wan.netns import Rates, Topology, cleanup_stale, nat_available
from benchmarks.wan.swarm_netns import NetnsSwarm

MTU_1500_GOODPUT = 0.956
LEARNER_CPUS, OTHER_CPUS = {0}, {1}


def measure(swarm: NetnsSwarm, peers: list[str], seconds: float, learner_args: list[str]) -> dict[str, Any]:
    swarm.start_bootstrap(cpus=OTHER_CPUS)
    swarm.start_learner("--seconds", "3600", *learner_args, cpus=LEARNER_CPUS)
    started = {}
    for host in range(2, 2 + len(peers)):
        name = swarm.start_peer(host, cpus=OTHER_CPUS)
        started[swarm.peer_ids[name]] = swarm.started[name]
    time.sleep(seconds)
    summary = swarm.stop_learner()
    firsts = {r["peer"]: r["wall"] for r in swarm.learner_records("first_accept")}
    joins = [firsts[p] - t for p, t in started.items() if p in firsts]
    train = swarm.learner_records()
    window = [r for r in train if r["wall"] >= max(started.values())]
    published_at: dict[int, float] = {}
    for r in train:
        published_at.setdefault(int(r["published"]), float(r["wall"]))
    peer_records = [swarm.peer_records(p) for p in peers]  # each peer's installed records, read once
    installs = [{int(r["version"]): float(r["wall"]) for r in records} for records in peer_records]
    live = [max(i[v] for i in installs) - t for v, t in published_at.items() if v > 0 and all(v in i for i in installs)]
    # Every install, not only versions all peers took: a peer busy with one version skips the
    # next, so `live` is a median over few versions (9-30 of 50-70 in a 45 s run).
    each = [i[v] - t for i in installs for v, t in published_at.items() if v > 0 and v in i]
    # Where an install's time went: publication until the peer began fetching (the announcement
    # reaching it, and a fetch of an older version still under way), then the fetch itself
    # (handshake and transfer: `receive_s`, then decode and the digest).
    records = [r for rs in peer_records for r in rs if int(r["version"]) in published_at and int(r["version"]) > 0
               and not r.get("renumbered")]
    parts = {
        "to_fetch_s": [float(r["wall"]) - float(r["fetch_s"]) - published_at[int(r["version"])] for r in records],
        "fetch_s": [float(r["fetch_s"]) for r in records],
        "receive_s": [float(r["receive_s"]) for r in records if "receive_s" in r],
    }
    published = sorted({int(r["published"]) for r in window})
    up = (window[-1]["learner_bytes_up"] - window[0]["learner_bytes_up"]) if len(window) > 1 else 0
    sizes = [int(r["bytes"]) for rs in peer_records for r in rs]
    minutes = (window[-1]["wall"] - window[0]["wall"]) / 60 if len(window) > 1 else float("nan")
    return {
        "peers_accepted": sum(1 for p in started if summary["peers"].get(p, {}).get("accepted", 0) > 0),
        "relays": sum(1 for p in started if summary["peers"].get(p, {}).get("relay")),
        "join_to_first_accept_s": {"mean": round(statistics.fmean(joins), 2), "max": round(max(joins), 2)} if joins else None,
        "versions": summary["versions"],
        "versions_per_min": round((window[-1]["version"] - window[0]["version"]) / minutes, 1) if len(window) > 1 else 0.0,
        "published_in_window": len(published),
        "learner_upload_per_version_bytes": round(up / max(1, len(published) - 1)),
        "version_bytes": max(sizes, default=0),
        "live_all_s": round(statistics.median(live), 4) if live else None,
        "versions_live_on_all": len(live),
        "installed_s": round(statistics.median(each), 4) if each else None,
        "installs": len(each),
        "install_parts_median_s": {k: round(statistics.median(v), 4) if v else None for k, v in parts.items()},
        "installs_by_delta": sum(1 for r in records if r.get("delta")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--nat", type=int, default=1, help="how many of the peers sit behind a NAT")
    p.add_argument("--learner-mbit", type=float, default=1000.0)
    p.add_argument("--peer-down-mbit", type=float, default=100.0)
    p.add_argument("--peer-up-mbit", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=60.0, help="training time per swarm after its last peer started")
    p.add_argument("--exchange", choices=["auto", "push", "mesh"], default="auto",
                   help="the learner's weights.exchange (auto: the bounded-degree mesh)")
    p.add_argument("--publish-every", default="1", metavar="K|auto",
                   help="the learner's --publish-every: every K-th version is broadcast (auto: the capacity model's κ)")
    args = p.parse_args(argv)
    if not 0 <= args.nat <= args.peers:
        p.error("--nat must be between 0 and --peers")
    why = nat_available()
    if why is not None:
        print(f"wan_swarm: {why}", file=sys.stderr)
        return 2
    cleanup_stale("ewsw")
    peer = Rates(up_mbit=args.peer_up_mbit, down_mbit=args.peer_down_mbit)
    hosts = [Rates(up_mbit=args.learner_mbit, down_mbit=args.learner_mbit)] * 2
    hosts += [peer] * (args.peers - args.nat) + [Rates(up_mbit=peer.up_mbit, down_mbit=peer.down_mbit, nat=True)] * args.nat
    names = [f"peer{h}" for h in range(2, 2 + args.peers)]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wan-swarm-") as tmp:
        config = Path(tmp) / "weights.toml"
        config.write_text(f'[weights]\nexchange = "{args.exchange}"\n')
        learner_args = ["--config", str(config), "--publish-every", args.publish_every]
        with Topology(hosts, prefix="ewsw") as topo:
            swarm = NetnsSwarm(topo, Path(tmp) / "wan", "wan-swarm")
            try:
                wan = measure(swarm, names, args.seconds, learner_args)
            finally:
                swarm.close()
        local = NetnsSwarm(None, Path(tmp) / "loopback", "loopback-swarm")
        try:
            loopback = measure(local, names, args.seconds, learner_args)
        finally:
            local.close()
    bound = bound_s(
        wan["version_bytes"], args.learner_mbit, [args.peer_up_mbit] * args.peers, [args.peer_down_mbit] * args.peers,
        efficiency=MTU_1500_GOODPUT,
    )
    wan["live_bound_s"] = round(bound, 4)
    wan["live_over_bound"] = round(wan["live_all_s"] / bound, 3) if wan["live_all_s"] else None
    wan["installed_over_bound"] = round(wan["installed_s"] / bound, 3) if wan["installed_s"] else None
    out = {
        "peers": args.peers, "nat": args.nat, "seconds": args.seconds, "exchange": args.exchange,
        "publish_every": args.publish_every,
        "rates_mbit": {"learner": args.learner_mbit, "peer_down": args.peer_down_mbit, "peer_up": args.peer_up_mbit},
        "wan": wan, "loopback": loopback,
        "versions_per_min_ratio": round(wan["versions_per_min"] / loopback["versions_per_min"], 3) if loopback["versions_per_min"] else None,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
