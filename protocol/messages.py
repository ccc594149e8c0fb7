"""Typed protocol messages with strict, bounded encode/decode. No I/O.

Job: define every message echo-node peers exchange, and the only way to turn one into wire values
(`to_wire`) and back (`from_wire`).

Wire form: a message is a msgpack *array* of its fields in declaration order (nested messages are
nested arrays; config dicts are maps with sorted keys). Arrays rather than maps make the encoding
canonical, which signatures rely on (envelope.py), and keep rollouts small.

Invariants:
- Constructing a message validates every field (presence, type, bound, cross-field rules); an
  invalid local construction raises LocalProtocolError naming the field.
- `from_wire` accepts exactly what a valid construction produces: the right number of fields,
  strict types (no bool for int, no int for float), finite floats, bounded ints, strings, lists
  and bytes. Anything else raises RemoteProtocolError naming the field (e.g.
  "RolloutGroup.samples[3]: Sample.reward: must be finite, got nan").
- `from_wire(m.to_wire()) == m` for every valid message m.

Messages are frozen dataclasses; list-valued fields are stored as tuples (a list passed in is
converted), so messages are immutable except for the config dicts inside `RunSpec`, which are
normalized copies the caller must not mutate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, TypeAlias, TypeVar, overload

from protocol._wire import pack, unpack_strict
from protocol.drops import DropReason
from protocol.episodes import EpisodeBatch
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.fields import (
    ConfigDict,
    WireMessage,
    _bytes,
    _config,
    _data_host,
    _fail,
    _float,
    _int,
    _ints,
    _logprobs,
    _nested_seq,
    _peer_id,
    _run_id,
    _seq,
    _set,
    _token_versions,
    _sha256,
    _short,
    _str,
)
from protocol.limits import (
    ERROR_CODE_PATTERN,
    MAX_PRICE_PER_HOUR,
    MAX_ABS_REWARD,
    MAX_BATCH_GROUPS,
    MAX_DEMAND_GROUPS,
    MAX_FRAME_BYTES,
    MAX_GROUP_SIZE,
    MAX_MESSAGE_BYTES,
    MAX_NAME_LEN,
    MAX_PROMPT_TOKENS,
    MAX_REPAIR_SEQS,
    MAX_SEQ,
    MAX_STALENESS,
    MAX_STR,
    MAX_TEMPERATURE,
    MAX_TOKENS_PER_SEQUENCE,
    MAX_VERSION,
    MAX_VOCAB,
    MAX_WEIGHTS_BYTES,
    MIN_GROUP_SIZE,
    ROLLOUT_BATCH_BYTES,
)
from protocol.weights.manifest import WeightManifest

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_VERSION",
    "ConfigDict",
    "ErrorResponse",
    "JoinRequest",
    "JoinResponse",
    "Message",
    "RepairRequest",
    "RepairResponse",
    "RolloutBatch",
    "RolloutGroup",
    "RunEnded",
    "RunSpec",
    "Sample",
    "SamplingParams",
    "StatusRequest",
    "StatusResponse",
    "SyncMode",
    "VersionAnnounce",
    "WireMessage",
    "check_schema",
    "decode_message",
    "encode_message",
    "expected_kind_name",
    "kind_of",
    "pack_groups",
    "pack_repair_response",
    "repair_response_had_room",
    "worst_group_bytes",
]

# Bumped on any incompatible change to a message layout or to a bound in limits.py that narrows
# what is accepted. Peers speaking another version are refused with a clear error, not misparsed.
SCHEMA_VERSION: Final = 10  # 2: rollouts travel as RolloutBatch; 3: manifests digest 16 KiB leaves;
# 4: a join request names the peer's data address, and data hosts are IP literals; 5: a sealed
# message is at most MAX_SEALED_BYTES and a message at most MAX_WIRE_ARRAYS arrays (the data
# channel's hello moved to v2 with it); 6: a group's prompt is the one its slot assigns
# (protocol/assignment.py); 7: run specs, status answers and version announcements name the
# learner's epoch (a resumed learner's versions continue; peers follow a newer epoch); 8: a
# status request is the peer's heartbeat (installed version, price, engine, device) and the
# answer says whether the peer is active or on standby (the capacity controller); 9: a slot no
# longer names the version its group began on (protocol/assignment.py: one prompt per seq); 10:
# a join answer names the seq a publisher the learner has seen goes on at (JoinResponse.seq_from)

SyncMode: TypeAlias = Literal["pull", "async"]
SYNC_MODES: Final = ("pull", "async")

# --- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams(WireMessage):
    """How rollout peers sample: temperature (0 = greedy), nucleus top_p, completion length cap."""

    temperature: float
    top_p: float
    max_new_tokens: int

    def __post_init__(self) -> None:
        w = "SamplingParams"
        _set(self, "temperature", _float(f"{w}.temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        _set(self, "top_p", _float(f"{w}.top_p", self.top_p, 0.0, 1.0))
        if self.top_p == 0.0:
            _fail(f"{w}.top_p", "must be > 0 (top_p = 0 keeps no tokens)")
        _set(self, "max_new_tokens", _int(f"{w}.max_new_tokens", self.max_new_tokens, 1, MAX_TOKENS_PER_SEQUENCE))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec(WireMessage):
    """What a joining peer needs to take part in a run (the discovery plane's answer to a join)."""

    KIND: ClassVar[str | None] = "run_spec"
    SIGNER_FIELD: ClassVar[str | None] = "learner_peer_id"  # a sealed spec is signed by its learner
    _NESTED: ClassVar[Mapping[str, type[WireMessage]]] = {"sampling": SamplingParams}

    run_id: str
    model: ConfigDict  # architecture config: str keys; scalar, list-of-scalar or one nested dict
    tokenizer: ConfigDict  # same constraints
    task: str
    sampling: SamplingParams
    sync_mode: SyncMode
    staleness: int  # S: async mode admits versions >= current - S (Echo)
    group_size: int  # completions per prompt (GRPO group)
    current_version: int
    learner_peer_id: str
    # Grows with every start of the run's learner (MAX_VERSION bounds it like a version).
    epoch: int

    def __post_init__(self) -> None:
        w = "RunSpec"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "model", _config(f"{w}.model", self.model))
        _set(self, "tokenizer", _config(f"{w}.tokenizer", self.tokenizer))
        _set(self, "task", _str(f"{w}.task", self.task, MAX_STR))
        if not isinstance(self.sampling, SamplingParams):
            _fail(f"{w}.sampling", f"expected SamplingParams, got {type(self.sampling).__name__}")
        if self.sync_mode not in SYNC_MODES:
            _fail(f"{w}.sync_mode", f"{_short(self.sync_mode)} is not one of {SYNC_MODES}")
        _set(self, "staleness", _int(f"{w}.staleness", self.staleness, 0, MAX_STALENESS))
        _set(self, "group_size", _int(f"{w}.group_size", self.group_size, MIN_GROUP_SIZE, MAX_GROUP_SIZE))
        _set(self, "current_version", _int(f"{w}.current_version", self.current_version, 0, MAX_VERSION))
        _set(self, "learner_peer_id", _peer_id(f"{w}.learner_peer_id", self.learner_peer_id))
        _set(self, "epoch", _int(f"{w}.epoch", self.epoch, 0, MAX_VERSION))


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample(WireMessage):
    """One completion with what the learner needs to train on it.

    Per-token `behaviour_logprobs` (log-probs under the sampling policy) drive truncated
    importance sampling; per-token `token_versions` support partial rollouts (Echo async mode:
    generation interrupted at a version boundary continues on the new weights), so versions are
    non-decreasing along a completion. A completion may be empty (it still carries a reward that
    enters the group's baseline); it then has no version of its own.
    """

    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    token_versions: tuple[int, ...]
    reward: float

    def __post_init__(self) -> None:
        w = "Sample"
        ids = _ints(f"{w}.completion_ids", self.completion_ids, MAX_TOKENS_PER_SEQUENCE, 0, MAX_VOCAB - 1)
        n = len(ids)
        lps = _logprobs(f"{w}.behaviour_logprobs", self.behaviour_logprobs, MAX_TOKENS_PER_SEQUENCE)
        if len(lps) != n:
            _fail(f"{w}.behaviour_logprobs", f"length {len(lps)} != len(completion_ids) {n}")
        vs = _token_versions(f"{w}.token_versions", self.token_versions, MAX_TOKENS_PER_SEQUENCE, MAX_VERSION)
        if len(vs) != n:
            _fail(f"{w}.token_versions", f"length {len(vs)} != len(completion_ids) {n}")
        _set(self, "completion_ids", ids)
        _set(self, "behaviour_logprobs", lps)
        _set(self, "token_versions", vs)
        _set(self, "reward", _float(f"{w}.reward", self.reward, -MAX_ABS_REWARD, MAX_ABS_REWARD))


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutGroup(WireMessage):
    """One group of completions for one prompt: GRPO's unit (advantages are relative within it).

    Travels only inside a `RolloutBatch`, which names the run and the publisher and is signed.
    At least one sample must contain a token: an all-empty group has nothing to train on and no
    version by which to judge its staleness.
    """

    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {"samples": (Sample, MAX_GROUP_SIZE)}

    group_id: str
    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        w = "RolloutGroup"
        _set(self, "group_id", _str(f"{w}.group_id", self.group_id, MAX_NAME_LEN))
        prompt = _ints(f"{w}.prompt_ids", self.prompt_ids, MAX_PROMPT_TOKENS, 0, MAX_VOCAB - 1, min_len=1)
        _set(self, "prompt_ids", prompt)
        samples = _nested_seq(f"{w}.samples", self.samples, Sample, MAX_GROUP_SIZE, min_len=1)
        if not any(s.completion_ids for s in samples):
            _fail(f"{w}.samples", "no sample has any completion token")
        _set(self, "samples", samples)

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group; empty samples do not count.

        This is the version the staleness rule judges: a group is as stale as its oldest token.
        """
        return min(s.token_versions[0] for s in self.samples if s.token_versions)

    @property
    def max_version(self) -> int:
        """Newest policy version of any token (a version above the learner's is a forgery)."""
        return max(s.token_versions[-1] for s in self.samples if s.token_versions)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)

    @property
    def num_rollouts(self) -> int:
        """What the learner's ledger counts of the group: its samples."""
        return len(self.samples)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutBatch(WireMessage):
    """The rollout record on the wire: one gossip message = the groups of one generation batch.

    `(peer_id, seq)` identifies it: `seq` is the publisher's own counter, so receivers detect gaps
    and duplicates (sequence.py) and repair them by seq. A publisher must never reuse a seq, also
    across restarts. Why several groups per message: the learner pays per gossip message
    (py-libp2p's message signature and signed peer record, our envelope signature), and one
    message per group cost ~20 % of its core on the default task (py-spy). `pack_groups`
    splits a generation batch's groups into batches that fit one gossip frame.
    """

    KIND: ClassVar[str | None] = "rollout_batch"
    SIGNER_FIELD: ClassVar[str | None] = "peer_id"  # the publisher signs its own rollouts
    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {
        "groups": (RolloutGroup, MAX_BATCH_GROUPS)
    }

    run_id: str
    peer_id: str
    seq: int
    groups: tuple[RolloutGroup, ...]

    def __post_init__(self) -> None:
        w = "RolloutBatch"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "peer_id", _peer_id(f"{w}.peer_id", self.peer_id))
        _set(self, "seq", _int(f"{w}.seq", self.seq, 0, MAX_SEQ))
        _set(self, "groups", _nested_seq(f"{w}.groups", self.groups, RolloutGroup, MAX_BATCH_GROUPS, min_len=1))

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    @property
    def max_version(self) -> int:
        """Newest policy version of any token in the batch."""
        return max(g.max_version for g in self.groups)


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinRequest(WireMessage):
    """A rollout peer asks the learner to join `run_id`, naming where its data channel listens
    (the learner dials it back before handing it out to others as a relay)."""

    KIND: ClassVar[str | None] = "join_request"
    SIGNER_FIELD: ClassVar[str | None] = "peer_id"

    run_id: str
    peer_id: str
    data_host: str
    data_port: int

    def __post_init__(self) -> None:
        _set(self, "run_id", _run_id("JoinRequest.run_id", self.run_id))
        _set(self, "peer_id", _peer_id("JoinRequest.peer_id", self.peer_id))
        _set(self, "data_host", _data_host("JoinRequest.data_host", self.data_host))
        _set(self, "data_port", _int("JoinRequest.data_port", self.data_port, 1, 65535))


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinResponse(WireMessage):
    """The learner's answer: the run spec, where its data channel listens
    (echo_node/weights/broadcast.py) and, to a publisher it has seen before, the seq it goes on
    at (`seq_from`; 0: none, the publisher numbers from its own base).

    Why the learner names it: every seq's prompts are assigned (protocol/assignment.py), so a
    publisher free to restart its numbering after a rejoin would pick where its next slots lie.
    Named, a rejoin costs nothing and chooses nothing: the publisher goes on right after the
    highest seq the learner saw from it."""

    KIND: ClassVar[str | None] = "join_response"
    _NESTED: ClassVar[Mapping[str, type[WireMessage]]] = {"spec": RunSpec}

    spec: RunSpec
    data_host: str
    data_port: int
    seq_from: int = 0

    def __post_init__(self) -> None:
        w = "JoinResponse"
        if not isinstance(self.spec, RunSpec):
            _fail(f"{w}.spec", f"expected RunSpec, got {type(self.spec).__name__}")
        _set(self, "data_host", _data_host(f"{w}.data_host", self.data_host))
        _set(self, "data_port", _int(f"{w}.data_port", self.data_port, 1, 65535))
        _set(self, "seq_from", _int(f"{w}.seq_from", self.seq_from, 0, MAX_SEQ))


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusRequest(WireMessage):
    """A peer's status poll, which is also its heartbeat for the learner's capacity controller.

    Not sealed: the stream is bound to the sender's key by libp2p's Noise handshake and nothing
    relays it. Everything in it is the peer's claim; the learner measures throughput itself and
    uses these only to rank and to report (a price is what the operator pays that peer).
    """

    KIND: ClassVar[str | None] = "status_request"

    run_id: str
    # The newest version the peer has installed (-1: none yet); T_bcast is measured from these.
    installed_version: int = -1
    # What the operator pays this peer per hour (0: a volunteer).
    price_per_hour: float = 0.0
    engine: str = ""
    device: str = ""

    def __post_init__(self) -> None:
        w = "StatusRequest"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "installed_version", _int(f"{w}.installed_version", self.installed_version, -1, MAX_VERSION))
        _set(self, "price_per_hour", _float(f"{w}.price_per_hour", self.price_per_hour, 0.0, MAX_PRICE_PER_HOUR))
        _set(self, "engine", _str(f"{w}.engine", self.engine, MAX_NAME_LEN, min_len=0))
        _set(self, "device", _str(f"{w}.device", self.device, MAX_NAME_LEN, min_len=0))


