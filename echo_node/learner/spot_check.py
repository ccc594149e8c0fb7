"""What the learner re-checks of a peer's claims before training on them: a ladder of checks.

Every batch, on arrival (cheap, in the gossip validator), group by group:
1. `completion`: nothing follows an eos. The task scores the text the tokenizer decodes, which
   stops at eos, so tokens after it would be trained on unscored (an injected string riding on
   a correct answer); no engine samples past eos.
2. `prompt`: the group's prompt is the one its slot assigns (protocol/assignment.py), encoded as
   the run encodes prompts; its samples all began on one version (the slot's).
3. `reward`: every completion re-scored with the run's reward function; a claim further than
   REWARD_TOLERANCE from the learner's score fails.

Spot checks (every batch of a peer on probation, then a share of batches chosen unpredictably
that falls with the tokens of the peer's that passed checks: `check_rate`; in a worker thread,
before the batch reaches the buffer; an episode batch's after its re-run, each episode one row
whose environment tokens carry no claim: `EpisodeRow`), on a random subset of the batch's rows
as large as `verify.budget` affords, per version its tokens claim, with that version's weights
(computed in float32 on a CPU: `check_dtype`):
4. `logprobs`: the claimed behaviour log-probs are what those weights give at the run's
   temperature, within the envelope measured for honest peers of the publisher's (engine,
   device, dtype) (echo_node/learner/calibration.py): per token, and on average over the checked tokens
   of a version. A pair never measured is refused only far outside every envelope measured and
   warned about in between. (b) Small batches pooled: over a publisher's checked tokens,
   prod (1 + gap / mu) / 2 with mu = GAP_MARGIN x the envelope's mean gap is a test
   supermartingale while its gaps have mean at most mu (each factor is >= 1/2 and has mean
   <= 1), kept per publisher as an e-CUSUM like 5(b) and failed at 1 / `false_alarm`: a nudge
   of every log-prob below what one small batch's mean test allows (mean + z sd / sqrt(k)
   for its k groups: `independent_units`) passes each batch alone and is caught pooled.
5. `sampling`: the tokens were sampled as the run samples (temperature, nucleus), q being that
   distribution. (a) No token an honest sampler draws with q below `false_alarm` / V: tokens of
   q <= eps together are drawn with probability at most V * eps. (b) Over a publisher's checked
   tokens, neither less likely than sampling gives (a prefilled answer, another model's
   tokens) nor more (greedy picks, a lowered temperature): each is a test martingale
   prod q(token)^a / E_q[q^a] (a = -1/2, a = 1) with mean 1 under honest sampling. A check of a
   few random rows sees too few tokens to convict a weak bias alone, so evidence accumulates
   per publisher across its checked batches as an e-CUSUM: S = max(0, S + log e of the batch),
   failed when S reaches log(1 / `false_alarm`). Restarting at 0 is starting a new martingale
   at 1, so by Ville's inequality an honest publisher fails within n checks with chance at most
   n * `false_alarm` (1e-9 per check by default), and a biased one cannot bank its honest
   batches against a later bias. (c) An old version claimed as the newest: over a publisher's
   checked tokens of version v, prod q_u(token) / q_v(token) with u the newest version kept
   below v (one more forward, under u's weights) has mean at most 1 under honest sampling from
   q_v, and grows on tokens sampled from u or older: a third e-CUSUM, the same threshold. It is
   skipped for a publisher check 6 already proved to draw the assigned noise (the replay
   judges it token by token).
6. `replay` (a proof of version and sampler, where the publisher's engine can be replayed):
   the torch engine on a CPU draws each token as argmax_y q(y) / E_y, E_y ~ Exp(1) from a CPU
   generator seeded with the batch's assigned seed (`batch_seed`: torch.multinomial's
   exponential race), one [rows, V] draw per decoding step. The checker draws the same noise
   and, for every checked token, asks whether the token wins the race under the claimed
   version's q: deficit = max_y (log q(y) - log E_y) - (log q(x) - log E_x), 0 for an honest
   token up to rounding (at most twice the largest per-token gap measured for its pair, times
   `lp_max_factor`, without check 4's floor: a token's score can be off by its own rounding and
   the winner's, and no near-tie makes it more). Whether the publisher
   draws our noise at all is itself tested: a token that wins our race although drawn with
   other noise does so with chance c = sum_y q(y)^2, so prod (1[won] / c + 1) / 2 over its
   checked tokens is a test martingale for "other noise" (an honest peer on another build,
   vLLM, a GPU); once it passes 1 / `false_alarm` the publisher provably draws our noise,
   and from then on any token losing the race by more than the rounding limit proves that it
   sampled from another distribution than the claimed version's at the run's temperature:
   an old version claimed as new, a lowered temperature, greedy picks. Replayable engines:
   `REPLAYABLE` ((torch, cpu), as the heartbeat claims); every other engine (vLLM, torch on
   CUDA, whose generators draw other noise) is judged by the statistics of check 5 only, and
   so is a publisher that never draws our noise (a forger using other seeds buys that).
   Drawing the noise costs rows x V x steps exponentials, charged to the budget like the
   forward: a replay the credit cannot afford is skipped (`replay_over_budget`).

Audits of training (free): where the weights a step trains are exactly the published ones (the
rollout dtype is float32, one process, no autocast), the step's own forward gives the learner's
log-probs of every token sampled on the current version; `audit` judges each trained group's
on-policy tokens by the same envelope as check 4. It comes after the step (the group is trained
already), so it bans and purges what is left, as a spot check does; it covers every on-policy
token of every trained group (all of them in pull mode) and costs nothing.

A version whose weights the learner no longer keeps cannot be spot-checked; such tokens are
counted (`unverifiable_tokens`), not failed. A batch is signed by its publisher, so one failed
group fails the batch; the intake then bans the publisher and purges its buffered groups.

Budget: checks cost CPU seconds (of the checking thread), and the checks the budget chooses may
take `verify.budget` of the learner's wall time since it started. A batch chosen for a check
gets as many rows as the credit left affords at the measured cost per row, at least `min_rows`;
a batch chosen while the credit does not afford `min_rows` is not checked (`over_budget`),
unless its publisher is on probation or still earning trust (`earning`: not proven, or checked
with a chance above EARNING_RATE): then `min_rows` rows are checked whatever the credit, so a
newcomer's first update waits for a small check, never a whole batch's, and a publisher honest
until proven meets a check on its first lie however busy the checker is kept. Those checks are
not refused for want of credit, so they spend only the credit there is: charged in full, Sybils
on probation drove the credit below zero, and every proven publisher's chosen batch then went
unchecked for 1/budget seconds per CPU-second their checks cost (20 s at 5 %), long after the
Sybils were gone. Not charged at all, the budget's own checks kept the checker so busy that
honest newcomers' batches found no room to wait and were dropped (`unchecked`). What stays
possible: a flood of fresh identities keeps the credit at zero while it lasts. Rows are drawn
uniformly at random (the publisher cannot tell which), so a forger who forges a share f of its
rows is caught per checked batch with chance at least 1 - (1 - f)^rows.

Unproven publishers (`proven`): a publisher is proven once `trust_tokens` of its tokens passed
checks, or a quarter of that (`NOISE_TRUST`) once check 6 proved that it draws the assigned
noise (from then on every checked token of its is judged exactly). Until then every batch of it
is checked, every row of it (at most UNPROVEN_ROWS) whatever the credit: a bias that only
pooled evidence proves (a lowered temperature, an old version, greedy picks) is caught after as
many batches as its evidence needs, and until then it trains a group of every step, so each
batch of evidence saved is steps it does not train. The price: a Sybil's batch costs the
checker up to UNPROVEN_ROWS rows instead of `min_rows` (the checker's queue is bounded either
way: `BESIDE_WAITING`). Past that, until its check rate is down to EARNING_RATE every batch
chosen for a check is checked: the budget does not excuse one (it gets `min_rows` rows whatever
the credit), and the intake drops one that finds no room to wait for a busy checker as
`unchecked` rather than train it unchecked. Its groups also weigh less in a step
(`verify.unproven_share`, echo_node/learner/replay.py). A refused message starts trust over;
noise evidence is kept.

Copies (`Copies`, in the intake's consumer): a group whose prompt and completions another
publisher sent first is dropped as `copied`; the first publisher keeps credit. The fingerprint is
over the prompt's tokens and the multiset of completions' tokens: reordering the samples or
perturbing what a copier can freely change (log-probs, rewards, version tags, the group's name)
makes the same fingerprint. One copy is not a strike: two honest peers can be assigned one prompt
and sample the same completions (in a small task's swarm, dozens of times a minute). A copy
counts against its sender only when sampling that multiset again was implausible: below
PLAUSIBLE_COPY by the first publisher's own log-probs (the multinomial chance n! / prod k_i! *
prod p_i^k_i, p_i the chance of completion i). Every COPIES_PER_STRIKE such copies are a strike.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from echo_node.config import VerifyConfig
from echo_node.envs.train import flatten
from echo_node.learner.calibration import Judgement, Tolerance, judgement
from echo_node.ml.engine import top_p_filter
from echo_node.ml.grpo import completion_log_softmax
from echo_node.ml.model import copy_model, load_state_tensors, state_tensors
from echo_node.ml.tasks import Task
from echo_node.ml.tokenizer import Tokenizer
from protocol._wire import pack
from protocol.assignment import batch_seed, group_version, prompt_draw
from protocol.drops import DropReason
from protocol.episodes import Episode, EpisodeBatch
from protocol.messages import RolloutBatch, RolloutGroup, Sample

log = logging.getLogger(__name__)

V = TypeVar("V")

# Rewards travel as float64; a reward function is deterministic, so only float noise separates
# an honest claim from the learner's own score.
REWARD_TOLERANCE = 1e-6
CHECKS = ("completion", "prompt", "reward", "logprobs", "sampling")
# (engine, device type) pairs whose sampling noise the checker draws again (check 6).
REPLAYABLE = frozenset({("torch", "cpu")})
# Peers whose probation state is kept (least recently seen forgotten first: it starts over).
MAX_TRACKED_PEERS = 65536
# Group fingerprints kept for copy detection.
COPY_WINDOW = 65536
# Implausible copies (below PLAUSIBLE_COPY, module docstring) a publisher may send before it
# gets a strike.
COPIES_PER_STRIKE = 3
PLAUSIBLE_COPY = 1e-6
# A spot check's forward holds rows x completion tokens x vocabulary log-probabilities (and a few
# copies of them: tempering, the nucleus, the sampling tests): rows go through in forwards of
# at most this many, so checking a batch costs bounded memory whatever its size (a 194-group
# batch of a 49,152-token vocabulary at 48 tokens in one forward would take ~14 GB).
SPOT_CHUNK_ELEMENTS = 1 << 24
# ... and of at most this many rows: the forward's activations grow with rows x tokens x width,
# whatever the vocabulary (a 1,552-row batch of the toy grew the learner by ~100 MB at once).
SPOT_CHUNK_ROWS = 64
# Check 4(b) takes honest peers' mean log-prob gap to be at most this many times the envelope's
# mean (a run's prompts and model may round a little differently from the ones measured).
GAP_MARGIN = 2.0
# The rows of an unproven publisher's batch every check of it covers (all of a batch up to this).
UNPROVEN_ROWS = 64
# A publisher whose noise is proven is proven once trust_tokens / NOISE_TRUST of its tokens passed.
NOISE_TRUST = 4
# Check 6 keeps -log E in float16: a stored value is within NOISE_ULP of itself (the relative
# rounding of float16's 11-bit significand) plus NOISE_SUBNORMAL (its smallest step) of the drawn one.
NOISE_ULP = 2.0**-11
NOISE_SUBNORMAL = 2.0**-24
# The measured cost per checked row follows new checks with this weight (they vary with length).
COST_EWMA = 0.3
# A publisher checked with more than this chance (fewer than twice `trust_tokens` of its tokens
# passed) is still earning trust (`Verifier.earning`): its batches chosen for a check are checked
# whatever the budget. Below it, the budget rules again: checking every chosen batch until the
# rate reaches `spot_rate` costs several times the budget on a young swarm.
EARNING_RATE = 0.5


class Grouped(Protocol):
    """What the checks read of a group: a `RolloutGroup` or an `EpisodeGroup`."""

    @property
    def group_id(self) -> str: ...

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


class Row(Protocol):
    """What the checks read of one row: a `Sample`, or an episode as an `EpisodeRow`. A token
    whose version is None carries no claim and is never judged."""

    @property
    def completion_ids(self) -> tuple[int, ...]: ...

    @property
    def behaviour_logprobs(self) -> tuple[float, ...]: ...

    @property
    def token_versions(self) -> Sequence[int | None]: ...


def independent_units(rows: Sequence[tuple[Grouped, Row]], version: int) -> float:
    """How many independent measurements the mean log-prob gap of `rows`' tokens tagged
    `version` is worth (echo_node/learner/calibration.py: the mean's limit): the groups' Kish
    effective number, (sum n_g)^2 / sum n_g^2 over their token counts n_g. A group's gaps are
    not independent draws from the envelope: its rows share a prompt, every position's rounding
    depends on the context before it, and the level depends on the content (a run's prompts and
    an environment's turns round differently from the ones measured), so an honest group's mean
    can sit many per-token standard errors from the envelope's mean. Groups answer independently
    drawn slots. The variance of a mean of correlated gaps is at most the per-token variance, so
    the token-weighted mean of k groups' gaps has a standard error of at most sd / sqrt(Kish k),
    whatever the correlation inside them."""
    per: dict[int, int] = {}
    for g, s in rows:
        per[id(g)] = per.get(id(g), 0) + sum(v == version for v in s.token_versions)
    total, squares = sum(per.values()), sum(n * n for n in per.values())
    return total * total / squares if squares else 1.0


@dataclass(frozen=True, slots=True)
class EpisodeRow:
    """An episode as the log-prob and sampling checks read a sample: every turn's tokens after
    the first observation, in order, as the engine saw them when it sampled the next model turn
    (the runner's context is the first observation and all turns so far). The environment's
    tokens carry no claim (log-prob 0.0, version None): the checks judge the model's tokens only."""

    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    token_versions: tuple[int | None, ...]

    @staticmethod
    def of(episode: Episode) -> EpisodeRow:
        ids, logprobs, versions = flatten(episode)  # the sequence the trainer trains, too
        return EpisodeRow(tuple(ids), tuple(logprobs), tuple(versions))


@dataclass(frozen=True, slots=True)
class Failure:
    reason: DropReason
    evidence: str


@dataclass(frozen=True, slots=True)
class SpotPlan:
    """Which groups of a batch a spot check covers, and how many of their rows (None: all)."""

    groups: list[int]
    rows: int | None = None
    probation: bool = False  # the publisher is on probation: its batch waits for this check
    # The budget chose this check and pays for it in full; probation's and an earning
    # publisher's checks are not refused for want of credit, and spend only the credit there is
    # (module docstring, Budget).
    budgeted: bool = False


@dataclass(slots=True)
class VerifyStats:
    """Per check, batches that passed and failed it; what spot checks covered and cost."""

    passed: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    groups_seen: int = 0
    groups_spot_checked: int = 0
    # Trained tokens re-checked by the training forward itself (`Verifier.audit`).
    tokens_audited: int = 0
    rows_seen: int = 0
    rows_spot_checked: int = 0
    tokens_spot_checked: int = 0
    unverifiable_tokens: int = 0
    # Batches chosen for a check that the budget could not afford (publishers past probation).
    over_budget: int = 0
    # ... and chosen while the checker was busy with another (checks run beside the intake).
    checker_busy: int = 0
    # ... and batches of publishers still earning trust dropped for it (never trained unchecked).
    unproven_dropped: int = 0
    # Checks of a peer on a pair never measured that left its dtype's envelope (warned, passed).
    excursions: int = 0
    # How close what passed came to the tolerances: the calibration a run reports (the largest
    # per-token gap, and the largest mean gap of a version's checked tokens).
    lp_gap_max: float = 0.0
    lp_gap_mean_max: float = 0.0
    log_e_max: dict[str, float] = field(
        default_factory=lambda: {"improbable": 0.0, "greedy": 0.0, "older": 0.0, "logprob_drift": 0.0})
    # Check 6: batches whose sampling noise was drawn again, the tokens judged by it, those
    # skipped for their cost, the largest race deficit that passed, and the largest log evidence
    # of a publisher drawing other noise than ours.
    replays: int = 0
    replayed_tokens: int = 0
    replay_over_budget: int = 0
    replay_deficit_max: float = 0.0
    replay_noise_log_e_max: float = 0.0
    # CPU seconds (of the checking thread): on a learner's busy core, what verification takes
    # from training, whatever else the core runs meanwhile.
    claims_s: float = 0.0
    spot_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "checks": {c: {"pass": self.passed[c], "fail": self.failed[c]} for c in CHECKS},
            "groups_seen": self.groups_seen,
            "groups_spot_checked": self.groups_spot_checked,
            "spot_rate_achieved": round(self.groups_spot_checked / max(1, self.groups_seen), 4),
            "rows_seen": self.rows_seen,
            "rows_spot_checked": self.rows_spot_checked,
            "row_rate_achieved": round(self.rows_spot_checked / max(1, self.rows_seen), 4),
            "tokens_spot_checked": self.tokens_spot_checked,
            "tokens_audited": self.tokens_audited,
            "unverifiable_tokens": self.unverifiable_tokens,
            "over_budget": self.over_budget,
            "checker_busy": self.checker_busy,
            "unproven_dropped": self.unproven_dropped,
            "excursions": self.excursions,
            "passed_lp_gap_max": self.lp_gap_max,
            "passed_lp_gap_mean_max": self.lp_gap_mean_max,
            "passed_log_e_max": {k: round(v, 2) for k, v in self.log_e_max.items()},
            "replays": self.replays,
            "replayed_tokens": self.replayed_tokens,
            "replay_over_budget": self.replay_over_budget,
            "passed_replay_deficit_max": round(self.replay_deficit_max, 6),
            "replay_shared_noise_log_e_max": round(self.replay_noise_log_e_max, 2),
            "seconds": round(self.claims_s + self.spot_s, 3),
        }


class Verifier:
    """The ladder for one run. `claims` runs in the gossip validator; `spot` in a worker thread,
    one call at a time (the intake serialises them); `remember` on the event loop."""

    def __init__(
        self,
        cfg: VerifyConfig,
        *,
        run_id: str,
        tokenizer: Tokenizer,
        task: Task,
        model: torch.nn.Module,
        temperature: float,
        top_p: float = 1.0,
        keep_versions: int,
        rollout_dtype: torch.dtype = torch.float32,
        check_dtype: torch.dtype | None = None,
        engine_of: Callable[[str], tuple[str, str] | None] = lambda peer: None,
    ) -> None:
        """`rollout_dtype`: the dtype peers sample in (and published weights are in);
        `check_dtype`: the one the spot checker computes in (None: the rollout dtype);
        `engine_of`: a publisher's (engine, device) as its heartbeat claims, None if unknown."""
        self.cfg = cfg
        self.run_id = run_id
        self.tokenizer = tokenizer
        self.task = task
        self.temperature = temperature
        self.top_p = top_p
        self.keep_versions = keep_versions
        self.stats = VerifyStats()
        # Check 5(a)'s rate, per checked token (the martingales' `cfg.false_alarm` is per peer
        # per run); the same number unless a test measures the two apart.
        self.token_false_alarm = cfg.false_alarm
        # The spot checker's own copy of the model: the trainer's changes under it while it runs.
        self.check_dtype = check_dtype or rollout_dtype
        self._dtype_name = str(rollout_dtype).removeprefix("torch.")
        self._engine_of = engine_of
        self._model = (
            copy_model(model, self.check_dtype).eval() if cfg.logprobs else None
        )
        self._loaded = -1
        self._vocab = int(model.config.vocab_size)  # type: ignore[union-attr, arg-type]  # an HF model (torch types nn.Module attributes as Tensor | Module)
        self._blobs: OrderedDict[int, bytes] = OrderedDict()
        self._blobs_lock = threading.Lock()
        # Peer -> batches still checked in full.
        self._probation: OrderedDict[str, int] = OrderedDict()
        # Peer -> completion tokens of its that passed spot checks (`check_rate`).
        self._trusted_tokens: OrderedDict[str, int] = OrderedDict()
        self._rng = random.SystemRandom()  # peers must not predict which batches are checked
        # The budget: since the first plan, checks may have spent `cfg.budget` of the wall time;
        # `_budgeted_s`: CPU seconds charged to it (`spot`).
        self._budget_from: float | None = None
        self._budgeted_s = 0.0
        self._cost_per_row: float | None = None
        # Publisher -> excursions beyond its dtype's envelope (warned at powers of two).
        self._warned: OrderedDict[str, int] = OrderedDict()
        # Publisher -> accumulated log e-values of the three sampling tests and check 4(b) (the
        # e-CUSUMs above).
        self._evidence: OrderedDict[str, tuple[float, float, float, float]] = OrderedDict()
        # Publisher -> log of check 6's martingale for "it draws other noise than ours", and the
        # largest race deficit of its checked tokens so far (judged once the noise is proven ours).
        self._shared_noise: OrderedDict[str, tuple[float, _Gap | None]] = OrderedDict()
        # CPU seconds per exponential drawn (check 6's cost), measured.
        self._cost_per_draw: float | None = None

    # -- every batch -------------------------------------------------------------------------

    def claims(self, batch: RolloutBatch) -> Failure | None:
        """Checks 1-3 on every group of `batch`; the first failure, or None."""
        t0 = time.thread_time()
        try:
            for name, check in (("completion", self._completions), ("prompt", self._prompts), ("reward", self._rewards)):
                failure = check(batch)
                if failure is not None:
                    self.stats.failed[name] += 1
                    return failure
                self.stats.passed[name] += 1
            self.stats.groups_seen += len(batch.groups)
            self.stats.rows_seen += batch.num_samples
            return None
        finally:
            self.stats.claims_s += time.thread_time() - t0

    def _completions(self, batch: RolloutBatch) -> Failure | None:
        eos = self.tokenizer.eos_id
        for g in batch.groups:
            for i, s in enumerate(g.samples):
                ids = s.completion_ids
                if eos in ids[:-1]:
                    at = ids.index(eos)
                    return Failure(
                        DropReason.BAD_COMPLETION,
                        f"group {g.group_id} sample {i}: {len(ids) - at - 1} token(s) after eos at position {at}",
                    )
        return None

    def _assigned(self, batch: RolloutBatch, index: int, g: RolloutGroup) -> str | None:
        """The prompt slot `index` of `batch` assigns; None when its samples began on different
        versions (no honest engine starts a group on two: such a group answers no slot)."""
        if group_version([s.token_versions[0] for s in g.samples if s.token_versions]) is None:
            return None
        return self.task.prompt_for(prompt_draw(self.run_id, batch.peer_id, batch.seq, index))

    def _prompts(self, batch: RolloutBatch) -> Failure | None:
        for index, g in enumerate(batch.groups):
            expected = self._assigned(batch, index, g)
            if expected is None:
                return Failure(DropReason.BAD_PROMPT, f"group {g.group_id}: its samples began on different versions")
            if list(g.prompt_ids) != self.tokenizer.encode_prompt(expected):
                got = self.tokenizer.decode(g.prompt_ids)
                return Failure(
                    DropReason.BAD_PROMPT,
                    f"group {index} of seq {batch.seq} answers {got!r}; its slot assigns {expected!r}",
                )
        return None

    def _rewards(self, batch: RolloutBatch) -> Failure | None:
        for index, g in enumerate(batch.groups):
            # The assigned prompt's text (checked above), not the ids decoded: with a chat
            # template those hold the template's text too, and rewards score the task's prompt.
            prompt = self._assigned(batch, index, g)
            assert prompt is not None  # _prompts refused such a group
            completions = [self.tokenizer.decode(s.completion_ids) for s in g.samples]
            try:
                rewards = self.task.reward([prompt] * len(completions), completions)
            except Exception as exc:  # a plug-in reward; the peer's own scoring would have failed too
                return Failure(DropReason.BAD_REWARD, f"group {g.group_id}: the run's reward fails on its completions ({type(exc).__name__}: {exc})")
            for i, (s, r) in enumerate(zip(g.samples, rewards)):
                if not math.isclose(s.reward, r, rel_tol=0.0, abs_tol=REWARD_TOLERANCE):
                    return Failure(
                        DropReason.BAD_REWARD,
                        f"group {g.group_id} sample {i}: claimed reward {s.reward:g} for {completions[i]!r} "
                        f"on {prompt!r}, the run's reward is {r:g}",
                    )
        return None

    # -- spot checks -------------------------------------------------------------------------

    def remember(self, version: int, blob: bytes) -> None:
        """Weights of a published version, kept while rollouts sampled on it can be admitted."""
        if self._model is None:
            return
        with self._blobs_lock:
            self._blobs[version] = blob
            while len(self._blobs) > self.keep_versions:
                self._blobs.popitem(last=False)

    def suspect(self, peer_id: str) -> None:
        """Check every group of `peer_id`'s next `probation_batches` batches, and start its
        trust over."""
        _keep_recent(self._probation, peer_id, self.cfg.probation_batches)
        self._trusted_tokens.pop(peer_id, None)

    def on_probation(self, peer_id: str) -> bool:
        """Whether `peer_id`'s next batch will be spot-checked in full (a peer not seen yet is:
        `plan` puts it on probation)."""
        return self._model is not None and self._probation.get(peer_id, self.cfg.probation_batches) > 0

    def plan(self, batch: RolloutBatch | EpisodeBatch) -> SpotPlan | None:
        """Whether to spot-check `batch`, and how much of it: while its publisher is on
        probation (a peer is, for its first batches), always, at least `min_rows` rows; else
        with probability `spot_rate`, as many rows as the budget affords (module docstring).

        Whole batches are the unit chosen, not groups one by one: on small models a check's
        forward costs mostly its fixed part, and the sampling tests gain power with every
        token they see."""
        if self._model is None:
            return None
        if self._budget_from is None:
            self._budget_from = time.monotonic()
        peer = batch.peer_id
        if peer not in self._probation:
            self.suspect(peer)
        everything = list(range(len(batch.groups)))
        # Every row of an unproven publisher's batch, else at least min_rows (module docstring).
        floor = self.cfg.min_rows if self.proven(peer) else max(self.cfg.min_rows, min(batch.num_samples, UNPROVEN_ROWS))
        left = self._probation[peer]
        if left > 0:
            self._probation[peer] = left - 1
            return SpotPlan(everything, self._affordable_rows(batch.num_samples, floor=floor), probation=True)
        if self._rng.random() >= self.check_rate(peer):
            return None
        if self.earning(peer):  # never unchecked (module docstring, unproven publishers)
            return SpotPlan(everything, self._affordable_rows(batch.num_samples, floor=floor))
        rows = self._affordable_rows(batch.num_samples, floor=0)
        if rows < min(self.cfg.min_rows, batch.num_samples):
            self.stats.over_budget += 1
            return None
        return SpotPlan(everything, rows, budgeted=True)

    def check_rate(self, peer_id: str) -> float:
        """The chance a batch of `peer_id` past probation is checked: `trust_tokens` over the
        tokens of its that passed checks, between `spot_rate` and 1. A peer honest for its
        probation and lying after is checked on nearly every batch until its honest work
        passes trust_tokens; to be checked at spot_rate it must have passed
        trust_tokens / spot_rate tokens of checks, and its lies then still meet spot_rate."""
        passed = self._trusted_tokens.get(peer_id, 0)
        return max(self.cfg.spot_rate, min(1.0, self.cfg.trust_tokens / max(1, passed)))

    def earning(self, peer_id: str) -> bool:
        """Whether `peer_id` is still earning trust: not proven, or checked with a chance above
        EARNING_RATE (and above `spot_rate`). A batch of such a publisher chosen for a
        check is checked or dropped, never trained unchecked (module docstring): its next batch
        may be its first lie, and an attacker can keep the checker busy or its budget spent
        with Sybils on probation."""
        rate = self.check_rate(peer_id)
        return not self.proven(peer_id) or rate > max(EARNING_RATE, self.cfg.spot_rate)

    def proven(self, peer_id: str) -> bool:
        """Whether `peer_id`'s checked work proved it (module docstring, unproven publishers):
        its tokens that passed checks reached `trust_tokens`, or check 6 proved that it draws the
        assigned noise and 1 / NOISE_TRUST of those tokens passed (judged exactly: a token that
        loses the race proves a lie, but an old version or a lowered temperature makes only some
        tokens lose, so the proof of noise alone says nothing yet of its distribution). Without
        log-prob checks every peer counts as proven (nothing could prove one)."""
        passed = self._trusted_tokens.get(peer_id, 0)
        if self._model is None or passed >= self.cfg.trust_tokens:
            return True
        noise = self._shared_noise.get(peer_id, (0.0, None))[0] >= -math.log(self.cfg.false_alarm)
        return noise and passed * NOISE_TRUST >= self.cfg.trust_tokens

    def credit_s(self) -> float:
        """CPU seconds the budget still allows the checks it chooses to spend now."""
        if self._budget_from is None:
            return 0.0
        return self.cfg.budget * (time.monotonic() - self._budget_from) - self._budgeted_s

    def _affordable_rows(self, total: int, *, floor: int) -> int:
        if self._cost_per_row is None:  # nothing measured yet: the smallest check
            return min(total, max(floor, self.cfg.min_rows))
        affordable = int(self.credit_s() / self._cost_per_row)
        return min(total, max(floor, affordable))

    def spot(
        self, batch: RolloutBatch | EpisodeBatch, indices: list[int], *, rows: int | None = None, budgeted: bool = False
    ) -> Failure | None:
        """Checks 4-5 on groups `indices` of `batch`, on `rows` of their rows drawn at random
        (None: all of them) (worker thread); `budgeted`: the budget chose it and pays for it
        (`SpotPlan.budgeted`). An episode is one row (`EpisodeRow`); check 6 does not replay
        episodes (the runner's engine calls are not one batch's)."""
        t0 = time.thread_time()
        indexed: list[tuple[int, Grouped, Row]]
        if isinstance(batch, EpisodeBatch):
            indexed = [(0, batch.groups[i], EpisodeRow.of(e)) for i in indices for e in batch.groups[i].episodes]
        else:
            # Each sample's row in the engine call that sampled the batch: group k's are the rows
            # after the samples of groups 0..k-1 (echo_node/ml/rollout.py).
            starts = [0]
            for g in batch.groups:
                starts.append(starts[-1] + len(g.samples))
            indexed = [(starts[i] + j, batch.groups[i], s) for i in indices for j, s in enumerate(batch.groups[i].samples)]
        if rows is not None and rows < len(indexed):
            picked = sorted(self._rng.sample(range(len(indexed)), max(1, rows)))
            indexed = [indexed[i] for i in picked]
        candidates = [(g, s) for _, g, s in indexed]
        try:
            noise = None
            if isinstance(batch, RolloutBatch):
                noise = self._replay_noise(batch, [r for r, _, _ in indexed], [s for _, _, s in indexed])
            failure = self._spot(batch.peer_id, candidates, noise)
        finally:
            spent = time.thread_time() - t0
            self.stats.spot_s += spent
            # What the budget chose, it pays in full; a check it cannot refuse spends only the
            # credit there is (module docstring, Budget).
            self._budgeted_s += spent if budgeted else min(spent, max(0.0, self.credit_s()))
            per_row = spent / max(1, len(candidates))
            self._cost_per_row = per_row if self._cost_per_row is None else (
                (1 - COST_EWMA) * self._cost_per_row + COST_EWMA * per_row)
        self.stats.groups_spot_checked += len({id(g) for g, _ in candidates})
        self.stats.rows_spot_checked += len(candidates)
        if failure is None:  # the tokens its claims were checked on (an environment's carry none)
            tokens = sum(v is not None for _, s in candidates for v in s.token_versions)
            _keep_recent(self._trusted_tokens, batch.peer_id, self._trusted_tokens.get(batch.peer_id, 0) + tokens)
        for name in ("logprobs", "sampling"):
            if failure is not None and failure.reason is _REASON[name]:
                self.stats.failed[name] += 1
                break
            self.stats.passed[name] += 1
        return failure

    def audit(self, peer_id: str, version: int, group_id: str, tokens: int, total: float, largest: float) -> Failure | None:
        """Judge the on-policy log-prob gaps the training forward found in one of `peer_id`'s
        trained groups (module docstring: audits of training); a failure as a spot check's."""
        if tokens <= 0 or self._model is None:  # no log-prob checks in this run
            return None
        self.stats.tokens_audited += tokens
        limits = self.judgement(peer_id).refuse
        mean = total / tokens
        if largest <= limits.token and mean <= limits.mean_limit(1):  # one group: one independent unit
            return None
        return Failure(
            DropReason.BAD_LOGPROBS,
            f"group {group_id} trained on version {version}: its claimed log-probs are {mean:.3g} from the learner's "
            f"training forward on average over {tokens} tokens, {largest:.3g} at most; honest peers stay within "
            f"{limits.mean_limit(1):.3g} on average and {limits.token:.3g} per token",
        )

    def judgement(self, peer_id: str) -> Judgement:
        """How `peer_id`'s log-probs are judged: by hand-set limits, or by the envelope of the
        (engine, device) its heartbeat claims in the run's dtype (echo_node/learner/calibration.py)."""
        cfg = self.cfg
        engine, device = self._engine_of(peer_id) or ("unknown", "unknown")
        judge = judgement(engine, device, self._dtype_name, factor=cfg.lp_max_factor, z=cfg.lp_mean_z)
        if cfg.lp_tolerance_max is None and cfg.lp_tolerance_mean is None:
            return judge
        # Set by hand: what is set replaces the envelope's limit, and nothing is only warned about.
        refuse = judge.refuse
        token = refuse.token if cfg.lp_tolerance_max is None else cfg.lp_tolerance_max
        mean = Tolerance(token, refuse.mean, refuse.sd, refuse.z) if cfg.lp_tolerance_mean is None else Tolerance(token, cfg.lp_tolerance_mean)
        return Judgement(f"{judge.pair} (configured)", True, mean, rounding=token)

    def _replay_noise(self, batch: RolloutBatch, rows: list[int], samples: list[Row]) -> _Noise | None:
        """Check 6's noise for `rows` of `batch`'s engine call (module docstring), or None when
        the publisher's engine is not replayable, the batch's groups began on different versions,
        or the draws cost more than the credit left and the check's own forward."""
        claim = self._engine_of(batch.peer_id)
        if claim is None or (claim[0], claim[1].split(":", 1)[0]) not in REPLAYABLE or self.temperature <= 0 or not rows:
            return None
        version = group_version([s.token_versions[0] for g in batch.groups for s in g.samples if s.token_versions])
        if version is None:
            return None
        steps = max(len(s.completion_ids) for g in batch.groups for s in g.samples)
        draws = batch.num_samples * self._vocab * steps
        if self._cost_per_draw is not None:
            forward = len(rows) * (self._cost_per_row or 0.0)
            if draws * self._cost_per_draw > max(self.credit_s(), forward):
                self.stats.replay_over_budget += 1
                return None
        t0 = time.thread_time()
        gen = torch.Generator().manual_seed(batch_seed(self.run_id, batch.peer_id, batch.seq))
        keep = torch.tensor(rows)
        drawn = torch.empty(batch.num_samples, self._vocab)
        # -log E per kept row and step, in float16 (half the memory of float32); `_race` allows
        # for its rounding (NOISE_ULP) before judging a deficit.
        neg_log = torch.empty(len(rows), steps, self._vocab, dtype=torch.float16)
        for t in range(steps):
            drawn.exponential_(1, generator=gen)  # what torch.multinomial draws for [rows, V]
            neg_log[:, t] = drawn.index_select(0, keep).log_().neg_()
        spent = (time.thread_time() - t0) / draws
        self._cost_per_draw = spent if self._cost_per_draw is None else (1 - COST_EWMA) * self._cost_per_draw + COST_EWMA * spent
        self.stats.replays += 1
        return _Noise(neg_log, {id(s): i for i, s in enumerate(samples)})

    def _spot(self, peer_id: str, candidates: list[tuple[Grouped, Row]], noise: _Noise | None = None) -> Failure | None:
        # Log e-values of the two sampling tests, over every checked token of the batch.
        surprise = greed = 0.0
        tokens = 0
        judge = self.judgement(peer_id)
        shared = 0.0  # check 6's log evidence from this batch; its largest deficit
        deficit: _Gap | None = None
        # Check 5(c)'s log e-value: how much likelier the tokens are under the version before
        # the one they claim (when the replay does not already judge them).
        older = 0.0
        drift = 0.0  # check 4(b)'s log e-value: log-prob gaps larger than honest ones on average
        proven = self._shared_noise.get(peer_id, (0.0, None))[0] >= -math.log(self.cfg.false_alarm)
        for version in sorted({v for _, s in candidates for v in s.token_versions if v is not None}):
            rows = [(g, s) for g, s in candidates if version in s.token_versions]
            if not self._load(version):
                self.stats.unverifiable_tokens += sum(s.token_versions.count(version) for _, s in rows)
                continue
            result = self._rows_checked(rows, version, judge, peer_id, noise)
            if isinstance(result, Failure):
                return result
            n, low, high, race, logq_sum, gaps = result
            tokens, surprise, greed, drift = tokens + n, surprise + low, greed + high, drift + gaps
            before = self._previous(version)
            if n and not proven and before is not None and self._load(before):
                older += self._logq_sum(rows, version) - logq_sum
            if race is not None:
                shared += race.log_e
                if race.worst is not None and (deficit is None or race.worst.value > deficit.value):
                    deficit = race.worst
        self.stats.tokens_spot_checked += tokens
        if noise is not None:
            self.stats.replayed_tokens += tokens
            failure = self._judge_race(peer_id, shared, deficit, judge)
            if failure is not None:
                return failure
        kept = self._evidence.get(peer_id, (0.0, 0.0, 0.0, 0.0))
        low, high, stale = max(0.0, kept[0] + surprise), max(0.0, kept[1] + greed), max(0.0, kept[2] + older)
        pooled = max(0.0, kept[3] + drift)
        _keep_recent(self._evidence, peer_id, (low, high, stale, pooled))
        threshold = -math.log(self.cfg.false_alarm)
        if pooled >= threshold:
            return Failure(
                DropReason.BAD_LOGPROBS,
                f"its claimed log-probs are further from the learner's than honest {judge.pair} peers' "
                f"(mean {judge.refuse.mean:.3g} a token) over its checked tokens: e-value e^{pooled:.1f} since the "
                f"evidence last restarted, e^{drift:.1f} from this batch's {tokens} tokens (an honest peer's chance "
                f"<= e^-{pooled:.1f} per run)",
            )
        for log_e, batch_e, how in ((low, surprise, "less likely than"), (high, greed, "more likely than"),
                                    (stale, older, "likelier under the version before the one they claim than")):
            if log_e >= threshold:
                return Failure(
                    DropReason.BAD_SAMPLING,
                    f"its checked tokens are {how} sampling at temperature {self.temperature:g} gives: "
                    f"e-value e^{log_e:.1f} over its checks since the evidence last restarted, e^{batch_e:.1f} from "
                    f"this batch's {tokens} tokens (an honest sampler's chance <= e^-{log_e:.1f} per check)",
                )
        for log_e, name in ((low, "improbable"), (high, "greedy"), (stale, "older"), (pooled, "logprob_drift")):
            self.stats.log_e_max[name] = max(self.stats.log_e_max[name], log_e)
        return None

    def _previous(self, version: int) -> int | None:
        """The newest version kept below `version` (check 5(c)'s alternative), or None."""
        with self._blobs_lock:
            older = [v for v in self._blobs if v < version]
        return max(older, default=None)

    def _logq_sum(self, rows: list[tuple[Grouped, Row]], version: int) -> float:
        """Sum of log q, under the weights loaded now, of the tokens of `rows` tagged `version`
        (the sampling distribution: tempered, cut to the nucleus), in bounded forwards."""
        assert self._model is not None
        width = max(len(s.completion_ids) for _, s in rows)
        per = max(1, min(SPOT_CHUNK_ROWS, SPOT_CHUNK_ELEMENTS // max(1, width * self._vocab)))
        total = 0.0
        for start in range(0, len(rows), per):
            samples = [s for _, s in rows[start : start + per]]
            with torch.inference_mode():
                logp, targets, mask = completion_log_softmax(
                    self._model, [list(g.prompt_ids) for g, _ in rows[start : start + per]],
                    [list(s.completion_ids) for s in samples], self.tokenizer.pad_id, temperature=self.temperature,
                )
            t_max = targets.shape[1]
            on = mask & torch.tensor([[v == version for v in s.token_versions] + [False] * (t_max - len(s.token_versions)) for s in samples])
            logq = torch.log_softmax(top_p_filter(logp, self.top_p), dim=-1) if self.top_p < 1 else logp
            total += float(logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1).clamp(min=-1e30)[on].sum())
        return total

    def _judge_race(self, peer_id: str, shared: float, deficit: _Gap | None, judge: Judgement) -> Failure | None:
        """Check 6's verdict on a batch: its evidence that the publisher draws our noise joins
        the publisher's; once that is beyond 1 / `false_alarm`, a token of any of its checked
        batches (this one or an earlier) that lost the race by more than twice the pair's rounding
        (`Judgement.rounding`) proves another sampling distribution."""
        before, earlier = self._shared_noise.get(peer_id, (0.0, None))
        log_e = before + shared
        if earlier is not None and (deficit is None or earlier.value > deficit.value):
            deficit = earlier
        _keep_recent(self._shared_noise, peer_id, (log_e, deficit))
        limit = 2 * (judge.rounding if judge.rounding is not None else judge.refuse.token)
        threshold = -math.log(self.cfg.false_alarm)
        if deficit is not None and deficit.value > limit and log_e >= threshold:
            return Failure(
                DropReason.BAD_SAMPLING,
                f"group {deficit.group_id} on version {deficit.claimed:.0f}: token {deficit.token} is not what that version "
                f"samples with the batch's assigned seed at temperature {self.temperature:g}: it loses the sampling race by "
                f"{deficit.value:.3g} nats (rounding explains {limit:.3g}); the publisher provably draws the assigned noise "
                f"(its tokens win the race beyond chance: e^{log_e:.1f}), so it sampled from another version or sampler",
            )
        self.stats.replay_noise_log_e_max = max(self.stats.replay_noise_log_e_max, log_e)
        if deficit is not None and log_e >= threshold:
            self.stats.replay_deficit_max = max(self.stats.replay_deficit_max, deficit.value)
        return None

    def _load(self, version: int) -> bool:
        if version == self._loaded:
            return True
        with self._blobs_lock:
            blob = self._blobs.get(version)
        if blob is None:
            return False
        assert self._model is not None
        # The published weights, widened to the checker's dtype in the copy (exactly: every
        # rollout dtype widens into float32 without rounding).
        load_state_tensors(self._model, state_tensors(blob), widen=True)
        self._loaded = version
        return True

    def _rows_checked(
        self, rows: list[tuple[Grouped, Row]], version: int, judge: Judgement, peer_id: str, noise: _Noise | None = None
    ) -> Failure | tuple[int, float, float, _Race | None, float, float]:
        """Checks 4 and 5(a) on the tokens of `rows` tagged `version` (weights loaded), in
        forwards of at most `SPOT_CHUNK_ELEMENTS` log-probabilities each; else (tokens, log
        e-values of both 5(b) tests over them, check 6's race, the sum of their log q, and check
        4(b)'s log e-value over them). The mean log-prob gap is judged over all rows."""
        width = max(len(s.completion_ids) for _, s in rows)
        per = max(1, min(SPOT_CHUNK_ROWS, SPOT_CHUNK_ELEMENTS // max(1, width * self._vocab)))
        tokens, low, high, gap_sum, logq_sum, drift = 0, 0.0, 0.0, 0.0, 0.0, 0.0
        worst: _Gap | None = None
        race: _Race | None = None
        for start in range(0, len(rows), per):
            part = self._rows_at(rows[start : start + per], version, judge, noise)
            if isinstance(part, Failure):
                return part
            n, lo, hi, gaps, gap, chunk_race, chunk_logq, chunk_drift = part
            tokens, low, high, gap_sum, logq_sum = tokens + n, low + lo, high + hi, gap_sum + gaps, logq_sum + chunk_logq
            drift += chunk_drift
            if gap is not None and (worst is None or gap.value > worst.value):
                worst = gap
            if chunk_race is not None:
                race = chunk_race if race is None else race.joined(chunk_race)
        if worst is None or not tokens:
            return tokens, low, high, race, logq_sum, drift
        mean, units = gap_sum / tokens, independent_units(rows, version)
        if mean > judge.refuse.mean_limit(units):
            return self._bad_logprobs(version, mean, tokens, units, worst, judge.refuse, judge.pair)
        warn = judge.warn
        if warn is not None and (worst.value > warn.token or mean > warn.mean_limit(units)):
            self._excursion(peer_id, version, mean, tokens, units, worst, judge)
        self.stats.lp_gap_max = max(self.stats.lp_gap_max, worst.value)
        self.stats.lp_gap_mean_max = max(self.stats.lp_gap_mean_max, mean)
        return tokens, low, high, race, logq_sum, drift

    def _excursion(self, peer_id: str, version: int, mean: float, tokens: int, units: float, worst: _Gap, judge: Judgement) -> None:
        """A peer on a pair never measured left the envelope honest peers of its dtype keep:
        not refused (its engine may round differently), but said, with the evidence."""
        self.stats.excursions += 1
        n = self._warned.get(peer_id, 0) + 1
        _keep_recent(self._warned, peer_id, n)
        if n & (n - 1) == 0:
            assert judge.warn is not None
            log.warning(
                "peer %s runs %s, for which no honest log-prob envelope was measured: its log-probs on version %d are "
                "%.3g from the learner's on average over %d tokens, %.3g at most, beyond what measured engines of its "
                "dtype give (%.3g / %.3g); not refused below %.3g / %.3g. %d such check(s) so far; measure the pair "
                "with `python -m benchmarks.logprob_calibration`",
                peer_id, judge.pair, version, mean, tokens, worst.value, judge.warn.mean_limit(units), judge.warn.token,
                judge.refuse.mean_limit(units), judge.refuse.token, n,
            )

    def _bad_logprobs(self, version: int, mean: float, tokens: int, units: float, worst: _Gap, limits: Tolerance, pair: str) -> Failure:
        return Failure(
            DropReason.BAD_LOGPROBS,
            f"group {worst.group_id} on version {version}: claimed log-probs are {mean:.3g} from the "
            f"learner's on average over {tokens} tokens ({units:.3g} groups' worth), {worst.value:.3g} at most "
            f"(token {worst.token}: claimed {worst.claimed:.4g}, recomputed {worst.recomputed:.4g}); honest {pair} "
            f"peers stay within {limits.mean_limit(units):.3g} on average and {limits.token:.3g} per token",
        )

    def _rows_at(
        self, rows: list[tuple[Grouped, Row]], version: int, judge: Judgement, noise: _Noise | None = None
    ) -> Failure | tuple[int, float, float, float, _Gap | None, _Race | None, float, float]:
        """Checks 4 (per token) and 5(a) on the tokens of `rows` tagged `version`, in one
        forward; else (tokens, both log e-values, the sum of their log-prob gaps, the largest,
        check 6's race over them when `noise` holds these rows, the sum of their log q, and
        check 4(b)'s log e-value over their gaps)."""
        assert self._model is not None
        samples = [s for _, s in rows]
        with torch.inference_mode():
            logp, targets, mask = completion_log_softmax(
                self._model, [list(g.prompt_ids) for g, _ in rows], [list(s.completion_ids) for s in samples],
                self.tokenizer.pad_id, temperature=self.temperature,
            )
        t_max = targets.shape[1]
        tagged = torch.tensor([[v == version for v in s.token_versions] + [False] * (t_max - len(s.token_versions)) for s in samples])
        on = tagged & mask
        recomputed = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        claimed = torch.tensor([list(s.behaviour_logprobs) + [0.0] * (t_max - len(s.behaviour_logprobs)) for s in samples])
        diff = (recomputed - claimed).abs().masked_fill(~on, -1.0)
        gap = diff[on]
        worst = None
        if gap.numel():
            r, t = divmod(int(diff.argmax()), t_max)
            worst = _Gap(float(gap.max()), rows[r][0].group_id, t, float(claimed[r, t]), float(recomputed[r, t]))
            if worst.value > judge.refuse.token:
                return self._bad_logprobs(version, float(gap.mean()), int(gap.numel()), independent_units(rows, version), worst,
                                          judge.refuse, judge.pair)
        # The distribution the engine samples from: tempered, then cut to the nucleus.
        logq = torch.log_softmax(top_p_filter(logp, self.top_p), dim=-1) if self.top_p < 1 else logp
        sampled = logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        floor = math.log(self.token_false_alarm / self._vocab)
        improbable = on & (sampled < floor)
        if improbable.any():
            r, t = (int(x) for x in improbable.nonzero()[0])
            return Failure(
                DropReason.BAD_SAMPLING,
                f"group {rows[r][0].group_id} on version {version}: token {t} of a sample has probability "
                f"{math.exp(float(sampled[r, t])):.2e} at temperature {self.temperature:g}, below {math.exp(floor):.1e}",
            )
        race = None
        if noise is not None:
            race = _race(logq, targets, on, noise.rows([s for _, s in rows], t_max), version, [g.group_id for g, _ in rows])
        return (int(on.sum()), _log_e_value(logq, sampled, on, -0.5), _log_e_value(logq, sampled, on, 1.0),
                float(gap.sum()), worst, race, float(sampled.clamp(min=-1e30)[on].sum()), gap_log_e(gap, GAP_MARGIN * judge.refuse.mean))


def _keep_recent(table: OrderedDict[str, V], peer_id: str, value: V) -> None:
    """`table[peer_id] = value`, most recent last; beyond MAX_TRACKED_PEERS peers the least
    recently set are forgotten (a peer id costs an attacker nothing)."""
    table[peer_id] = value
    table.move_to_end(peer_id)
    while len(table) > MAX_TRACKED_PEERS:
        table.popitem(last=False)


@dataclass(frozen=True, slots=True)
class _Gap:
    """The largest claimed-vs-recomputed log-prob gap of a check, and where (for the evidence)."""

    value: float
    group_id: str
    token: int
    claimed: float
    recomputed: float


@dataclass(frozen=True, slots=True)
class _Noise:
    """Check 6's replayed noise: -log E [rows, steps, V] (float16) of the checked rows, and
    each checked sample's row in it (by identity)."""

    neg_log: Tensor
    row_of: dict[int, int]

    def rows(self, samples: list[Row], width: int) -> Tensor | None:
        """[len(samples), width, V] float32 for `samples`, None if one was not replayed."""
        if any(id(s) not in self.row_of for s in samples):
            return None
        index = torch.tensor([self.row_of[id(s)] for s in samples])
        return self.neg_log.index_select(0, index)[:, :width].float()


@dataclass(frozen=True, slots=True)
class _Race:
    """Check 6 over some tokens: the log evidence that their publisher draws our noise, and
    the largest race deficit among them (its `claimed` field holds the version)."""

    log_e: float
    worst: _Gap | None

    def joined(self, other: _Race) -> _Race:
        worst = self.worst
        if other.worst is not None and (worst is None or other.worst.value > worst.value):
            worst = other.worst
        return _Race(self.log_e + other.log_e, worst)


def _race(logq: Tensor, targets: Tensor, on: Tensor, neg_log_e: Tensor | None, version: int, group_ids: list[str]) -> _Race | None:
    """Check 6 on the tokens `on` (module docstring): each token's deficit in the race
    argmax_y log q(y) - log E_y, and log prod (1[it won] / c + 1) / 2 with c = sum_y q(y)^2,
    the chance a token drawn with other noise wins ours."""
    if neg_log_e is None or not bool(on.any()):
        return None
    score = logq + neg_log_e
    best = score.max(dim=-1)
    mine = score.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # The noise is kept in float16 (`_Noise`): each stored -log E is off by up to NOISE_ULP of
    # itself (plus a subnormal's step), so a race two tokens honestly ran within that of each
    # other may look lost. The deficit judged is what is left beyond that error: a token is
    # never failed for the noise's rounding (an honest torch CPU peer lost races by 9e-4 nats
    # of it, four times the fp32 rounding limit).
    noise_of = neg_log_e.gather(-1, best.indices.unsqueeze(-1)).squeeze(-1).abs() + neg_log_e.gather(
        -1, targets.unsqueeze(-1)).squeeze(-1).abs()
    deficit = (best.values - mine - NOISE_ULP * noise_of - 2 * NOISE_SUBNORMAL).clamp(min=0.0).masked_fill(~on, -1.0)
    won = best.indices == targets
    collide = torch.logsumexp(2.0 * logq.masked_fill(logq == -math.inf, -1e30), dim=-1).exp()
    log_e = float(torch.log(0.5 * won.float() / collide + 0.5)[on].sum())
    t_max = targets.shape[1]
    r, t = divmod(int(deficit.argmax()), t_max)
    worst = _Gap(float(deficit[r, t]), group_ids[r], t, float(version), float(mine[r, t]))
    return _Race(log_e, worst)


def gap_log_e(gaps: Tensor, mean: float) -> float:
    """Check 4(b)'s log e-value of some tokens' log-prob gaps x >= 0: log prod (1 + x / mean) / 2.
    Under E[x | the past] <= `mean` (honest peers of the pair: the envelope's mean, at least the
    floor) each factor has mean at most 1 and is >= 1/2, so the product is a test
    supermartingale; it grows on gaps larger than `mean` on average, by log((1 + m / mean) / 2)
    a token at a gap of m."""
    if not gaps.numel():
        return 0.0
    return float(torch.log1p(gaps.double() / mean).sum()) - gaps.numel() * math.log(2.0)


def _log_e_value(logq: Tensor, sampled: Tensor, on: Tensor, a: float) -> float:
    """log of prod_t q(token_t)^a / E_q[q^a] over tokens `on`: a test martingale (mean 1 under
    honest sampling), so by Ville's inequality an honest sampler reaches e^x with chance <= e^-x.
    a < 0 grows on improbable tokens (prefilled, another model's), a > 0 on too-likely ones
    (greedy picks). Tokens outside the nucleus never get here (the floor check refuses them)."""
    moment = torch.logsumexp((1.0 + a) * logq.masked_fill(logq == -math.inf, -1e30), dim=-1)
    return float((a * sampled - moment)[on].sum())


_REASON = {"logprobs": DropReason.BAD_LOGPROBS, "sampling": DropReason.BAD_SAMPLING}


def resample_log_chance(group: RolloutGroup) -> float:
    """log of the chance that sampling `group`'s prompt as often again gives the same multiset
    of completions, by the group's own behaviour log-probs (module docstring, Copies)."""
    counts = Counter(s.completion_ids for s in group.samples)
    chance = {s.completion_ids: sum(s.behaviour_logprobs) for s in group.samples}
    log_ways = math.lgamma(len(group.samples) + 1) - sum(math.lgamma(k + 1) for k in counts.values())
    return log_ways + sum(k * chance[c] for c, k in counts.items())


def group_fingerprint(group: RolloutGroup) -> bytes:
    """What a copy of `group` cannot change without changing what it trains: the prompt's tokens
    and the completions' tokens as a multiset (module docstring, Copies)."""
    completions = sorted(s.completion_ids for s in group.samples)
    return hashlib.sha256(pack([list(group.prompt_ids), [list(c) for c in completions]])).digest()


class Copies:
    """Who first sent each group (by `group_fingerprint`, not its name): a later publisher of the
    same is a copier. Bounded to the last COPY_WINDOW groups and MAX_TRACKED_PEERS copiers."""

    def __init__(self, window: int = COPY_WINDOW) -> None:
        self.window = window
        # Fingerprint -> (first publisher, the log chance its group is sampled again).
        self._first: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._implausible: OrderedDict[str, int] = OrderedDict()  # copier -> implausible copies sent

    def first_sender(self, group: RolloutGroup, origin: str) -> tuple[str, bool]:
        """The publisher that sent `group` first (`origin` if nobody else did), and whether this
        copy earns `origin` a strike: every COPIES_PER_STRIKE-th copy of a group that honest
        sampling was unlikely to give twice (by the first publisher's log-probs, which the
        copier cannot lower)."""
        key = group_fingerprint(group)
        first = self._first.get(key)
        if first is None:
            first = self._first[key] = (origin, resample_log_chance(group))
        self._first.move_to_end(key)
        while len(self._first) > self.window:
            self._first.popitem(last=False)
        sender, log_chance = first
        if sender == origin or log_chance >= math.log(PLAUSIBLE_COPY):
            return sender, False
        count = self._implausible.get(origin, 0) + 1
        _keep_recent(self._implausible, origin, count)
        return sender, count % COPIES_PER_STRIKE == 0
