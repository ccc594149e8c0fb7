"""Does the learner's verification keep attackers out, and at what cost? Six attack classes, each
with verification on and off, against a clean run.

Per run a fresh loopback swarm of the real binary (bootstrap; learner in async mode, S = 4,
training `--versions` steps; two honest `echo-node join` peers; for an attack, one attacker peer
from benchmarks/attackers.py, started with the honest ones), the same keys, seed and duration
every run (the same number of steps, not seconds: an attacker's process takes CPU from the
honest peers on this machine, so equal seconds would train attacked runs less). Classes (benchmarks/attackers.py says how each lies): `clean`, `fake_rewards` (a),
`garbage` (b), `other_model` (c), `cherry_picked` (d), `copier` (e), `poison` (f).

Measured per run (from the learner's summary.json and metrics.jsonl, the attacker's stdout, and
the final checkpoint):
- `attacker_groups_published`, `attacker_groups_trained` and their ratio `trained_share`;
- `caught`: the learner's record of the ban (reason, evidence, `batches`: the attacker's batches
  it had opened, the failing one included), and `ban_after_s` from the attacker's first publish;
- `honest_flagged`: checks failed, penalties or bans of the honest peers (false positives);
- `greedy_accuracy` of the final checkpoint on 500 fixed prompts, its ratio to the clean run
  with verification on; what the poisoner teaches: `injected_rate`, greedy completions holding a
  bos or pad token, and `injected_prob`, the mean probability of bos right after the answer's
  first digit (where the poisoner puts it);
- `verification`: the summary's per-check counts, spot-check rate achieved and
  `share_of_learner_time` (judged) and `share_of_train_time`.

`slot_picker` (adaptive, not in the default classes) answers honestly but only the seqs whose
prompts it likes, leaving the rest out; its repair server (the reference one) lists the seqs it
left out as unavailable. Within the horizon every publisher keeps, that disowns them, and the
intake catches it past DISOWN_ALLOWANCE (8) of those: about 3 batches for a picker that likes
one slot in five. Until then its batches are honest answers to prompts it chose
(`trained_share` is reported, not judged). `rejoining_slot_picker` samples each picked seq
with that seq's own seed and joins the run again before publishing it (a rejoin once excused
the next gap); it is caught the same way, rejoins or not. `paced_rejoining_slot_picker` keeps
to the learner's join rate, so each of its picks follows a join that went through.

`stale_1`, `stale_5`, `tempered`, `greedy` (adaptive, not in the default classes) pass checks 4
and 5 on any one batch: old weights claimed as the newest with log-probs recomputed under the
claimed weights, a temperature-0.6 sampler, greedy picks. They run the torch engine on a CPU,
so check 6 (echo_node/learner/spot_check.py) replays their noise and proves them once their tokens showed
they draw the assigned noise. For every adaptive class `lies_trained_share_of_all` is judged:
the groups of its lying batches that were trained over all groups trained in the run, <= 0.05
for stale_1 and <= 0.01 for the others (the issue's targets). The learner's `caught` record
names the ids of the caught key's trained groups, which tells a lie from an honest batch (a
stale attacker's batches before it loaded a second version, rotating's first two per key);
what it cannot tell apart counts as a lie (`lying_groups_trained`). `trained_share_of_all`,
every group of its keys, and `lying_batches_to_ban` are reported beside it.

`reordered_copier` (adaptive) copies other peers' groups with their samples reversed, log-probs
nudged and names changed. `rotating` (adaptive) is `other_model` honest for its first 2 batches
under each key, restarted under a new key (a new identity at zero trust) each time the learner
catches it, 5 keys at most: its numbers sum over every key (`keys_caught`,
`lying_batches_to_ban_per_key`).

`other_model_late` and `poison_late` are those attackers honest for their first AFTER = 5
batches: past probation only the spot rate finds them, each lying batch with chance
`verify.spot_rate` (0.1), so the wait is geometric with mean 10 lying batches
(`lying_batches_to_ban`). Not in the default classes: run them with `--classes
other_model_late,poison_late --off no`.

Targets (printed with the results): trained_share <= 0.01 and caught within 2 batches for
fake_rewards, garbage, cherry_picked, copier; other_model and poison caught within the expected
number of batches at the default spot rate (probation checks a new peer's first 2 batches in
full, so a peer that lies from its first batch is expected to be caught on it) and accuracy >=
0.97 of the clean run; no honest peer flagged in any run; verification <= 3 % of learner time.

Pinning on this 2-core machine: the learner on core 0; bootstrap, peers and attacker on core 1.
One JSON object on stdout (and --out FILE); reward over versions, clean vs each attack, with and
without verification, in --png.

    .venv/bin/python -m benchmarks.verification --out benchmarks/results/verification.json \\
        --png benchmarks/results/verification.png
    .venv/bin/python -m benchmarks.verification --classes clean,poison --versions 150 --off no
    .venv/bin/python -m benchmarks.verification --classes clean,stale_1 --off no --versions 60 --key-set 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from echo_node.config import RunConfig
from echo_node.demo import Child, Swarm, _is_ready, _wait_line
from echo_node.learner.checkpoint import CheckpointStore
from echo_node.metrics import read_metrics
from protocol import Identity

CLASSES = ["clean", "fake_rewards", "garbage", "other_model", "cherry_picked", "copier", "poison"]
# The adaptive attacker's classes (not in the default run: `--classes slot_picker --off no`).
ADAPTIVE = ["slot_picker", "rejoining_slot_picker", "paced_rejoining_slot_picker", "stale_1", "stale_5", "tempered", "greedy", "reordered_copier", "rotating"]
# `rotating`: this attacker class, honest for its first ROTATING_AFTER batches under each key,
# restarted under a new key each time the learner catches it, ROTATIONS keys at most.
ROTATING, ROTATING_AFTER, ROTATIONS = "other_model", 2, 5
# Targets on the share of all trained groups that came from an adaptive attacker.
ADAPTIVE_SHARE = {"stale_1": 0.05}
ADAPTIVE_SHARE_DEFAULT = 0.01
# Attackers honest for their first AFTER batches (past probation: only the spot rate finds them).
LATE = {"other_model_late": "other_model", "poison_late": "poison"}
AFTER = 5
EXACT = {"fake_rewards", "garbage", "cherry_picked", "copier"}  # targets: <= 1 % trained, caught within 2 batches
LEARNER_CPUS, OTHER_CPUS = {0}, {1}
RUN_ID = "verify-bench"
EVAL_PROMPTS = 500


NAMES = ["boot", "learner", "peer0", "peer1", "attacker", *(f"attacker{i}" for i in range(1, ROTATIONS))]


def attacker_key(i: int) -> str:
    """The name of the key the attacker uses after `i` bans."""
    return "attacker" if i == 0 else f"attacker{i}"


# Which set of keys the nodes use (`--key-set`). Every run of one invocation has the same keys, so
# the same seqs assign the same prompts and noise in every class: one invocation is one draw of
# them, and a class's numbers from one set can sit far from another's.
KEY_SET = 0


def identity(name: str) -> Identity:
    """Every run's nodes have the same keys, so the same slots assign the same prompts."""
    if KEY_SET == 0:
        return Identity.from_seed(bytes([40 + NAMES.index(name)]) * 32)
    return Identity.from_seed(hashlib.sha256(f"echo-node/verification-keys/{KEY_SET}/{name}".encode()).digest())


