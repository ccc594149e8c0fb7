"""Fuzz targets: every decoder that takes a peer's bytes, with valid seeds and hostile mutators.

A *target* wraps one decoder (or one handler that decodes) as `run(data: bytes) -> None`: it feeds
the bytes to the decoder and swallows only what that decoder documents for bad input,
`protocol.errors.RemoteProtocolError` (subclasses included), or, where a docstring names another
class, that one (`Target.accepted`, with `Target.note` saying why). Anything else escaping `run`
is a *crash*; an input that runs longer than `HANG_S` (1 s of CPU, or 10 s of wall-clock time)
is a *hang*. Some targets also check an oracle after a successful decode (a decoded message
survives a round trip, a stream splits back into what was fed, an admitted hello names a routable
address, ...): a failed oracle is an AssertionError, so a crash too.

Inputs are deterministic: input `i` of target `t` under seed `s` is `input_for(t, s, i)` (its own
`random.Random`; hellos are checked at a fixed `NOW`), so a finding replays from its index alone,
though a stateful target (the learner, the hello checker's nonce memory) sees it after whatever
inputs ran before it in that process. Mutators, from dumb to deep:
- byte havoc on a valid seed: bit flips, interesting bytes and ints, inserts, deletes,
  duplications, truncation, splices of two seeds, msgpack length and nesting bombs;
- msgpack-aware: decode a seed, replace random nodes with hostile values (int <-> float, 2**63,
  2**64 - 1, negatives, NaN/inf, long strings, deep nesting, empty containers, bytes <-> str,
  ...) and re-pack, canonically or with needlessly wide encodings;
- re-signed: for signed envelopes and data-channel hellos, mutate the signed body's wire values
  and sign again with the author's key (`envelope.signing_input`, `datachannel.HELLO_DOMAIN`), so the
  mutation reaches past the signature check into the message's own validation (and, for the
  learner, into its admission rules, sequence tracker and replay buffer);
- zstd-aware: the same content in frames without a content size, with checksums, in several
  blocks, behind skippable frames, concatenated, truncated, with lying content sizes, bombs and
  oversize windows.

Used by tests/fuzz/test_fuzz.py (a short deterministic run in `make test`) and benchmarks/fuzz.py.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import random
import shutil
import signal
import struct
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgpack
import zstandard

from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from protocol._wire import unpack_strict
from protocol.addresses import (
    AddressError,
    check_announce,
    check_data_host,
    check_dns_name,
    check_port,
    dial_plan,
    parse_tcp_multiaddr,
)
from protocol.envelope import SIGNATURE_DOMAIN, open_envelope, open_manifest, seal, signing_input
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.framing import LengthPrefixedReader, decode_frame, encode_frame, encode_length_prefixed
from protocol.identity import Identity, b58decode, is_valid_peer_id, peer_id_from_public_key, public_key_from_peer_id, verify
from protocol.limits import MAX_DECOMPRESSED_BYTES, MAX_LENGTH_PREFIXED
from protocol.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    ErrorResponse,
    JoinRequest,
    JoinResponse,
    Message,
    RepairRequest,
    RepairResponse,
    RolloutBatch,
    RunEnded,
    RunSpec,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    VersionAnnounce,
    decode_message,
    encode_message,
    kind_of,
)
from protocol.weights.delta import decode_delta, encode_delta
from protocol.weights.manifest import build_manifest, payload_digest, piece_range
from tests.factories import ALICE, MALLORY, make_batch

__all__ = [
    "HANG_S",
    "Finding",
    "Hang",
    "Stats",
    "Target",
    "all_targets",
    "fuzz",
    "input_for",
    "quiet_logs",
    "run_one",
]

HANG_S = 1.0  # CPU seconds one input may take (and 10x that in wall-clock time: see _alarm)
# Generated inputs are capped here (decoders refuse far smaller inputs anyway: 256 KiB frames).
MAX_INPUT = 512 * 1024

# Keys: the rollout peer ALICE (the same seed as tests/factories.py), the run's LEARNER, MALLORY
# (a peer that signs other peers' messages), BOB (a forwarder), ME (the node receiving hellos and
# weight pieces), and a STRANGER that never joined the run.
LEARNER = Identity.from_seed(b"\x03" * 32)
BOB = Identity.from_seed(b"\x05" * 32)
ME = Identity.from_seed(b"\x04" * 32)
STRANGER = Identity.from_seed(b"\x06" * 32)
IDENTITIES = (ALICE, MALLORY, LEARNER, BOB, ME)
RUN_ID = "run-1"
SHA = bytes(range(32))


# --- valid messages (the seeds) ----------------------------------------------------------------


def _batch(seq: int = 0, groups: int = 1, identity: Identity = ALICE, run_id: str = RUN_ID, **kw: Any) -> RolloutBatch:
    """What the default run (tiny model, addition) admits: tests.factories' batch."""
    return make_batch(run_id=run_id, identity=identity, seq=seq, groups=groups, **kw)


def _spec() -> RunSpec:
    return RunSpec(
        run_id=RUN_ID,
        model={"hidden_size": 64, "rope_scaling": {"type": "linear", "factor": 2.0}, "layers": [1, 2, 3],
               "tie": True, "eps": 1e-6, "name": None},
        tokenizer={"kind": "char", "vocab": list("0123456789+=")},
        task="addition",
        sampling=SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=64),
        sync_mode="async",
        staleness=2,
        group_size=8,
        current_version=0,
        learner_peer_id=LEARNER.peer_id,
        epoch=1,
    )


_PAYLOAD = bytes((i * 7 + (i >> 9)) & 0xFF for i in range(40_000))


@lru_cache(maxsize=1)
def messages() -> tuple[tuple[Message, Identity], ...]:
    """One or more valid messages of every top-level kind, each with the identity that seals it
    (the author its SIGNER_FIELD names, else the side that sends it)."""
    batch = _batch(seq=7, groups=2)
    spec = _spec()
    full = build_manifest(run_id=RUN_ID, version=3, payload=_PAYLOAD, piece_size=16384)
    delta = build_manifest(
        run_id=RUN_ID, version=4, payload=_PAYLOAD[:1500], codec="xor-zstd", base_version=3,
        weights_size=len(_PAYLOAD), weights_sha256=payload_digest(_PAYLOAD[::-1]),
    )
    return (
        (spec, LEARNER),
        (batch, ALICE),
        (_batch(seq=1, groups=1, tokens=1, samples=2), ALICE),
        (full, LEARNER),
        (delta, LEARNER),
        (JoinRequest(run_id=RUN_ID, peer_id=ALICE.peer_id, data_host="10.0.0.2", data_port=7001), ALICE),
        (JoinRequest(run_id=RUN_ID, peer_id=ALICE.peer_id, data_host="2001:db8::2", data_port=65535), ALICE),
        (JoinResponse(spec=spec, data_host="10.0.0.1", data_port=7000, seq_from=70), LEARNER),
        (StatusRequest(run_id=RUN_ID), ALICE),
        (StatusResponse(run_id=RUN_ID, version=3, weights_size=123, weights_sha256=SHA, demand_groups=8, epoch=1), LEARNER),
        (VersionAnnounce(run_id=RUN_ID, version=3, size=40_000, sha256=SHA, demand_groups=16, epoch=1), LEARNER),
        (RunEnded(run_id=RUN_ID, epoch=1, version=3, reason="finished"), LEARNER),
        (RepairRequest(run_id=RUN_ID, peer_id=ALICE.peer_id, seqs=(1, 5, 9)), ALICE),
        (RepairResponse(envelopes=(seal(batch, ALICE),), unavailable=(3,)), ALICE),
        (RepairResponse(envelopes=()), ALICE),
        (ErrorResponse(code="unknown_run", message="no such run"), LEARNER),
        (_episodes(), ALICE),
    )


def _episodes() -> EpisodeBatch:
    """Two groups of multi-turn episodes (model, environment, model turns; a weight swap between)."""
    model = Turn(from_env=False, token_ids=(5, 6, 2), logprobs=(-0.5, -1.25, -0.125), versions=(3, 3, 4))
    env = Turn(from_env=True, token_ids=(7, 8, 9), logprobs=(), versions=())
    last = Turn(from_env=False, token_ids=(10, 2), logprobs=(-2.0, -0.25), versions=(4, 4))
    episodes = (Episode(turns=(model, env, last), reward=0.5), Episode(turns=(model,), reward=0.0))
    groups = tuple(EpisodeGroup(group_id=f"g{i}", prompt_ids=(1, 4, 5), episodes=episodes) for i in range(2))
    return EpisodeBatch(run_id=RUN_ID, peer_id=ALICE.peer_id, seq=3, groups=groups)


@dataclass(frozen=True)
class Signed:
    """A sealed message's parts, for re-signing mutations of it."""

    kind: str
    wire: Any
    identity: Identity


def _signed(pairs: Sequence[tuple[Message, Identity]]) -> list[Signed]:
    return [Signed(kind_of(m), _unpack(msgpack.packb(m.to_wire(), use_bin_type=True)), ident) for m, ident in pairs]


# --- byte havoc --------------------------------------------------------------------------------

_BYTES_8 = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x28, 0xB5, 0x2F, 0xFD, 0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF, 0xC0, 0xC1,
            0xC2, 0xC3, 0xC4, 0xC5, 0xC6, 0xC7, 0xCA, 0xCB, 0xCC, 0xCF, 0xD0, 0xD3, 0xD4, 0xD9, 0xDB, 0xDC, 0xDD,
            0xDE, 0xDF, 0xE0)
_INTS = (0, 1, 2, 3, 4, 16, 32, 64, 127, 128, 255, 256, 4096, 4097, 32767, 32768, 65535, 65536,
         2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1)
