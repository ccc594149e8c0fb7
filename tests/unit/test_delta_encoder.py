"""The learner's torch delta encoder speaks `protocol.weights.delta`'s wire format: the protocol's
decoder round-trips it bit-exactly, and it picks the form the protocol encoder picks (a sparse
delta byte for byte the same)."""

from __future__ import annotations

import random

import pytest
import torch

from echo_node.weights import delta_encoder
from echo_node.weights.delta_encoder import encode_delta
from protocol.errors import LocalProtocolError
from protocol.weights import delta as wire

N = 150_001  # lanes: above MIN_VECTOR_BYTES, and several chunks once CHUNK_BYTES is shrunk


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 KiB, so every input here crosses chunk boundaries (and an odd tail)."""
    monkeypatch.setattr(delta_encoder, "CHUNK_BYTES", 1 << 16)


def bf16_rl_step(n: int, *, lr: float, seed: int) -> tuple[bytes, bytes]:
    """bf16 weights before/after an Adam-like step (every fp32 master weight moves by lr)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    before = master.to(torch.bfloat16)
    after = (master + lr * torch.randn(n, generator=g).sign()).to(torch.bfloat16)
    return _raw(after), _raw(before)


def _raw(t: torch.Tensor) -> bytes:
    out = bytearray(t.numel() * t.element_size())
    torch.frombuffer(out, dtype=t.dtype).copy_(t)
    return bytes(out)


def check(new: bytes, base: bytes, *, threads: int = 2) -> bytes:
    fast = encode_delta(new, base, threads=threads)
    assert wire.decode_delta(fast, base, max_size=len(base)) == new
    reference = wire.encode_delta(new, base)
    assert fast[:1] == reference[:1] or len(fast) <= len(reference)  # the same form, or smaller
    if reference[0] == 0x01:
        assert fast == reference  # sparse streams are the same bytes, compressed alike
    return fast


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-3])
@pytest.mark.parametrize("extra", [b"", b"\x7f"])
def test_bf16_rl_steps_round_trip_and_match_the_protocol_encoder(lr: float, extra: bytes) -> None:
    new, base = bf16_rl_step(N, lr=lr, seed=1)
    delta = check(new + extra, base + extra)
    if lr == 1e-6:
        assert delta[0] == 0x01 and len(delta) < 0.05 * len(new)
    check(new + b"\x01", base + b"\x00")  # the odd last byte itself changed


def test_no_changes_all_changed_and_random() -> None:
    rng = random.Random(2)
    a, b = rng.randbytes(2 * N + 1), rng.randbytes(2 * N + 1)
    assert check(a, b)[:4] == b"\x28\xb5\x2f\xfd"  # everything changed: plain
    assert len(check(a, a)) < 200  # nothing changed
    check(bytes(2 * N + 1), a)
    ones = bytes(x ^ 0xFF for x in a)
    check(ones, a, threads=1)


def test_fp32_and_wide_gaps() -> None:
    g = torch.Generator().manual_seed(3)
    master = torch.randn(N, generator=g)
    check(_raw(master * (1 + 1e-6)), _raw(master))
    base = bytes(4 * N)
    new = bytearray(base)
    new[1] = 1
    new[-2] = 0x80  # two changes, a gap of ~2 * N lanes: 3-byte gap planes if sparse
    check(bytes(new), base)


def test_small_inputs_and_misuse() -> None:
    for n in range(0, 7):
        a = bytes(range(n))
        check(a, a)
        check(bytes(n), a)
    with pytest.raises(LocalProtocolError, match="lengths differ"):
        encode_delta(b"ab", b"abc")
    with pytest.raises(LocalProtocolError, match="zstd level"):
        encode_delta(b"ab", b"ab", level=0)
