"""Lossless weight deltas: a sparse or a plain zstd coding of `new` vs `base`, and the choice of what
to send. No I/O.

Job: let a version after the first travel as a delta against a version the receiving peer
already holds. One RL step changes few weights of a bf16 snapshot (only those whose fp32 master
crosses a bf16 rounding boundary) and those by a unit or two in the last place; the delta codes
which 16-bit lanes changed and by how much, and the round trip is bit-exact whatever the bytes are.

Wire form of a delta (self-describing: the first byte says which):
- plain (first byte 0x28, the zstd magic): one zstd frame (RFC 8878) that declares its content
  size, whose content is `new XOR base` (equal lengths). This is the original format, unchanged.
- sparse (first byte 0x01): the blob is read as little-endian 16-bit lanes (bf16 elements; an odd
  last byte travels raw as its XOR). Header `<B Q B`: tag, k = number of changed lanes, w = gap
  width in bytes (1..8); then, if len(base) is odd, the last byte's XOR; then w + 2 frame lengths
  (`<Q` each); then w + 2 zstd frames, each declaring exactly k bytes of content:
  frames 0..w-1 are the byte planes (least significant first) of the gaps, i.e. the number of
  unchanged lanes before each changed lane since the previous one; frames w and w+1 are the low and
  high byte planes of zigzag((new - base) mod 2**16 as int16) of each changed lane. Byte planes
  keep each stream's statistics simple (the high planes are nearly all zero), which is what lets
  zstd's entropy coder get within a few % of the gaps' entropy; the arithmetic difference is
  +-1 for most changed weights (1-2 bits) where their XOR is a carry chain (~3 bits).
`encode_delta` builds both and sends the smaller (the sparse one is only built while it can be
decoded within the bound below, k * (w + 2) <= len(base)). The signed manifest carries the hashes
that bind the delta's output to a version (manifest.py, `weights_sha256`).

Invariants:
- `decode_delta` writes the output into the caller's buffer `out` (exactly len(base) B; without
  one it allocates it, plus one copy to return it as bytes) and allocates at most len(base) B of
  decompressed sparse streams, plus temporaries bounded by one chunk, whatever the delta's bytes
  (a plain delta is decompressed chunk by chunk into `out`): every zstd frame must declare its
  exact expected content size before anything is decompressed (a zstd bomb is refused up front),
  the sparse header must satisfy k * (w + 2) <= len(base), and the frames must fill the delta
  exactly. Nothing is ever written outside `out`; after a failure its contents are undefined
  (the caller discards it: the weights it holds are the base, untouched).
- `decode_delta(encode_delta(new, base), base, max_size=len(base)) == new` for every pair of
  equal-length byte strings.
- Every failure on a peer's delta is a RemoteProtocolError; misuse on our side (different
  lengths, a bad level) is a LocalProtocolError.

Speed (2 shared cores, pure Python, no numpy): the scan XORs 64 KiB chunks via Python ints and
finds changed lanes with a SWAR test plus bytes.split, the per-change work (gather, difference,
scatter) runs in C through map/array/int arithmetic on chunks of 64 Ki changes; only the loop
over chunks is Python. Throughput and sizes on a real snapshot: benchmarks/results/measurements.md.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import deque
from itertools import accumulate, islice, repeat
from operator import add
from typing import Final, Iterable, overload

import zstandard

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.framing import _frame_end  # the same strict one-frame walk the gossip frames use
from protocol.limits import MAX_WEIGHTS_BYTES

__all__ = ["decode_delta", "encode_delta", "estimate_delta_ratio", "max_delta_size", "xor_bytes"]

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # RFC 8878 §3.1.1; also the plain format's first bytes
_TAG_SPARSE = 0x01  # first byte of a sparse delta (never the first byte of a zstd frame)
_SPARSE_HEAD = struct.Struct("<BQB")  # tag, changed lanes k, gap width w
_FRAME_LEN = struct.Struct("<Q")
_MAX_GAP_WIDTH = 8
_XOR_CHUNK = 64 * 1024  # cache-resident: 64 KiB chunks XOR at least as fast as one whole-blob int
_CHANGE_CHUNK = 1 << 16  # changed lanes handled per step of the sparse coder (bounds temporaries)
_BIG_ENDIAN = sys.byteorder == "big"
_LANE_CODE: Final = "H"  # unsigned 16-bit lanes
assert array(_LANE_CODE).itemsize == 2, "array('H') must hold 16-bit items"
_GAP_CODES = {array(c).itemsize: c for c in reversed("QLIHB")}  # itemsize -> typecode
DEFAULT_DELTA_LEVEL = 3  # zstd's default level: the streams are entropy-coded; higher levels gain little


def xor_bytes(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> bytes:
    """Bytewise XOR of two equal-length buffers (LocalProtocolError if the lengths differ)."""
    n = len(a)
    if len(b) != n:
        raise LocalProtocolError(f"cannot XOR {n} B with {len(b)} B: lengths differ")
    ma, mb = memoryview(a).cast("B"), memoryview(b).cast("B")
    out = bytearray(n)
    for lo in range(0, n, _XOR_CHUNK):
        hi = min(lo + _XOR_CHUNK, n)
        x = int.from_bytes(ma[lo:hi], "little") ^ int.from_bytes(mb[lo:hi], "little")
        out[lo:hi] = x.to_bytes(hi - lo, "little")
    return bytes(out)


def max_delta_size(weights_size: int) -> int:
    """Largest delta we accept for `weights_size` bytes of weights.

    zstd's worst case (ZSTD_COMPRESSBOUND: incompressible input stored in raw blocks) is
    n + n/256 + 128 KiB-dependent slack; 1 KiB covers the frame header and the slack. A sparse
    delta is only sent when smaller than the plain one, so the same bound holds for both.
    """
    return weights_size + (weights_size >> 8) + 1024


# --- 16-bit lane arithmetic on Python ints (SWAR: one int holds many little-endian lanes) -------


def _lane_const(pattern: bytes, lanes: int) -> int:
    return int.from_bytes(pattern * lanes, "little")


class _Lanes:
    """The lane masks for `lanes` lanes; built once per chunk size."""

    __slots__ = ("high", "low15", "one", "even")

    def __init__(self, lanes: int) -> None:
        self.high = _lane_const(b"\x00\x80", lanes)  # 0x8000 per lane
        self.low15 = _lane_const(b"\xff\x7f", lanes)  # 0x7fff
        self.one = _lane_const(b"\x01\x00", lanes)  # 0x0001
        self.even = _lane_const(b"\xfe\xff", lanes)  # 0xfffe


def _lanes_for(lanes: int, cache: dict[int, _Lanes]) -> _Lanes:
    got = cache.get(lanes)
    if got is None:
        got = cache[lanes] = _Lanes(lanes)
    return got


def _zigzag_diff(new: int, base: int, k: _Lanes) -> int:
    """Per lane: zigzag((new - base) mod 2**16 read as int16)."""
    d = ((new | k.high) - (base & k.low15)) ^ ((new ^ base ^ k.high) & k.high)
    return ((d << 1) & k.even) ^ (((d >> 15) & k.one) * 0xFFFF)


def _apply_zigzag(base: int, zz: int, k: _Lanes) -> int:
    """Per lane: base + unzigzag(zz) mod 2**16 (the inverse of `_zigzag_diff`)."""
    d = ((zz >> 1) & k.low15) ^ ((zz & k.one) * 0xFFFF)
    return ((base & k.low15) + (d & k.low15)) ^ ((base ^ d) & k.high)


def _lane_values(values: array[int]) -> int:
    if _BIG_ENDIAN:
        values.byteswap()
    return int.from_bytes(values, "little")


def _lane_array(x: int, count: int) -> array[int]:
    out = array(_LANE_CODE)
    out.frombytes(x.to_bytes(2 * count, "little"))
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def _lane_view(buf: memoryview, lanes: int) -> memoryview[int] | array[int]:
    """Random access to the first `lanes` little-endian 16-bit lanes of `buf` (no copy if we can)."""
    if not _BIG_ENDIAN:
        return buf[: 2 * lanes].cast(_LANE_CODE)
    out = array(_LANE_CODE)
    out.frombytes(buf[: 2 * lanes])
    out.byteswap()
    return out


# --- Encoding ----------------------------------------------------------------------------------


def encode_delta(
    new: bytes | bytearray | memoryview,
    base: bytes | bytearray | memoryview,
    *,
    level: int = DEFAULT_DELTA_LEVEL,
) -> bytes:
    """The smaller of the sparse and the plain delta of `new` against `base` (same length)."""
    if type(level) is not int or not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise LocalProtocolError(f"zstd level must be an int in [1, {zstandard.MAX_COMPRESSION_LEVEL}], got {level!r}")
    if len(new) > MAX_WEIGHTS_BYTES:
        raise LocalProtocolError(f"weights of {len(new)} B exceed MAX_WEIGHTS_BYTES={MAX_WEIGHTS_BYTES}")
    n = len(new)
    if len(base) != n:
        raise LocalProtocolError(f"cannot XOR {n} B with {len(base)} B: lengths differ")
    mn, mb = memoryview(new).cast("B"), memoryview(base).cast("B")
    plain, gaps = _scan(mn, mb, level)
    if gaps is not None:
        sparse = _encode_sparse(mn, mb, gaps, level)
        if len(sparse) < len(plain):
            return sparse
    return plain


def estimate_delta_ratio(
    new: bytes | bytearray | memoryview,
    base: bytes | bytearray | memoryview,
    *,
    sample_bytes: int = 256 * 1024,
    spots: int = 8,
    level: int = DEFAULT_DELTA_LEVEL,
) -> float:
    """len(encode_delta(new, base)) / len(new), estimated from `spots` evenly spread slices of
    `sample_bytes` in all: ~1/13 of the cost on the default model, to decide whether a delta is
    worth cutting at all. Exact when the blob is no bigger than the sample. Zstd does a little
    worse on the short slices, so the estimate errs high (towards "not worth it")."""
    n = len(new)
    if len(base) != n:
        raise LocalProtocolError(f"cannot compare {n} B with {len(base)} B: lengths differ")
    if n == 0:
        return 1.0
    if n <= sample_bytes:
        return len(encode_delta(new, base, level=level)) / n
    width = max(2, sample_bytes // spots) & ~1  # whole 16-bit lanes
    step = (n - width) // max(1, spots - 1) & ~1
    mn, mb = memoryview(new).cast("B"), memoryview(base).cast("B")
    starts = [i * step for i in range(spots)]
    sample_new = b"".join(mn[lo : lo + width] for lo in starts)
    sample_base = b"".join(mb[lo : lo + width] for lo in starts)
    return len(encode_delta(sample_new, sample_base, level=level)) / len(sample_new)


def _scan(mn: memoryview, mb: memoryview, level: int) -> tuple[bytes, list[int] | None]:
    """One pass: the plain delta (zstd(new XOR base), streamed) and the gaps between changed lanes.

    The gaps are None once there are too many changed lanes for a sparse delta to be decodable
    within its bound (k * (w + 2) <= n with w >= 1).
    """
    n = len(mn)
    lanes_total = n // 2
    max_changes = n // 3
    # The declared content size is what lets decode_delta refuse a bomb before decompressing.
    cobj = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compressobj(size=n)
    plain: list[bytes] = []
    gaps: list[int] | None = []
    pending = 0  # unchanged lanes since the last changed one
    masks: dict[int, _Lanes] = {}
    for lo in range(0, n, _XOR_CHUNK):
        hi = min(lo + _XOR_CHUNK, n)
        x = int.from_bytes(mn[lo:hi], "little") ^ int.from_bytes(mb[lo:hi], "little")
        plain.append(cobj.compress(x.to_bytes(hi - lo, "little")))
        if gaps is None:
            continue
        lanes = min(hi, 2 * lanes_total) // 2 - lo // 2  # _XOR_CHUNK is even: chunks hold whole lanes
        if not x or not lanes:
            pending += lanes
            continue
        k = _lanes_for(lanes, masks)
        x &= (1 << (16 * lanes)) - 1  # an odd last byte is not a lane
        # 0x80 in the high byte of every nonzero lane, 0x00 elsewhere; keep one byte per lane.
        flags = ((((x & k.low15) + k.low15) | x) & k.high).to_bytes(2 * lanes, "little")[1::2]
        runs = list(map(len, flags.split(b"\x80")))  # runs of unchanged lanes between changed ones
        if len(runs) == 1:
            pending += runs[0]
            continue
        gaps.append(pending + runs[0])
        pending = runs.pop()
        gaps += islice(runs, 1, None)
        if len(gaps) > max_changes:
            gaps = None
    plain.append(cobj.flush())
    return b"".join(plain), gaps


def _positions(gaps: Iterable[int]) -> accumulate[int]:
    """Lane index of each changed lane, from the gaps before each."""
    return accumulate(map(add, gaps, repeat(1)), initial=-1)


def _encode_sparse(mn: memoryview, mb: memoryview, gaps: list[int], level: int) -> bytes:
    n = len(mn)
    k = len(gaps)
    width = max(1, (max(gaps, default=0).bit_length() + 7) // 8)
    new_lanes, base_lanes = _lane_view(mn, n // 2), _lane_view(mb, n // 2)
    masks: dict[int, _Lanes] = {}
    zigzags: list[bytes] = []
    positions = _positions(gaps)
    next(positions)
    while chunk := list(islice(positions, _CHANGE_CHUNK)):
        c = len(chunk)
        nv = _lane_values(array(_LANE_CODE, map(new_lanes.__getitem__, chunk)))
        bv = _lane_values(array(_LANE_CODE, map(base_lanes.__getitem__, chunk)))
        zigzags.append(_zigzag_diff(nv, bv, _lanes_for(c, masks)).to_bytes(2 * c, "little"))
    del new_lanes, base_lanes
    zz = b"".join(zigzags)
    del zigzags
    size = next(s for s in sorted(_GAP_CODES) if s >= width)
    packed = array(_GAP_CODES[size], gaps)
    if _BIG_ENDIAN:
        packed.byteswap()
    gap_bytes = packed.tobytes()
    del packed
    streams = [gap_bytes[j::size] for j in range(width)] + [zz[0::2], zz[1::2]]
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    frames = [cctx.compress(s) for s in streams]
    head = _SPARSE_HEAD.pack(_TAG_SPARSE, k, width)
    tail = bytes([mn[-1] ^ mb[-1]]) if n & 1 else b""
    return b"".join([head, tail, *(_FRAME_LEN.pack(len(f)) for f in frames), *frames])


# --- Decoding ----------------------------------------------------------------------------------


@overload
def decode_delta(
    delta: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview, *, max_size: int, out: None = None
) -> bytes: ...
@overload
def decode_delta(
    delta: bytes | bytearray | memoryview, base: bytes | bytearray | memoryview, *, max_size: int, out: bytearray | memoryview
) -> memoryview: ...
def decode_delta(
    delta: bytes | bytearray | memoryview,
    base: bytes | bytearray | memoryview,
    *,
    max_size: int,
    out: bytearray | memoryview | None = None,
) -> bytes | memoryview:
    """The new weights from a peer's `delta` against our `base`; bounded, bit-exact.

    `max_size` is the most bytes the caller will hold for the result (e.g. the manifest's
    `weights_size`); a base larger than that is the caller's mistake (LocalProtocolError).
    `out`: a writable buffer of exactly len(base) B (not overlapping `base`) to decode into,
    returned as a read-only view; without it the result is new bytes. RemoteProtocolError
    unless `delta` is a well-formed plain or sparse delta (module docstring) of exactly
    `len(base)` bytes of weights.
    """
    n = len(base)
    if n > max_size:
        raise LocalProtocolError(f"base of {n} B is larger than max_size={max_size}")
    target = memoryview(bytearray(n) if out is None else out).cast("B")
    if target.readonly or len(target) != n:
        raise LocalProtocolError(f"cannot decode {n} B of weights into a {'read-only ' * target.readonly}buffer of {len(target)} B")
    data = bytes(delta)
    if len(data) > max_delta_size(n):
        raise RemoteProtocolError(f"delta of {len(data)} B is larger than any delta of {n} B weights")
    mb = memoryview(base).cast("B")
    if data[:1] == bytes([_TAG_SPARSE]):
        _decode_sparse(data, mb, target)
    elif data.startswith(_ZSTD_MAGIC):
        _decode_plain(data, mb, target)
    else:
        raise RemoteProtocolError("delta is neither a sparse delta nor a zstd frame (bad magic number)")
    return bytes(target) if out is None else target.toreadonly()


def _check_frame(frame: bytes, size: int, what: str) -> None:
    """`frame` is exactly one zstd frame declaring exactly `size` bytes (nothing decompressed)."""
    if not frame.startswith(_ZSTD_MAGIC):
        raise RemoteProtocolError(f"{what} is not a zstd frame (bad magic number)")
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"{what}: corrupt zstd frame header: {exc}") from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise RemoteProtocolError(f"{what}: zstd frame does not declare its content size")
    if params.content_size != size:
        # Checked before decompressing: python-zstandard allocates the declared size up front.
        raise RemoteProtocolError(f"{what} declares {params.content_size} B of content, expected {size} B")
    try:
        end = _frame_end(frame, has_checksum=params.has_checksum)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"{what}: corrupt zstd frame: {exc}") from None
    if end != len(frame):
        raise RemoteProtocolError(f"{what}: {len(frame) - end} trailing bytes after the zstd frame")


def _decode_plain(data: bytes, base: memoryview, out: memoryview) -> None:
    """out = base XOR zstd-decompress(data), one chunk of decompressed bytes at a time."""
    n = len(base)
    _check_frame(data, n, "delta")
    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False)
    pos = 0
    try:
        while pos < n:
            chunk = reader.read(min(_XOR_CHUNK, n - pos))
            if not chunk:
                raise RemoteProtocolError(f"delta decompressed to {pos} B, expected {n} B")
            hi = pos + len(chunk)
            x = int.from_bytes(chunk, "little") ^ int.from_bytes(base[pos:hi], "little")
            out[pos:hi] = x.to_bytes(hi - pos, "little")
            pos = hi
        if reader.read(1):  # defensive: zstd already checks the output against the declared size
            raise RemoteProtocolError(f"delta decompresses to more than {n} B")
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"delta does not decompress to {n} B: {exc}") from None


def _decompress_exact(frame: bytes, size: int, what: str) -> bytes:
    """`frame`, exactly one zstd frame declaring exactly `size` bytes, decompressed."""
    _check_frame(frame, size, what)
    try:
        out = zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as exc:
        raise RemoteProtocolError(f"{what} does not decompress to {size} B: {exc}") from None
    if len(out) != size:  # defensive: zstd already checks the output against the declared size
        raise RemoteProtocolError(f"{what} decompressed to {len(out)} B, expected {size} B")
    return out


def _decode_sparse(data: bytes, base: memoryview, out: memoryview) -> None:
    n = len(base)
    lanes_total = n // 2
    odd = n & 1
    if len(data) < _SPARSE_HEAD.size + odd:
        raise RemoteProtocolError("sparse delta: truncated header")
    _, k, width = _SPARSE_HEAD.unpack_from(data)
    if not 1 <= width <= _MAX_GAP_WIDTH:
        raise RemoteProtocolError(f"sparse delta: gap width {width} not in [1, {_MAX_GAP_WIDTH}]")
    if k > lanes_total or k * (width + 2) > n:
        raise RemoteProtocolError(f"sparse delta: {k} changed lanes of width {width} do not fit {n} B of weights")
    pos = _SPARSE_HEAD.size + odd
    n_frames = width + 2
    if len(data) < pos + n_frames * _FRAME_LEN.size:
        raise RemoteProtocolError("sparse delta: truncated frame table")
    sizes = [_FRAME_LEN.unpack_from(data, pos + i * _FRAME_LEN.size)[0] for i in range(n_frames)]
    pos += n_frames * _FRAME_LEN.size
    if pos + sum(sizes) != len(data):
        raise RemoteProtocolError(f"sparse delta: frames of {sum(sizes)} B do not fill the {len(data) - pos} B after the header")
    streams = []
    for i, size in enumerate(sizes):
        streams.append(_decompress_exact(data[pos : pos + size], k, f"sparse delta stream {i}"))
        pos += size
    # Gaps: reassemble the byte planes into native ints.
    item = next(s for s in sorted(_GAP_CODES) if s >= width)
    buf = bytearray(k * item)
    for j in range(width):
        buf[j::item] = streams[j]
    gaps = array(_GAP_CODES[item])
    gaps.frombytes(buf)
    del buf
    if _BIG_ENDIAN:
        gaps.byteswap()
    zz_lo, zz_hi = streams[width], streams[width + 1]
    del streams
    out[:] = base
    # The changed lanes are rewritten in place: through a 16-bit view of `out`, or on a
    # big-endian host through a byte-swapped copy written back at the end.
    lanes: memoryview[int] | array[int]
    if _BIG_ENDIAN:
        lanes = array(_LANE_CODE)
        lanes.frombytes(out[: 2 * lanes_total])
        lanes.byteswap()
    else:
        lanes = out[: 2 * lanes_total].cast(_LANE_CODE)
    masks: dict[int, _Lanes] = {}
    positions = _positions(gaps)
    next(positions)
    done = 0
    while chunk := list(islice(positions, _CHANGE_CHUNK)):
        c = len(chunk)
        if chunk[-1] >= lanes_total:  # positions increase: the last one is the largest
            raise RemoteProtocolError(f"sparse delta: changed lane {chunk[-1]} is past the {lanes_total} lanes of the weights")
        zz = bytearray(2 * c)
        zz[0::2] = zz_lo[done : done + c]
        zz[1::2] = zz_hi[done : done + c]
        done += c
        bv = _lane_values(array(_LANE_CODE, map(lanes.__getitem__, chunk)))
        nv = _apply_zigzag(bv, int.from_bytes(zz, "little"), _lanes_for(c, masks))
        deque(map(lanes.__setitem__, chunk, _lane_array(nv, c)), maxlen=0)
    if isinstance(lanes, array):
        lanes.byteswap()
        out[: 2 * lanes_total] = memoryview(lanes).cast("B")
    else:
        lanes.release()
    if odd:
        out[-1] = base[-1] ^ data[_SPARSE_HEAD.size]