def _check_version_fields(obj: WireMessage, w: str, size_field: str, hash_field: str) -> None:
    _set(obj, "run_id", _run_id(f"{w}.run_id", getattr(obj, "run_id")))
    _set(obj, "version", _int(f"{w}.version", getattr(obj, "version"), 0, MAX_VERSION))
    _set(obj, "epoch", _int(f"{w}.epoch", getattr(obj, "epoch"), 0, MAX_VERSION))
    _set(obj, size_field, _int(f"{w}.{size_field}", getattr(obj, size_field), 0, MAX_WEIGHTS_BYTES))
    _set(obj, hash_field, _sha256(f"{w}.{hash_field}", getattr(obj, hash_field)))


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusResponse(WireMessage):
    KIND: ClassVar[str | None] = "status_response"

    run_id: str
    version: int
    weights_size: int
    weights_sha256: bytes
    # Flow control: groups the learner wants from this peer per version (see VersionAnnounce).
    demand_groups: int
    # The learner incarnation answering (RunSpec.epoch).
    epoch: int
    # False: the capacity controller put this peer on standby: it keeps following weights (to be
    # activated at once) and generates nothing until an answer says True again.
    active: bool = True

    def __post_init__(self) -> None:
        _check_version_fields(self, "StatusResponse", "weights_size", "weights_sha256")
        _set(self, "demand_groups", _int("StatusResponse.demand_groups", self.demand_groups, 1, MAX_DEMAND_GROUPS))
        if not isinstance(self.active, bool):
            _fail("StatusResponse.active", f"expected a bool, got {type(self.active).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class VersionAnnounce(WireMessage):
    """Gossiped (sealed) by the learner when it publishes a weight version."""

    KIND: ClassVar[str | None] = "version_announce"

    run_id: str
    version: int
    size: int
    sha256: bytes
    # Flow control: how many groups each rollout peer should sample from this version. More
    # than the learner can train on before the version leaves the staleness window only burns
    # the volunteers' compute and the learner's intake.
    demand_groups: int
    # The learner incarnation that made the version (RunSpec.epoch). A version number names
    # one digest for the life of a run; a peer follows a newer epoch and ignores older ones.
    epoch: int

    def __post_init__(self) -> None:
        _check_version_fields(self, "VersionAnnounce", "size", "sha256")
        _set(self, "demand_groups", _int("VersionAnnounce.demand_groups", self.demand_groups, 1, MAX_DEMAND_GROUPS))


RunEndReason: TypeAlias = Literal["finished", "stopped"]
RUN_END_REASONS: Final = ("finished", "stopped")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEnded(WireMessage):
    """Gossiped (sealed) by the learner on the versions topic as it stops: "finished" (the run
    spent its time or version budget: peers leave) or "stopped" (its operator stopped it; a
    restart resumes the run as a newer epoch: peers stop generating and wait for it)."""

    KIND: ClassVar[str | None] = "run_ended"

    run_id: str
    # The learner incarnation that ended (RunSpec.epoch): an older epoch's is ignored.
    epoch: int
    # The newest version it published.
    version: int
    reason: RunEndReason

    def __post_init__(self) -> None:
        w = "RunEnded"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "epoch", _int(f"{w}.epoch", self.epoch, 0, MAX_VERSION))
        _set(self, "version", _int(f"{w}.version", self.version, 0, MAX_VERSION))
        reason = _str(f"{w}.reason", self.reason, 16)
        if reason not in RUN_END_REASONS:
            _fail(f"{w}.reason", f"{_short(reason)} is not one of {', '.join(RUN_END_REASONS)}")
        _set(self, "reason", reason)


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairRequest(WireMessage):
    """Ask for rollouts gossip lost: `seqs` of publisher `peer_id` (not the requester)."""

    KIND: ClassVar[str | None] = "repair_request"

    run_id: str
    peer_id: str
    seqs: tuple[int, ...]

    def __post_init__(self) -> None:
        w = "RepairRequest"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "peer_id", _peer_id(f"{w}.peer_id", self.peer_id))
        seqs = _ints(f"{w}.seqs", self.seqs, MAX_REPAIR_SEQS, 0, MAX_SEQ, min_len=1)
        if len(set(seqs)) != len(seqs):
            _fail(f"{w}.seqs", "contains duplicates")
        _set(self, "seqs", seqs)


