"""Ed25519 node identities, compatible with libp2p peer ids. No I/O except the key file.

Job: one keypair per node that signs every message the node originates and that *is* its libp2p
identity, so a signature binds a message to the same peer id gossip and the DHT see.

Peer id derivation (libp2p peer-ids spec, "Peer Ids" and "Keys"): the public key is serialized as
the protobuf `PublicKey{Type: Ed25519 (1), Data: <32 raw bytes>}` = b"\\x08\\x01\\x12\\x20" + raw.
That is 36 bytes (<= 42), so the peer id is the *identity* multihash of it (code 0x00, varint
length, bytes), base58btc-encoded: always 52 characters starting "12D3KooW".

`Identity.seed` is what `libp2p.crypto.ed25519.create_new_key_pair(seed)` takes, so the node's
libp2p host and this module derive the same peer id from the same key file.

Invariants:
- A peer id accepted by `is_valid_peer_id` / `public_key_from_peer_id` is an Ed25519 identity
  peer id: every peer in echo-node signs with Ed25519, so other key types are refused.
- The key file is never group- or world-accessible; it is created atomically with mode 0600.
"""

from __future__ import annotations

import os
import pathlib
import stat

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.drops import DropReason
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import (
    ED25519_PUBLIC_KEY_BYTES,
    ED25519_SEED_BYTES,
    ED25519_SIGNATURE_BYTES,
    MAX_PEER_ID_LEN,
)

__all__ = [
    "Identity",
    "b58decode",
    "b58encode",
    "is_valid_peer_id",
    "load_or_create_key_file",
    "peer_id_from_public_key",
    "public_key_from_peer_id",
    "verify",
]

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"  # bitcoin's base58btc
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}

# protobuf PublicKey{Type=Ed25519(1) [field 1, varint], Data [field 2, length 32]}
_ED25519_KEY_PROTO_PREFIX = b"\x08\x01\x12\x20"
# identity multihash: code 0x00, then the digest length (36) as a one-byte varint
_PEER_ID_PREFIX = b"\x00\x24" + _ED25519_KEY_PROTO_PREFIX
_PEER_ID_BYTES = len(_PEER_ID_PREFIX) + ED25519_PUBLIC_KEY_BYTES


def b58encode(data: bytes) -> str:
    """base58btc (bitcoin alphabet); each leading zero byte becomes a leading '1'."""
    n = int.from_bytes(data, "big")
    digits: list[str] = []
    while n:
        n, r = divmod(n, 58)
        digits.append(_B58_ALPHABET[r])
    zeros = len(data) - len(data.lstrip(b"\x00"))
    return "1" * zeros + "".join(reversed(digits))


def b58decode(text: str) -> bytes:
    """Inverse of `b58encode`; ValueError on characters outside the alphabet."""
    n = 0
    for ch in text:
        digit = _B58_INDEX.get(ch)
        if digit is None:
            raise ValueError(f"invalid base58 character {ch!r}")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    return b"\x00" * zeros + (n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b"")


def peer_id_from_public_key(raw32: bytes) -> str:
    """The libp2p peer id string ("12D3KooW...") of a raw 32-byte Ed25519 public key."""
    if len(raw32) != ED25519_PUBLIC_KEY_BYTES:
        raise LocalProtocolError(f"Ed25519 public key must be 32 bytes, got {len(raw32)}")
    return b58encode(_PEER_ID_PREFIX + bytes(raw32))


