"""Delta codec: bit-exact round trips on fp32 / bf16 patterns, and bounded decoding of bad deltas."""

from __future__ import annotations

import array
import random

import pytest
import zstandard

from protocol.delta import choose_payload, decode_delta, encode_delta, max_delta_size, xor_bytes
from protocol.errors import LocalProtocolError, RemoteProtocolError

N_PARAMS = 32_768  # small enough to keep the module well under a second


def fp32_weights(seed: int, n: int = N_PARAMS) -> array.array[float]:
    rng = random.Random(seed)
    return array.array("f", (rng.gauss(0.0, 0.02) for _ in range(n)))


def perturbed(w: array.array[float], *, rel: float, fraction: float, seed: int) -> array.array[float]:
    """new = old * (1 + rel) on a random `fraction` of the entries (what a small step looks like)."""
    rng = random.Random(seed)
    out = array.array("f", w)
    for i in rng.sample(range(len(w)), int(len(w) * fraction)):
        out[i] = w[i] * (1.0 + rel)
    return out


def bf16(w: array.array[float]) -> bytes:
    """bf16 bit patterns: the high 16 bits of each fp32 (truncation; enough for a byte test)."""
    bits = array.array("I", w.tobytes())
    assert bits.itemsize == 4
    return array.array("H", (b >> 16 for b in bits)).tobytes()


def round_trip(new: bytes, base: bytes) -> bytes:
    delta = encode_delta(new, base)
    assert decode_delta(delta, base, max_size=len(base)) == new
    return delta


def test_xor_matches_bytewise_xor_across_chunk_boundaries() -> None:
    rng = random.Random(0)
    a, b = rng.randbytes(200_003), rng.randbytes(200_003)  # not a multiple of the chunk size
    assert xor_bytes(a, b) == bytes(x ^ y for x, y in zip(a, b))
    assert xor_bytes(b"", b"") == b""
    with pytest.raises(LocalProtocolError, match="lengths differ"):
        xor_bytes(b"ab", b"abc")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trips_are_bit_exact(dtype: str) -> None:
    old = fp32_weights(1)
    small = perturbed(old, rel=1e-6, fraction=0.1, seed=2)
    big = perturbed(old, rel=1e-2, fraction=1.0, seed=3)
    enc = (lambda w: w.tobytes()) if dtype == "fp32" else bf16
    base = enc(old)
    unrelated = round_trip(enc(fp32_weights(9)), base)  # random weights against random weights
    after_small_step = round_trip(enc(small), base)
    round_trip(enc(big), base)
    identical = round_trip(base, base)
    assert len(identical) < 100  # all-zero XOR: a few bytes
    assert len(after_small_step) < len(base) / 4  # most bits did not move
    assert len(unrelated) <= max_delta_size(len(base))


def test_special_float_patterns_survive() -> None:
    specials = array.array("f", [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.4e38] * 100)
    base = array.array("f", reversed(specials)).tobytes()
    round_trip(specials.tobytes(), base)
    nan_payload = bytes.fromhex("0100c07f") * 50  # a NaN with a payload: bits, not values, travel
    round_trip(nan_payload, bytes(200))


def test_empty_weights_round_trip() -> None:
    assert decode_delta(encode_delta(b"", b""), b"", max_size=0) == b""


def test_length_mismatch_and_bad_level_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError, match="lengths differ"):
        encode_delta(b"\x00" * 10, b"\x00" * 11)
    for level in (0, 23, 3.0, True):
        with pytest.raises(LocalProtocolError, match="level"):
            encode_delta(b"ab", b"cd", level=level)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="max_size"):
        decode_delta(encode_delta(b"ab", b"cd"), b"cd", max_size=1)


def test_bad_deltas_are_remote_errors() -> None:
    base = fp32_weights(4).tobytes()
    good = encode_delta(perturbed(fp32_weights(4), rel=1e-6, fraction=0.1, seed=5).tobytes(), base)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(len(base)))
    cases = {
        "truncated": good[: len(good) // 2],
        "truncated header": good[:5],
        "garbage": b"\x00\xffnot zstd" * 10,
        "bad magic": b"\x28\xb5\x2f\xfe" + good[4:],
        "trailing bytes": good + b"\x00",
        "two frames": good + good,
        "empty": b"",
        "wrong content size": encode_delta(b"\x01" * 100, b"\x00" * 100),
        "no content size": no_size,
        "oversize": good + bytes(max_delta_size(len(base))),
    }
    for name, delta in cases.items():
        with pytest.raises(RemoteProtocolError):
            decode_delta(delta, base, max_size=len(base))
            pytest.fail(name)
    corrupted = bytearray(good)
    corrupted[len(corrupted) // 2] ^= 0xFF  # may or may not be caught by zstd; never crashes
    try:
        out = decode_delta(bytes(corrupted), base, max_size=len(base))
    except RemoteProtocolError:
        pass
    else:
        assert len(out) == len(base)  # the manifest's weights hash catches the rest


def test_zstd_bombs_are_refused_before_allocating() -> None:
    base = bytes(1024)
    bomb_bytes = 64 * 1024 * 1024
    declared = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(bomb_bytes))
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(bomb_bytes))
    assert len(declared) < 16 * 1024 and len(undeclared) < 16 * 1024
    # Both would be larger than any delta of a 1 KiB base, so they fail the size check first...
    for bomb in (declared, undeclared):
        with pytest.raises(RemoteProtocolError):
            decode_delta(bomb, base, max_size=len(base))
    # ...and against a base large enough to admit their size, on the declared content size.
    big_base = bytes(64 * 1024)
    with pytest.raises(RemoteProtocolError, match="declares 67108864 B"):
        decode_delta(declared, big_base, max_size=len(big_base))
    with pytest.raises(RemoteProtocolError, match="does not declare"):
        decode_delta(undeclared, big_base, max_size=len(big_base))


def test_choose_payload() -> None:
    bases = {3: 500, 4: 300, 5: 300, 6: 100}
    assert choose_payload({3, 4, 5}, bases, 1000) == 5  # smallest; tie goes to the newest base
    assert choose_payload({6, 1}, bases, 1000) == 6
    assert choose_payload({3}, bases, 1000) == 3
    assert choose_payload({3}, bases, 500) is None  # a delta no smaller than the full weights
    assert choose_payload({1, 2}, bases, 1000) is None  # the peer holds no base we encoded against
    assert choose_payload(set(), {}, 1000) is None


def test_dissemination_modules_import_no_numpy_or_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, protocol.delta, protocol.manifest, protocol.pieces\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'numpy', 'torch', 'trio', 'libp2p'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