@dataclass(frozen=True, kw_only=True, slots=True)
class RepairResponse(WireMessage):
    """The original sealed frames (bytes from `envelope.seal`) of the requested rollouts.

    Carrying the publisher's signed frames, not re-encoded groups, lets the requester verify each
    with `open_envelope(frame, expected_kind=RolloutBatch, expected_sender=publisher)`, whoever
    served them. `unavailable` lists requested seqs the responder does not hold (stop asking);
    seqs in neither list did not fit in this response (ask again).
    """

    KIND: ClassVar[str | None] = "repair_response"

    envelopes: tuple[bytes, ...]  # sealed RolloutBatch frames, exactly as the publisher sent them
    unavailable: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        w = "RepairResponse"
        frames = _seq(f"{w}.envelopes", self.envelopes, MAX_REPAIR_SEQS)
        _set(self, "envelopes", tuple(
            _bytes(f"{w}.envelopes[{i}]", f, max_len=MAX_FRAME_BYTES) for i, f in enumerate(frames)
        ))
        _set(self, "unavailable", _ints(f"{w}.unavailable", self.unavailable, MAX_REPAIR_SEQS, 0, MAX_SEQ))


@dataclass(frozen=True, kw_only=True, slots=True)
class ErrorResponse(WireMessage):
    """A request failed. `code` is a stable snake_case identifier, `message` is for humans."""

    KIND: ClassVar[str | None] = "error"

    code: str
    message: str

    def __post_init__(self) -> None:
        code = _str("ErrorResponse.code", self.code, 64)
        if not ERROR_CODE_PATTERN.fullmatch(code):
            _fail("ErrorResponse.code", f"{_short(code)} does not match {ERROR_CODE_PATTERN.pattern}")
        _set(self, "code", code)
        _set(self, "message", _str("ErrorResponse.message", self.message, MAX_STR, min_len=0))