def public_key_from_peer_id(peer_id: object) -> bytes:
    """The raw Ed25519 public key inside an Ed25519 peer id; ValueError for anything else."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_LEN:
        raise ValueError("peer id must be a non-empty string of at most 128 characters")
    raw = b58decode(peer_id)  # length-bounded above, so the big-int work is bounded too
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        raise ValueError(f"{peer_id[:60]!r} is not an Ed25519 libp2p peer id")
    # Re-encoding must give the same text: rejects non-canonical spellings of the same bytes.
    if b58encode(raw) != peer_id:
        raise ValueError(f"{peer_id[:60]!r} is not canonical base58btc")
    return raw[len(_PEER_ID_PREFIX) :]


def is_valid_peer_id(peer_id: object) -> bool:
    """True for a well-formed Ed25519 libp2p peer id string."""
    try:
        public_key_from_peer_id(peer_id)
    except ValueError:
        return False
    return True


def verify(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Check an Ed25519 signature; RemoteProtocolError (reason bad_signature) if it fails."""
    if len(public_key) != ED25519_PUBLIC_KEY_BYTES:
        raise RemoteProtocolError(
            f"public key must be 32 bytes, got {len(public_key)}", reason=DropReason.BAD_SIGNATURE
        )
    if len(signature) != ED25519_SIGNATURE_BYTES:
        raise RemoteProtocolError(
            f"signature must be 64 bytes, got {len(signature)}", reason=DropReason.BAD_SIGNATURE
        )
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except InvalidSignature:
        raise RemoteProtocolError("signature does not verify", reason=DropReason.BAD_SIGNATURE) from None
    except ValueError as exc:  # not a valid curve point encoding
        raise RemoteProtocolError(f"invalid public key: {exc}", reason=DropReason.BAD_SIGNATURE) from None


class Identity:
    """A node's Ed25519 keypair. `repr` shows only the peer id, never key material."""

    __slots__ = ("_key", "_peer_id", "_public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._public_key = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = peer_id_from_public_key(self._public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed32: bytes) -> Identity:
        """The identity whose RFC 8032 private key (seed) is `seed32`."""
        if len(seed32) != ED25519_SEED_BYTES:
            raise ValueError(f"Ed25519 seed must be {ED25519_SEED_BYTES} bytes, got {len(seed32)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed32)))

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed (secret). Feed it to libp2p's create_new_key_pair."""
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public_key

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature over `data`."""
        return self._key.sign(bytes(data))

    def __repr__(self) -> str:
        return f"Identity(peer_id={self._peer_id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other._public_key == self._public_key

    def __hash__(self) -> int:
        return hash(self._public_key)


def load_or_create_key_file(path: pathlib.Path) -> Identity:
    """Load the node identity from `path`, creating it (mode 0600) on first run.

    File format: exactly 32 raw bytes, the Ed25519 seed (RFC 8032 private key), nothing else.
    Refuses, with ValueError saying what to do, a file that is not a regular file, is accessible
    by group or others (like ssh, any such bit: the seed is the node's identity and reputation),
    or does not hold exactly 32 bytes.
    """
    path = pathlib.Path(path)
    try:
        return _create_key_file(path)
    except FileExistsError:
        pass  # normal on every run after the first; also the loser of a creation race
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)  # fstat the open file, so the checked file is the one we read
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"key file {path} is not a regular file; remove it or choose another path")
        if st.st_mode & 0o077:
            raise ValueError(
                f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}, readable or writable by "
                f"group/others; run `chmod 600 {path}` (and consider the key compromised if others "
                "could read it: delete it to generate a new identity)"
            )
        seed = os.read(fd, ED25519_SEED_BYTES + 1)
    finally:
        os.close(fd)
    if len(seed) != ED25519_SEED_BYTES:
        raise ValueError(
            f"key file {path} is malformed: expected exactly {ED25519_SEED_BYTES} bytes (a raw "
            f"Ed25519 seed), found {len(seed) if len(seed) <= ED25519_SEED_BYTES else 'more'}; "
            "restore it from backup, or delete it to generate a new identity (a new peer id)"
        )
    return Identity.from_seed(seed)


def _create_key_file(path: pathlib.Path) -> Identity:
    """Create `path` with a fresh seed; FileExistsError if it exists (O_EXCL: never overwrite)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    identity = Identity.generate()
    try:
        seed = identity.seed
        written = 0
        while written < len(seed):
            written += os.write(fd, seed[written:])
        os.fsync(fd)  # a crash right after first start must not leave an empty key file
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)  # a partial key file would be refused on the next start
        raise
    os.close(fd)
    return identity