def write_keys(keys: Path) -> None:
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in NAMES:
        path = keys / f"{name}.key"
        path.write_bytes(identity(name).seed)
        path.chmod(0o600)


def peer_id(name: str) -> str:
    return identity(name).peer_id


def run_one(root: Path, keys: Path, attack: str, *, verify: bool, versions: int, seconds: float) -> dict[str, Any]:
    runs = root / "runs"
    root.mkdir(parents=True)
    config = root / "run.toml"
    config.write_text(f"[verify]\nenabled = {'true' if verify else 'false'}\n")
    swarm = Swarm(root / "swarm")
    boot = swarm.spawn("bootstrap", ["bootstrap", "--key-file", str(keys / "boot.key")], cpus=OTHER_CPUS)
    try:
        addr = _wait_line(boot, lambda l: "/p2p/" in l, 30, "its address").strip()
        common = ["--bootstrap", addr, "--run-id", RUN_ID, "--runs-dir", str(runs), "--config", str(config)]
        learner = swarm.spawn(
            "learner", ["learn", *common, "--key-file", str(keys / "learner.key"), "--mode", "async", "--staleness", "4",
                        "--max-versions", str(versions), "--seconds", str(seconds)], cpus=LEARNER_CPUS,
        )
        _wait_line(learner, _is_ready, 240, "ready")
        for i in range(2):
            swarm.spawn(f"peer{i}", ["join", *common, "--learner", peer_id("learner"), "--key-file", str(keys / f"peer{i}.key")], cpus=OTHER_CPUS)
        attackers: list[Child] = []

        def spawn_attacker(i: int) -> None:
            how = ([LATE[attack], "--after", str(AFTER)] if attack in LATE else
                   [ROTATING, "--after", str(ROTATING_AFTER)] if attack == "rotating" else [attack])
            name = attacker_key(i)
            attackers.append(swarm.spawn(
                name, [*how, *common, "--learner", peer_id("learner"), "--key-file", str(keys / f"{name}.key")], cpus=OTHER_CPUS,
                module="benchmarks.attackers",
            ))

        if attack != "clean":
            spawn_attacker(0)
        deadline = time.monotonic() + seconds + 300
        while learner.proc.poll() is None and time.monotonic() < deadline:
            # A caught rotating attacker comes back at once under its next key (a new identity).
            if attack == "rotating" and len(attackers) < ROTATIONS and attackers[-1].proc.poll() is None:
                metrics = runs / RUN_ID / "metrics.jsonl"
                current = peer_id(attacker_key(len(attackers) - 1))
                if metrics.exists() and any(r.get("event") == "caught" and r.get("peer") == current for r in read_metrics(metrics)):
                    attackers[-1].proc.terminate()
                    attackers[-1].proc.wait(30)
                    spawn_attacker(len(attackers))
            time.sleep(1.0)
    finally:
        swarm.stop_all()
    run_dir = runs / RUN_ID
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    published = [json.loads(line) for a in attackers for line in a.stdout_path.read_text().splitlines() if line.startswith("{")]
    return measure(attack, verify, summary, records, published, run_dir, keys_used=len(attackers))