Message: TypeAlias = (
    RunSpec
    | RolloutBatch
    | JoinRequest
    | JoinResponse
    | StatusRequest
    | StatusResponse
    | VersionAnnounce
    | RunEnded
    | RepairRequest
    | RepairResponse
    | ErrorResponse
    | WeightManifest
    | EpisodeBatch
)

# kind string -> class, for every message that travels on its own (not only nested).
MESSAGE_TYPES: Final[Mapping[str, type[WireMessage]]] = {
    cls.KIND: cls
    for cls in (
        RunSpec, RolloutBatch, JoinRequest, JoinResponse, StatusRequest, StatusResponse,
        VersionAnnounce, RunEnded, RepairRequest, RepairResponse, ErrorResponse,
        WeightManifest, EpisodeBatch,
    )
    if cls.KIND is not None
}


def kind_of(message: object) -> str:
    """The registry kind of a top-level message (or message class); LocalProtocolError otherwise."""
    cls = message if isinstance(message, type) else type(message)
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str) or MESSAGE_TYPES.get(kind) is not cls:
        raise LocalProtocolError(f"{cls.__name__} is not a top-level protocol message")
    return kind


# What `pack_repair_response` reserves: the envelope array, schema and kind (< 64 B) with two array
# headers; each unavailable int (<= 9 B); each frame's bin header (<= 5 B).
_REPAIR_FIXED, _REPAIR_PER_SEQ, _REPAIR_PER_FRAME = 64, 9, 5


