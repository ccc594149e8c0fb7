"""The learner's rollout intake: who may publish, what is admitted, and what every drop was.

Dataflow: gossip validator (`validate`: signature, then the run's admission rules) -> consumer
(`deliver`) -> sequence tracker (duplicates; gaps become repair requests) -> replay buffer.

Rules:
- Only peers that joined publish. A message from anyone else is a counted `not_joined` drop: a
  join is what puts a peer in the (bounded) peer table, so everything kept per publisher is
  bounded by it.
- A batch whose claims fail the learner's checks (echo_node/learner/spot_check.py: the cheap ones in the
  validator, spot checks of log-probs and sampling in the consumer before the buffer) bans its
  publisher at once for `ban_versions` versions and purges its buffered groups (`purged`). Any
  refused message puts its publisher back on probation: its next batches are spot-checked in
  full. A group another publisher sent first is dropped as `copied`.
- Any other rejected message is a counted drop with its reason and a penalty for its sender (and
  for the forwarder that relayed it); a message of another schema version is counted but not a strike
  (an honest peer on another release). `ban_after` penalties ban the peer for `ban_s` seconds: its joins
  are refused and its rollouts dropped as `banned` without being opened. Bans are appended to
  `bans.log` in the run directory (off the event loop, echo_node/learner/banlog.py) and read back at
  start, so a restart does not forgive them.
- Eviction never re-admits: the peer table evicts only peers idle for `ACTIVE_WINDOW_S`, and
  when the sequence tracker has to forget a publisher, a publisher it does not know must bring
  newer tokens than the learner's version at that moment (an old signed batch, replayed, cannot).
- Gap repair runs at most `REPAIRS_AT_ONCE` requests at a time, one per publisher, each bounded
  by `REPAIR_TIMEOUT_S`: peers that accept a repair stream and never answer cost one timeout
  each, in parallel, not one after the other.
- Demand (groups each peer is asked for per version) is split by delivered work, not by heads
  (`PeerBook.effective_peers`): joining, asking for status or delivering a trickle does not cut
  the demand of the peers doing the work.
- A peer the learner's data channel caught misbehaving is banned at once (`ban`): no honest peer
  sends a bad frame or asks without reading.
- A publisher owes every seq in order: each seq's prompts are assigned (protocol/assignment.py),
  so leaving out the seqs whose prompts it dislikes would choose its own prompts. Seqs given up
  after repair or passed over by a jump are counted (`SequenceTracker.skips`); beyond
  SKIP_ALLOWANCE plus SKIP_SHARE of what it delivered, the publisher is caught as a `bad_prompt`
  forger. What that bounds: a publisher may leave out at most ~5 % of its slots for good (a
  weak bias towards easier prompts), never the 80 % an unchecked one did. Seqs the publisher
  itself lists as unavailable although they lie within the horizon every publisher keeps
  (`DISOWN_HORIZON` below the highest the learner had seen when it asked) were never published:
  more than DISOWN_ALLOWANCE of those is the same offence, so a publisher that answers repairs
  gets no allowance to spend on choosing. A seq left out of an answer that had room for more
  is given up (a skip, not disowned: a restarted peer leaves out its earlier process's seqs). A
  publisher that joins again, restarted or not, goes on at the seq the learner names
  (`SequenceTracker.resume_at`, sent in the join answer), so a rejoin excuses no gap; a restart
  of the learner excuses one.

Invariant (replay.py): every rollout that reaches the learner is trained or dropped with a
reason, exactly once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from echo_node import offload
from echo_node.envs.bounded import hung_threads
from echo_node.envs.gate import EpisodeGate, RerunCooldown
from echo_node.learner.banlog import BanLog
from echo_node.learner.journal import Journal
from echo_node.learner.replay import ReplayBuffer
from echo_node.learner.spot_check import COPIES_PER_STRIKE, Copies, Failure, SpotPlan, Verifier
from echo_node.net import rpc
from echo_node.net.transport import Host
from protocol.admission import RunBounds, judge_batch
from protocol.drops import DropReason
from protocol.envelope import open_envelope
from protocol.episodes import EpisodeBatch
from protocol.errors import RemoteProtocolError
from protocol.limits import MAX_FRAME_BYTES, MAX_REPAIR_SEQS, REPAIR_KEEP
from protocol.messages import RepairRequest, RepairResponse, RolloutBatch, RolloutGroup, repair_response_had_room
from protocol.sequence import Observation, SequenceTracker
from protocol.staleness import admissible

log = logging.getLogger(__name__)

# A joined peer is safe from eviction, and its deliveries count towards splitting demand, for
# this long after it joined or last had rollouts accepted.
ACTIVE_WINDOW_S = 15.0
# A publisher that does not answer a repair request within this is treated as gone.
REPAIR_TIMEOUT_S = 10.0
REPAIRS_AT_ONCE = 8
# How stale the demand split may be when nothing joined, left or delivered since.
EFFECTIVE_REFRESH_S = 1.0
# Verified batches waiting for the consumer; more than a subscription queue's worth means the
# consumer fell behind and re-checks the rest.
CHECKED_CACHE = 1024
# Validated batches waiting in the subscription queue for the consumer (which runs the spot
# checks one at a time) are bounded by what they hold, not by count: in total and per publisher;
# and a publisher on probation (its batches all spot-checked) has at most one in the queue or
# being checked. Beyond either, a batch is an `overload` drop (no strike: an honest peer meets it
# while a slow check runs) that gap repair asks for again later. What a batch holds is its bytes
# and its decoded form: CPython keeps ~35 bytes per number of a tuple of ints or floats (measured
# on decoded RolloutBatches; a zstd-compressed batch decodes to ~70x its size).
MAX_UNCHECKED_BYTES = 64 << 20
MAX_UNCHECKED_PER_PEER = 16 << 20
HELD_BYTES_PER_NUMBER = 40
# What a batch that fell out of the validator's cache is taken to hold, per byte of the wire.
DECODED_PER_WIRE_BYTE = 70
# Penalty counts kept for peers that never joined (forwarders, strangers), oldest forgotten
# first; bans kept at most, the one ending first forgotten first.
MAX_STRANGERS = 4096
MAX_BANS = 65536
# Batches of young publishers waiting beside the intake for the checker, at most (each holds a
# decoded batch: bounded like the subscription queue's).
BESIDE_WAITING = 4
# Skipped seqs a publisher may have before it is caught: a fixed allowance (what a restart loses
# in flight, repairs that time out) plus a share of the seqs it delivered.
SKIP_ALLOWANCE = 256
SKIP_SHARE = 0.05
# Seqs a publisher may disown (say it never published, inside the horizon it must keep:
# protocol/limits.py REPAIR_KEEP) before it is caught. An honest publisher disowns none; the
# allowance only absorbs a peer that keeps fewer than the rule asks.
DISOWN_ALLOWANCE = 8
DISOWN_HORIZON = REPAIR_KEEP // 2
# Refusals no honest peer earns: its claims did not survive the learner's checks.
CHEATING = frozenset(
    {DropReason.BAD_REWARD, DropReason.BAD_PROMPT, DropReason.BAD_COMPLETION, DropReason.BAD_LOGPROBS, DropReason.BAD_SAMPLING,
     DropReason.BAD_EPISODE}
)
# What a run's peers publish: rollout batches, or episode batches in a run with an environment.
Batch = RolloutBatch | EpisodeBatch


class JoinRefused(Exception):
    """A join the learner will not take (banned, or the peer table is full of active peers)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class PeerBook:
    """What the learner knows about each peer. Bounded: `max_peers` joined peers (the least
    recently heard idle one makes room), `MAX_STRANGERS` penalty entries for the rest."""

    max_peers: int = 1024
    ban_after: int = 3
    ban_s: float = 600.0
    # Joined peers -> when they joined or last had rollouts accepted (trio time), least recent
    # first. Kept by reference by the weight sources, which serve only members.
    joined: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # Groups contributed per joined peer within the last ACTIVE_WINDOW_S (`contributed`): (time, groups), oldest first.
    recent: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    # `effective_peers`' last answer and when (trio time): it is asked on every status request,
    # and walking every peer's window each time would make status O(peers).
    _effective: tuple[float, float] | None = None
    accepted: Counter[str] = field(default_factory=Counter)
    # Signed batches judged per joined peer (what a ban is measured in: how many it took).
    batches: Counter[str] = field(default_factory=Counter)
    penalties: Counter[str] = field(default_factory=Counter)
    # Banned peer -> wall-clock time the ban ends (wall clock: bans outlive the process), or
    # for bans counted in versions, the learner version it ends at (`version` tells the current).
    banned: dict[str, float] = field(default_factory=dict)
    banned_until_version: dict[str, int] = field(default_factory=dict)
    version: Callable[[], int] = lambda: 0
    # Data addresses a dial-back proved (handed to other peers as relays), and why the others
    # are not (they download and contribute, but are never handed out).
    relays: dict[str, tuple[str, int]] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)

    def join(self, peer_id: str, now: float) -> None:
        """Admit `peer_id` (JoinRefused if banned, or if the table is full of active peers)."""
        if self.is_banned(peer_id):
            raise JoinRefused("banned", f"{peer_id} is banned from this run for bad messages")
        if peer_id not in self.joined and len(self.joined) >= self.max_peers:
            oldest, seen = next(iter(self.joined.items()))
            if now - seen <= ACTIVE_WINDOW_S:
                raise JoinRefused("full", f"this run has {self.max_peers} active peers, the most it takes")
            self.leave(oldest)
        self.joined[peer_id] = now
        self.joined.move_to_end(peer_id)

    def leave(self, peer_id: str) -> None:
        self.joined.pop(peer_id, None)
        self.recent.pop(peer_id, None)
        self._effective = None
        self.relays.pop(peer_id, None)
        self.unreachable.pop(peer_id, None)
        self.accepted.pop(peer_id, None)
        self.batches.pop(peer_id, None)

    def contributed(self, peer_id: str, groups: int, now: float) -> None:
        """A joined peer's checked groups arrived (accepted, or late in pull mode): it is active
        (requests alone never make a peer active, so a peer that only asks cannot shrink
        anyone's demand)."""
        if peer_id not in self.joined:
            return
        self.joined[peer_id] = now
        self.joined.move_to_end(peer_id)
        window = self.recent.setdefault(peer_id, deque())
        window.append((now, groups))
        _prune(window, now)
        self._effective = None

    def effective_peers(self, now: float) -> float:
        """How many full-rate peers the recent contributions amount to: groups contributed in the
        window over the most any one peer delivered (>= 1). Equal peers count as their number;
        a peer (or a hundred Sybils) delivering a trickle counts as that trickle, not as a head,
        so it cannot cut the demand of the peers that do the work. Recomputed on a contribution or
        a departure, else at most every EFFECTIVE_REFRESH_S (windows age out in between)."""
        if self._effective is not None and now - self._effective[0] < EFFECTIVE_REFRESH_S:
            return self._effective[1]
        totals = []
        for window in self.recent.values():
            _prune(window, now)
            totals.append(sum(n for _, n in window))
        top = max(totals, default=0)
        value = max(1.0, sum(totals) / top) if top else 1.0
        self._effective = (now, value)
        return value

    def penalize(self, peer_id: str, *, strikes: int = 1, until_version: int | None = None) -> bool:
        """Count an offence (`strikes` of them); True if it got the peer banned just now (until
        `until_version` if given, else for `ban_s` seconds)."""
        self.penalties[peer_id] += strikes
        excess = len(self.penalties) - self.max_peers - MAX_STRANGERS
        if excess > 0:  # forget the oldest strangers' counts (insertion order; the first found)
            forget = []
            for p in self.penalties:
                if p not in self.joined and p != peer_id:
                    forget.append(p)
                    if len(forget) == excess:
                        break
            for p in forget:
                del self.penalties[p]
        if self.penalties[peer_id] < self.ban_after or self.is_banned(peer_id):
            return False
        bans: dict[str, Any] = self.banned if until_version is None else self.banned_until_version
        if len(bans) >= MAX_BANS:
            # The ban ending first: every ban of a kind lasts as long (ban_s; ban_versions from
            # the version it was given at), so the one given first. O(1), not a scan.
            del bans[next(iter(bans))]
        bans[peer_id] = time.time() + self.ban_s if until_version is None else until_version
        self.leave(peer_id)
        return True

    def is_banned(self, peer_id: str) -> bool:
        until = self.banned.get(peer_id)
        if until is not None and until > time.time():
            return True
        until_version = self.banned_until_version.get(peer_id)
        if until_version is not None and until_version > self.version():
            return True
        if until is not None or until_version is not None:
            self.banned.pop(peer_id, None)
            self.banned_until_version.pop(peer_id, None)
            self.penalties.pop(peer_id, None)
        return False

    def banned_peers(self) -> set[str]:
        """Peers under a ban of either kind (some may have ended: `is_banned` lifts those)."""
        return {*self.banned, *self.banned_until_version}

    def score(self, peer_id: str) -> float:
        """GossipSub's application score: a peer below its graylist threshold is ignored."""
        banned = peer_id in self.banned or peer_id in self.banned_until_version
        return -10.0 * self.penalties.get(peer_id, 0) - (1000.0 if banned else 0.0)

    def live_bans(self) -> tuple[dict[str, float], dict[str, int]]:
        """The bans in force, by wall-clock end and by version (what the ban log compacts to)."""
        now, version = time.time(), self.version()
        return (
            {p: until for p, until in self.banned.items() if until > now},
            {p: until for p, until in self.banned_until_version.items() if until > version},
        )

    def restore_bans(self, by_time: dict[str, float], by_version: dict[str, int]) -> None:
        """Bans of an earlier run of this learner (echo_node/learner/banlog.py), those not ended, in the
        order they end (the table forgets the one ending first when full)."""
        now = time.time()
        for peer, until in sorted(by_time.items(), key=lambda kv: kv[1])[-MAX_BANS:]:
            if until > now:
                self.banned[peer] = until
        # A learner restarted from version 0 keeps the bans it gave in versions, whole.
        for peer, until_version in sorted(by_version.items(), key=lambda kv: kv[1])[-MAX_BANS:]:
            self.banned_until_version[peer] = until_version