def measure(attack: str, verify: bool, summary: dict[str, Any], records: list[dict[str, Any]], published: list[dict[str, Any]],
            run_dir: Path, *, keys_used: int = 1) -> dict[str, Any]:
    honest = {peer_id("peer0"), peer_id("peer1")}
    bad = [peer_id(attacker_key(i)) for i in range(keys_used)]
    caught = [r for r in records if r.get("event") == "caught"]
    trained = summary.get("trained_groups", {})
    result: dict[str, Any] = {
        "attack": attack,
        "verify": verify,
        "versions": summary["versions"],
        "learner_wall_s": summary.get("wall_s"),
        "honest_groups_trained": sum(trained.get(p, 0) for p in honest),
        "honest_flagged": {
            "caught": [r for r in caught if r["peer"] in honest],
            "penalties": {p: n for p, n in summary.get("penalties", {}).items() if p in honest},
            "banned": [p for p in summary.get("banned", []) if p in honest],
        },
        "verification": summary.get("verification"),
        "trained_groups_all": sum(trained.values()),
        "rollouts_dropped": summary.get("rollouts_dropped"),
        "rewards": [(r["version"], r["reward_mean"]) for r in records if r.get("event") == "train"],
        **evaluate(run_dir),
    }
    if attack != "clean":
        groups = sum(p["groups"] for p in published)
        mine = [r for r in caught if r["peer"] in bad]
        lies = [p for p in published if p.get("lying", True)]
        first = min((p["wall"] for p in lies), default=None)
        honest_first = AFTER if attack in LATE else ROTATING_AFTER if attack == "rotating" else 0
        bad_trained = sum(trained.get(p, 0) for p in bad)
        result.update(
            attacker_keys=len(bad),
            attacker_batches_published=len(published),
            attacker_groups_published=groups,
            attacker_groups_trained=bad_trained,
            # Groups of the batches it published lying (the honest first batches left out).
            attacker_lying_groups_published=sum(p["groups"] for p in lies),
            trained_share=round(bad_trained / max(1, groups), 4),
            trained_share_of_all=round(bad_trained / max(1, sum(trained.values())), 4),
            lies_trained=(lies_trained := lying_groups_trained(bad, trained, mine, published)),
            lies_trained_share_of_all=round(lies_trained / max(1, sum(trained.values())), 4),
            caught={k: mine[0][k] for k in ("reason", "evidence", "batches", "version")} if mine else None,
            keys_caught=len({r["peer"] for r in mine}),
            # Of the batches the learner opened up to the ban, how many lied (the honest ones first).
            lying_batches_to_ban=mine[0]["batches"] - honest_first if mine else None,
            lying_batches_to_ban_per_key=[r["batches"] - honest_first for r in mine],
            ban_after_s=round(mine[0]["wall"] - first, 3) if mine and first is not None else None,
        )
    return result


