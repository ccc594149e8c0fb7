"""Delta codec: bit-exact round trips on fp32 / bf16 patterns, and bounded decoding of bad deltas."""

from __future__ import annotations

import array
import os
import random

import pytest
import zstandard

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.weights.delta import decode_delta, encode_delta, estimate_delta_ratio, max_delta_size, xor_bytes

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


def test_dissemination_modules_import_no_numpy_or_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, protocol.weights.delta, protocol.weights.manifest, protocol.weights.pieces\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'numpy', 'torch', 'trio', 'libp2p'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


# --- Sparse coding (first byte 0x01) vs plain (a zstd frame), and the choice between them --------


def bf16_after_step(n: int, *, fraction: float, seed: int) -> tuple[bytes, bytes]:
    """bf16 bit patterns before/after a step that moves a `fraction` of the weights by 1-2 ulp."""
    rng = random.Random(seed)
    old = array.array("H", (rng.getrandbits(16) & 0xBFFF for _ in range(n)))  # no NaN/inf exponents
    new = array.array("H", old)
    for i in rng.sample(range(n), int(n * fraction)):
        new[i] = (old[i] + rng.choice((1, -1, 1, 2, -2))) & 0xFFFF
    return new.tobytes(), old.tobytes()


def test_sparse_changes_use_the_sparse_form_and_beat_plain() -> None:
    new, base = bf16_after_step(50_000, fraction=0.05, seed=11)
    delta = round_trip(new, base)
    assert delta[0] == 0x01
    plain = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(xor_bytes(new, base))
    assert len(delta) < len(plain) * 0.7
    assert len(delta) < 0.035 * len(base)


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.01, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("extra", [b"", b"\x7f"])  # even and odd lengths (an odd last byte is not a lane)
def test_round_trips_at_every_density(fraction: float, extra: bytes) -> None:
    new, base = bf16_after_step(20_000, fraction=fraction, seed=12)
    round_trip(new + extra, base + extra)
    round_trip(new + b"\x01", base + b"\x00")  # the odd last byte itself changed


def test_identical_and_tiny_inputs() -> None:
    for n in range(0, 6):
        a = bytes(range(n))
        round_trip(a, a)
        round_trip(bytes(n), a)
    delta = round_trip(bytes(1 << 20), bytes(1 << 20))
    assert len(delta) < 100


def test_random_bytes_round_trip_and_fall_back_to_plain() -> None:
    rng = random.Random(13)
    a, b = rng.randbytes(100_001), rng.randbytes(100_001)
    delta = round_trip(a, b)
    assert delta.startswith(b"\x28\xb5\x2f\xfd")  # dense: the plain zstd frame
    assert len(delta) <= max_delta_size(len(a))


def test_dense_structured_change_picks_the_smaller() -> None:
    base = bytes(range(256)) * 400
    new = bytearray(base)
    new[1000:3000] = bytes(2000)  # one contiguous changed region
    delta = round_trip(bytes(new), base)
    plain = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(xor_bytes(bytes(new), base))
    assert len(delta) <= len(plain)


def test_large_gaps_need_wide_gap_planes() -> None:
    n = 300_000  # lanes; a change at each end: one gap of ~2**18 lanes needs 3 bytes
    base = bytes(2 * n)
    new = bytearray(base)
    new[0] = 1
    new[-1] = 0x80
    round_trip(bytes(new), base)  # two changes: the plain frame is smaller
    delta = forced_sparse(bytes(new), base)
    assert delta[0] == 0x01 and delta[9] == 3
    assert decode_delta(delta, base, max_size=len(base)) == new


def test_fp32_sparse_round_trip() -> None:
    old = fp32_weights(21)
    round_trip(perturbed(old, rel=1e-6, fraction=0.02, seed=22).tobytes(), old.tobytes())


def forced_sparse(new: bytes, base: bytes) -> bytes:
    """The sparse form even where the plain one is smaller (what a peer may legally send)."""
    from protocol.weights import delta as d

    mn, mb = memoryview(new), memoryview(base)
    _, gaps = d._scan(mn, mb, 3)
    assert gaps is not None
    return d._encode_sparse(mn, mb, gaps, 3)


def test_forced_sparse_round_trips_where_plain_wins() -> None:
    for new, base in [(b"", b""), (b"a", b"b"), (b"abc", b"abd"), (bytes(10), bytes(10)), (b"\xff" * 9, b"\x00" + b"\xff" * 8)]:
        delta = forced_sparse(new, base)
        assert delta[0] == 0x01
        assert decode_delta(delta, base, max_size=len(base)) == new


