"""Framing: zstd frames (bounds, bombs, garbage) and the length-prefixed stream reader."""

from __future__ import annotations

import pytest
import zstandard

from protocol import LengthPrefixedReader, LocalProtocolError, RemoteProtocolError
from protocol.framing import decode_frame, encode_frame, encode_length_prefixed
from protocol.limits import MAX_DECOMPRESSED_BYTES, MAX_FRAME_BYTES


def test_frame_round_trip() -> None:
    for payload in (b"", b"x", b"hello" * 1000, bytes(range(256)) * 100):
        assert decode_frame(encode_frame(payload)) == payload


def test_frame_at_decompressed_limit_accepted_one_over_rejected() -> None:
    at = b"a" * MAX_DECOMPRESSED_BYTES
    assert decode_frame(encode_frame(at)) == at
    with pytest.raises(LocalProtocolError):
        encode_frame(at + b"a")
    over = zstandard.ZstdCompressor().compress(at + b"a")
    with pytest.raises(RemoteProtocolError, match="declares"):
        decode_frame(over)


def test_encode_rejects_frame_that_compresses_above_limit() -> None:
    import random

    incompressible = random.Random(1).randbytes(MAX_FRAME_BYTES)
    with pytest.raises(LocalProtocolError, match="split"):
        encode_frame(incompressible)


def test_decode_rejects_oversize_input_before_anything_else() -> None:
    with pytest.raises(RemoteProtocolError, match="MAX_FRAME_BYTES"):
        decode_frame(b"\x28\xb5\x2f\xfd" + b"\x00" * MAX_FRAME_BYTES)


def test_frame_exactly_max_frame_bytes_is_accepted() -> None:
    import random

    # Raw (stored) zstd blocks grow by a few bytes; pick a payload whose frame is exactly the cap.
    rnd = random.Random(2)
    size = MAX_FRAME_BYTES - 64
    while True:
        frame = zstandard.ZstdCompressor(level=1).compress(rnd.randbytes(size))
        if len(frame) == MAX_FRAME_BYTES:
            break
        size += MAX_FRAME_BYTES - len(frame)
    assert len(decode_frame(frame)) == size


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage bytes here", b"\x28\xb5\x2f\xfd", b"\x28\xb5\x2f\xfd\xff\xff\xff\xff\xff"],
)
def test_decode_rejects_garbage(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frame(data)


def test_decode_rejects_truncated_and_trailing_and_concatenated() -> None:
    frame = encode_frame(b"hello world" * 50)
    for cut in (len(frame) - 1, len(frame) // 2, 6):
        with pytest.raises(RemoteProtocolError):
            decode_frame(frame[:cut])
    with pytest.raises(RemoteProtocolError, match="trailing"):
        decode_frame(frame + b"\x00")
    with pytest.raises(RemoteProtocolError, match="trailing"):
        decode_frame(frame + frame)


def test_decode_rejects_skippable_frame() -> None:
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd"
    with pytest.raises(RemoteProtocolError, match="magic"):
        decode_frame(skippable)


def test_zstd_bomb_with_declared_size_rejected() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (64 * 1024 * 1024))
    assert len(bomb) < MAX_FRAME_BYTES
    with pytest.raises(RemoteProtocolError, match="declares"):
        decode_frame(bomb)


def test_zstd_bomb_without_content_size_is_bounded() -> None:
    cctx = zstandard.ZstdCompressor(level=19, write_content_size=False)
    bomb = cctx.compress(b"\x00" * (64 * 1024 * 1024))
    assert zstandard.get_frame_parameters(bomb).content_size == zstandard.CONTENTSIZE_UNKNOWN
    with pytest.raises(RemoteProtocolError, match="within"):
        decode_frame(bomb)


def test_streamed_frame_without_content_size_decodes_within_cap() -> None:
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(b"abc" * 1000) + cobj.flush()
    assert decode_frame(frame) == b"abc" * 1000
    with pytest.raises(RemoteProtocolError):
        decode_frame(frame, max_size=2999)
    assert decode_frame(frame, max_size=3000) == b"abc" * 1000


def test_frame_with_checksum_accepted() -> None:
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b"abc" * 100)
    assert decode_frame(frame) == b"abc" * 100
    corrupted = frame[:-1] + bytes([frame[-1] ^ 1])
    with pytest.raises(RemoteProtocolError):
        decode_frame(corrupted)


# --- length prefixes ------------------------------------------------------------------------


def test_length_prefixed_round_trip_split_at_every_byte() -> None:
    messages = [b"", b"a", b"hello", bytes(300)]
    stream = b"".join(encode_length_prefixed(m) for m in messages)
    reader = LengthPrefixedReader(max_len=300)
    got: list[bytes] = []
    for i in range(len(stream)):
        reader.feed(stream[i : i + 1])
        while (m := reader.next_message()) is not None:
            got.append(m)
    reader.feed_eof()
    assert got == messages
    assert reader.buffered == 0


def test_reader_says_how_many_bytes_the_next_message_still_needs() -> None:
    reader = LengthPrefixedReader(max_len=300)
    assert reader.missing == 4  # the prefix
    stream = encode_length_prefixed(bytes(300)) + encode_length_prefixed(b"ab")
    reader.feed(stream[:2])
    assert reader.missing == 2
    reader.feed(stream[2:104])
    assert reader.missing == 200
    reader.feed(stream[104:306])  # the rest of the first message and half the next prefix
    assert reader.missing == 0
    assert reader.next_message() == bytes(300)
    assert reader.missing == 2
    reader.feed(stream[306:])
    assert reader.missing == 0
    assert reader.next_message() == b"ab"
    assert reader.missing == 4


def test_length_prefix_format() -> None:
    assert encode_length_prefixed(b"abc") == b"\x00\x00\x00\x03abc"
    with pytest.raises(LocalProtocolError):
        encode_length_prefixed(b"abcd", max_len=3)


def test_oversize_declared_length_raises_immediately_and_sticks() -> None:
    reader = LengthPrefixedReader(max_len=10)
    reader.feed(encode_length_prefixed(b"x" * 10))  # exactly at the limit: fine
    assert reader.next_message() == b"x" * 10
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        reader.feed((11).to_bytes(4, "big"))  # no body needed to refuse it
    assert reader.failed
    with pytest.raises(RemoteProtocolError, match="already failed"):
        reader.next_message()
    with pytest.raises(RemoteProtocolError, match="already failed"):
        reader.feed(b"\x00\x00\x00\x01a")


def test_oversize_length_behind_a_message_raises_when_reached() -> None:
    reader = LengthPrefixedReader(max_len=4)
    reader.feed(encode_length_prefixed(b"ok") + (5).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError):
        reader.next_message()


def test_eof_mid_message_is_an_error() -> None:
    reader = LengthPrefixedReader(max_len=100)
    reader.feed(encode_length_prefixed(b"hello")[:-1])
    assert reader.next_message() is None
    with pytest.raises(RemoteProtocolError, match="ended inside"):
        reader.feed_eof()


def test_feed_after_eof_is_local_error() -> None:
    reader = LengthPrefixedReader(max_len=100)
    reader.feed_eof()
    with pytest.raises(LocalProtocolError):
        reader.feed(b"x")


def test_reader_rejects_bad_max_len() -> None:
    with pytest.raises(ValueError):
        LengthPrefixedReader(max_len=-1)