def lying_groups_trained(keys: list[str], trained: dict[str, int], caught: list[dict[str, Any]],
                         published: list[dict[str, Any]]) -> int:
    """The attacker's trained groups that came from batches it published lying. A caught key's
    record names the ids of its last trained groups (TRAINED_IDS_KEPT): those of honest batches
    are left out. Whatever cannot be told apart counts as a lie: a key never caught, trained
    groups beyond the ids named, and any trained after the record."""
    lied = {i for p in published if p.get("lying", True) for i in p.get("ids", ())}
    records = {r["peer"]: r for r in caught}
    total = 0
    for key in keys:
        record = records.get(key)
        if record is None or "trained_recent" not in record:
            total += trained.get(key, 0)
            continue
        named = record["trained_recent"]
        total += sum(1 for i in named if i in lied) + max(0, trained.get(key, 0) - len(named))
    return total


def evaluate(run_dir: Path) -> dict[str, Any]:
    """Greedy accuracy of the final checkpoint, and how many greedy completions carry a bos or pad
    token (what the poisoner teaches)."""
    import random

    import torch

    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import sequence_logprobs
    from echo_node.ml.model import load_checkpoint, load_state_bytes
    from echo_node.policy import learner_policy

    cfg = RunConfig(run_id=RUN_ID)
    policy = learner_policy(cfg)
    blob, version = load_checkpoint(CheckpointStore(run_dir).newest_model())
    load_state_bytes(policy.model, blob)
    tok, task = policy.tokenizer, policy.task
    engine = TorchEngine(policy.model, eos_id=tok.eos_id, pad_id=tok.pad_id)
    prompts = task.sample_prompts(EVAL_PROMPTS, random.Random(10_000))
    with torch.inference_mode():
        gens = engine.generate([tok.encode_prompt(p) for p in prompts], max_new_tokens=task.max_new_tokens, temperature=0.0, top_p=1.0, seed=0)
    texts = [tok.decode(g.completion_ids) for g in gens]
    rewards = task.reward(prompts, texts)
    special = {tok.pad_id, *([tok.bos_id] if tok.bos_id is not None else [])}
    # Where the poisoner puts its token: after the answer's first digit.
    assert tok.bos_id is not None
    with torch.inference_mode():
        lp, _ = sequence_logprobs(
            policy.model, [tok.encode_prompt(p) for p in prompts], [[tok.encode(task.answer(p))[0], tok.bos_id] for p in prompts],
            tok.pad_id, temperature=cfg.sampling.temperature,
        )
    return {
        "checkpoint_version": version,
        "greedy_accuracy": round(sum(rewards) / len(rewards), 4),
        "injected_rate": round(sum(any(i in special for i in g.completion_ids) for g in gens) / len(gens), 4),
        "injected_prob": float(f"{lp[:, 1].exp().mean().item():.3g}"),
    }


