"""Publication without whole-model copies: the snapshot written in place is `state_to_bytes`
byte for byte, its reader is strict, the checker's copy is cast directly, hashing in threads
gives the same manifest, and the version store keeps versions as mapped files."""

from __future__ import annotations

import copy
import struct

import pytest
import torch

from echo_node.ml.model import (
    build_model,
    canonical_state,
    copy_model,
    state_layout,
    state_tensors,
    state_to_bytes,
    tiny_llama_config,
    write_state,
)
from protocol.weights.manifest import build_manifest, payload_digest


def tiny() -> torch.nn.Module:
    model = build_model(tiny_llama_config(13), seed=1)
    model.register_buffer("steps", torch.arange(5, dtype=torch.int64))  # a non-float tensor too
    return model


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_state_written_in_place_is_state_to_bytes(dtype: torch.dtype | None) -> None:
    model = tiny()
    state = canonical_state(model)
    layout = state_layout(state, dtype)
    out = bytearray(layout.size)
    write_state(state, layout, out)
    assert bytes(out) == state_to_bytes(model, dtype=dtype)
    with pytest.raises(ValueError, match="does not fit"):
        write_state(state, layout, bytearray(layout.size + 1))


def test_state_tensors_are_views_and_the_reader_is_strict() -> None:
    model = tiny()
    blob = state_to_bytes(model, dtype=torch.bfloat16)
    tensors = state_tensors(blob)
    for name, t in canonical_state(model).items():
        assert torch.equal(tensors[name], t.to(torch.bfloat16) if t.is_floating_point() else t)
    (n,) = struct.unpack_from("<Q", blob)
    bad = [
        b"",
        struct.pack("<Q", 1 << 40) + blob[8:],  # header longer than the blob
        struct.pack("<Q", n) + b"[" + blob[9:],  # not JSON
        blob[:-2],  # the data cut short: offsets do not tile it
        blob + b"\x00\x00",  # trailing bytes
        blob.replace(b'"BF16"', b'"XX16"', 1),
    ]
    for data in bad:
        with pytest.raises(ValueError, match="not a safetensors blob"):
            state_tensors(data)


def test_copy_model_casts_without_a_full_precision_copy() -> None:
    model = build_model(tiny_llama_config(13), seed=2)
    ours = copy_model(model, torch.bfloat16)
    reference = copy.deepcopy(model).to(dtype=torch.bfloat16)
    assert state_to_bytes(ours) == state_to_bytes(reference)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # ties stay tied
    assert all(not p.requires_grad for p in ours.parameters())
    assert next(model.parameters()).dtype == torch.float32  # the original is untouched
    same = copy_model(model, torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(next(same.parameters()), next(model.parameters()))  # a copy, not an alias


@pytest.mark.parametrize("size", [1, 16 * 1024, 5_000_003])
def test_threaded_hashing_gives_the_same_manifest(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    one = build_manifest(run_id="run-1", version=1, payload=payload)
    many = build_manifest(run_id="run-1", version=1, payload=payload, workers=3)
    assert one == many
    assert payload_digest(payload, workers=3) == one.payload_sha256