_BOMBS = (
    b"\x91" * 2000,  # nesting past msgpack's stack
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 G items
    b"\xdc\xff\xff",  # array16 of 65535 items
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xda\x10\x01",  # str16 just past MAX_STR
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xde\x01\x01",  # map16 just past MAX_CONFIG_KEYS
    b"\xc7\x05\x01abcde",  # ext8
    b"\xd6\xff\x00\x00\x00\x00",  # the timestamp ext
    b"\xc1",  # never used
    b"\x28\xb5\x2f\xfd",  # zstd magic
    b"\x50\x2a\x4d\x18\x04\x00\x00\x00abcd",  # a skippable zstd frame
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff",
)


def havoc(data: bytes, rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    """1, 2, 4 or 8 random byte-level edits of `data`."""
    buf = bytearray(data)
    for _ in range(1 << rng.randrange(4)):
        n = len(buf)
        op = rng.randrange(12)
        if op == 0 and n:
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            buf[rng.randrange(n)] = rng.choice(_BYTES_8)
        elif op == 2 and n:
            buf[rng.randrange(n)] = rng.randrange(256)
        elif op == 3 and n:
            width = rng.choice((1, 2, 4, 8))
            value = (rng.choice(_INTS) + rng.choice((0, 0, 1, -1))) % (1 << (8 * width))
            pos = rng.randrange(n)
            buf[pos : pos + width] = value.to_bytes(width, rng.choice(("big", "little")))
        elif op == 4:
            pos = rng.randrange(n + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 5:
            pos = rng.randrange(n + 1)
            buf[pos:pos] = rng.choice(_BOMBS)
        elif op == 6 and n:
            a = rng.randrange(n)
            del buf[a : a + rng.randint(1, max(1, n // 4))]
        elif op == 7 and n:
            a = rng.randrange(n)
            chunk = buf[a : a + rng.randint(1, max(1, n // 4))]
            pos = rng.randrange(n + 1)
            buf[pos:pos] = chunk
        elif op == 8 and n:
            del buf[rng.randrange(n) :]
        elif op == 9 and seeds:
            other = rng.choice(seeds)
            buf = buf[: rng.randrange(n + 1)] + other[rng.randrange(len(other) + 1) :]
        elif op == 10 and n:
            i = rng.randrange(n)
            buf[i] = (buf[i] + rng.randint(-35, 35)) & 0xFF
        elif op == 11 and n > 1:
            a, b = rng.randrange(n), rng.randrange(n)
            width = rng.randint(1, max(1, min(n - a, n - b, 32)))
            buf[a : a + width] = buf[b : b + width]
        if len(buf) > MAX_INPUT:
            del buf[MAX_INPUT:]
    return bytes(buf)


# --- msgpack-aware mutation ------------------------------------------------------------------


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


_UNPACKED: dict[bytes, Any] = {}


def _unpacked(data: bytes) -> Any:
    """A seed's decoded msgpack, cached (mutations copy the path they change, never the seed)."""
    obj = _UNPACKED.get(data, _UNPACKED)
    if obj is _UNPACKED:
        obj = _UNPACKED[data] = _unpack(data)
    return obj


_ODD_CHARS = "0OIl1/:%.-_ \t\n\x00\x7féß²٣１𝟘\u202e\ufeff[]@#?+"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _nested(depth: int) -> Any:
    obj: Any = 1
    for _ in range(depth):
        obj = [obj]
    return obj


def _any(rng: random.Random) -> Any:
    return rng.choice((None, True, False, 0, -1, 2**64 - 1, -(2**63), 0.5, math.nan, "", "x", b"", b"\x00" * 32, [], {}, [0], {"a": 1}))


def _str_variant(v: str, rng: random.Random) -> str:
    if not v:
        return rng.choice(_ODD_CHARS)
    i = rng.randrange(len(v))
    return v[:i] + rng.choice(_ODD_CHARS + _B58) + v[i + rng.randint(0, 1) :]


def hostile(v: Any, rng: random.Random) -> Any:
    """A hostile replacement for the wire value `v`, mostly of a related type or magnitude."""
    if rng.random() < 0.12:
        return rng.choice((lambda: None, lambda: [], lambda: {}, lambda: _nested(rng.randint(2, 400)), lambda: _any(rng)))()
    t = type(v)
    opts: list[Callable[[], Any]]
    if t is bool:
        opts = [lambda: not v, lambda: int(v), lambda: float(v), lambda: None, lambda: "true"]
    elif t is int:
        opts = [lambda: v + 1, lambda: v - 1, lambda: -v, lambda: -1, lambda: 0, lambda: 1, lambda: float(v),
                lambda: str(v), lambda: True, lambda: 2**63 - 1, lambda: 2**63, lambda: 2**64 - 1, lambda: -(2**63),
                lambda: 2**31, lambda: 2**32, lambda: 2**53 + 1, lambda: v * 65536, lambda: rng.choice(_INTS),
                lambda: rng.randrange(-(2**63), 2**64), lambda: b"\x01"]
    elif t is float:
        opts = [lambda: int(v) if math.isfinite(v) else 0, lambda: math.nan, lambda: math.inf, lambda: -math.inf,
                lambda: -0.0, lambda: 0.0, lambda: 1e308, lambda: -1e308, lambda: 5e-324, lambda: -v,
                lambda: math.nextafter(v, math.inf), lambda: math.nextafter(v, -math.inf), lambda: 1e6,
                lambda: math.nextafter(1e6, math.inf), lambda: -1e6, lambda: str(v), lambda: float(2**63),
                lambda: struct.unpack(">d", rng.randbytes(8))[0]]
    elif t is str:
        opts = [lambda: "", lambda: v + v, lambda: v[:-1], lambda: v[1:], lambda: v + "\x00", lambda: "a" * 4096,
                lambda: "a" * 4097, lambda: "é" * 2049, lambda: v.upper(), lambda: v.encode(), lambda: _str_variant(v, rng),
                lambda: _str_variant(v, rng), lambda: 0, lambda: "12D3KooW" + v, lambda: v[: len(v) // 2],
                lambda: rng.choice(list(MESSAGE_TYPES)), lambda: "".join(rng.choice(_ODD_CHARS) for _ in range(rng.randint(1, 70)))]
    elif t is bytes:
        opts = [lambda: b"", lambda: v[:-1], lambda: v + b"\x00", lambda: bytes(len(v)), lambda: rng.randbytes(len(v)),
                lambda: v * 2, lambda: v.decode("latin-1"), lambda: b"\xff" * 4097, lambda: b"\x00" * 31,
                lambda: b"\x00" * 33, lambda: v[: len(v) // 2], lambda: _flip(v, rng)]
    elif t is list:
        def drop() -> Any:
            i = rng.randrange(len(v)) if v else 0
            return v[:i] + v[i + 1 :]

        def insert() -> Any:
            i = rng.randrange(len(v) + 1)
            return v[:i] + [rng.choice(v) if v and rng.random() < 0.5 else _any(rng)] + v[i:]

        def repeat_first() -> Any:
            # Just past a bound (64 samples, 256 groups or repairs, 4096 tokens), but never more
            # than ~1 MiB packed: repeating an element that repeats its own elements would grow
            # without bound over a few rounds.
            n = rng.choice((65, 256, 257, 4096, 4097))
            first = v[0] if v else 0
            try:
                size = len(msgpack.packb(first, use_bin_type=True))
            except _PACK_ERRORS:
                size = 1 << 30
            return [first] * n if size * n <= 1 << 20 else [0] * n

        opts = [lambda: [], drop, drop, insert, insert, lambda: v + v[-1:], lambda: v[::-1], lambda: [v], lambda: v * 2,
                repeat_first,
                lambda: {str(i): x for i, x in enumerate(v)}, lambda: v[: len(v) // 2], lambda: tuple_swap(v, rng)]
    elif t is dict:
        def drop_key() -> Any:
            out = dict(v)
            if out:
                del out[rng.choice(list(out))]
            return out

        opts = [lambda: {}, drop_key, lambda: {**v, "extra": 1}, lambda: {**v, b"k": 1}, lambda: {**v, 1: 1},
                lambda: list(v.values()), lambda: {"": v}, lambda: {"a": {"b": {"c": 1}}},
                lambda: {f"k{i}": i for i in range(rng.choice((256, 257)))}, lambda: {**v, "x" * 129: 1},
                lambda: {**v, "l": list(range(rng.choice((1024, 1025))))}]
    else:
        opts = [lambda: 0, lambda: "", lambda: [], lambda: {}, lambda: False, lambda: b"", lambda: 0.0]
    return rng.choice(opts)()


def _flip(v: bytes, rng: random.Random) -> bytes:
    if not v:
        return b"\x01"
    b = bytearray(v)
    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def tuple_swap(v: list[Any], rng: random.Random) -> list[Any]:
    if len(v) < 2:
        return v + v
    out = list(v)
    i, j = rng.randrange(len(v)), rng.randrange(len(v))
    out[i], out[j] = out[j], out[i]
    return out


def _pick_path(obj: Any, rng: random.Random) -> list[Any]:
    """A random node of `obj` (random descent: leaves mostly, containers sometimes; a nested
    container is preferred to its scalar siblings, so a message body gets more mutations than
    the schema and kind beside it)."""
    path: list[Any] = []
    node = obj
    while True:
        if isinstance(node, (list, dict)) and node and rng.random() >= 0.18:
            keys = range(len(node)) if isinstance(node, list) else list(node)
            nested = [k for k in keys if isinstance(node[k], (list, dict)) and node[k]]
            key = rng.choice(nested) if nested and rng.random() < 0.7 else rng.choice(keys)
        else:
            return path
        path.append(key)
        node = node[key]


def _get(obj: Any, path: Sequence[Any]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _replace(obj: Any, path: Sequence[Any], new: Any) -> Any:
    """`obj` with the node at `path` replaced, copying only the containers on the path."""
    if not path:
        return new
    copy: Any = list(obj) if isinstance(obj, list) else dict(obj)
    copy[path[0]] = _replace(obj[path[0]], path[1:], new)
    return copy


def mutate_obj(obj: Any, rng: random.Random, rounds: int | None = None) -> Any:
    for _ in range(rng.choice((1, 1, 1, 2, 3)) if rounds is None else rounds):
        path = _pick_path(obj, rng)
        obj = _replace(obj, path, hostile(_get(obj, path), rng))
    return obj


def pack_wide(obj: Any, rng: random.Random) -> bytes:
    """msgpack with each node in a randomly chosen valid encoding, often not the canonical one."""
    out = bytearray()
    _wide(obj, rng, out)
    return bytes(out)


_INT_FORMS = ((0xCC, ">B", 0, 2**8 - 1), (0xCD, ">H", 0, 2**16 - 1), (0xCE, ">I", 0, 2**32 - 1), (0xCF, ">Q", 0, 2**64 - 1),
              (0xD0, ">b", -(2**7), 2**7 - 1), (0xD1, ">h", -(2**15), 2**15 - 1), (0xD2, ">i", -(2**31), 2**31 - 1),
              (0xD3, ">q", -(2**63), 2**63 - 1))


def _wide(o: Any, rng: random.Random, out: bytearray) -> None:
    canonical = rng.random() < 0.6
    if o is None:
        out.append(0xC0)
    elif o is True or o is False:
        out.append(0xC3 if o else 0xC2)
    elif type(o) is int:
        forms = [bytes([o & 0xFF])] if -32 <= o < 128 else []
        forms += [bytes([code]) + struct.pack(fmt, o) for code, fmt, lo, hi in _INT_FORMS if lo <= o <= hi]
        if not forms:
            raise OverflowError(f"{o} does not fit msgpack")
        out += forms[0] if canonical else rng.choice(forms)
    elif type(o) is float:
        try:
            single = struct.pack(">f", o)
            fits = struct.unpack(">f", single)[0] == o or math.isnan(o)
        except OverflowError:
            fits = False
        out += b"\xca" + single if fits and not canonical else b"\xcb" + struct.pack(">d", o)
    elif isinstance(o, (str, bytes)):
        raw = o.encode("utf-8", "surrogatepass") if isinstance(o, str) else o
        n = len(raw)
        if isinstance(o, str):
            forms = [bytes([0xA0 | n])] if n < 32 else []
            codes = ((0xD9, ">B", 2**8), (0xDA, ">H", 2**16), (0xDB, ">I", 2**32))
        else:
            forms = []
            codes = ((0xC4, ">B", 2**8), (0xC5, ">H", 2**16), (0xC6, ">I", 2**32))
        forms += [bytes([code]) + struct.pack(fmt, n) for code, fmt, limit in codes if n < limit]
        out += forms[0] if canonical else rng.choice(forms)
        out += raw
    elif isinstance(o, (list, tuple, dict)):
        n = len(o)
        base, b16, b32 = (0x90, 0xDC, 0xDD) if not isinstance(o, dict) else (0x80, 0xDE, 0xDF)
        forms = [bytes([base | n])] if n < 16 else []
        forms += [bytes([b16]) + struct.pack(">H", n)] if n < 65536 else []
        forms += [bytes([b32]) + struct.pack(">I", n)]
        out += forms[0] if canonical else rng.choice(forms)
        if isinstance(o, dict):
            for k, v in o.items():
                _wide(k, rng, out)
                _wide(v, rng, out)
        else:
            for v in o:
                _wide(v, rng, out)
    else:
        raise TypeError(f"cannot pack {type(o).__name__}")


def pack_obj(obj: Any, rng: random.Random, *, wide: float = 0.15) -> bytes:
    """Canonical msgpack (what our `pack` makes) or, with probability `wide`, a wide encoding."""
    canonical = msgpack.packb(obj, use_bin_type=True)
    if len(canonical) <= 16384 and rng.random() < wide:  # pack_wide is pure Python: small objects only
        return pack_wide(obj, rng)
    return canonical


_PACK_ERRORS = (ValueError, OverflowError, TypeError, RecursionError)


def msgpack_mutate(data: bytes, rng: random.Random) -> bytes:
    """Decode a msgpack seed, replace random nodes with hostile values, re-pack."""
    obj = _unpacked(data)
    for _ in range(4):
        try:
            return pack_obj(mutate_obj(obj, rng), rng)
        except _PACK_ERRORS:
            continue
    return havoc(data, rng, (data,))


# --- text mutation -----------------------------------------------------------------------------

_PARTS = ("", "0", "1", "65535", "65536", "-1", "+1", " 1", "1 ", "0x10", "1e3", "²", "١٢", "１", "𝟘", "99999999999999999999",
          "::", "::1", "1.2.3.4.5", "127.1", "0.0.0.0", "255.255.255.255", "224.0.0.1", "fe80::1%eth0", "[::1]",
          "::ffff:10.0.0.1", "localhost", "a" * 64, "a" * 300, "xn--e1afmkfd", "-a", "a-", "a..b", "p2p", "tcp", "ip4",
          "ip6", "dns", "dns4", "udp", "12D3KooW", "%", "/")


def text_mutate(data: bytes, rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    """Character- and component-level edits of UTF-8 text (multiaddrs, hosts, peer ids)."""
    s = data.decode("utf-8", "replace")
    for _ in range(1 << rng.randrange(3)):
        n = len(s)
        op = rng.randrange(9)
        i = rng.randrange(n + 1)
        if op == 0:
            s = s[:i] + rng.choice(_ODD_CHARS + _B58) + s[i:]
        elif op == 1 and n:
            s = s[:i] + s[i + 1 :]
        elif op == 2 and n:
            s = s[:i] + rng.choice(_ODD_CHARS + _B58) + s[i + 1 :]
        elif op == 3 and n:
            j = rng.randrange(n + 1)
            s = s[:i] + s[min(i, j) : max(i, j)] + s[i:]
        elif op == 4:
            s = s[:i]
        elif op == 5 and "/" in s:
            parts = s.split("/")
            parts[rng.randrange(len(parts))] = rng.choice(_PARTS)
            s = "/".join(parts)
        elif op == 6:
            other = rng.choice(seeds).decode("utf-8", "replace")
            s = s[:i] + other[rng.randrange(len(other) + 1) :]
        elif op == 7 and n:
            s = s[:i] + s[i:].swapcase()
        elif op == 8:
            s = s[:i] + rng.choice(_PARTS) + s[i:]
    return s.encode("utf-8", "surrogatepass")[:4096]


# --- zstd frames -------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _special_frames() -> tuple[bytes, ...]:
    zeros = bytes(MAX_DECOMPRESSED_BYTES + 1)
    # A frame without a content size has a Window_Descriptor byte after its header byte: patch
    # it to declare 128 MiB (exponent 17) and exactly MAX_ZSTD_WINDOW (8 MiB, exponent 13).
    small = zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 100)
    windows = [small[:5] + bytes([exp << 3]) + small[6:] for exp in (17, 13)]
    return (
        zstandard.ZstdCompressor(write_content_size=True).compress(zeros),  # declares > the cap
        zstandard.ZstdCompressor(write_content_size=False).compress(zeros),  # a bomb that declares nothing
        *windows,
        zstandard.ZstdCompressor().compress(b""),
        zstandard.ZstdCompressor(write_content_size=False).compress(b""),
    )


def _lie_about_size(frame: bytes, rng: random.Random) -> bytes:
    """`frame` with its Frame_Content_Size field rewritten (RFC 8878 §3.1.1.1)."""
    if len(frame) < 6 or not frame.startswith(b"\x28\xb5\x2f\xfd"):
        return frame
    fhd = frame[4]
    single, did = (fhd >> 5) & 1, fhd & 3
    fcs_size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    if not fcs_size:
        return frame
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[did]
    old = int.from_bytes(frame[pos : pos + fcs_size], "little")
    new = rng.choice((0, 1, old - 1, old + 1, old * 2, (1 << (8 * fcs_size)) - 1, rng.randrange(1 << (8 * fcs_size))))
    new %= 1 << (8 * fcs_size)
    return frame[:pos] + new.to_bytes(fcs_size, "little") + frame[pos + fcs_size :]


def zstd_variant(content: bytes, rng: random.Random) -> bytes:
    """`content` in a zstd frame a strict receiver may or may not take."""
    op = rng.randrange(13)
    if op == 0:
        return zstandard.ZstdCompressor(level=rng.randint(1, 6), write_content_size=False).compress(content)
    if op == 1:
        return zstandard.ZstdCompressor(write_checksum=True).compress(content)
    if op == 2:
        cobj = zstandard.ZstdCompressor(write_content_size=rng.random() < 0.5).compressobj()
        out, step = [], max(1, len(content) // rng.randint(1, 5))
        for lo in range(0, len(content), step):
            out.append(cobj.compress(content[lo : lo + step]))
            out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        return b"".join(out) + cobj.flush()
    frame = _frame(content)
    if op == 3:
        size = rng.randint(0, 16)
        skip = struct.pack("<II", 0x184D2A50 + rng.randrange(16), size) + rng.randbytes(size)
        return skip + frame if rng.random() < 0.5 else frame + skip
    if op == 4:
        return frame + _frame(content[: rng.randrange(len(content) + 1)])
    if op == 5:
        return frame + rng.randbytes(rng.randint(1, 8))
    if op == 6:
        return frame[: rng.randrange(len(frame) + 1)]
    if op == 7:
        return rng.choice(_special_frames())
    if op == 8:
        return zstandard.ZstdCompressor(level=1).compress(rng.randbytes(len(content)))  # raw blocks
    if op in (9, 10):
        return _lie_about_size(frame, rng)
    if op == 11:
        return zstandard.ZstdCompressor(write_dict_id=True, level=rng.randint(1, 19)).compress(content)
    return frame[:4] + bytes([frame[4] ^ (1 << rng.randrange(8))]) + frame[5:] if len(frame) > 4 else frame


def _frame(content: bytes) -> bytes:
    """What a sender's `encode_frame` makes, or a plain zstd frame if it would refuse."""
    try:
        return encode_frame(content)
    except LocalProtocolError:
        return zstandard.ZstdCompressor(write_content_size=True).compress(content)


def frame_for(content: bytes, rng: random.Random) -> bytes:
    return zstd_variant(content, rng) if rng.random() < 0.08 else _frame(content)


# --- re-signed envelopes -------------------------------------------------------------------------


def reseal(kind: str, payload: bytes, identity: Identity, rng: random.Random, *, schema: int = SCHEMA_VERSION) -> bytes:
    """An envelope around arbitrary payload bytes, validly signed by `identity` (envelope.seal,
    without its checks)."""
    signature = identity.sign(signing_input(kind, payload))
    outer = msgpack.packb([schema, kind, payload, identity.public_key, signature], use_bin_type=True)
    return frame_for(outer, rng)


def resigned(rng: random.Random, specs: Sequence[Signed], *, kind_swap: float = 0.06, seq_shuffle: bool = False) -> bytes:
    """A mutation of a signed message's wire values, signed again by its author."""
    spec = rng.choice(specs)
    kind, ident = spec.kind, spec.identity
    for _ in range(4):
        obj = spec.wire
        if seq_shuffle and kind == "rollout_batch" and rng.random() < 0.6:
            obj = _replace(obj, [2], rng.randrange(1 << rng.choice((8, 20, 62))))  # a fresh seq
        obj = mutate_obj(obj, rng, rounds=rng.choice((0, 1, 1, 1, 1, 2, 3)))
        try:
            payload = pack_obj(obj, rng, wide=0.1)
            break
        except _PACK_ERRORS:
            continue
    else:
        payload = msgpack.packb(spec.wire, use_bin_type=True)
    r = rng.random()
    if r < kind_swap:
        kind = rng.choice(list(MESSAGE_TYPES))
    elif r < kind_swap + 0.04:
        ident = rng.choice(IDENTITIES)
    schema = SCHEMA_VERSION if rng.random() > 0.03 else rng.choice((SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, 0, -1, 2**63))
    return reseal(kind, payload, ident, rng, schema=schema)


_OUTERS: dict[bytes, Any] = {}


def outer_mutated(rng: random.Random, frames: Sequence[bytes]) -> bytes:
    """A sealed frame with its outer array [schema, kind, payload, key, signature] mutated."""
    frame = rng.choice(frames)
    outer = _OUTERS.get(frame)
    if outer is None:
        outer = _OUTERS[frame] = _unpack(decode_frame(frame))
    for _ in range(4):
        try:
            return frame_for(pack_obj(mutate_obj(outer, rng), rng), rng)
        except _PACK_ERRORS:
            continue
    return frame


def rezstd(rng: random.Random, frames: Sequence[bytes]) -> bytes:
    """A sealed frame's content in another kind of zstd frame."""
    return zstd_variant(decode_frame(rng.choice(frames)), rng)


# --- targets -------------------------------------------------------------------------------------

Generator = Callable[[random.Random], bytes]


@dataclass
class Target:
    """One decoder under fuzz. `call` feeds it the bytes (and checks oracles); `run` is `call`
    with the decoder's documented errors (`accepted`) swallowed."""

    name: str
    call: Callable[[bytes], object]
    seeds: Sequence[bytes]
    accepted: tuple[type[BaseException], ...] = (RemoteProtocolError,)
    generators: Sequence[tuple[float, Generator]] = ()
    structured: float = 0.55  # share of inputs from `generators` (the rest: random bytes, havoc)
    msgpack_seeds: bool = False  # seeds are msgpack: add msgpack-aware mutation of them
    text_seeds: bool = False  # seeds are UTF-8 text: add text mutation
    max_len: int | None = None
    note: str = ""
    setup: Callable[[], object] | None = None  # slow one-time preparation, run before the first input
    _gens: list[Generator] = field(init=False, repr=False)
    _weights: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        gens = list(self.generators)
        if self.msgpack_seeds:
            gens.append((1.0, lambda rng: msgpack_mutate(rng.choice(self.seeds), rng)))
        if self.text_seeds:
            gens.append((1.0, lambda rng: text_mutate(rng.choice(self.seeds), rng, self.seeds)))
        self._weights = [w for w, _ in gens]
        self._gens = [g for _, g in gens]

    def prepare(self) -> None:
        """Run `setup` (outside the hang alarm: building the learner imports torch)."""
        if self.setup is not None:
            self.setup()

    def run(self, data: bytes) -> None:
        try:
            self.call(data)
        except self.accepted:
            pass

    def generate(self, rng: random.Random) -> bytes:
        r = rng.random()
        if self._gens and r < self.structured:
            data = rng.choices(self._gens, self._weights)[0](rng)
        elif r < self.structured + 0.04:
            data = rng.randbytes(rng.choice((0, 1, 2, 3, 4, 8, 16, 64, 256, 1024)))
        elif r < self.structured + 0.07:
            data = rng.choice(self.seeds)  # the seeds themselves: the accepting paths
        else:
            data = havoc(rng.choice(self.seeds), rng, self.seeds)
        if self.max_len is not None and len(data) > self.max_len:
            data = data[: self.max_len]
        return data


# --- the calls (one per target) -----------------------------------------------------------------


def _decode_message(data: bytes) -> None:
    message = decode_message(data)
    again = type(message).from_wire(_unpack(msgpack.packb(message.to_wire(), use_bin_type=True)))
    assert again == message, f"{kind_of(message)} does not survive re-encoding: {message!r} != {again!r}"


def _open_envelope(data: bytes) -> None:
    message, sender = open_envelope(data)
    assert is_valid_peer_id(sender), f"open_envelope returned a sender that is not a peer id: {sender!r}"
    assert kind_of(message) in MESSAGE_TYPES


def _decode_frame(data: bytes) -> None:
    out = decode_frame(data)
    assert len(out) <= MAX_DECOMPRESSED_BYTES, f"decode_frame returned {len(out)} B"


def _open_manifest(data: bytes) -> None:
    manifest = open_manifest(data, learner_peer_id=LEARNER.peer_id, run_id=RUN_ID)
    offset, size = piece_range(manifest, manifest.num_pieces - 1)
    assert offset + size == manifest.payload_size and 0 < size <= manifest.piece_size, "pieces do not tile the payload"


_READER_LIMITS = (64, 0, 16, 1024, 4 * 1024 * 1024 + 1024, MAX_LENGTH_PREFIXED)


def _length_prefixed(data: bytes) -> None:
    """data = [max_len selector][chunking seed][the stream]; fed in chunks, drained after each."""
    if len(data) < 2:
        return
    reader = LengthPrefixedReader(max_len=_READER_LIMITS[data[0] % len(_READER_LIMITS)])
    stream = data[2:]
    rng = random.Random(data[1])
    got: list[bytes] = []
    pos = 0
    while pos < len(stream):
        step = rng.choice((1, 2, 3, 4, 5, 7, 64, 1 << 16))
        reader.feed(stream[pos : pos + step])
        pos += step
        while (message := reader.next_message()) is not None:
            got.append(message)
        assert reader.missing >= 0 and reader.buffered >= 0
    reader.feed_eof()  # raises (RemoteProtocolError) unless the stream ended between messages
    rebuilt = b"".join(len(m).to_bytes(4, "big") + m for m in got)
    assert rebuilt == stream, "the messages do not add up to the stream that was fed"
    assert all(len(m) <= reader.max_len for m in got)


_BASE_EVEN = bytes((i * 37 + (i >> 7)) & 0xFF for i in range(4096))
_BASE_ODD = _BASE_EVEN[:4095] + b"\x5a\xa5"  # 4097 bytes


def _decode_delta(data: bytes) -> None:
    # One input, both bases: the decoders' odd-length path reads a raw tail byte.
    for base in (_BASE_EVEN, _BASE_ODD):
        try:
            out = decode_delta(data, base, max_size=len(base))
        except RemoteProtocolError:
            continue
        assert len(out) == len(base), f"decode_delta returned {len(out)} B for a {len(base)} B base"


_SPARSE = struct.Struct("<BQB")


def _zframe(content: bytes, rng: random.Random, *, declare: bool = True) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=declare).compress(content)


def sparse_delta(rng: random.Random) -> bytes:
    """A sparse delta assembled field by field around hostile header values (protocol/weights/delta.py)."""
    base = rng.choice((_BASE_EVEN, _BASE_ODD))
    n = len(base)
    lanes = n // 2
    k = rng.choice((0, 1, 2, 3, rng.randrange(lanes + 2), lanes // 4, n // 3, n // 4 + 1, lanes, lanes + 1, 2**63, 2**64 - 1))
    width = rng.choice((1, 1, 1, 2, 2, 3, 4, 8, 0, 9, 255))
    body_k = k if k <= lanes + 1 else rng.randint(0, 8)
    gaps = [rng.choice((0, 0, 1, 2, 5, rng.randrange(lanes + 1), lanes, 2**16, 2**32 - 1)) for _ in range(body_k)]
    planes = max(1, min(width, 8))
    item = 1 if planes == 1 else 2 if planes == 2 else 4 if planes <= 4 else 8
    packed = b"".join(g.to_bytes(8, "little")[:item] for g in gaps)
    streams = [packed[j::item] for j in range(planes)] + [rng.randbytes(body_k), rng.randbytes(body_k)]
    if rng.random() < 0.15:
        i = rng.randrange(len(streams))
        streams[i] = streams[i] + b"\x00" if rng.random() < 0.5 else streams[i][:-1]
    frames = [_zframe(s, rng, declare=rng.random() > 0.05) for s in streams]
    if rng.random() < 0.1:
        frames[rng.randrange(len(frames))] = zstd_variant(streams[0], rng)
    count = width + 2 if 1 <= width <= 8 else rng.randint(0, 10)
    frames = (frames + frames)[:count] if count > len(frames) else frames[:count]
    sizes = [len(f) for f in frames]
    if rng.random() < 0.1 and sizes:
        i = rng.randrange(len(sizes))
        sizes[i] = rng.choice((0, sizes[i] - 1, sizes[i] + 1, 2**63, 2**64 - 1))
    tail = b"" if n % 2 == 0 or rng.random() < 0.05 else bytes([rng.randrange(256)])
    head = _SPARSE.pack(1, k, width)
    return head + tail + b"".join(struct.pack("<Q", s) for s in sizes) + b"".join(frames)


def plain_delta(rng: random.Random) -> bytes:
    """A plain delta: a zstd frame whose declared and real content sizes may lie."""
    n = len(rng.choice((_BASE_EVEN, _BASE_ODD)))
    size = rng.choice((n, n, n - 1, n + 1, 0, n * 2))
    content = rng.choice((bytes(size), rng.randbytes(size), _BASE_EVEN[:size]))
    frame = _zframe(content, rng, declare=rng.random() > 0.1)
    return _lie_about_size(frame, rng) if rng.random() < 0.2 else frame


def _delta_seeds() -> list[bytes]:
    out = []
    for base in (_BASE_EVEN, _BASE_ODD):
        few = bytearray(base)
        for i in range(0, len(base), 97):
            few[i] ^= 1
        many = bytes(b ^ ((i * 13) & 0xFF) for i, b in enumerate(base))
        last = bytearray(base)
        last[-1] ^= 0x40
        out += [encode_delta(bytes(few), base), encode_delta(many, base), encode_delta(base, base), encode_delta(bytes(last), base)]
    return out


def _peer_ids(data: bytes) -> None:
    """Peer id parsing, on text (libp2p, multiaddrs) and on any msgpack value (message fields)."""
    text = data.decode("utf-8", "replace")
    ok = is_valid_peer_id(text)
    assert type(ok) is bool
    try:
        key = public_key_from_peer_id(text)
    except ValueError:
        assert not ok, "is_valid_peer_id and public_key_from_peer_id disagree"
    else:
        assert ok and peer_id_from_public_key(key) == text, "a peer id that does not re-encode to itself"
    if len(text) <= 256:  # b58decode is quadratic; its callers bound the length first
        try:
            b58decode(text)
        except ValueError:
            pass
    try:
        obj = _unpack(data)
    except Exception:
        return
    assert type(is_valid_peer_id(obj)) is bool


_OWN = frozenset({("127.0.0.1", 4001), ("10.0.0.1", 4001)})


def _addresses(data: bytes) -> None:
    """Every address parser on the text; AddressError is their documented refusal."""
    text = data.decode("utf-8", "replace")
    try:
        addr = parse_tcp_multiaddr(text)
    except AddressError:
        pass
    else:
        assert parse_tcp_multiaddr(addr.text()) == addr, f"{text!r} parses to {addr}, which does not re-parse to itself"
    for check in (check_data_host, check_dns_name, check_announce):
        try:
            check(text)
        except AddressError:
            pass
    for local_only in (False, True):
        dial, skipped = dial_plan([text, text.strip()], own=_OWN, local_only=local_only)
        assert len(dial) + len(skipped) == 2
    try:
        obj = _unpack(data)
    except Exception:
        return
    for check_field in (check_data_host, check_port):
        try:
            check_field(obj)
        except AddressError:
            pass


def _verify(data: bytes) -> None:
    """data = [key length selector][signature length selector][key][signature][message]."""
    if len(data) < 2:
        return
    klen = (32, 32, 32, 31, 33, 0)[data[0] % 6]
    slen = (64, 64, 64, 63, 65, 0)[data[1] % 6]
    key = data[2 : 2 + klen]
    signature = data[2 + klen : 2 + klen + slen]
    verify(key, signature, data[2 + klen + slen :])


_WEIRD_KEYS = (bytes(32), b"\x01" + bytes(31), b"\xff" * 32, b"\xec" + b"\xff" * 30 + b"\x7f", b"\xed" + b"\xff" * 30 + b"\x7f")


def verify_inputs(rng: random.Random) -> bytes:
    message = rng.randbytes(rng.randint(0, 64))
    ident = rng.choice(IDENTITIES)
    key = ident.public_key if rng.random() < 0.6 else rng.choice(_WEIRD_KEYS)
    signature = ident.sign(message) if rng.random() < 0.7 else rng.choice((bytes(64), b"\xff" * 64, rng.randbytes(64)))
    if rng.random() < 0.3:
        message = _flip(message, rng)
    return b"\x00\x00" + key + signature + message


# --- the data channel (protocol/weights/datachannel.py) and its handler (echo_node/weights/broadcast.py) -----------

# Hellos carry an expiry; the checker takes the time as an argument, so the target fixes it.
NOW = 1_800_000_000.0


def _hello_target() -> Target:
    from protocol.weights.datachannel import FULL, HELLO_DOMAIN, HELLO_MAX, PROBE, HelloChecker, make_hello

    checker = HelloChecker(ME.peer_id, RUN_ID)

    def check(data: bytes) -> None:
        hello = checker.check(data, NOW)
        if (hello.host, hello.port) != ("", 0):
            assert check_data_host(hello.host) == hello.host and 1 <= hello.port <= 65535, f"admitted {hello}"
        assert hello.target == ME.peer_id and hello.run_id == RUN_ID and hello.raw == data
        assert hello.sender == peer_id_from_public_key(_unpack(_unpack(data)[0])[0])

    seeds = [
        make_hello(ALICE, target=ME.peer_id, run_id=RUN_ID, version=3, host="10.0.0.5", port=7000, now=NOW, nonce=b"\x01" * 16),
        make_hello(BOB, target=ME.peer_id, run_id=RUN_ID, version=4, base=3, host="2001:db8::5", port=1, now=NOW, nonce=b"\x02" * 16),
        make_hello(ALICE, target=ME.peer_id, run_id=RUN_ID, version=PROBE, now=NOW, nonce=b"\x03" * 16),
        make_hello(ALICE, target=ALICE.peer_id, run_id=RUN_ID, version=3, base=FULL, host="10.0.0.5", port=7000, now=NOW),
    ]
    bodies = [_unpack(_unpack(s)[0]) for s in seeds]

    def resigned_hello(rng: random.Random) -> bytes:
        body = list(rng.choice(bodies))
        ident = rng.choice(IDENTITIES)
        body[0] = ident.public_key
        body[5] = rng.randbytes(16)  # a fresh nonce, so the replay check does not hide the rest
        body[6] = NOW + rng.choice((60.0, 60.0, 60.0, 0.0, 120.0, math.nextafter(120.0, 200.0), -1e-9))
        for _ in range(4):
            try:
                raw = pack_obj(mutate_obj(body, rng, rounds=rng.choice((0, 1, 1, 2))), rng, wide=0.1)
                break
            except _PACK_ERRORS:
                continue
        else:
            raw = msgpack.packb(body)
        signature = ident.sign(HELLO_DOMAIN + raw) if rng.random() < 0.95 else ident.sign(SIGNATURE_DOMAIN + raw)
        return msgpack.packb([raw, signature])

    return Target(
        "datachannel.HelloChecker.check", check, seeds,
        generators=((3.0, resigned_hello), (1.0, lambda rng: msgpack_mutate(rng.choice(seeds), rng))),
        structured=0.7, max_len=HELLO_MAX + 16,
        note="one checker for the whole run: its bounded nonce memory is part of what is fuzzed",
    )


def _peer_entry_target() -> Target:
    from protocol.weights.datachannel import MAX_SWARM_ENTRIES, _peer_entry

    def entries(data: bytes) -> None:
        # What decode_frame does with a `peers` frame's list, on any msgpack value.
        obj = unpack_strict(data, what="peers")
        for entry in obj[:MAX_SWARM_ENTRIES] if isinstance(obj, list) else [obj]:
            e = _peer_entry(entry)
            assert is_valid_peer_id(e.peer_id)
            if (e.host, e.port) != ("", 0):
                assert check_data_host(e.host) == e.host and type(e.port) is int and 1 <= e.port <= 65535

    seeds = [
        msgpack.packb([[ME.peer_id, "10.0.0.7", 7001], [ALICE.peer_id, "", 0], [BOB.peer_id, "2001:db8::1", 65535]]),
        msgpack.packb([ALICE.peer_id, "192.168.1.2", 1]),
        msgpack.packb([]),
    ]

    return Target("datachannel._peer_entry", entries, seeds, msgpack_seeds=True, structured=0.6,
                  note="the brief's echo_node.weights.broadcast._peers_entry moved here (typed data channel)")


@lru_cache(maxsize=1)
def _piece_setup() -> Any:
    return build_manifest(run_id=RUN_ID, version=1, payload=_PAYLOAD, piece_size=16384)


@lru_cache(maxsize=1)
def _data_streams() -> tuple[bytes, ...]:
    """Length-prefixed data-channel streams (each frame as protocol.weights.datachannel.encode makes it)."""
    from protocol.weights.datachannel import Get, ManifestFrame, Next, NoMore, NotServed, PeerEntry, Peers, Piece, encode

    p0, p2 = _PAYLOAD[:16384], _PAYLOAD[32768:]
    peers = Peers((PeerEntry(ME.peer_id, "10.0.0.7", 7001), PeerEntry(ALICE.peer_id, "", 0), PeerEntry(BOB.peer_id, "10.0.0.9", 7002)))
    sealed = seal(_piece_setup(), LEARNER)

    def stream(*frames: Any) -> bytes:
        return b"".join(encode_length_prefixed(encode(f)) for f in frames)

    return (
        stream(Piece(0, p0), Get(0), Get(2), NoMore()),
        stream(peers, Piece(2, p2), Get(2), Next()),
        stream(Piece(1, p0)),  # the wrong bytes for piece 1
        stream(Get(1), NoMore(), Peers(())),
        stream(ManifestFrame(sealed, b"s" * 64), NotServed(b"s" * 64)),
    )


def _frames_of(stream: bytes) -> list[bytes]:
    frames, pos = [], 0
    while pos + 4 <= len(stream):
        n = int.from_bytes(stream[pos : pos + 4], "big")
        frames.append(stream[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return frames


def _frame_stream_mutate(rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    """Mutate one msgpack frame of a length-prefixed stream, then re-prefix (usually honestly)."""
    frames = _frames_of(rng.choice(seeds))
    i = rng.randrange(len(frames))
    frames[i] = msgpack_mutate(frames[i], rng)
    if rng.random() < 0.3:
        frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
    out = bytearray()
    for f in frames:
        n = len(f) if rng.random() > 0.05 else rng.choice((0, len(f) + 1, max(0, len(f) - 1), 2**32 - 1, 4 * 1024 * 1024 + 1025))
        out += n.to_bytes(4, "big") + f
    return bytes(out)


def _data_frame_target() -> Target:
    from protocol.weights.datachannel import Piece
    from protocol.weights.datachannel import decode_frame as decode_data_frame

    num_pieces = _piece_setup().num_pieces

    def decode(data: bytes) -> None:
        for from_source in (False, True):
            try:
                frame = decode_data_frame(data, num_pieces=num_pieces, from_source=from_source)
            except RemoteProtocolError:
                continue
            if isinstance(frame, Piece):
                assert type(frame.index) is int and 0 <= frame.index < num_pieces, f"decoded {frame!r}"

    seeds = [f for s in _data_streams() for f in _frames_of(s)]
    return Target("datachannel.decode_frame", decode, seeds, msgpack_seeds=True, structured=0.6)


def _probe_target() -> Target:
    from protocol.weights.datachannel import HELLO_MAX, PROBE, PROBE_DOMAIN, decode_probe_answer, make_hello, probe_answer

    hello = make_hello(ALICE, target=ME.peer_id, run_id=RUN_ID, version=PROBE, now=NOW, nonce=b"\x07" * 16)

    def answer(data: bytes) -> None:
        decode_probe_answer(data, ME.peer_id, hello)

    seeds = [probe_answer(ME, hello), probe_answer(ALICE, hello), msgpack.packb(["reachable", b"\x00" * 64])]

    def resigned_answer(rng: random.Random) -> bytes:
        signed = rng.choice((hello, hello[:-1], hello + b"\x00", b""))
        domain = PROBE_DOMAIN if rng.random() < 0.9 else SIGNATURE_DOMAIN
        frame = ["reachable", rng.choice(IDENTITIES).sign(domain + signed)]
        try:
            return pack_obj(mutate_obj(frame, rng, rounds=rng.choice((0, 0, 1, 2))), rng)
        except _PACK_ERRORS:
            return msgpack.packb(frame)

    return Target("datachannel.decode_probe_answer", answer, seeds, msgpack_seeds=True,
                  generators=((2.0, resigned_answer),), structured=0.6, max_len=HELLO_MAX,
                  note="inputs capped at HELLO_MAX: broadcast.probe reads the answer with read_frame(max_len=HELLO_MAX)")


def _receiver_target() -> Target:
    import trio

    from echo_node.weights.broadcast import DataServer, Link, Receiver

    manifest = _piece_setup()
    server = DataServer(ME, RUN_ID)

    def on_frames(data: bytes) -> None:
        """data = [role byte: odd = the link is to the source (the learner)][the link's stream]."""
        if not data:
            return
        remote = LEARNER.peer_id if data[0] & 1 else ALICE.peer_id

        async def go() -> None:
            # A fresh receiver per input; then as Receiver._run_link: decoded frames until the
            # link ends, each handed to _on_frame; a RemoteProtocolError ends (and bans) the link.
            receiver = Receiver(server, manifest, source_id=LEARNER.peer_id)
            link = Link(FakeStream(data[1:]), remote, receiver.stats, num_pieces=manifest.num_pieces,  # type: ignore[arg-type]
                        piece_size=manifest.piece_size, from_source=remote == LEARNER.peer_id)
            receiver.links[remote] = link
            async with aclosing(link.frames()) as frames:  # _run_link's bare `async for` leaves it to the GC
                async for frame in frames:
                    receiver._on_frame(link, frame)

        trio.run(go)

    streams = list(_data_streams())
    seeds = [role + s for s in streams for role in (b"\x01", b"\x00")]

    def mutated(rng: random.Random) -> bytes:
        return rng.choice((b"\x00", b"\x01")) + _frame_stream_mutate(rng, streams)

    return Target(
        "broadcast.Receiver._on_frame", on_frames, seeds, generators=((1.0, mutated),), structured=0.7,
        note="Link.frames (LengthPrefixedReader + datachannel.decode_frame) then Receiver._on_frame, as "
             "Receiver._run_link runs them; one trio.run per input",
    )


def _source_target() -> Target:
    import trio

    from echo_node.weights.broadcast import Source
    from protocol.weights.datachannel import Get, HelloChecker, Next, Piece, encode, make_hello

    manifest = _piece_setup()
    sealed = seal(manifest, LEARNER)
    raw = make_hello(ALICE, target=LEARNER.peer_id, run_id=RUN_ID, version=1, host="10.0.0.5", port=7000, now=NOW, nonce=b"\x09" * 16)
    hello = HelloChecker(LEARNER.peer_id, RUN_ID).check(raw, NOW)

    def serve(data: bytes) -> None:
        """The learner's side of a data link, a member (ALICE) sending `data` after its hello."""

        async def go() -> None:
            source = Source(LEARNER, manifest, sealed, _PAYLOAD, {ALICE.peer_id})
            await source.serve(FakeStream(data), hello)  # type: ignore[arg-type]

        trio.run(go)

    def stream(*frames: Any) -> bytes:
        return b"".join(encode_length_prefixed(encode(f)) for f in frames)

    streams = [stream(Next(), Next(), Get(1), Next(), Next(), Get(0)), stream(Get(2), Piece(0, _PAYLOAD[:100]), Next()),
               *_data_streams()]
    return Target(
        "broadcast.Source.serve", serve, streams, generators=((1.0, lambda rng: _frame_stream_mutate(rng, streams)),),
        structured=0.7, note="Misbehaved (a RemoteProtocolError) is how serve reports a bad link; one trio.run per input",
    )


class FakeStream:
    """A trio-style byte stream over fixed bytes: never blocks, so coroutines that only read it can
    be driven without an event loop. Chunk sizes vary (deterministically) like a socket's."""

    def __init__(self, data: bytes, remote_peer_id: str = "") -> None:
        self.data = data
        self.pos = 0
        self.sent = bytearray()
        self.remote_peer_id = remote_peer_id
        self._step = (len(data) * 2654435761) % 7

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self._step += 1
        size = (1 << 20, 3, 1 << 16, 1 << 20, 1000, 1 << 20, 17)[self._step % 7]  # mostly whole reads
        if max_bytes is not None:
            size = min(size, max_bytes)
        chunk = self.data[self.pos : self.pos + size]
        self.pos += len(chunk)
        return chunk

    async def send_all(self, data: bytes) -> None:
        self.sent += data

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


def drive(coro: Any) -> Any:
    """Run a coroutine that never really suspends (it only awaits FakeStreams) to completion."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the coroutine suspended: it awaited something a FakeStream never provides")


# --- echo_node: request/response streams -------------------------------------------------------


def _rpc_targets() -> list[Target]:
    from echo_node.net import rpc

    fixed = StatusResponse(run_id=RUN_ID, version=3, weights_size=123, weights_sha256=SHA, demand_groups=8, epoch=1)

    async def handler(request: Any, remote: str) -> Any:
        if isinstance(request, JoinRequest):
            raise rpc.RequestRefused("wrong_run", "refused")
        return fixed

    def serve(data: bytes) -> None:
        bad: list[str] = []
        stream = FakeStream(data, remote_peer_id=ALICE.peer_id)
        drive(rpc.serve_one(stream, handler, on_bad=lambda peer, exc: bad.append(peer)))
        reader = LengthPrefixedReader(max_len=MAX_DECOMPRESSED_BYTES)
        reader.feed(bytes(stream.sent))
        answer = reader.next_message()
        assert answer is not None and reader.buffered == 0, "serve_one did not answer with exactly one frame"
        decode_message(answer)

    class Opener:
        def __init__(self, data: bytes) -> None:
            self.data = data

        async def open_stream(self, peer_id: str, protocol_id: str) -> FakeStream:
            return FakeStream(self.data, remote_peer_id=peer_id)

        def set_stream_handler(self, protocol_id: str, handler: Any) -> None:
            raise AssertionError("a caller serves nothing")

    def call(data: bytes) -> None:
        reply = drive(rpc.call(Opener(data), LEARNER.peer_id, rpc.STATUS, StatusRequest(run_id=RUN_ID), StatusResponse))
        assert isinstance(reply, StatusResponse)

    requests = [encode_length_prefixed(encode_message(m)) for m, _ in messages()]
    replies = [encode_length_prefixed(encode_message(m)) for m in (fixed, ErrorResponse(code="busy", message="later"))]
    replies += requests[:3]
    return [
        Target(
            "rpc.serve_one", serve, requests, accepted=(),
            generators=((1.0, lambda rng: _frame_stream_mutate(rng, requests)),), structured=0.6,
            note="nothing may escape serve_one: it answers bad input with an ErrorResponse",
        ),
        Target(
            "rpc.call", call, replies, accepted=(RemoteProtocolError, rpc.RequestFailed),
            generators=((1.0, lambda rng: _frame_stream_mutate(rng, replies)),), structured=0.6,
            note="rpc.RequestFailed is call's documented answer to an ErrorResponse",
        ),
    ]


# --- echo_node: the learner's gossip validator ------------------------------------------------


class LearnerIntake:
    """A real Learner, built as tests/node/conftest.py's `learner` fixture builds it (libp2p host
    built, not started; tiny model; no warm-up), fed through its gossip validator and consumer.

    ALICE and MALLORY have joined the run; STRANGER has not. A joined peer that got itself banned
    is forgiven (ban and penalties cleared) before the next input, so every input is opened.
    """

    def __init__(self) -> None:
        from echo_node.config import RunConfig
        from echo_node.learner.learner import Learner
        from echo_node.ml.model import build_model, tiny_llama_config
        from echo_node.ml.tasks import get_task
        from echo_node.ml.tokenizer import CharTokenizer
        from echo_node.policy import Policy

        workdir = tempfile.mkdtemp(prefix="echo-fuzz-")
        atexit.register(shutil.rmtree, workdir, ignore_errors=True)
        cfg = RunConfig(run_id=RUN_ID, runs_dir=Path(workdir))
        cfg.run_dir.mkdir(parents=True, exist_ok=True)  # as Learner.run does before it subscribes
        tok = CharTokenizer()
        arch = tiny_llama_config(tok.vocab_size)
        policy = Policy(build_model(arch), tok, get_task("addition"), {"kind": "embedded", **arch}, tok.to_dict())
        self.learner = Learner(cfg, Identity.from_seed(b"\x01" * 32), policy)
        # The validator moved from Learner._validate/_deliver to Learner.intake.validate/deliver.
        intake = getattr(self.learner, "intake", None)
        if intake is not None and hasattr(intake, "validate"):
            self.validate, self.deliver = intake.validate, intake.deliver
        else:
            self.validate, self.deliver = self.learner._validate, self.learner._deliver  # type: ignore[attr-defined]
        self.peers = getattr(intake, "peers", None) or self.learner.peers
        self.joined = (ALICE.peer_id, MALLORY.peer_id)

    def _rejoin(self) -> None:
        peers = self.peers
        if not hasattr(peers, "join"):
            return
        for peer in self.joined:
            bans = [getattr(peers, name, {}) for name in ("banned", "banned_until_version")]
            if any(peer in b for b in bans):
                for b in bans:
                    b.pop(peer, None)
                peers.penalties.pop(peer, None)
            if peer not in peers.joined:
                peers.join(peer, 0.0)

    def __call__(self, data: bytes) -> None:
        import trio

        sel = data[-1] if data else 0
        origin = MALLORY.peer_id if sel % 8 == 7 else STRANGER.peer_id if sel % 32 == 5 else ALICE.peer_id
        forwarder = BOB.peer_id if sel % 4 == 3 else origin
        self._rejoin()
        ok = self.validate(forwarder, origin, data)
        assert type(ok) is bool, f"the gossip validator returned {ok!r}"
        if ok:
            async def deliver() -> None:
                delivered = self.deliver(data, origin)
                if delivered is not None:  # async since the consumer spot-checks
                    await delivered

            trio.run(deliver)


@lru_cache(maxsize=1)
def _learner() -> LearnerIntake:
    return LearnerIntake()  # once per process: it imports torch and builds the model


_ROLLOUTS = [
    (_batch(seq=1), ALICE),
    (_batch(seq=2, groups=3), ALICE),
    (_batch(seq=3, groups=1, tokens=1), ALICE),
    (_batch(seq=4, identity=MALLORY), MALLORY),
]


def _learner_target() -> Target:
    specs = _signed(_ROLLOUTS)
    frames = [seal(b, ident) for b, ident in _ROLLOUTS]
    return Target(
        "learner.intake.validate", lambda data: _learner()(data), frames, accepted=(),
        generators=(
            (6.0, lambda rng: resigned(rng, specs, seq_shuffle=True)),
            (1.0, lambda rng: outer_mutated(rng, frames)),
            (0.5, lambda rng: rezstd(rng, frames)),
        ),
        structured=0.8, setup=_learner,
        note="the validator must return a bool and never raise; what it accepts is delivered (trio.run per accepted input)",
    )


class _FakeGossip:
    """The learner's libp2p node as its intake sees it, answering every stream with `data`."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def open_stream(self, peer_id: str, protocol_id: str) -> FakeStream:
        return FakeStream(self.data, remote_peer_id=peer_id)

    def penalize(self, peer_id: str, topic: str) -> None:
        pass


def _learner_repair_target() -> Target:
    """The learner's gap repair (RolloutIntake.repair) reading a publisher's hostile answer: the
    RepairResponse stream, the sealed rollouts in it, and the seqs it calls unavailable."""
    import trio

    def repair(data: bytes) -> None:
        harness = _learner()
        intake = getattr(harness.learner, "intake", None)
        if intake is None or not hasattr(intake, "repair"):
            return  # the learner has no gap repair to fuzz
        harness._rejoin()
        saved, intake.node = intake.node, _FakeGossip(data)
        try:
            trio.run(intake.repair, ALICE.peer_id, [3, 4, 5, 6])
        finally:
            intake.node = saved

    specs = _signed(_ROLLOUTS)
    sealed = [seal(_batch(seq=s), ALICE) for s in (3, 4, 5)]

    def answer(envelopes: Sequence[bytes], unavailable: Any, rng: random.Random | None = None) -> bytes:
        body = msgpack.packb([SCHEMA_VERSION, "repair_response", [list(envelopes), unavailable]], use_bin_type=True)
        return encode_length_prefixed(body)

    seeds = [answer(sealed, [6]), answer(sealed[:1], []), answer([], [3, 4, 5, 6]), answer(sealed + sealed, [2**63 - 1, 0])]

    def hostile_answer(rng: random.Random) -> bytes:
        envelopes = [resigned(rng, specs, seq_shuffle=True) if rng.random() < 0.8 else rng.choice(sealed)
                     for _ in range(rng.choice((0, 1, 1, 2, 3)))]
        unavailable = mutate_obj([3, 4, 5, 6], rng, rounds=rng.choice((0, 1, 2)))
        try:
            return answer(envelopes, unavailable)
        except _PACK_ERRORS:
            return answer(envelopes, [])

    return Target(
        "learner.intake.repair", repair, seeds, accepted=(),
        generators=((3.0, hostile_answer), (1.0, lambda rng: _frame_stream_mutate(rng, seeds))),
        structured=0.8, setup=_learner,
        note="repair answers every failure itself (counted, logged, penalized): nothing may escape; one trio.run per input",
    )


# --- the registry --------------------------------------------------------------------------------


def _swapping_among(seeds: Sequence[bytes]) -> Generator:
    return lambda rng: _kind_swap(rng, seeds)


def _kind_swap(rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    """A message's body under another kind: every from_wire on every other message's fields."""
    obj = _unpacked(rng.choice(seeds))
    return msgpack.packb([obj[0], rng.choice(list(MESSAGE_TYPES)), obj[2]], use_bin_type=True)


@lru_cache(maxsize=1)
def _all_targets() -> tuple[Target, ...]:
    pairs = messages()
    encoded = {kind: [encode_message(m) for m, _ in pairs if kind_of(m) == kind] for kind in MESSAGE_TYPES}
    every = [s for seeds in encoded.values() for s in seeds]
    out: list[Target] = [
        Target(
            f"messages.decode_message[{kind}]", _decode_message, seeds, msgpack_seeds=True,
            generators=((0.15, _swapping_among(seeds + every)),),
        )
        for kind, seeds in encoded.items()
    ]

    specs = _signed(pairs)
    sealed = [seal(m, ident) for m, ident in pairs]
    out.append(Target(
        "envelope.open_envelope", _open_envelope, sealed,
        generators=((4.0, lambda rng: resigned(rng, specs)), (1.0, lambda rng: outer_mutated(rng, sealed)),
                    (1.0, lambda rng: rezstd(rng, sealed))),
        structured=0.75,
    ))

    frame_seeds = sealed + [_frame(b""), _frame(_PAYLOAD[:1000]), _frame(b"a" * 100_000)]
    contents = [decode_frame(f) for f in frame_seeds]
    out.append(Target(
        "framing.decode_frame", _decode_frame, frame_seeds,
        generators=((1.0, lambda rng: zstd_variant(rng.choice(contents), rng)),), structured=0.6,
    ))

    streams = [encode_length_prefixed(encode_message(m)) for m, _ in pairs]
    stream_seeds = [bytes([i % len(_READER_LIMITS), 7 + 13 * i]) + b"".join(streams[i : i + 3]) for i in range(len(streams))]
    stream_seeds += [b"\x00\x00", b"\x01\x00" + b"\x00\x00\x00\x00", b"\x04\x05" + (1 << 31).to_bytes(4, "big")]

    def stream_mutate(rng: random.Random) -> bytes:
        seed = rng.choice(stream_seeds)
        return bytes([rng.randrange(256), rng.randrange(256)]) + seed[2:]

    out.append(Target(
        "framing.LengthPrefixedReader", _length_prefixed, stream_seeds,
        generators=((1.0, stream_mutate),), structured=0.3,
    ))

    manifests = [(m, ident) for m, ident in pairs if kind_of(m) == "weight_manifest"]
    manifests.append((build_manifest(run_id="another-run", version=1, payload=b"y" * 20000), LEARNER))
    manifest_specs = _signed(manifests)
    sealed_manifests = [seal(m, ident) for m, ident in manifests] + [seal(manifests[0][0], ALICE)]
    out.append(Target(
        "manifest.open_manifest", _open_manifest, sealed_manifests,
        generators=((4.0, lambda rng: resigned(rng, manifest_specs, kind_swap=0.03)),
                    (1.0, lambda rng: outer_mutated(rng, sealed_manifests)), (0.5, lambda rng: rezstd(rng, sealed_manifests))),
        structured=0.75,
    ))

    out.append(Target(
        "delta.decode_delta", _decode_delta, _delta_seeds(),
        generators=((2.0, sparse_delta), (1.0, plain_delta)), structured=0.6,
    ))

    peer_texts = [ALICE.peer_id, LEARNER.peer_id, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
                  "16Uiu2HAmLhLvBoYaoZfaMUKuibM6ac163GwKY74c5kiSLg5KvLpY", "12D3KooW", "1" * 52]
    out.append(Target(
        "identity.peer_id", _peer_ids, [t.encode() for t in peer_texts] + [msgpack.packb(ALICE.peer_id)],
        accepted=(), text_seeds=True, structured=0.6,
        note="public_key_from_peer_id and b58decode document ValueError (not RemoteProtocolError); "
             "is_valid_peer_id documents no error at all",
    ))
    out.append(Target("identity.verify", _verify, [verify_inputs(random.Random(i)) for i in range(4)],
                      generators=((1.0, verify_inputs),), structured=0.5))

    addr_texts = ["/ip4/10.0.0.1/tcp/4001", f"/ip4/10.0.0.1/tcp/4001/p2p/{ALICE.peer_id}", "/ip6/::1/tcp/4001",
                  "/ip6/2001:db8::1/tcp/65535", "/dns4/example.com/tcp/443", "/dns/a-b.example/tcp/1",
                  "/dns6/x.y/tcp/80/p2p/" + BOB.peer_id, "10.0.0.1", "fe80::1%eth0", "::ffff:1.2.3.4",
                  "255.255.255.255", "example.com", "/ip4/0.0.0.0/tcp/0", "/ip4/127.0.0.1/tcp/4001"]
    out.append(Target(
        "addresses", _addresses, [t.encode() for t in addr_texts] + [msgpack.packb(7000), msgpack.packb("10.0.0.1")],
        accepted=(), text_seeds=True, structured=0.65,
        note="parse_tcp_multiaddr, check_data_host, check_dns_name, check_announce and check_port "
             "document AddressError (a ValueError, not a RemoteProtocolError); dial_plan documents no error",
    ))

    out.append(_hello_target())
    out.append(_peer_entry_target())
    out.append(_data_frame_target())
    out.append(_probe_target())
    out.append(_receiver_target())
    out.append(_source_target())
    out.extend(_rpc_targets())
    out.append(_learner_target())
    out.append(_learner_repair_target())
    return tuple(out)


def all_targets() -> dict[str, Target]:
    """Every target by name (built once per process; the learner's model only on first use)."""
    return {t.name: t for t in _all_targets()}


# --- the engine ----------------------------------------------------------------------------------


class Hang(BaseException):
    """Raised by the alarm inside an input that ran past HANG_S (a BaseException, so a decoder's
    `except Exception` cannot swallow it)."""


@dataclass
class Finding:
    target: str
    kind: str  # "crash" or "hang"
    index: int
    data: bytes
    error: str  # "TypeError: message", one line
    where: str  # the innermost frame: file:line in function
    traceback: str
    original_len: int = 0

    @property
    def signature(self) -> tuple[str, str, str]:
        return self.kind, self.error.split(":", 1)[0], self.where

    def report(self, max_hex: int = 4096) -> str:
        hexed = self.data.hex()
        if len(hexed) > max_hex:
            hexed = hexed[:max_hex] + f"... ({len(self.data)} B in all)"
        shrunk = f", minimized from {self.original_len} B" if self.original_len and self.original_len != len(self.data) else ""
        return (f"{self.kind.upper()} in {self.target} (input #{self.index}, {len(self.data)} B{shrunk})\n"
                f"  {self.error}\n  at {self.where}\n  input hex: {hexed}\n{self.traceback}")


@dataclass
class Stats:
    target: str
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)  # the first of each signature

    def merge(self, other: Stats) -> None:
        self.inputs += other.inputs
        self.crashes += other.crashes
        self.hangs += other.hangs
        self.seconds = max(self.seconds, other.seconds)
        known = {f.signature for f in self.findings}
        self.findings += [f for f in other.findings if f.signature not in known]


def input_for(target: Target, seed: int, index: int) -> bytes:
    return target.generate(random.Random(f"{seed}/{target.name}/{index}"))


_armed = False


def _on_alarm(signum: int, frame: Any) -> None:
    if _armed:
        clock = "CPU" if signum == signal.SIGPROF else "wall-clock"
        raise Hang(f"input ran past its {clock} limit")


@contextmanager
def _alarm() -> Iterator[bool]:
    """While an input runs, SIGPROF (its CPU time past the limit) or SIGALRM (its wall-clock time
    past WALL_FACTOR x the limit: it blocks) raises Hang. CPU time, because the machine is shared:
    a slow input that merely waited for a core is not a hang. Main thread only; elsewhere inputs
    are timed after the fact."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.signal(sig, _on_alarm) for sig in (signal.SIGALRM, signal.SIGPROF)}
    try:
        yield True
    finally:
        _disarm()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


WALL_FACTOR = 10


def _arm(hang_s: float) -> None:
    signal.setitimer(signal.ITIMER_PROF, hang_s)
    signal.setitimer(signal.ITIMER_REAL, hang_s * WALL_FACTOR)


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)


def _caused_by_hang(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, Hang):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def run_one(target: Target, data: bytes, *, index: int = -1, hang_s: float = HANG_S, alarm: bool = True) -> Finding | None:
    """Run one input; a Finding if it crashed or hung."""
    global _armed
    if alarm and signal.getsignal(signal.SIGALRM) is not _on_alarm:
        with _alarm() as installed:  # called on its own, not from fuzz()
            return run_one(target, data, index=index, hang_s=hang_s, alarm=installed)
    started = time.process_time()
    try:
        try:
            if alarm:
                _armed = True
                _arm(hang_s)
            target.run(data)
        finally:
            _armed = False
            if alarm:
                _disarm()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - anything else escaping a decoder is the finding
        kind = "hang" if _caused_by_hang(exc) else "crash"
        tb = traceback.extract_tb(exc.__traceback__)
        last = tb[-1] if tb else None
        where = f"{_short_path(last.filename)}:{last.lineno} in {last.name}" if last else "?"
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return Finding(target.name, kind, index, data, error, where, "".join(traceback.format_exception(exc))[-6000:])
    cpu = time.process_time() - started
    if cpu > hang_s:
        return Finding(target.name, "hang", index, data, f"Hang: took {cpu:.2f} s of CPU", "?", "")
    return None


def _short_path(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if path.startswith(root) else path


def minimize(target: Target, finding: Finding, *, budget: int = 1500, alarm: bool = True) -> Finding:
    """Delete chunks of the input while it still fails the same way (same signature)."""
    best = finding
    chunk = max(1, len(best.data) // 2)
    tries = 0
    while tries < budget:
        i, progressed = 0, False
        while i < len(best.data) and tries < budget:
            tries += 1
            candidate = best.data[:i] + best.data[i + chunk :]
            got = run_one(target, candidate, index=finding.index, alarm=alarm)
            if got is not None and got.signature == finding.signature:
                best, progressed = got, True
            else:
                i += chunk
        if chunk == 1 and not progressed:
            break
        if not progressed:
            chunk //= 2
    best.original_len = len(finding.data)
    return best


def fuzz(
    target: Target,
    *,
    inputs: int,
    seed: int = 0,
    start: int = 0,
    step: int = 1,
    deadline: float | None = None,
    shrink: bool = True,
    seen: set[tuple[str, str, str]] | None = None,
) -> Stats:
    """Inputs start, start + step, ... below `inputs` of `target`; stops early at `deadline`
    (time.monotonic()). Each input runs under the hang alarm. The first finding of each
    signature not in `seen` (shared across calls, updated) is minimized and kept."""
    stats = Stats(target.name)
    signatures: set[tuple[str, str, str]] = set() if seen is None else seen
    target.prepare()
    began = time.perf_counter()
    with _alarm() as alarm:
        for index in range(start, inputs, step):
            if deadline is not None and (index - start) % 64 == 0 and time.monotonic() > deadline:
                break
            data = input_for(target, seed, index)
            finding = run_one(target, data, index=index, alarm=alarm)
            stats.inputs += 1
            if finding is None:
                continue
            if finding.kind == "hang":
                stats.hangs += 1
            else:
                stats.crashes += 1
            if finding.signature not in signatures:
                signatures.add(finding.signature)
                if shrink and finding.kind == "crash":
                    finding = minimize(target, finding, alarm=alarm)
                stats.findings.append(finding)
    stats.seconds = time.perf_counter() - began
    return stats


# --- logging --------------------------------------------------------------------------------


class _FormatEveryRecord(logging.Handler):
    """Formats every record, as a real handler would, and discards it: a log call whose message
    cannot be formatted surfaces as a crash instead of a line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        record.getMessage()


@contextmanager
def quiet_logs(names: Sequence[str] = ("echo_node", "protocol")) -> Iterator[None]:
    """Route the project's log records (INFO and up) to `_FormatEveryRecord` instead of stderr."""
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate, logger.level))
        logger.handlers = [_FormatEveryRecord()]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, handlers, propagate, level in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
