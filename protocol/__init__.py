"""echo-node's wire protocol, sans-I/O: messages, bounds, framing, signatures, and the pure rules
(sequence gaps, staleness; weight manifests, piece bookkeeping, the delta codec) built on them.

Imports only the standard library, msgpack, zstandard and cryptography: never trio, libp2p or
torch (a test checks it), so everything here is testable without a network or a model, and the
I/O layer in echo_node/ owns all sockets, streams and clocks.

Errors: a peer's bad bytes raise `RemoteProtocolError` (with a `DropReason` in `.reason`);
building something invalid locally raises `LocalProtocolError`.
"""

from protocol.admission import RunBounds, judge_batch
from protocol.drops import DropReason
from protocol.envelope import (
    SIGNATURE_DOMAIN,
    SignedEnvelope,
    decode_message,
    encode_message,
    open_envelope,
    open_manifest,
    seal,
    signing_input,
)
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.framing import LengthPrefixedReader, decode_frame, encode_frame, encode_length_prefixed
from protocol.identity import (
    Identity,
    b58decode,
    b58encode,
    is_valid_peer_id,
    load_or_create_key_file,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)
from protocol.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    ErrorResponse,
    JoinRequest,
    JoinResponse,
    Message,
    RepairRequest,
    RepairResponse,
    RolloutBatch,
    RolloutGroup,
    RunEnded,
    RunSpec,
    Sample,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    SyncMode,
    VersionAnnounce,
    WireMessage,
    kind_of,
    pack_groups,
    pack_repair_response,
)
from protocol.sequence import Observation, SequenceTracker
from protocol.staleness import admissible
from protocol.weights.delta import decode_delta, encode_delta
from protocol.weights.manifest import (
    WeightManifest,
    build_manifest,
    choose_piece_size,
    payload_digest,
    piece_digest,
    piece_range,
    verify_piece,
)
from protocol.weights.pieces import Cancel, PieceSwarm, Request

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_VERSION",
    "SIGNATURE_DOMAIN",
    "Cancel",
    "DropReason",
    "ErrorResponse",
    "Identity",
    "JoinRequest",
    "JoinResponse",
    "LengthPrefixedReader",
    "LocalProtocolError",
    "Message",
    "Observation",
    "PieceSwarm",
    "ProtocolError",
    "RemoteProtocolError",
    "RepairRequest",
    "RepairResponse",
    "Request",
    "RolloutBatch",
    "RolloutGroup",
    "RunBounds",
    "RunEnded",
    "RunSpec",
    "Sample",
    "SamplingParams",
    "SequenceTracker",
    "SignedEnvelope",
    "StatusRequest",
    "StatusResponse",
    "SyncMode",
    "VersionAnnounce",
    "WeightManifest",
    "WireMessage",
    "admissible",
    "b58decode",
    "b58encode",
    "build_manifest",
    "choose_piece_size",
    "decode_delta",
    "decode_frame",
    "decode_message",
    "encode_delta",
    "encode_frame",
    "encode_length_prefixed",
    "encode_message",
    "is_valid_peer_id",
    "judge_batch",
    "kind_of",
    "load_or_create_key_file",
    "open_envelope",
    "open_manifest",
    "pack_groups",
    "pack_repair_response",
    "payload_digest",
    "peer_id_from_public_key",
    "piece_digest",
    "piece_range",
    "public_key_from_peer_id",
    "seal",
    "signing_input",
    "verify",
    "verify_piece",
]
