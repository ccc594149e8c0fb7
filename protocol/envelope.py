"""Signed envelopes (gossip) and plain message encoding (authenticated streams). No I/O.

Job: turn a message into bytes a peer can trust, and untrusted bytes back into a message plus
the peer id that vouches for it.

Sealed frame layout: zstd frame (framing.py) of the msgpack array
    [schema, kind, payload, public_key, signature]
where `payload` is the canonical msgpack of `message.to_wire()` and `signature` is Ed25519 over
    b"echo-node/v1\\x00" + kind + b"\\x00" + payload
The domain prefix keeps these signatures from being valid for any other use of the key (libp2p
signs its own records with it); the kind inside the signed bytes stops a payload signed as one
kind from being replayed as another.

Invariants of `open_envelope` (each violation is a RemoteProtocolError with a DropReason):
- the schema version is checked before anything else, so a newer peer gets a clear refusal;
- the signature is verified before the payload is parsed;
- the payload is the canonical encoding of the message it decodes to (re-encoding gives the
  same bytes), so one message has exactly one signed form;
- a message that names its author (`SIGNER_FIELD`: RolloutBatch.peer_id, JoinRequest.peer_id,
  RunSpec.learner_peer_id) names the key that signed it.

Unsigned messages (`encode_message` / `decode_message`, defined in messages.py and re-exported
here) are for request/response streams, which libp2p's Noise handshake already authenticates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar, overload

from protocol._wire import pack, unpack_strict
from protocol.drops import DropReason
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.framing import decode_frame, encode_frame
from protocol.identity import Identity, peer_id_from_public_key, verify
from protocol.limits import ED25519_PUBLIC_KEY_BYTES, ED25519_SIGNATURE_BYTES, MAX_SEALED_BYTES
from protocol.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Message,
    WireMessage,
    check_schema,
    decode_message,
    encode_message,
    expected_kind_name,
    kind_of,
)
from protocol.weights.manifest import WeightManifest

__all__ = [
    "SIGNATURE_DOMAIN",
    "SignedEnvelope",
    "decode_message",
    "encode_message",
    "open_envelope",
    "open_manifest",
    "seal",
    "signing_input",
]

SIGNATURE_DOMAIN = b"echo-node/v1\x00"

M = TypeVar("M", bound=WireMessage)


def signing_input(kind: str, payload: bytes) -> bytes:
    """The exact bytes an envelope's signature covers."""
    return SIGNATURE_DOMAIN + kind.encode("ascii") + b"\x00" + payload


@dataclass(frozen=True, kw_only=True, slots=True)
class SignedEnvelope:
    """The decoded outer layer of a sealed frame. Construct with `seal`; parse with `from_wire`."""

    schema: int
    kind: str
    payload: bytes  # canonical msgpack of the message's wire form
    public_key: bytes  # raw Ed25519, 32 bytes
    signature: bytes  # 64 bytes over signing_input(kind, payload)

    def to_wire(self) -> list[Any]:
        return [self.schema, self.kind, self.payload, self.public_key, self.signature]

    @classmethod
    def from_wire(cls, obj: object) -> SignedEnvelope:
        """Strict structural decode (no signature check). Schema is checked first."""
        if not isinstance(obj, list) or not obj:
            raise RemoteProtocolError("envelope: expected a non-empty array")
        check_schema(obj[0], "envelope")
        if len(obj) != 5:
            raise RemoteProtocolError(
                f"envelope: expected 5 fields (schema, kind, payload, public_key, signature), got {len(obj)}"
            )
        _, kind, payload, public_key, signature = obj
        if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
            raise RemoteProtocolError(f"envelope.kind: unknown message kind {_short(kind)}")
        for name, value, size in (
            ("public_key", public_key, ED25519_PUBLIC_KEY_BYTES),
            ("signature", signature, ED25519_SIGNATURE_BYTES),
        ):
            if not isinstance(value, bytes) or len(value) != size:
                raise RemoteProtocolError(f"envelope.{name}: expected {size} bytes", reason=DropReason.BAD_SIGNATURE)
        if not isinstance(payload, bytes):
            raise RemoteProtocolError("envelope.payload: expected bytes")
        return cls(schema=SCHEMA_VERSION, kind=kind, payload=payload, public_key=public_key, signature=signature)

    @property
    def sender(self) -> str:
        """The peer id of the signing key (meaningful only once the signature is verified)."""
        return peer_id_from_public_key(self.public_key)

    def verify(self) -> None:
        """RemoteProtocolError (bad_signature) unless the signature covers kind and payload."""
        verify(self.public_key, self.signature, signing_input(self.kind, self.payload))


