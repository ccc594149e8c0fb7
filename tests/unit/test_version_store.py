"""VersionStore: one mapped file per version, kinds told apart by suffix, pages released without
losing a byte, files unlinked when dropped or left by an earlier process."""

from __future__ import annotations

from pathlib import Path

from echo_node.weights.store import VersionStore


def test_stores_of_two_kinds_share_a_folder_and_release_keeps_the_bytes(tmp_path: Path) -> None:
    (tmp_path / "3.payload").write_bytes(b"stale")
    (tmp_path / "3.weights").write_bytes(b"stale")
    payloads = VersionStore(tmp_path, suffix=".payload")
    assert not (tmp_path / "3.payload").exists() and (tmp_path / "3.weights").exists(), "each store cleans its own kind"
    weights = VersionStore(tmp_path)
    assert not (tmp_path / "3.weights").exists()
    a = payloads.create(1, 3 * 4096 + 5)
    a[:] = bytes(range(256)) * 48 + b"abcde"
    b = weights.put(1, b"weights of 1")
    payloads.release_all()
    weights.release(1)
    assert a[:] == bytes(range(256)) * 48 + b"abcde" and b[:] == b"weights of 1", "released pages come back from the file"
    assert (tmp_path / "1.payload").read_bytes() == a[:]
    payloads.drop(1)
    payloads.release_buffer(a)  # a dropped mapping stays valid while referenced
    assert not (tmp_path / "1.payload").exists() and a[-5:] == b"abcde"
    assert weights.versions() == [1] and payloads.versions() == []


def test_without_a_folder_release_keeps_anonymous_pages() -> None:
    store = VersionStore(None)
    buf = store.create(0, 10)
    buf[:] = b"0123456789"
    store.release_all()
    assert buf[:] == b"0123456789"