def verdict(results: list[dict[str, Any]]) -> dict[str, Any]:
    clean = next((r for r in results if r["attack"] == "clean" and r["verify"]), None)
    base = clean["greedy_accuracy"] if clean else None
    out: dict[str, Any] = {"clean_accuracy": base, "classes": {}}
    for r in results:
        if base:
            r["accuracy_vs_clean"] = round(r["greedy_accuracy"] / base, 4)
        if r["attack"] == "clean" or not r["verify"]:
            continue
        caught = r.get("caught") or {}
        ok = {"caught": bool(caught)}
        if r["attack"] in EXACT:
            ok.update(trained_share=r["trained_share"] <= 0.01, within_2_batches=bool(caught) and caught["batches"] <= 2)
        elif r["attack"] in ADAPTIVE:
            target = ADAPTIVE_SHARE.get(r["attack"], ADAPTIVE_SHARE_DEFAULT)
            ok.update(lies_share_of_all=r["lies_trained_share_of_all"] <= target)
        elif r["attack"] in LATE:
            # Each lying batch is checked with chance spot_rate: the wait is geometric (mean 1 / rate).
            ok.update(accuracy=r.get("accuracy_vs_clean", 0) >= 0.97)
        else:
            ok.update(within_expected=bool(caught) and caught["batches"] <= 2, accuracy=r.get("accuracy_vs_clean", 0) >= 0.97)
        out["classes"][r["attack"]] = ok
    on = [r for r in results if r["verify"]]
    out["honest_false_positives"] = sum(
        len(r["honest_flagged"]["caught"]) + len(r["honest_flagged"]["banned"]) + sum(r["honest_flagged"]["penalties"].values()) for r in on
    )
    # The target is on the learner's time (the docstring's); the share of its train time is reported beside it.
    out["verification_share_max"] = max((r["verification"]["share_of_learner_time"] for r in on if r["verification"]), default=None)
    out["verification_share_of_train_time_max"] = max((r["verification"]["share_of_train_time"] for r in on if r["verification"]), default=None)
    out["all_met"] = (
        all(all(v.values()) for v in out["classes"].values()) and out["honest_false_positives"] == 0
        and (out["verification_share_max"] or 0) <= 0.03
    )
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from echo_node.metrics import _moving_mean

    attacks = [a for a in [*CLASSES, *LATE] if a != "clean" and any(r["attack"] == a for r in results)]
    clean = [r for r in results if r["attack"] == "clean"]
    cols = 3
    rows = max(1, (len(attacks) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), dpi=110, squeeze=False)
    for ax, attack in zip(axes.flat, attacks):
        for r in [*clean, *(r for r in results if r["attack"] == attack)]:
            if not r["rewards"]:
                continue
            xs = [v for v, _ in r["rewards"]]
            ys, _ = _moving_mean([y for _, y in r["rewards"]])
            style = "-" if r["verify"] else "--"
            color = "tab:gray" if r["attack"] == "clean" else ("tab:blue" if r["verify"] else "tab:red")
            ax.plot(xs, ys, style, color=color, linewidth=1.3,
                    label=f"{r['attack']}, verification {'on' if r['verify'] else 'off'}")
        ax.set_title(attack)
        ax.set_xlabel("policy version")
        ax.set_ylabel("mean reward of trained groups")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="lower right")
    for ax in list(axes.flat)[len(attacks):]:
        ax.axis("off")
    fig.suptitle("reward over versions: clean vs each attack, with and without verification")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", default=",".join(CLASSES))
    p.add_argument("--versions", type=int, default=400, help="training steps per run (the same for every run)")
    p.add_argument("--seconds", type=float, default=300.0, help="a run's training time at most")
    p.add_argument("--off", choices=["yes", "no"], default="yes", help="also run each class with verification off")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--key-set", type=int, default=0, help="another set of node keys: another draw of the prompts and noise")
    args = p.parse_args()
    global KEY_SET
    KEY_SET = args.key_set
    classes = [c for c in args.classes.split(",") if c]
    unknown = set(classes) - set(CLASSES) - set(LATE) - set(ADAPTIVE)
    if unknown:
        raise SystemExit(f"unknown classes {sorted(unknown)}; known: {CLASSES + list(LATE) + ADAPTIVE}")
    root = Path(tempfile.mkdtemp(prefix="echo-verify-"))
    keys = root / "keys"
    write_keys(keys)
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the swarm of the run in progress, then report
    try:
        for attack in classes:
            for verify in ([True, False] if args.off == "yes" else [True]):
                run_root = root / f"{attack}-{'on' if verify else 'off'}"
                r = run_one(run_root, keys, attack, verify=verify, versions=args.versions, seconds=args.seconds)
                results.append(r)
                brief = {k: r.get(k) for k in ("versions", "trained_share", "trained_share_of_all", "lies_trained_share_of_all", "greedy_accuracy", "injected_prob")}
                print(f"# {attack} verify={'on' if verify else 'off'}: {brief} caught={(r.get('caught') or {}).get('batches')}",
                      flush=True)
                shutil.rmtree(run_root / "runs", ignore_errors=True)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    report = {
        "benchmark": "verification",
        "key_set": args.key_set,
        "versions_per_run": args.versions,
        "wall_s": round(time.monotonic() - t0, 1),
        "verdict": verdict(results),
        "runs": [{k: v for k, v in r.items() if k != "rewards"} for r in results],
    }
    if args.png:
        plot(results, args.png)
        report["png"] = str(args.png)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