def _sparse_fixture() -> tuple[bytes, bytes, bytes]:
    new, base = bf16_after_step(4_000, fraction=0.05, seed=14)
    delta = encode_delta(new, base)
    assert delta[0] == 0x01
    return new, base, delta


def _sparse_parts(delta: bytes) -> tuple[int, int, list[bytes]]:
    import struct

    _, k, w = struct.unpack_from("<BQB", delta)
    sizes = struct.unpack_from(f"<{w + 2}Q", delta, 10)
    frames, pos = [], 10 + 8 * (w + 2)
    for s in sizes:
        frames.append(delta[pos : pos + s])
        pos += s
    return k, w, frames


def _sparse_build(k: int, w: int, frames: list[bytes], *, tail: bytes = b"") -> bytes:
    import struct

    return struct.pack("<BQB", 1, k, w) + tail + struct.pack(f"<{len(frames)}Q", *map(len, frames)) + b"".join(frames)


def bad_sparse_deltas(base: bytes, good: bytes) -> dict[str, bytes]:
    """Malformed variants of the sparse delta `good` against `base`, by what is wrong."""
    k, w, frames = _sparse_parts(good)
    assert _sparse_build(k, w, frames) == good
    z = zstandard.ZstdCompressor(write_content_size=True)
    lanes = len(base) // 2
    past_end = (lanes - k + 1).to_bytes(2, "little") + bytes(2 * (k - 1))  # last change at lane `lanes`
    wide = [z.compress(past_end[0::2]), z.compress(past_end[1::2]), *frames[w:]]
    just_fits = (lanes - k).to_bytes(2, "little") + bytes(2 * (k - 1))  # last change at the last lane
    assert decode_delta(_sparse_build(k, 2, [z.compress(just_fits[0::2]), z.compress(just_fits[1::2]), *frames[w:]]), base, max_size=len(base))
    return {
        "truncated": good[: len(good) // 2],
        "header only": good[:10],
        "tag only": good[:1],
        "trailing byte": good + b"\x00",
        "missing byte": good[:-1],
        "width 0": _sparse_build(k, 0, frames[2:]),
        "width 9": _sparse_build(k, 9, frames + [frames[0]] * 7),
        "too many changes": _sparse_build(len(base), w, frames),
        "k mismatch": _sparse_build(k - 1, w, frames),
        "frame not zstd": _sparse_build(k, w, [b"\x00" * len(frames[0]), *frames[1:]]),
        "frame without size": _sparse_build(k, w, [zstandard.ZstdCompressor(write_content_size=False).compress(bytes(k)), *frames[1:]]),
        "frame wrong size": _sparse_build(k, w, [z.compress(bytes(k + 1)), *frames[1:]]),
        "frame with trailing": _sparse_build(k, w, [frames[0] + b"\x00", *frames[1:]]),
        "position past the end": _sparse_build(k, 2, wide),  # RemoteProtocolError "past the"
        "all gaps max": _sparse_build(k, w, [z.compress(b"\xff" * k)] * w + frames[w:]),
    }


def test_bad_sparse_deltas_are_remote_errors() -> None:
    new, base, good = _sparse_fixture()
    for name, delta in bad_sparse_deltas(base, good).items():
        with pytest.raises(RemoteProtocolError):
            decode_delta(delta, base, max_size=len(base))
            pytest.fail(name)
    corrupted = bytearray(good)
    corrupted[-5] ^= 0xFF  # may or may not be caught by zstd; never crashes, never a wrong length
    try:
        out = decode_delta(bytes(corrupted), base, max_size=len(base))
    except RemoteProtocolError:
        pass
    else:
        assert len(out) == len(base)


def guarded(n: int) -> tuple[bytearray, memoryview]:
    """A buffer of `n` B between two guard bands (what a decode must never write)."""
    whole = bytearray(GUARD + bytes(n) + GUARD)
    return whole, memoryview(whole)[len(GUARD) : len(GUARD) + n]


GUARD = b"\xa5" * 64


@pytest.mark.parametrize("extra", [b"", b"\x7f"])
def test_decoding_into_a_buffer_is_the_same_and_stays_inside_it(extra: bytes) -> None:
    new, base = bf16_after_step(20_000, fraction=0.05, seed=16)
    new, base = new + extra, base + extra
    rng = random.Random(16)
    dense_new = rng.randbytes(len(base))
    for delta, want in [(encode_delta(new, base), new), (forced_sparse(new, base), new), (encode_delta(dense_new, base), dense_new)]:
        whole, out = guarded(len(base))
        got = decode_delta(delta, base, max_size=len(base), out=out)
        assert got.readonly and bytes(got) == want and bytes(out) == want
        assert whole[: len(GUARD)] == GUARD and whole[-len(GUARD) :] == GUARD
    with pytest.raises(LocalProtocolError, match="buffer of"):
        decode_delta(encode_delta(new, base), base, max_size=len(base), out=bytearray(len(base) - 1))
    with pytest.raises(LocalProtocolError, match="read-only"):
        decode_delta(encode_delta(new, base), base, max_size=len(base), out=memoryview(bytearray(len(base))).toreadonly())


def test_a_bad_delta_into_a_buffer_fails_cleanly_and_never_writes_past_it() -> None:
    """Hostile input: every malformed delta (plain, sparse, random mutations) decoded into a
    provided buffer is a RemoteProtocolError; the guard bands around the buffer and the base
    are untouched."""
    new, base_bytes, good = _sparse_fixture()
    base = bytearray(base_bytes)  # writable, so "untouched" means something
    plain = encode_delta(os.urandom(len(base)), base)
    assert plain[:1] == b"\x28"
    cases = dict(bad_sparse_deltas(base_bytes, good))
    cases |= {
        "plain truncated": plain[: len(plain) // 2],
        "plain trailing": plain + b"\x00",
        "plain two frames": plain + plain,
        "plain short content": zstandard.ZstdCompressor(write_content_size=True).compress(bytes(len(base) - 2)),
        "plain long content": zstandard.ZstdCompressor(write_content_size=True).compress(bytes(len(base) + 2)),
        "oversize": good + bytes(max_delta_size(len(base))),
    }
    rng = random.Random(17)
    for i in range(200):
        data = bytearray(good if i % 2 else plain)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        cases[f"mutant {i}"] = bytes(data)
    base_before = bytes(base)
    failed = 0
    for name, delta in cases.items():
        whole, out = guarded(len(base))
        try:
            decode_delta(delta, base, max_size=len(base), out=out)
        except RemoteProtocolError:
            failed += 1
        else:
            assert name.startswith("mutant"), name  # some mutations still decode (the digest catches them)
        assert whole[: len(GUARD)] == GUARD and whole[-len(GUARD) :] == GUARD, name
        assert base == base_before, name
    assert failed > len(cases) // 2


def test_sparse_bombs_are_refused_before_allocating() -> None:
    base = bytes(64 * 1024)
    z = zstandard.ZstdCompressor(write_content_size=True)
    huge = 64 * 1024 * 1024
    bomb = z.compress(bytes(huge))
    # A header claiming many changes is refused on k * (w + 2) > len(base) before any frame.
    with pytest.raises(RemoteProtocolError, match="do not fit"):
        decode_delta(_sparse_build(huge, 1, [bomb] * 3), base, max_size=len(base))
    # Frames that declare more than k bytes are refused on the declared size.
    with pytest.raises(RemoteProtocolError, match="declares 67108864 B"):
        decode_delta(_sparse_build(16, 1, [bomb] * 3), base, max_size=len(base))
    # A length field far past the delta's end is refused without reading.
    with pytest.raises(RemoteProtocolError, match="do not fill"):
        decode_delta(b"\x01" + (16).to_bytes(8, "little") + b"\x01" + (1 << 62).to_bytes(8, "little") * 3, base, max_size=len(base))


def test_random_garbage_never_escapes_as_another_exception() -> None:
    rng = random.Random(15)
    new, base, good = _sparse_fixture()
    for i in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        if i % 3 == 0:
            data = data[: rng.randrange(len(data))]
        try:
            out = decode_delta(bytes(data), base, max_size=len(base))
        except RemoteProtocolError:
            continue
        assert len(out) == len(base)


def test_estimated_ratio_tracks_the_real_one() -> None:
    """A sparse bf16 update and a dense fp32 one land on the right sides of a 0.3 bar."""
    old = fp32_weights(4, n=262_144)  # 1 MiB of fp32: four times the default sample
    cases = {
        "sparse": (bf16(perturbed(old, rel=1e-2, fraction=0.03, seed=5)), bf16(old)),
        "dense": (perturbed(old, rel=1e-3, fraction=1.0, seed=6).tobytes(), old.tobytes()),
    }
    for name, (new, base) in cases.items():
        real = len(encode_delta(new, base)) / len(new)
        estimate = estimate_delta_ratio(new, base)
        assert abs(estimate - real) < 0.05 + 0.2 * real, (name, estimate, real)
    assert estimate_delta_ratio(*cases["sparse"]) < 0.3 < estimate_delta_ratio(*cases["dense"])
    small_new, small_base = cases["sparse"][0][:1000], cases["sparse"][1][:1000]
    assert estimate_delta_ratio(small_new, small_base) == len(encode_delta(small_new, small_base)) / 1000
    with pytest.raises(LocalProtocolError, match="lengths differ"):
        estimate_delta_ratio(b"ab", b"abc")
