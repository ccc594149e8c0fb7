"""echo-node's wire protocol, sans-I/O: messages, bounds, framing, signatures, and the pure rules
(sequence gaps, staleness) built on them.

Imports only the standard library, msgpack, zstandard and cryptography: never trio, libp2p or
torch (a test checks it), so everything here is testable without a network or a model, and the
I/O layer in echo_node/ owns all sockets, streams and clocks.

Errors: a peer's bad bytes raise `RemoteProtocolError` (with a `DropReason` in `.reason`);
building something invalid locally raises `LocalProtocolError`.
"""

from protocol.drops import DropReason
from protocol.envelope import (
    SIGNATURE_DOMAIN,
    SignedEnvelope,
    decode_message,
    encode_message,
    open_envelope,
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
    RolloutGroup,
    RunSpec,
    Sample,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    SyncMode,
    VersionAnnounce,
    WeightsHeader,
    WeightsRequest,
    WireMessage,
    kind_of,
    pack_repair_response,
)
from protocol.sequence import Observation, SequenceTracker
from protocol.staleness import admissible, judge_group

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_VERSION",
    "SIGNATURE_DOMAIN",
    "DropReason",
    "ErrorResponse",
    "Identity",
    "JoinRequest",
    "JoinResponse",
    "LengthPrefixedReader",
    "LocalProtocolError",
    "Message",
    "Observation",
    "ProtocolError",
    "RemoteProtocolError",
    "RepairRequest",
    "RepairResponse",
    "RolloutGroup",
    "RunSpec",
    "Sample",
    "SamplingParams",
    "SequenceTracker",
    "SignedEnvelope",
    "StatusRequest",
    "StatusResponse",
    "SyncMode",
    "VersionAnnounce",
    "WeightsHeader",
    "WeightsRequest",
    "WireMessage",
    "admissible",
    "b58decode",
    "b58encode",
    "decode_frame",
    "decode_message",
    "encode_frame",
    "encode_length_prefixed",
    "encode_message",
    "is_valid_peer_id",
    "judge_group",
    "kind_of",
    "load_or_create_key_file",
    "open_envelope",
    "pack_repair_response",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "seal",
    "signing_input",
    "verify",
]
