"""One typed configuration tree for every role, loadable from TOML.

Each component owns a small keyword-only dataclass; `RunConfig` is the tree. `load_config`
accepts a TOML file whose tables mirror the tree (`[rl]`, `[sampling]`, ...) and rejects
unknown keys and wrong types with a `ValueError` that names the key and the remedy, so a typo
in an operator's run file fails at start-up instead of silently running defaults.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from echo_node.ml import defaults as ml_defaults
from protocol.addresses import AddressError, check_announce, check_data_host, parse_tcp_multiaddr
from protocol.identity import is_valid_peer_id
from protocol.limits import MAX_STALENESS, MAX_TEMPERATURE, MAX_TOKENS_PER_SEQUENCE, REPAIR_KEEP
from protocol.weights.overlay import DEFAULT_DEGREE, DEGREE_RANGE

SyncMode = Literal["pull", "async"]
Correction = Literal["tis", "decoupled", "none"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
EngineKind = Literal["torch", "vllm"]
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:[0-9]{1,3})$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(kw_only=True, slots=True)
class NetConfig:
    listen: str = "/ip4/127.0.0.1/tcp/0"
    # The IP address others dial this node at, published with the listen port (and the data
    # port). Default: the listen address, or this machine's interface addresses for 0.0.0.0.
    advertise_host: str | None = None
    # Full multiaddrs to publish instead (port forwards, DNS names); they win over the above.
    announce: list[str] = field(default_factory=list)
    # The TCP port of the weight data channel (0: any free one). Fix it, and open or forward it
    # next to the listen port, for other peers to fetch weights from this node.
    data_port: int = 0
    bootstrap: list[str] = field(default_factory=list)
    # A rollout peer joins only the learner with this peer id (also written as the run address
    # RUN_ID@PEER_ID). Without it, any provider record for the run id may be an impostor.
    learner: str | None = None
    # Without a pin, a peer joins only when exactly one provider of the run answers as its
    # learner, and refuses to choose among several. This joins the first that answers instead,
    # for a demo on one machine, where no other machine can announce the run id: refused unless
    # every bootstrap address (and the learner) is on loopback.
    insecure_first_learner: bool = False
    # A joining peer retries the bootstrap list with exponential backoff until this deadline.
    join_deadline_s: float = 60.0
    # A rollout peer whose learner stops answering keeps its weights and its rollouts not yet
    # delivered, and looks the learner up again (DHT, same peer id; its address may change) with
    # backoff for this long before it gives up.
    learner_outage_s: float = 1800.0
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 4.0
    # The learner is announced on the DHT under the run id; re-announce before records expire.
    provide_interval_s: float = 60.0
    # The learner asks publishers for missing sequence numbers this often.
    repair_interval_s: float = 2.0
    # A rollout peer keeps this many of its last published messages to answer repair requests
    # (at least the wire's REPAIR_KEEP).
    repair_history: int = REPAIR_KEEP
    # Weight versions each node keeps serving on the data channel (relaying, late joiners).
    keep_versions: int = 4
    # The learner takes at most this many joined peers; a join beyond it replaces the peer that
    # joined or delivered least recently if that one is idle, else it is refused as "full".
    max_peers: int = 1024
    # A peer refused this many times (bad rollouts, requests or pieces) is banned for ban_s
    # seconds: its rollouts are dropped unopened, its joins and data connections refused.
    ban_after: int = 3
    ban_s: float = 600.0
    # A private swarm: when not empty, the learner takes joins from these peer ids only.
    allow_peers: list[str] = field(default_factory=list)
    # The learner dials a joiner back (to hand it out as a relay) only at the address its join
    # came from; a loopback, link-local or private one only when the learner has an address of
    # that scope itself. True: private ones always (a LAN swarm behind a public learner address).
    dial_private: bool = False
    # A Prometheus endpoint (GET /metrics) on this port, for operators; None: none. It binds
    # metrics_host, the loopback by default: expose it wider only on a network you trust.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    # A local Hugging Face model directory; None selects the embedded tiny Llama.
    path: str | None = None
    seed: int = 0
    # The rollout dtype: what engines run in and what the learner publishes (a bf16 publication
    # is half the bytes of fp32). auto: bfloat16 on CUDA, float32 on CPU. The learner keeps fp32
    # master weights and optimizer state whatever this says.
    dtype: DType = "auto"
    # Where this node computes: auto (CUDA when there is one), cpu, cuda, cuda:N.
    device: str = "auto"


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    # A built-in task (addition, math) or, with `dataset`, the name of a task read from a file.
    name: str = "addition"
    # A JSONL, Parquet or CSV file with one prompt per row (read with `datasets`).
    dataset: str | None = None
    # The prompt is this column, or `prompt_template` formatted with the row's columns.
    prompt_column: str = "prompt"
    prompt_template: str | None = None
    # Reward functions as "module:function" with TRL's signature
    # (prompts, completions, **columns) -> list[float]; a sample's reward is their weighted sum.
    rewards: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)
    # Bounds of the summed reward; the learner refuses a claimed reward outside them.
    reward_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    # Wrap each prompt in the tokenizer's chat template (a user turn + the generation prompt).
    chat: bool = False


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    # A multi-turn environment (echo_node/envs): a built-in name ("calc") or "module:Class"
    # imported from this node's own Python path. None: the run trains `[task]`, one turn.
    name: str | None = None
    # The environment's own table ([env.options]), passed to its class as keyword arguments.
    options: dict[str, Any] = field(default_factory=dict)
    # Budgets of one episode: model turns, tokens of one model turn, tokens of all turns.
    max_turns: int = 4
    turn_tokens: int = 8
    episode_tokens: int = 64
    # A reset or step that takes longer ends its episode (counted as env_timeout), never the node.
    step_timeout_s: float = 5.0
    # An environment that is not deterministic given (seed, actions) cannot be verified by a
    # re-run; it is refused unless the operator marks it untrusted-only, which needs a private
    # swarm (net.allow_peers).
    untrusted_only: bool = False


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = ml_defaults.RL.temperature
    top_p: float = ml_defaults.RL.top_p
    max_new_tokens: int = 4


@dataclass(kw_only=True, slots=True)
class RLConfig:
    mode: SyncMode = "async"
    # Async admits a rollout whose oldest token has version >= current - staleness.
    staleness: int = 4
    # The ML defaults were measured on the embedded task (echo_node/ml/defaults.py).
    group_size: int = ml_defaults.RL.group_size
    groups_per_step: int = ml_defaults.RL.groups_per_step
    lr: float = ml_defaults.RL.lr
    clip_eps: float = ml_defaults.RL.clip_eps
    max_grad_norm: float = ml_defaults.RL.max_grad_norm
    # Off-policy correction (echo_node/ml/grpo.py): truncated IS, AReaL's decoupled PPO, or none.
    correction: Correction = "tis"
    # Importance weights pi_learner / pi_behaviour are truncated at this cap.
    is_cap: float = 2.0
    # Optimizer steps per update (decoupled PPO's clip only matters from the second one on).
    minibatches: int = 1
    # Replay-buffer capacity in groups and in (estimated) bytes; on overflow the oldest group of
    # the peer holding the most is dropped as "overload".
    buffer_groups: int = 256
    buffer_bytes: int = 64 << 20
    # async: an update takes up to this share of groups_per_step more groups when more than a
    # step's worth would otherwise expire before a later update could take them (a peer's
    # batches begun on the same weights arrive and expire together; measurements in
    # benchmarks/results/measurements.md). Such a step costs up to 1 + this share of a step's
    # memory and time; 0 never enlarges a step (a GPU sized to a step exactly).
    rescue_share: float = 1.0
    # async: the learner publishes (snapshots, hashes, announces and serves) every k-th version
    # only. Versions still count every update, so staleness is measured as before; a peer's
    # weights are up to k - 1 versions older. Pull needs every version (k = 1), and k <= S
    # keeps a peer's newest weights admissible. k <= S - 2 is better: a rollout begun on the
    # previous published weights (its oldest token counts) then stays admissible until the
    # peer's first rollouts on the new ones arrive; at k = S - 1 the learner waits for data
    # right before each publication.
    publish_every: int = 1
    # Let the capacity model choose publish_every (κ): S - 1 while broadcasts take less than an
    # update, else the largest κ whose worst-case staleness stays within S (with a warning).
    publish_auto: bool = False


@dataclass(kw_only=True, slots=True)
class WarmupConfig:
    enabled: bool = True
    cache_dir: Path = Path.home() / ".cache" / "echo-node"


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    # The generation engine: torch (CPU or CUDA, any HF causal LM) or vllm (CUDA; the extra
    # `echo-node[vllm]`).
    engine: EngineKind = "torch"
    # What the operator pays for this peer per hour (0: a volunteer); told to the learner in
    # every heartbeat, where the capacity controller ranks peers by price per rollout/s.
    price_per_hour: float = 0.0
    # Groups generated per engine call; a pull-mode peer refreshes weights between calls. One
    # call makes one update's worth (rl.groups_per_step) and one gossip message: the learner pays
    # py-libp2p's per-message cost on its own core, so fewer, larger messages make faster updates.
    groups_per_batch: int = 8


@dataclass(kw_only=True, slots=True)
class VerifyConfig:
    # The learner's checks of what peers claim (echo_node/learner/spot_check.py); a batch that fails one
    # bans its publisher for `ban_versions` versions and purges its buffered groups.
    # Every batch: completions end at eos, prompts are the ones their slots assign, rewards are
    # the run's. Off (and every check with it) only to measure what verification buys.
    enabled: bool = True
    # Log-prob spot checks: the learner recomputes the behaviour log-probs of a group's tokens
    # under the versions they claim and tests that they were sampled at the run's temperature.
    logprobs: bool = True
    # Share of batches spot-checked, chosen unpredictably; a peer's first `probation_batches`
    # batches, and its next ones after any refused message, all are. Past probation a peer's
    # batches are checked with chance trust_tokens / (tokens of its that passed checks), never
    # below spot_rate: trust is earned by checked work, slowly, not by two honest batches.
    spot_rate: float = 0.1
    probation_batches: int = 2
    trust_tokens: int = 4096
    # Spot checks take at most this share of the learner's wall time: each checks a random
    # subset of its batch's rows, as many as the budget affords (at least `min_rows`, for a
    # batch on probation too), and a batch the budget cannot afford is not checked unless its
    # publisher is on probation (counted as `over_budget`).
    budget: float = 0.05
    # 16: a forger of half its rows slips past one check with chance C(16, 16) / C(32, 16) ~ 2e-9
    # in a batch of 32 rows, past a 2-row check 1 time in 4; a row costs ~0.15 CPU-s on
    # SmolLM2-135M in float32, so a newcomer's first batch waits ~2.4 s.
    min_rows: int = 16
    # The spot checker recomputes log-probs over the published weights in this dtype: "auto" is
    # float32 on a CPU (bf16 is emulated there, ~4x slower, and rounds on both sides of the
    # comparison) and the rollout dtype on a GPU.
    check_dtype: Literal["auto", "float32", "rollout"] = "auto"
    # Claimed vs recomputed log-probs are judged against the envelope measured for the peer's
    # (engine, device, dtype) (echo_node/learner/calibration.py): a token's gap may reach
    # `lp_max_factor` times the largest honest gap measured; the mean gap over the checked
    # tokens of a version may exceed the honest mean by `lp_mean_z` standard errors (of a mean
    # over the groups they come from: gaps within a group are correlated). A peer on a pair
    # never measured is judged by a wider envelope and warned about, not banned, in between.
    # Set lp_tolerance_max / lp_tolerance_mean to fix the limits by hand instead.
    lp_max_factor: float = 4.0
    lp_mean_z: float = 6.0
    lp_tolerance_max: float | None = None
    lp_tolerance_mean: float | None = None
    # Chance an honest peer fails the sampling checks: per token for "improbable token", per
    # checked batch for "not sampled at the run's temperature" (e.g. greedy).
    false_alarm: float = 1e-9
    ban_versions: int = 1000
    # A step takes at most this share of its groups from one peer while others have admissible
    # ones: what an attacker not caught yet can move the policy by.
    max_peer_share: float = 0.5
    # Publishers not proven yet (their checked tokens below trust_tokens and, on a replayable
    # engine, their noise not proven: echo_node/learner/spot_check.py) together weigh at most this share of
    # a full step, even when nobody else has data (loss weights and a scaled learning rate:
    # echo_node/learner/replay.py); their groups take at most this share of a step's slots, and one
    # slot each, while proven publishers have groups.
    unproven_share: float = 0.25
    # ... and beside proven publishers' groups, one not proven yet has at most this many of its
    # groups trained in all until it is proven: an attacker whose lies only evidence pooled over
    # batches exposes (a sharper sampler, chosen slots) would otherwise train one group a step
    # until then. Alone (no proven group in a step) they fill it past that only while they owe,
    # skipped and disowned none of their seqs: a publisher that chose its slots waits for its proof.
    unproven_groups: int = 2


@dataclass(kw_only=True, slots=True)
class CapacityConfig:
    # ECHO-2's cost-aware activation (echo_node/learner/capacity_controller.py): the learner measures each peer's
    # throughput, its own step time and the broadcast time, and keeps the cheapest set of peers
    # active whose throughput covers gamma x what keeps it busy; the others stand by (they follow
    # weights and generate nothing). Off: every peer is active.
    enabled: bool = True
    gamma: float = 1.1
    # Decisions on a slow tick, and releases only past this margin above the target: no churn.
    tick_s: float = 30.0
    release_margin: float = 0.25
    # Peers' throughput is measured over this window (accepted rollouts per second, smoothed).
    window_s: float = 60.0
    # A learner that has waited this long for rollouts wakes every standby peer, and none is put
    # back on standby until it trains again and tick_s has passed: the measured rates overstate
    # what arrives (a pool that covers the target keeps it busy), e.g. free identities that
    # delivered a burst and went silent. 10 s: a third of tick_s, so Sybils that win a standby
    # decision idle the learner at most this long per tick; a wake on a hiccup costs only the
    # standby peers' price for about a tick. inf: never wake.
    wake_after_s: float = 10.0


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    # The learner checkpoints (model, optimizer, ledger, peer tables: echo_node/learner/checkpoint.py)
    # every this many versions but no sooner than `min_interval_s` after the last one, when its
    # journal passes `max_journal_bytes`, and when it stops. A restart redoes the steps since the
    # last checkpoint from the journal: at most about max(every_versions steps, min_interval_s)
    # of training. A checkpoint a second (a small model's 20 versions) took 20 % of the learner's
    # throughput, in a worker thread or not.
    every_versions: int = 20
    min_interval_s: float = 60.0
    # Checkpoints kept; a corrupt newest one falls back to the one before.
    keep: int = 3
    # Accepted rollouts reach the journal's disk at least this often (steps and publications
    # before the version is announced, whatever this says).
    journal_flush_s: float = 0.5
    max_journal_bytes: int = 64 << 20
    # With every checkpoint, also write runs/<id>/model/: the policy as a save_pretrained
    # directory (rollout dtype, with its tokenizer) that transformers and vLLM load as is.
    export: bool = True


ReportTo = Literal["none", "tensorboard", "wandb"]


@dataclass(kw_only=True, slots=True)
class ReportConfig:
    """What the learner tells its operator while it runs (echo_node/learner/report.py)."""

    # A progress line at INFO every this many seconds (0: none): version, updates/s, rewards,
    # rollouts accepted and dropped in the window, idle, staleness, peers, bytes out.
    progress_s: float = 10.0
    # Held-out evaluation (echo_node/learner/evaluation.py): greedy accuracy on `eval_prompts` fixed
    # prompts of the task every `eval_every` versions, in a worker thread (0: none).
    eval_every: int = 20
    eval_prompts: int = 64
    # Experiment tracking, TRL's `report_to`: the train, eval and progress scalars also go to
    # TensorBoard event files or a W&B run (runs/<id>/tracking/), as in metrics.jsonl.
    report_to: ReportTo = "none"
    # W&B's mode: "offline" writes the run locally (`wandb sync` uploads it later), so nothing
    # needs the network; "online" needs a login.
    wandb_mode: Literal["offline", "online"] = "offline"


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    # How versions travel among peers: "push" (every peer linked to every other, pieces relayed
    # one hop: echo_node/weights/broadcast.py), "mesh" (the bounded-degree overlay below, pieces
    # exchanged over many hops: echo_node/weights/mesh.py), or "auto": the mesh, whatever the
    # run's size (on home uplinks it is nearer its bound than push at 3 and 8 peers, and level
    # with it on symmetric links).
    exchange: Literal["auto", "push", "mesh"] = "auto"
    # Data links each peer keeps (k), chosen by the learner (protocol/weights/overlay.py); a
    # swarm of at most k + 1 peers is a full mesh. Allowed: overlay.DEGREE_RANGE.
    degree: int = DEFAULT_DEGREE
    # Peers the learner itself sends pieces to, rotated `source_rotate` at a time per version.
    source_degree: int = 32
    source_rotate: int = 2
    # A member counts as settled (may fill the first half of a newcomer's links) this long
    # after it joined: a burst of identities cannot surround the next newcomer.
    settle_s: float = 60.0
    # Share of the overlay's links rewired per version (slow rotation).
    rotate_share: float = 0.02


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_id: str = "default"
    task: TaskConfig = field(default_factory=TaskConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    runs_dir: Path = Path("runs")
    # Torch intra-op threads for this process. Oversubscribing the cores is the largest slowdown
    # on this platform (docs/platform.md), so every process sets it explicitly.
    threads: int = 1
    seed: int = 0
    # The learner stops after this much RL time (None: run until interrupted).
    seconds: float | None = None
    max_versions: int | None = None
    net: NetConfig = field(default_factory=NetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_id


def validate(cfg: RunConfig) -> None:
    """Raise ValueError, with the remedy, for a config no role can run with."""
    if not _RUN_ID.fullmatch(cfg.run_id):  # fullmatch: "$" alone also matches before a final newline
        raise ValueError(
            f"run id {cfg.run_id!r} is invalid: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    if cfg.threads < 1:
        raise ValueError(f"threads must be >= 1, got {cfg.threads}")
    rl = cfg.rl
    if rl.mode not in ("pull", "async"):
        raise ValueError(f"rl.mode must be 'pull' or 'async', got {rl.mode!r}")
    if not 0 <= rl.staleness <= MAX_STALENESS:
        raise ValueError(f"rl.staleness must be in 0..{MAX_STALENESS}, got {rl.staleness}")
    if not 2 <= rl.group_size <= 64:
        raise ValueError(f"rl.group_size must be in 2..64 (GRPO needs a group), got {rl.group_size}")
    if rl.groups_per_step < 1 or rl.buffer_groups < rl.groups_per_step:
        raise ValueError("rl.groups_per_step must be >= 1 and <= rl.buffer_groups")
    if not rl.lr > 0 or not 0 < rl.clip_eps < 1:
        raise ValueError("rl.lr must be > 0 and rl.clip_eps in (0, 1)")
    if rl.publish_every < 1:
        raise ValueError(f"rl.publish_every must be >= 1, got {rl.publish_every}")
    if rl.publish_every > 1 and (rl.mode == "pull" or rl.publish_every > rl.staleness):
        raise ValueError(
            f"rl.publish_every = {rl.publish_every} needs async mode with staleness >= it (got mode "
            f"{rl.mode!r}, staleness {rl.staleness}): a peer's newest weights would be too old to train on"
        )
    if not 0 <= rl.rescue_share <= 4:
        raise ValueError(f"rl.rescue_share must be in 0..4, got {rl.rescue_share}")
    if rl.buffer_bytes < 1 << 20:
        raise ValueError(f"rl.buffer_bytes must be >= 1 MiB, got {rl.buffer_bytes}")
    v = cfg.verify
    if (not 0 < v.max_peer_share <= 1 or not 0 < v.unproven_share <= 1 or not 0 <= v.spot_rate <= 1 or v.probation_batches < 0 or v.ban_versions < 1
            or v.trust_tokens < 0 or v.unproven_groups < 0):
        raise ValueError("verify needs 0 < max_peer_share <= 1, 0 < unproven_share <= 1, 0 <= spot_rate <= 1, probation_batches >= 0, ban_versions >= 1, "
                         "trust_tokens >= 0, unproven_groups >= 0")
    if not (v.lp_max_factor >= 1 and v.lp_mean_z > 0 and 0 < v.false_alarm < 1):
        raise ValueError("verify needs lp_max_factor >= 1, lp_mean_z > 0 and false_alarm in (0, 1)")
    if any(t is not None and not t > 0 for t in (v.lp_tolerance_max, v.lp_tolerance_mean)):
        raise ValueError("verify.lp_tolerance_max and lp_tolerance_mean must be > 0 when set")
    if not 0 < v.budget <= 1 or v.min_rows < 1:
        raise ValueError(f"verify needs 0 < budget <= 1 and min_rows >= 1, got {v.budget} and {v.min_rows}")
    if not rl.is_cap > 0 or rl.minibatches < 1:
        raise ValueError(f"rl.is_cap must be > 0 and rl.minibatches >= 1, got {rl.is_cap} and {rl.minibatches}")
    s = cfg.sampling
    if not 0 < s.temperature <= MAX_TEMPERATURE or not 0 < s.top_p <= 1 or not 1 <= s.max_new_tokens <= MAX_TOKENS_PER_SEQUENCE:
        raise ValueError(
            f"sampling needs 0 < temperature <= {MAX_TEMPERATURE:g}, 0 < top_p <= 1, 1 <= max_new_tokens <= {MAX_TOKENS_PER_SEQUENCE}"
        )
    if cfg.seconds is not None and cfg.seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {cfg.seconds}")
    c = cfg.checkpoint
    if (c.every_versions < 1 or c.keep < 1 or not 0 < c.journal_flush_s <= 60 or c.max_journal_bytes < 1 << 20
            or not 0 <= c.min_interval_s <= 86400):
        raise ValueError(
            "checkpoint needs every_versions >= 1, 0 <= min_interval_s <= 86400, keep >= 1, 0 < journal_flush_s <= 60 "
            "and max_journal_bytes >= 1 MiB"
        )
    m = cfg.model
    if not _DEVICE.fullmatch(m.device):
        raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, got {m.device!r}")
    t = cfg.task
    if t.reward_weights and len(t.reward_weights) != len(t.rewards):
        raise ValueError(f"task.reward_weights has {len(t.reward_weights)} entries for {len(t.rewards)} task.rewards")
    if len(t.reward_range) != 2 or not t.reward_range[0] < t.reward_range[1]:
        raise ValueError(f"task.reward_range must be [low, high] with low < high, got {t.reward_range}")
    if t.dataset is None and (t.rewards or t.prompt_template):
        raise ValueError("task.rewards and task.prompt_template need task.dataset (a built-in task has its own)")
    _validate_env(cfg)
    cap = cfg.capacity
    if not (cap.gamma >= 1 and cap.tick_s > 0 and cap.release_margin >= 0 and cap.window_s > 0):
        raise ValueError("capacity needs gamma >= 1, tick_s > 0, release_margin >= 0 and window_s > 0")
    if not 0 <= cfg.rollout.price_per_hour <= 1e6:
        raise ValueError(f"rollout.price_per_hour must be in [0, 1e6], got {cfg.rollout.price_per_hour}")
    w = cfg.weights
    lo, hi = DEGREE_RANGE
    if w.exchange not in ("auto", "push", "mesh"):
        raise ValueError(f"weights.exchange must be auto, push or mesh, got {w.exchange!r}")
    if not (lo <= w.degree <= hi and 1 <= w.source_degree <= 1024 and 0 <= w.source_rotate <= w.source_degree
            and 0 <= w.settle_s <= 86400 and 0 <= w.rotate_share <= 1):
        raise ValueError(
            f"weights needs {lo} <= degree <= {hi}, 1 <= source_degree <= 1024, 0 <= source_rotate <= source_degree, "
            f"0 <= settle_s <= 86400 and 0 <= rotate_share <= 1 (got {w.degree}, {w.source_degree}, {w.source_rotate}, "
            f"{w.settle_s}, {w.rotate_share})"
        )
    r = cfg.report
    if r.progress_s < 0 or r.eval_every < 0 or r.eval_prompts < 0:
        raise ValueError("report needs progress_s >= 0, eval_every >= 0 and eval_prompts >= 0 (0 turns either off)")
    validate_net(cfg.net)


def _validate_env(cfg: RunConfig) -> None:
    e = cfg.env
    if not isinstance(e.options, dict) or not all(isinstance(k, str) for k in e.options):
        raise ValueError("env.options must be a table of named values")
    if not (1 <= e.max_turns <= 64 and 1 <= e.turn_tokens <= MAX_TOKENS_PER_SEQUENCE and 1 <= e.episode_tokens <= MAX_TOKENS_PER_SEQUENCE):
        raise ValueError(f"env needs 1 <= max_turns <= 64 and 1 <= turn_tokens, episode_tokens <= {MAX_TOKENS_PER_SEQUENCE}")
    if not 0 < e.step_timeout_s <= 3600:
        raise ValueError(f"env.step_timeout_s must be in (0, 3600], got {e.step_timeout_s}")
    if e.untrusted_only and not cfg.net.allow_peers:
        raise ValueError("env.untrusted_only needs a private swarm: list the trusted peers in net.allow_peers")


def validate_net(net: NetConfig) -> None:
    try:
        listen = parse_tcp_multiaddr(net.listen)
        if listen.proto not in ("ip4", "ip6") or listen.peer_id:
            raise AddressError(f"{net.listen!r}: listen on /ip4/ADDRESS/tcp/PORT or /ip6/ADDRESS/tcp/PORT")
        if net.advertise_host is not None:
            check_data_host(net.advertise_host, where="net.advertise_host")
        for text in net.announce:
            check_announce(text)
    except AddressError as exc:
        raise ValueError(str(exc)) from None
    if net.metrics_port is not None and not 0 <= net.metrics_port <= 65535:
        raise ValueError(f"net.metrics_port must be a TCP port (0 for any), got {net.metrics_port}")
    if not 0 <= net.data_port <= 65535:
        raise ValueError(f"net.data_port must be a TCP port (0 for any), got {net.data_port}")
    bad = [p for p in net.allow_peers if not is_valid_peer_id(p)]
    if bad:
        raise ValueError(f"net.allow_peers: {bad[0]!r} is not a libp2p Ed25519 peer id (12D3KooW...)")
    if net.learner is not None and not is_valid_peer_id(net.learner):
        raise ValueError(f"net.learner {net.learner!r} is not a libp2p Ed25519 peer id (12D3KooW...)")
    if net.repair_history < REPAIR_KEEP:
        raise ValueError(f"net.repair_history must be >= {REPAIR_KEEP} (the wire's promise to answer repair for the last "
                         f"{REPAIR_KEEP} batches), got {net.repair_history}")
    if not net.learner_outage_s > 0:
        raise ValueError(f"net.learner_outage_s must be > 0, got {net.learner_outage_s}")
    if net.max_peers < 1 or net.ban_after < 1 or not net.ban_s >= 0:
        raise ValueError(f"net.max_peers and net.ban_after must be >= 1, net.ban_s >= 0 (got {net.max_peers}, {net.ban_after}, {net.ban_s})")


def load_config(path: Path | None = None, **overrides: Any) -> RunConfig:
    """Build the tree from an optional TOML file, then apply dotted overrides from the CLI.

    `overrides` uses double underscores for nesting (`rl__mode="pull"`); None values are
    ignored so that unset CLI flags keep the file's values.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    # `task = "addition"` (and `--task addition`) name a built-in task: the table's name.
    if isinstance(data.get("task"), str):
        data["task"] = {"name": data["task"]}
    # A run address RUN_ID@PEER_ID pins the learner; an explicit net.learner must agree.
    run = data.get("run_id")
    if isinstance(run, str) and "@" in run:
        data["run_id"], pin = run.split("@", 1)
        net = data.setdefault("net", {})
        if net.get("learner") not in (None, pin):
            raise ValueError(f"run address {run!r} names learner {pin}, but net.learner is {net['learner']}")
        net["learner"] = pin
    return _build(RunConfig, data, "")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"[{prefix.rstrip('.')}] must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(prefix + u for u in unknown)}; "
            f"known keys here: {', '.join(sorted(known))}"
        )
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, name: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, name + ".")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, name)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{name} must be one of {typing.get_args(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, name) for v in value]
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ValueError(f"{name} must be a path string")
        return Path(value).expanduser()
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ValueError(f"{name} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able view of the tree (for logs and the run folder)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else (str(v) if isinstance(v, Path) else v)
    return out
