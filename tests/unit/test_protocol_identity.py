"""Identities: base58btc, libp2p-compatible peer ids, signatures, the key file."""

from __future__ import annotations

import os
import pathlib
import stat

import pytest

from protocol import (
    Identity,
    LocalProtocolError,
    RemoteProtocolError,
    b58decode,
    b58encode,
    is_valid_peer_id,
    load_or_create_key_file,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)
from protocol.drops import DropReason

# Computed with libp2p 0.8.1: create_new_key_pair(b"\x01" * 32) -> ID.from_pubkey(...).to_base58()
_SEED_01_PEER_ID = "12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5"


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"", ""),
        (b"\x00", "1"),
        (b"\x00\x00\x01", "112"),
        (b"hello world", "StV1DL6CwTryKyV"),  # the Bitcoin wiki / draft-msporny-base58 vector
        (b"\x00\x00\x28\x7f\xb4\xcd", "11233QC4"),
    ],
)
def test_base58_vectors(raw: bytes, text: str) -> None:
    assert b58encode(raw) == text
    assert b58decode(text) == raw


def test_base58_round_trip_and_invalid_chars() -> None:
    for n in range(0, 64, 7):
        data = bytes(range(n)) + b"\x00" * 3
        assert b58decode(b58encode(data)) == data
    for bad in ("0", "O", "I", "l", "abc+"):
        with pytest.raises(ValueError):
            b58decode(bad)


def test_known_peer_id_vector() -> None:
    ident = Identity.from_seed(b"\x01" * 32)
    assert ident.peer_id == _SEED_01_PEER_ID
    assert public_key_from_peer_id(ident.peer_id) == ident.public_key


def test_peer_ids_match_libp2p() -> None:
    # libp2p only in this test: protocol/ itself must not import it.
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    for i in range(8):
        seed = bytes([i + 7]) * 16 + os.urandom(16)
        ours = Identity.from_seed(seed)
        pair = create_new_key_pair(seed)
        assert pair.public_key.to_bytes() == ours.public_key
        assert ID.from_pubkey(pair.public_key).to_base58() == ours.peer_id
        assert ours.peer_id.startswith("12D3KooW") and len(ours.peer_id) == 52
    other = create_new_key_pair()  # libp2p-generated key, our derivation
    assert peer_id_from_public_key(other.public_key.to_bytes()) == ID.from_pubkey(other.public_key).to_base58()


def test_seed_round_trip_and_repr_hides_key() -> None:
    ident = Identity.generate()
    again = Identity.from_seed(ident.seed)
    assert again == ident and again.peer_id == ident.peer_id and hash(again) == hash(ident)
    assert ident.seed.hex() not in repr(ident) and ident.peer_id in repr(ident)
    with pytest.raises(ValueError):
        Identity.from_seed(b"\x00" * 31)


def test_peer_id_rejects_wrong_key_length() -> None:
    with pytest.raises(LocalProtocolError):
        peer_id_from_public_key(b"\x00" * 31)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not-base58!",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha256 multihash (RSA-style) id
        "12D3KooW",
        "1" + _SEED_01_PEER_ID,  # an extra leading zero byte
        _SEED_01_PEER_ID + "1",
        "2" * 200,
        12345,
    ],
)
def test_invalid_peer_ids(bad: object) -> None:
    assert not is_valid_peer_id(bad)


def test_sign_and_verify() -> None:
    ident = Identity.generate()
    sig = ident.sign(b"data")
    verify(ident.public_key, sig, b"data")
    with pytest.raises(RemoteProtocolError) as info:
        verify(ident.public_key, sig, b"Data")
    assert info.value.reason is DropReason.BAD_SIGNATURE
    with pytest.raises(RemoteProtocolError):
        verify(Identity.generate().public_key, sig, b"data")
    with pytest.raises(RemoteProtocolError):
        verify(ident.public_key[:31], sig, b"data")
    with pytest.raises(RemoteProtocolError):
        verify(ident.public_key, sig[:63], b"data")


def test_key_file_created_0600_and_reloaded(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "deep" / "dir" / "node.key"
    first = load_or_create_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == first.seed and len(first.seed) == 32
    second = load_or_create_key_file(path)
    assert second.peer_id == first.peer_id


def test_key_file_rejects_group_or_world_access(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "node.key"
    load_or_create_key_file(path)
    for mode in (0o644, 0o640, 0o604, 0o620):
        os.chmod(path, mode)
        with pytest.raises(ValueError, match="chmod 600"):
            load_or_create_key_file(path)


@pytest.mark.parametrize("content", [b"", b"\x01" * 31, b"\x01" * 33, b"\x01" * 64])
def test_key_file_rejects_malformed(tmp_path: pathlib.Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(ValueError, match="malformed"):
        load_or_create_key_file(path)


def test_key_file_rejects_directory(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "node.key"
    path.mkdir(mode=0o700)
    with pytest.raises(ValueError, match="regular file"):
        load_or_create_key_file(path)