def repair_response_had_room(response: RepairResponse, *, frame_bytes: int, max_bytes: int = MAX_MESSAGE_BYTES) -> bool:
    """Whether `pack_repair_response` would have fit one more frame of `frame_bytes` into
    `response`: if so, what it left out was not left out for want of space."""
    used = _REPAIR_FIXED + _REPAIR_PER_SEQ * len(response.unavailable) + sum(
        len(e) + _REPAIR_PER_FRAME for e in response.envelopes)
    return len(response.envelopes) < MAX_REPAIR_SEQS and used + frame_bytes + _REPAIR_PER_FRAME <= max_bytes


def pack_repair_response(
    frames: Iterable[bytes],
    *,
    unavailable: Iterable[int] = (),
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> RepairResponse:
    """A RepairResponse holding, in order, as many of `frames` as fit in `max_bytes` encoded.

    Frames that do not fit are left out; the requester still sees those seqs missing and asks
    again, so a large backlog drains over several round trips instead of one oversize message.
    """
    missing = tuple(unavailable)
    budget = max_bytes - _REPAIR_FIXED - _REPAIR_PER_SEQ * len(missing)
    chosen: list[bytes] = []
    for frame in frames:
        cost = len(frame) + _REPAIR_PER_FRAME
        if cost > budget or len(chosen) == MAX_REPAIR_SEQS:
            break
        chosen.append(frame)
        budget -= cost
    return RepairResponse(envelopes=tuple(chosen), unavailable=missing)


def pack_groups(
    groups: Sequence[RolloutGroup],
    *,
    max_bytes: int = ROLLOUT_BATCH_BYTES,
    max_groups: int = MAX_BATCH_GROUPS,
) -> list[tuple[RolloutGroup, ...]]:
    """`groups` in order, packed greedily into the groups of successive `RolloutBatch`es: at
    most `max_bytes` of encoded groups and `max_groups` groups each.

    The bound is on the uncompressed encoding, so a sealed batch fits one gossip frame whatever
    zstd makes of it. A group bigger than `max_bytes` travels alone; sealing it fails
    (LocalProtocolError) if even zstd cannot bring it under a frame.
    """
    if not 1 <= max_groups <= MAX_BATCH_GROUPS:
        raise LocalProtocolError(f"max_groups must be in 1..{MAX_BATCH_GROUPS}, got {max_groups}")
    packed: list[list[RolloutGroup]] = []
    used = max_bytes
    for group in groups:
        cost = len(pack(group.to_wire()))
        if packed and used + cost <= max_bytes and len(packed[-1]) < max_groups:
            packed[-1].append(group)
            used += cost
        else:
            packed.append([group])
            used = cost
    return [tuple(chunk) for chunk in packed]


def worst_group_bytes(*, group_size: int, prompt_tokens: int, max_new_tokens: int, group_id_len: int = MAX_NAME_LEN) -> int:
    """The most a group of this shape can take in a batch's encoding (largest ids, versions and
    floats msgpack has for them): what a publisher plans a batch's size with, before sampling."""
    n = max(1, max_new_tokens)
    sample = Sample(
        completion_ids=(MAX_VOCAB - 1,) * n,
        behaviour_logprobs=(-1.5,) * n,
        token_versions=(MAX_VERSION,) * n,
        reward=-1.5,
    )
    group = RolloutGroup(group_id="g" * group_id_len, prompt_ids=(MAX_VOCAB - 1,) * max(1, prompt_tokens), samples=(sample,) * group_size)
    return len(pack(group.to_wire()))


# --- unsigned encoding for authenticated streams ----------------------------------------------
#
# Request/response streams are authenticated by libp2p's Noise handshake, so their messages are
# not signed: msgpack [schema, kind, fields], no zstd (the only large members are sealed frames,
# already compressed). Decoding checks the schema first so a newer peer gets a clear refusal.

M = TypeVar("M", bound=WireMessage)


def encode_message(message: Message, *, max_size: int = MAX_MESSAGE_BYTES) -> bytes:
    """Unsigned encoding for authenticated streams: msgpack [schema, kind, fields]."""
    data = pack([SCHEMA_VERSION, kind_of(message), message.to_wire()])
    if len(data) > max_size:
        raise LocalProtocolError(f"{kind_of(message)} encodes to {len(data)} B, above {max_size} B")
    return data


@overload
def decode_message(data: bytes, expected: type[M], *, max_size: int = MAX_MESSAGE_BYTES) -> M: ...
@overload
def decode_message(data: bytes, expected: str | None = None, *, max_size: int = MAX_MESSAGE_BYTES) -> Message: ...
def decode_message(
    data: bytes, expected: str | type[WireMessage] | None = None, *, max_size: int = MAX_MESSAGE_BYTES
) -> Any:
    """Inverse of `encode_message`; RemoteProtocolError for anything malformed or unexpected."""
    want = expected_kind_name(expected)
    if len(data) > max_size:
        raise RemoteProtocolError(f"message of {len(data)} B exceeds {max_size} B")
    obj = unpack_strict(bytes(data), what="message")
    if not isinstance(obj, list) or not obj:
        raise RemoteProtocolError("message: expected a non-empty array")
    check_schema(obj[0], "message")
    if len(obj) != 3:
        raise RemoteProtocolError(f"message: expected 3 fields (schema, kind, body), got {len(obj)}")
    kind = obj[1]
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise RemoteProtocolError(f"message.kind: unknown message kind {_short(kind)}")
    if want is not None and kind != want:
        raise RemoteProtocolError(f"expected a {want!r} message, got {kind!r}")
    return MESSAGE_TYPES[kind].from_wire(obj[2])


def check_schema(schema: object, what: str) -> None:
    """RemoteProtocolError unless `schema` is SCHEMA_VERSION (reason unsupported_schema if an int)."""
    if type(schema) is not int:
        raise RemoteProtocolError(f"{what}.schema: expected int, got {type(schema).__name__}")
    if schema != SCHEMA_VERSION:
        raise RemoteProtocolError(
            f"unsupported schema version {schema} (this node speaks {SCHEMA_VERSION})",
            reason=DropReason.UNSUPPORTED_SCHEMA,
        )


def expected_kind_name(expected: str | type[WireMessage] | None) -> str | None:
    """Normalize an `expected` argument (kind string or message class) to a kind string."""
    if expected is None:
        return None
    if isinstance(expected, type):
        return kind_of(expected)
    if expected not in MESSAGE_TYPES:
        raise LocalProtocolError(f"unknown message kind {expected!r}")
    return expected