def seal(message: Message, identity: Identity) -> bytes:
    """Sign `message` as `identity` and return the zstd frame to publish.

    LocalProtocolError if the message is not a top-level kind, names another author than
    `identity`, or the frame exceeds MAX_FRAME_BYTES (split the message).
    """
    kind = kind_of(message)
    field = message.SIGNER_FIELD
    if field is not None and getattr(message, field) != identity.peer_id:
        raise LocalProtocolError(
            f"{type(message).__name__}.{field} is {getattr(message, field)!r} but the signer is "
            f"{identity.peer_id!r}; every receiver would reject it"
        )
    payload = pack(message.to_wire())
    envelope = SignedEnvelope(
        schema=SCHEMA_VERSION,
        kind=kind,
        payload=payload,
        public_key=identity.public_key,
        signature=identity.sign(signing_input(kind, payload)),
    )
    sealed = pack(envelope.to_wire())
    if len(sealed) > MAX_SEALED_BYTES:
        raise LocalProtocolError(f"{kind} of {len(sealed)} B exceeds MAX_SEALED_BYTES={MAX_SEALED_BYTES}; split it")
    return encode_frame(sealed)


@overload
def open_envelope(
    frame: bytes, *, expected_kind: type[M], expected_sender: str | None = None
) -> tuple[M, str]: ...
@overload
def open_envelope(
    frame: bytes, *, expected_kind: str | None = None, expected_sender: str | None = None
) -> tuple[Message, str]: ...
def open_envelope(
    frame: bytes,
    *,
    expected_kind: str | type[WireMessage] | None = None,
    expected_sender: str | None = None,
) -> tuple[Any, str]:
    """Verify and decode a sealed frame; returns (message, signer's peer id).

    RemoteProtocolError (with `.reason`) for anything wrong: frame, schema, kind, signature,
    sender, payload bounds, non-canonical payload, or an author field naming someone else.
    """
    want = expected_kind_name(expected_kind)
    envelope = SignedEnvelope.from_wire(unpack_strict(decode_frame(frame, max_size=MAX_SEALED_BYTES), what="envelope"))
    if want is not None and envelope.kind != want:
        raise RemoteProtocolError(f"expected a {want!r} message, got {envelope.kind!r}")
    envelope.verify()
    sender = envelope.sender
    if expected_sender is not None and sender != expected_sender:
        raise RemoteProtocolError(
            f"{envelope.kind} signed by {sender}, expected {expected_sender}", reason=DropReason.WRONG_SENDER
        )
    cls = MESSAGE_TYPES[envelope.kind]
    message = cls.from_wire(unpack_strict(envelope.payload, what=envelope.kind))
    if pack(message.to_wire()) != envelope.payload:
        # Same message, different bytes: refuse, so signatures and payload hashes are unique.
        raise RemoteProtocolError(f"{envelope.kind}: payload is not canonically encoded")
    field = cls.SIGNER_FIELD
    if field is not None and getattr(message, field) != sender:
        raise RemoteProtocolError(
            f"{cls.__name__}.{field} claims {getattr(message, field)} but the signer is {sender}",
            reason=DropReason.WRONG_SENDER,
        )
    return message, sender


def open_manifest(frame: bytes, *, learner_peer_id: str, run_id: str) -> WeightManifest:
    """Verify and decode a sealed manifest from whoever relayed it.

    RemoteProtocolError with `.reason`: bad_signature (tampered or forged), wrong_sender (validly
    signed, but not by this run's learner), wrong_run (another run's manifest), malformed or
    unsupported_schema (bad bytes).
    """
    manifest, _ = open_envelope(frame, expected_kind=WeightManifest, expected_sender=learner_peer_id)
    if manifest.run_id != run_id:
        raise RemoteProtocolError(
            f"manifest for run {manifest.run_id!r}, expected {run_id!r}", reason=DropReason.WRONG_RUN
        )
    return manifest


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


