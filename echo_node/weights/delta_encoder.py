"""The learner's delta encoder: `protocol.weights.delta`'s wire format, computed with torch.

Job: cut the delta of one version against another at memory speed. The encoder runs only on the
learner, over its own weights, so it may use torch; the decoder (hostile input, bounded) stays
in `protocol/`, and every delta this module makes is one `protocol.weights.delta.decode_delta`
decodes bit-exactly (tests/unit/test_delta_encoder.py).

Rules:
- The same forms and the same choice as `protocol.weights.delta.encode_delta`: the sparse form
  (byte planes of the gaps, low and high planes of the zigzag differences) is built while
  k <= n // 3 and k * (w + 2) <= n (so it is always decodable), the plain form (one zstd frame of
  new XOR base declaring its content size) always, and the smaller is sent. The sparse streams
  are the same bytes as the protocol encoder's and each is compressed single-threaded at the
  same level, so a sparse delta is byte-identical to the protocol encoder's; the plain frame is
  compressed with `threads` zstd workers (another frame, the same content).
- Temporaries are bounded by one chunk (`CHUNK_BYTES`) plus the sparse streams (k * (w + 10)
  bytes: 8-byte gaps until the width is known), so encoding does not copy the model.
- Little-endian hosts only (the wire's lane order); elsewhere, and below `MIN_VECTOR_BYTES`,
  the protocol encoder does the work.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import zstandard

from protocol.errors import LocalProtocolError
from protocol.limits import MAX_WEIGHTS_BYTES
from protocol.weights import delta as wire

__all__ = ["CHUNK_BYTES", "encode_delta", "worker_count"]

DEFAULT_DELTA_LEVEL = wire.DEFAULT_DELTA_LEVEL
# Per step of the scan: big enough that per-call overheads vanish, small enough to stay in cache
# levels that matter and to bound the temporaries.
CHUNK_BYTES = 8 << 20
# Below this the protocol encoder is as fast and there is nothing to gain.
MIN_VECTOR_BYTES = 1 << 16


def worker_count() -> int:
    """Threads worth using here: the cores this process may run on (at most 8)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def as_uint8(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A flat uint8 tensor over `buf`, without a copy. Read-only buffers are only read here."""
    view = memoryview(buf).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def encode_delta(
    new: bytes | bytearray | memoryview,
    base: bytes | bytearray | memoryview,
    *,
    level: int = DEFAULT_DELTA_LEVEL,
    threads: int | None = None,
    check: Callable[[], None] | None = None,
) -> bytes:
    """The smaller of the sparse and the plain delta of `new` against `base` (same length); the
    wire format of `protocol.weights.delta`. `check` is called before every chunk and may raise
    to stop the encode (e.g. `echo_node.offload.check_cancelled`: a stop does not wait for it)."""
    if type(level) is not int or not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise LocalProtocolError(f"zstd level must be an int in [1, {zstandard.MAX_COMPRESSION_LEVEL}], got {level!r}")
    n = len(memoryview(new).cast("B"))
    if n > MAX_WEIGHTS_BYTES:
        raise LocalProtocolError(f"weights of {n} B exceed MAX_WEIGHTS_BYTES={MAX_WEIGHTS_BYTES}")
    if len(memoryview(base).cast("B")) != n:
        raise LocalProtocolError(f"cannot XOR {n} B with {len(memoryview(base).cast('B'))} B: lengths differ")
    if n < MIN_VECTOR_BYTES or sys.byteorder != "little":
        return wire.encode_delta(new, base, level=level)
    threads = worker_count() if threads is None else threads
    a, b = as_uint8(new), as_uint8(base)
    plain, sparse = _scan(a, b, level, threads, check)
    if sparse is not None:
        gaps, zz_lo, zz_hi = sparse
        delta = _encode_sparse(a, b, gaps, zz_lo, zz_hi, level, threads)
        del gaps, zz_lo, zz_hi
        if delta is not None and len(delta) < len(plain):
            return delta
    return plain


def _scan(
    a: torch.Tensor, b: torch.Tensor, level: int, threads: int, check: Callable[[], None] | None = None
) -> tuple[bytes, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """One pass: the plain delta (streamed) and, while the sparse form is still possible, each
    changed lane's gap and zigzag difference planes."""
    n = a.numel()
    lanes_total = n // 2
    max_changes = n // 3
    params = zstandard.ZstdCompressionParameters.from_level(level, threads=threads if threads > 1 else 0,
                                                            write_content_size=True, write_checksum=False)
    # The declared content size is what lets decode_delta refuse a bomb before decompressing.
    cobj = zstandard.ZstdCompressor(compression_params=params).compressobj(size=n)
    scratch = bytearray(min(CHUNK_BYTES, n))
    xor = torch.frombuffer(scratch, dtype=torch.uint8)
    plain: list[bytes] = []
    gaps: list[torch.Tensor] | None = []
    lows: list[torch.Tensor] = []
    highs: list[torch.Tensor] = []
    k = 0
    last = -1  # lane index of the last changed lane so far
    for lo in range(0, n, CHUNK_BYTES):
        if check is not None:
            check()
        hi = min(lo + CHUNK_BYTES, n)
        x = torch.bitwise_xor(a[lo:hi], b[lo:hi], out=xor[: hi - lo])
        plain.append(cobj.compress(memoryview(scratch)[: hi - lo]))
        if gaps is None:
            continue
        lane_hi = min(hi, 2 * lanes_total)  # an odd last byte is not a lane
        if lane_hi <= lo:
            continue
        changed = torch.nonzero(x[: lane_hi - lo].view(torch.int16)).flatten()
        if changed.numel() == 0:
            continue
        k += changed.numel()
        if k > max_changes:
            gaps = None
            lows.clear()
            highs.clear()
            continue
        base_lane = lo // 2
        positions = changed + base_lane
        gap = torch.diff(positions, prepend=positions.new_tensor([last])) - 1
        last = int(positions[-1])
        gaps.append(gap)
        new16 = a[lo:lane_hi].view(torch.int16)[changed].to(torch.int32)
        old16 = b[lo:lane_hi].view(torch.int16)[changed].to(torch.int32)
        # zigzag((new - base) mod 2**16 read as int16), as the wire defines it.
        d = ((new16 - old16 + 32768) & 0xFFFF) - 32768
        zz = (d << 1) ^ (d >> 15)
        lows.append((zz & 0xFF).to(torch.uint8))
        highs.append((zz >> 8).to(torch.uint8))
    plain.append(cobj.flush())
    blob = b"".join(plain)
    if gaps is None:
        return blob, None
    empty8 = torch.empty(0, dtype=torch.uint8)
    return blob, (
        torch.cat(gaps) if gaps else torch.empty(0, dtype=torch.int64),
        torch.cat(lows) if lows else empty8,
        torch.cat(highs) if highs else empty8,
    )


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous uint8 tensor's bytes as a buffer zstd can read (one copy into a bytearray)."""
    out = bytearray(t.numel())
    if t.numel():
        torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return memoryview(out)


def _encode_sparse(
    a: torch.Tensor, b: torch.Tensor, gaps: torch.Tensor, zz_lo: torch.Tensor, zz_hi: torch.Tensor, level: int, threads: int,
) -> bytes | None:
    n = a.numel()
    k = gaps.numel()
    biggest = int(gaps.max()) if k else 0
    width = max(1, (biggest.bit_length() + 7) // 8)
    if k * (width + 2) > n:
        return None  # beyond what a decoder accepts
    planes = [_tensor_bytes(((gaps >> (8 * j)) & 0xFF).to(torch.uint8)) for j in range(width)]
    streams = [*planes, _tensor_bytes(zz_lo), _tensor_bytes(zz_hi)]

    def compress(stream: memoryview) -> bytes:
        # One compressor per call: a ZstdCompressor is not safe to share between threads.
        return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(stream)

    if threads > 1 and k >= MIN_VECTOR_BYTES:
        with ThreadPoolExecutor(max_workers=min(threads, len(streams))) as pool:
            frames = list(pool.map(compress, streams))
    else:
        frames = [compress(s) for s in streams]
    head = wire._SPARSE_HEAD.pack(wire._TAG_SPARSE, k, width)
    tail = bytes([int(a[-1]) ^ int(b[-1])]) if n & 1 else b""
    return b"".join([head, tail, *(wire._FRAME_LEN.pack(len(f)) for f in frames), *frames])