def held_numbers(batch: Batch) -> int:
    """The numbers a decoded batch keeps: prompt ids, and per sample its ids, log-probs and
    token versions (per episode, as many per token: an environment token's id counts the same)."""
    if isinstance(batch, EpisodeBatch):
        return sum(len(g.prompt_ids) + sum(3 * e.num_tokens for e in g.episodes) for g in batch.groups)
    return sum(len(g.prompt_ids) + sum(3 * len(x.completion_ids) for x in g.samples) for g in batch.groups)


def _prune(window: deque[tuple[float, int]], now: float) -> None:
    """Drop a peer's contributions older than ACTIVE_WINDOW_S."""
    while window and now - window[0][0] > ACTIVE_WINDOW_S:
        window.popleft()


class RolloutIntake:
    def __init__(
        self,
        run: RunBounds,
        buffer: ReplayBuffer,
        peers: PeerBook,
        *,
        version: Callable[[], int],
        topic: str,
        bans_path: Path | None = None,
        on_first_accept: Callable[[str], None] = lambda peer: None,
        on_accept: Callable[[str, int, int], None] = lambda peer, version, rollouts: None,
        on_caught: Callable[[dict[str, Any]], None] = lambda record: None,
        verify: Verifier | None = None,
        ban_versions: int = 1000,
        node: Host | None = None,
        journal: Journal | None = None,
        published: Callable[[int], bool] | None = None,
        episodes: EpisodeGate | None = None,
    ) -> None:
        """`node`: the gossip node penalties and repair requests go to (None: neither);
        `journal`: the learner's write-ahead journal (new seqs are journaled, so a restart
        rebuilds the tracker); `published`: which version numbers the learner published;
        `episodes`: the run's environment gate (echo_node/envs/gate.py): its peers publish
        episode batches, and nothing else is taken."""
        self.run = run
        self.buffer = buffer
        self.peers = peers
        self.version = version
        self.topic = topic
        self.on_first_accept = on_first_accept
        # Each accepted group: its publisher, the version it was begun on, its rollouts.
        self.on_accept = on_accept
        self.on_caught = on_caught
        # The learner's checks of what a batch claims (echo_node/learner/spot_check.py); None: none.
        self.verify = verify
        self.ban_versions = ban_versions
        self.copies = Copies() if verify is not None else None
        # Why the last refused batch failed verification, for the ban's log line.
        self._evidence = ""
        # Spot checks run one at a time, in a worker thread (they own one model copy).
        self._spot_lock = trio.Lock()
        # `consume`'s nursery: checks of publishers past probation run there, beside the intake,
        # one at a time; a young publisher's may wait there for the checker (`admit`). Checks
        # started there, in all and per publisher.
        self._beside: trio.Nursery | None = None
        self._beside_checks = 0
        self._beside_by: Counter[str] = Counter()
        self.node = node
        self.tracker = SequenceTracker()
        self.journal = journal
        self.published = published
        self.episodes = episodes
        # Whose episode batches are re-run now (echo_node/envs/gate.py); whether the last batch
        # found every environment thread hung (logged once per spell).
        self.rerun_cooldown = RerunCooldown(episodes.rerun_bound_s) if episodes is not None else None
        self._env_exhausted = False
        # The learner's version when the tracker last forgot a publisher (see the module rules).
        self._forgot_at = -1
        # Messages seen missing from a publisher's sequence and never recovered by repair. They
        # never reached the learner, so they are not in the rollout ledger; counted here instead.
        self.lost_messages = 0
        self._arrived = trio.Event()
        # Batches the gossip validator verified, by their bytes, for the consumer to take.
        self._checked: OrderedDict[bytes, Batch] = OrderedDict()
        # Batches let into the subscription queue (`queue_admits`): their bytes -> (publisher,
        # what each copy holds, copies queued); totals; and per publisher the ones queued or
        # being checked.
        self._queued: dict[bytes, tuple[str, int, int]] = {}
        self.unchecked_bytes = 0
        self._unchecked_by: Counter[str] = Counter()
        self._in_flight: Counter[str] = Counter()
        self._repairing: set[str] = set()
        self._owing = trio.Event()  # a publisher owes more than DISOWN_ALLOWANCE seqs (`repair_loop`)
        self._repair_slots = trio.CapacityLimiter(REPAIRS_AT_ONCE)
        # Bans outlive the process (echo_node/learner/banlog.py); `ban_log.run` writes them.
        self.ban_log = BanLog(bans_path) if bans_path is not None else None
        if self.ban_log is not None:
            peers.restore_bans(*self.ban_log.load())

    # -- checks ----------------------------------------------------------------------------------

    def check(self, data: bytes, origin: str) -> tuple[Batch | None, DropReason | None, int]:
        """Verify and judge one message from `origin`: (batch, None, rollouts) to take it, or
        (batch or None, reason, rollouts to count as dropped)."""
        if self.peers.is_banned(origin):
            return None, DropReason.BANNED, 1
        if origin not in self.peers.joined:
            log.info("dropped a rollout message from %s, which has not joined the run", origin)
            return None, DropReason.NOT_JOINED, 1
        kind = RolloutBatch if self.episodes is None else EpisodeBatch
        try:
            batch, _ = open_envelope(data, expected_kind=kind, expected_sender=origin)
        except RemoteProtocolError as exc:
            log.warning("rejected a rollout message from %s: %s", origin, exc)
            return None, exc.reason, 1
        if isinstance(batch, EpisodeBatch):
            return self._check_episodes(batch, origin)
        assert isinstance(batch, RolloutBatch)
        n = batch.num_samples
        reason = judge_batch(batch, run=self.run, current_version=self.version(), published=self.published)
        if reason is not None:
            log.warning(
                "rejected %d rollouts from %s: %s (run %r, newest token version %d, learner at %d)",
                n, origin, reason, batch.run_id, batch.max_version, self.version(),
            )
            self._evidence = f"{reason} on arrival"
            self.peers.batches[origin] += 1
            return batch, reason, n
        failure = self.verify.claims(batch) if self.verify is not None else None
        if failure is not None:
            self._evidence = failure.evidence
            self.peers.batches[origin] += 1
            return batch, failure.reason, n
        return batch, None, n

    def _check_episodes(self, batch: EpisodeBatch, origin: str) -> tuple[Batch, DropReason | None, int]:
        """`check`'s cheap part for an episode batch (the gate's checks 2-3); the re-run of the
        environment comes in the consumer (`admit`)."""
        assert self.episodes is not None
        n = batch.num_samples
        refused = self.episodes.judge(batch, current_version=self.version(), published=self.published)
        if refused is None or refused.drop is DropReason.STALE:
            # Staleness is the buffer's to judge (`ReplayBuffer.offer`), as for rollout batches:
            # no strike, and in pull mode the work still counts in the demand split.
            return batch, None, n
        assert refused.drop is not None
        log.warning("rejected %d episodes from %s: %s (%s)", n, origin, refused.drop, refused.detail)
        self._evidence = f"{refused.drop} on arrival: {refused.detail}"
        self.peers.batches[origin] += 1
        return batch, refused.drop, n

    def validate(self, forwarder: str, origin: str, data: bytes) -> bool:
        """The gossip validator: True passes the message on (to other subscribers and to
        `deliver`); a refusal is counted, and charged to the origin and the forwarder."""
        batch, reason, n = self.check(data, origin)
        if reason is None:
            assert batch is not None
            # The consumer takes it from here instead of verifying the signature a second time.
            self._checked[data] = batch
            while len(self._checked) > CHECKED_CACHE:
                self._checked.popitem(last=False)
            return True
        self.buffer.reject(reason, n)
        if reason in CHEATING:
            self.caught(origin, reason)
        elif reason is DropReason.UNSUPPORTED_SCHEMA:
            # An honest peer running another release, not an offence: no strike (refused before
            # its signature is checked, so cheap); GossipSub's score still weighs it.
            if self.node is not None:
                self.node.penalize(origin, self.topic)
        elif reason not in (DropReason.NOT_JOINED, DropReason.BANNED):
            self.penalize(origin, f"rollout refused: {reason}")
            if forwarder != origin:
                self.penalize(forwarder, f"relayed a refused rollout of {origin}")
        return False

    def judge_skips(self, peer_id: str) -> bool:
        """Catch `peer_id` if it skipped more of its seqs than honest loss explains (module
        rules); True if it was caught now."""
        skipped, delivered = self.tracker.skips(peer_id)
        disowned = self.tracker.disowned(peer_id)
        if self.peers.is_banned(peer_id):
            return False
        if disowned > DISOWN_ALLOWANCE:
            self._evidence = (f"it said it never published {disowned} of its sequence numbers below seqs it delivered "
                              f"(it delivered {delivered}): the prompts of those seqs were assigned to it, and leaving "
                              f"them out chose its prompts")
        elif skipped > SKIP_ALLOWANCE + SKIP_SHARE * delivered:
            self._evidence = (f"it left out {skipped} of its sequence numbers and delivered {delivered}: the prompts of the "
                              f"seqs it skipped were assigned to it (more than {SKIP_ALLOWANCE} + {SKIP_SHARE:.0%} is a choice)")
        else:
            return False
        self.caught(peer_id, DropReason.BAD_PROMPT)
        return True

    def catch(self, peer_id: str, failure: Failure) -> None:
        """`caught`, for a failure found outside the intake (the learner's audit of a step)."""
        self._evidence = failure.evidence
        self.caught(peer_id, failure.reason)

    def caught(self, peer_id: str, reason: DropReason) -> None:
        """A batch failed verification: ban its publisher at once for `ban_versions` versions
        and purge its groups still waiting to be trained, with one WARNING naming the check and
        the evidence."""
        purged = self.buffer.purge(peer_id)
        until = self.version() + self.ban_versions
        # What of its data had reached training already: the count, and its last groups' ids
        # (the operator's measure of the damage; a benchmark's of what its lies bought).
        trained = list(self.buffer.trained_ids.get(peer_id, ()))
        self.on_caught({"peer": peer_id, "reason": str(reason), "evidence": self._evidence[:500],
                        "batches": self.peers.batches[peer_id], "purged": purged, "until_version": until,
                        "trained_groups": self.buffer.trained_groups[peer_id], "trained_recent": trained})
        log.warning(
            "caught %s: %s (%s); banned until version %d, %d buffered rollouts purged", peer_id, reason, self._evidence, until, purged
        )
        self.penalize(peer_id, f"{reason}: {self._evidence}", strikes=self.peers.ban_after, until_version=until)

    def ban(self, peer_id: str, why: str) -> None:
        """Ban at once: for offences no honest peer commits."""
        self.penalize(peer_id, why, strikes=self.peers.ban_after)

    def penalize(self, peer_id: str, why: str, *, strikes: int = 1, until_version: int | None = None) -> None:
        if self.verify is not None:
            self.verify.suspect(peer_id)
        if self.peers.penalize(peer_id, strikes=strikes, until_version=until_version):
            term = f"{self.peers.ban_s:.0f}s" if until_version is None else f"until version {until_version}"
            log.warning("banned %s for %s: %s", peer_id, term, why)
            self.tracker.forget(peer_id)
            if self.ban_log is not None:
                if until_version is None:
                    self.ban_log.record(peer_id, until_time=self.peers.banned[peer_id])
                else:
                    self.ban_log.record(peer_id, until_version=until_version)
        if self.node is not None:
            self.node.penalize(peer_id, self.topic)

    def queue_admits(self, msg: Any) -> bool:
        """Whether a validated message may wait in the subscription queue for the consumer (the
        bounds above); False makes it an overload drop (`overflowed`)."""
        batch = self._checked.get(msg.data)
        decoded = HELD_BYTES_PER_NUMBER * held_numbers(batch) if batch is not None else DECODED_PER_WIRE_BYTE * len(msg.data)
        held = len(msg.data) + decoded
        origin = msg.sender
        if self.unchecked_bytes + held > MAX_UNCHECKED_BYTES or self._unchecked_by[origin] + held > MAX_UNCHECKED_PER_PEER:
            return False
        if self._in_flight[origin] and self.verify is not None and self.verify.on_probation(origin):
            return False
        # The same bytes may be queued twice (republished under another gossip seqno): each copy
        # is accounted and released on its own, or a replayed message would leak the budget.
        _, _, copies = self._queued.get(msg.data, (origin, held, 0))
        self._queued[msg.data] = (origin, held, copies + 1)
        self.unchecked_bytes += held
        self._unchecked_by[origin] += held
        self._in_flight[origin] += 1
        return True

    def _dequeued(self, data: bytes) -> str | None:
        """A queued message left the queue: its bytes are released (its publisher's in-flight
        count only when its check is done). Returns its publisher if it was queued."""
        entry = self._queued.get(data)
        if entry is None:
            return None
        origin, held, copies = entry
        if copies > 1:
            self._queued[data] = (origin, held, copies - 1)
        else:
            del self._queued[data]
        self.unchecked_bytes -= held
        self._unchecked_by[origin] -= held
        if not self._unchecked_by[origin]:
            del self._unchecked_by[origin]
        return origin

    def _done(self, origin: str) -> None:
        self._in_flight[origin] -= 1
        if self._in_flight[origin] <= 0:
            del self._in_flight[origin]

    def overflowed(self, msg: Any) -> None:
        """A validated message the subscription queue had no room for (the consumer fell
        behind, or the bounds on unchecked batches): counted as overload, so the ledger still
        sees every rollout it passed."""
        origin = self._dequeued(msg.data)
        if origin is not None:
            self._done(origin)
        batch = self._checked.pop(msg.data, None)
        self.buffer.reject(DropReason.OVERLOAD, batch.num_samples if batch is not None else 1)

    async def deliver(self, data: bytes, origin: str) -> None:
        """Admit a message the gossip validator passed, as the validator decoded it."""
        queued = self._dequeued(data)
        try:
            await self._deliver(data, origin)
        finally:
            if queued is not None:
                self._done(queued)

    async def _deliver(self, data: bytes, origin: str) -> None:
        batch = self._checked.pop(data, None)
        if batch is None:  # fell out of the cache: check it again
            batch, reason, n = self.check(data, origin)
            if reason is not None or batch is None:
                # Valid a moment ago; the peer was banned or evicted since, or the cache
                # overflowed on a version boundary. Counted, not lost.
                self.buffer.reject(reason or DropReason.MALFORMED, n)
                return
        await self.admit(batch, origin)

    async def admit(self, batch: Batch, origin: str) -> None:
        """Spot-check what `batch`'s publisher's turn calls for, then ingest it.

        A probation check holds the intake until it is done (a newcomer's batches are all
        checked, one in the queue at a time). A later check runs beside the intake, in
        `consume`'s nursery, so other peers' batches go on reaching the buffer meanwhile (the
        learner waited behind each check before); the batch is ingested when its check passed.
        One such check at a time: a batch chosen while one runs is not checked (`checker_busy`,
        like a check the budget cannot afford), unless its publisher is still earning trust
        (`Verifier.earning`): then it waits beside for the checker (one batch per publisher
        besides the one being checked, BESIDE_WAITING in all), so a newcomer past probation
        cannot slip batches past the checks by sending them while the checker is busy with
        others, and one that finds no room to wait is dropped as `unchecked`: every batch of
        such a publisher that is chosen is checked (the budget does not excuse one either,
        `Verifier.plan`) or not trained."""
        if self.peers.is_banned(origin):  # caught on a batch validated after this one, or queued before it
            self.buffer.reject(DropReason.BANNED, batch.num_samples)
            return
        # Batches judged per peer, in the order judged: a refused one when refused, a passed one here.
        self.peers.batches[origin] += 1
        if isinstance(batch, EpisodeBatch):
            await self._admit_episodes(batch, origin)
            return
        plan = self.verify.plan(batch) if self.verify is not None else None
        if plan is not None and not plan.probation and self._beside is not None:
            assert self.verify is not None
            earning = self.verify.earning(origin)
            if not self._beside_checks or (
                earning and self._beside_by[origin] < 2 and self._beside_checks <= BESIDE_WAITING
            ):
                self._beside_checks += 1
                self._beside_by[origin] += 1
                self._beside.start_soon(self._check_beside, batch, origin, plan)
                return
            if earning:
                # Never trained unchecked: dropped, counted, its seq delivered (not a skip).
                self.verify.stats.unproven_dropped += 1
                self.ingest(batch, origin, take=False)
                return
            self.verify.stats.checker_busy += 1
            plan = None
        if plan is None or await self._passes(batch, origin, plan):
            self.ingest(batch, origin)

    async def _admit_episodes(self, batch: EpisodeBatch, origin: str) -> None:
        """Every episode batch of a deterministic environment is re-run in full
        (echo_node/envs/verify.py): no sample of batches would do, since one fabricated
        observation is the whole lie (an untrusted-only environment's get the runner's rules on
        their tokens only). Then its model tokens are spot-checked as a rollout batch's are
        (`Verifier.plan`). Both in a worker thread under the spot lock, holding the intake like
        a probation check. A forgery gets its publisher caught. Whatever the environment does
        on the learner (raises, hangs, takes every thread) drops the batch with nobody blamed
        (its seq was delivered): env_failed, env_timeout or env_unavailable, the last also for
        a publisher in its cooldown (`RerunCooldown`), whose batch is dropped without a re-run."""
        assert self.episodes is not None and self.rerun_cooldown is not None
        buffer, current = self.buffer, self.version()
        if buffer.mode == "async" and all(admissible(g.min_version, current, buffer.staleness, "async") for g in batch.groups):
            # Stale before it is re-run: the buffer drops it as stale (no blame), unverified and
            # never trained. (In pull mode a late batch still counts as its publisher's work in
            # the demand split, so only a verified one may: it is re-run first.)
            self.ingest(batch, origin)
            return
        if self.rerun_cooldown.refuses(origin, trio.current_time(), hung=hung_threads(origin)):
            self.ingest(batch, origin, take=False, drop=DropReason.ENV_UNAVAILABLE)
            return
        async with self._spot_lock:
            verdict = await offload.run_sync(self.episodes.rerun, batch, origin)
        self._env_health(verdict.drop, origin, trio.current_time(), verdict.detail)
        if verdict.drop is DropReason.BAD_EPISODE:
            self.buffer.reject(verdict.drop, batch.num_samples)
            if not self.peers.is_banned(origin):
                self._evidence = verdict.detail
                self.caught(origin, verdict.drop)
            return
        if self.peers.is_banned(origin):  # caught while its batch was being re-run
            self.buffer.reject(DropReason.BANNED, batch.num_samples)
            return
        if verdict.drop is not None:
            log.info("dropped %d episodes of %s: %s (%s)", batch.num_samples, origin, verdict.drop, verdict.detail)
            self.ingest(batch, origin, take=False, drop=verdict.drop)
            return
        # The model's tokens of the episodes the re-run passed: log-probs and sampling, as a
        # rollout batch's (probation, then a share); inline, holding the intake like the re-run.
        plan = self.verify.plan(batch) if self.verify is not None else None
        if plan is None or await self._passes(batch, origin, plan):
            self.ingest(batch, origin)

    def _env_health(self, drop: DropReason | None, origin: str, now: float, detail: str) -> None:
        """What a re-run's end says of the learner's environment: the publisher's cooldown, and
        one WARNING when every environment thread is taken (an INFO once one is free again)."""
        assert self.rerun_cooldown is not None
        cooldown = self.rerun_cooldown.record(origin, drop, now)
        if cooldown is not None:
            log.info("the environment failed re-running %s's episodes (%s, %s): its batches are not re-run for %gs",
                     origin, drop, detail, cooldown)
        exhausted = drop is DropReason.ENV_UNAVAILABLE
        if exhausted and not self._env_exhausted:
            log.warning("every environment thread of this learner is taken by hung calls (%d hung): episode batches are "
                        "dropped as env_unavailable until hung calls end", hung_threads())
        elif self._env_exhausted and not exhausted:
            log.info("environment threads are free again: episode batches are re-run")
        self._env_exhausted = exhausted

    async def _check_beside(self, batch: RolloutBatch, origin: str, plan: SpotPlan) -> None:
        try:
            passed = await self._passes(batch, origin, plan)
        finally:
            self._beside_checks -= 1
            self._beside_by[origin] -= 1
            if not self._beside_by[origin]:
                del self._beside_by[origin]
        if passed:
            self.ingest(batch, origin)

    async def _passes(self, batch: Batch, origin: str, plan: SpotPlan) -> bool:
        """Run `plan`'s spot check on `batch`; False if it failed (the publisher is caught, once:
        a check of another of its batches that ends after the ban only counts the drop) or the
        publisher was banned meanwhile (the batch is counted either way)."""
        assert self.verify is not None
        async with self._spot_lock:
            check = partial(self.verify.spot, batch, plan.groups, rows=plan.rows, budgeted=plan.budgeted)
            failure = await offload.run_sync(check)
        if failure is not None:
            self.buffer.reject(failure.reason, batch.num_samples)
            if not self.peers.is_banned(origin):
                self._evidence = failure.evidence
                self.caught(origin, failure.reason)
            return False
        if self.peers.is_banned(origin):  # caught while its batch was being checked
            self.buffer.reject(DropReason.BANNED, batch.num_samples)
            return False
        return True

    def ingest(self, batch: Batch, origin: str, *, take: bool = True, drop: DropReason = DropReason.UNCHECKED) -> None:
        """Observe `batch`'s seq and buffer its groups (`take`), or drop them as `drop`."""
        # The seq and the fate of the batch's groups are journaled as one: a restart that knows
        # the seq arrived knows what became of it (else gap repair asks for it again).
        if self.journal is None:
            self._ingest(batch, origin, take, drop)
            return
        self.journal.begin()
        try:
            self._ingest(batch, origin, take, drop)
        finally:
            self.journal.commit()

    def _ingest(self, batch: Batch, origin: str, take: bool = True, drop: DropReason = DropReason.UNCHECKED) -> None:
        current = self.version()
        known = origin in self.tracker
        if not known and batch.max_version <= self._forgot_at:
            # The tracker may have forgotten this publisher: an old batch is indistinguishable
            # from a replay, and only newer tokens than at that moment prove it is not one.
            self.buffer.reject(DropReason.TOO_OLD, batch.num_samples)
            return
        forgetting = not known and len(self.tracker) >= self.tracker.capacity
        observation = self.tracker.observe(origin, batch.seq)
        if forgetting:
            self._forgot_at = current
        if observation is not Observation.NEW:
            reason = DropReason.DUPLICATE if observation is Observation.DUPLICATE else DropReason.TOO_OLD
            self.buffer.reject(reason, batch.num_samples)
            return
        if self.judge_skips(origin):  # a jump over seqs it owed
            self.buffer.reject(DropReason.BANNED, batch.num_samples)
            return
        if self.tracker.owed(origin) > DISOWN_ALLOWANCE and origin not in self._repairing:
            self._owing.set()
        if self.journal is not None:
            self.journal.append(["seen", origin, batch.seq])
        if not take:
            self.buffer.reject(drop, batch.num_samples)
            return
        # Groups that count as the peer's work in the demand split (`PeerBook.contributed`):
        # those accepted, and in pull mode also those that passed every check but came after
        # their version was trained. A pull peer that is always the last to finish would
        # otherwise never count, the split would leave it out, and its work would always come
        # too late: starved for good while it samples exactly as asked.
        taken = worked = 0
        for group in batch.groups:
            # Episodes are not copied from another publisher: their seeds are the publisher's own
            # slots, and the re-run holds every observation to them.
            if self.copies is not None and isinstance(group, RolloutGroup):
                first, strike = self.copies.first_sender(group, origin)
            else:
                first, strike = origin, False
            if first != origin:
                log.info("dropped a group of %s: %s sent the same prompt and completions first", origin, first)
                self.buffer.reject(DropReason.COPIED, group.num_rollouts)
                if strike:
                    self.penalize(origin, f"copied {COPIES_PER_STRIKE} groups others sent first that honest sampling would "
                                          "hardly give twice")
                continue
            dropped = self.buffer.offer(group, current, origin)
            if dropped is not None:
                worked += dropped is DropReason.STALE and self.buffer.mode == "pull"
                continue
            if not self.peers.accepted[origin]:
                self.on_first_accept(origin)
            self.peers.accepted[origin] += group.num_rollouts
            self.on_accept(origin, group.min_version, group.num_rollouts)
            taken += 1
            self._arrived.set()
        if taken + worked:
            self.peers.contributed(origin, taken + worked, trio.current_time())

    async def next_arrival(self) -> None:
        """Wait until a group entered the buffer since the last such wait returned (at once if one did)."""
        await self._arrived.wait()
        self._arrived = trio.Event()

    async def consume(self, messages: Any) -> None:
        async with trio.open_nursery() as nursery:
            self._beside = nursery
            try:
                async for msg in messages:
                    await self.deliver(msg.data, msg.sender)
            finally:
                self._beside = None

    # -- gap repair ------------------------------------------------------------------------------

    async def repair_loop(self, interval_s: float) -> None:
        """A repair round every `interval_s`, and at once when a publisher owes more seqs than
        DISOWN_ALLOWANCE: a publisher that leaves most of its seqs out then answers for them
        before its next few batches, not a whole interval of them later."""
        async with trio.open_nursery() as nursery:
            while True:
                with trio.move_on_after(interval_s):
                    await self._owing.wait()
                self._owing = trio.Event()
                for peer_id in list(self.peers.joined):
                    missing = self.tracker.missing(peer_id)
                    if missing and peer_id not in self._repairing:
                        self._repairing.add(peer_id)
                        nursery.start_soon(self._repair_slot, peer_id, missing)

    async def _repair_slot(self, peer_id: str, missing: list[int]) -> None:
        try:
            async with self._repair_slots:
                await self.repair(peer_id, missing)
        finally:
            self._repairing.discard(peer_id)

    async def repair(self, peer_id: str, missing: list[int]) -> None:
        assert self.node is not None
        request = RepairRequest(run_id=self.run.run_id, peer_id=peer_id, seqs=tuple(missing[:MAX_REPAIR_SEQS]))
        asked_below = self.tracker.highest(peer_id)
        try:
            with trio.fail_after(REPAIR_TIMEOUT_S):
                response = await rpc.call(self.node, peer_id, rpc.REPAIR, request, RepairResponse)
        except Exception as exc:
            # The publisher is gone or will not answer: what it alone held is lost in transit.
            log.info("gap repair from %s failed (%s); giving up on %d messages", peer_id, exc, len(missing))
            self.tracker.mark_given_up(peer_id, missing)
            self.lost_messages += len(missing)
            self.judge_skips(peer_id)
            return
        recovered: set[int] = set()
        for envelope in response.envelopes:
            batch, reason, n = self.check(envelope, peer_id)
            if reason is not None or batch is None:
                self.buffer.reject(reason or DropReason.MALFORMED, n)
                if reason in CHEATING:
                    self.caught(peer_id, reason)
                    return
                self.penalize(peer_id, f"bad repaired rollout: {reason}")
                continue
            await self.admit(batch, peer_id)
            if self.peers.is_banned(peer_id):
                return
            recovered.add(batch.seq)
        # What the publisher no longer has is gone for good; stop asking for it. Seqs that did
        # not fit in this response stay missing and are asked for on the next round. Within the
        # horizon it keeps, "unavailable" means it never published the seq (module rules).
        recent = [s for s in response.unavailable if asked_below is not None and asked_below - s < DISOWN_HORIZON]
        older = [s for s in response.unavailable if asked_below is None or asked_below - s >= DISOWN_HORIZON]
        self.tracker.mark_given_up(peer_id, recent, disowned=True)
        self.tracker.mark_given_up(peer_id, older)
        if repair_response_had_room(response, frame_bytes=MAX_FRAME_BYTES):  # not left out for want of space
            left_out = (set(request.seqs) - recovered - set(response.unavailable)).intersection(self.tracker.missing(peer_id))
            self.tracker.mark_given_up(peer_id, left_out)
            self.lost_messages += len(left_out)
        self.lost_messages += len(response.unavailable)
        self.judge_skips(peer_id)
        log.info("gap repair from %s: %d of %d missing messages recovered", peer_id, len(recovered), len(missing))

    # -- demand ----------------------------------------------------------------------------------

    def demand_groups(self, per_version: int, slack: float) -> int:
        """Groups each peer should sample per published version: the updates' worth until the
        next publication, split among the peers that deliver (`PeerBook.effective_peers`),
        with slack. Asking too much costs stale drops; asking too little idles the learner, so
        the split errs towards asking too much."""
        return max(1, math.ceil(per_version * slack / self.peers.effective_peers(trio.current_time())))

