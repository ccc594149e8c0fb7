"""The policy model: the embedded tiny Llama, local HF checkpoints, and weight (de)serialization.

Invariants:
- `build_model(arch, seed=s)` gives bit-identical float32 weights for the same (arch, s, torch
  version), without disturbing the caller's global RNG.
- `state_to_bytes(model)` is a deterministic safetensors blob of the model's *canonical* state:
  every persistent tensor once, with tied aliases (e.g. `lm_head.weight` tied to the embedding)
  dropped, so the same weights always hash the same.
- `load_state_bytes` / `load_state_tensors` are strict: the blob must hold exactly the canonical
  keys with the same shapes and dtypes, else `ValueError` and the model is left untouched.
- `load_checkpoint(save_checkpoint(m, p, v))` returns `(state_to_bytes(m), v)`: the version lives
  in the safetensors metadata, never in the state bytes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from echo_node.ml.tokenizer import HFTokenizerAdapter

# SDPA is the faster attention kernel on CPU for these shapes and is numerically equivalent to
# eager (both float32); every code path (engine, learner, HF generate in tests) uses the same one.
ATTN_IMPLEMENTATION = "sdpa"

_VERSION_KEY = "echo_node.version"


def tiny_llama_config(vocab_size: int) -> dict[str, Any]:
    """LlamaConfig kwargs (JSON-able) for the embedded ~0.8M-parameter default policy.

    Sized so supervised warm-up on 2-digit addition takes well under a minute on one thread and
    the model can still reach exact answers; 64 positions cover prompt + answer of every task here.
    """
    return {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def build_model(arch: dict[str, Any], *, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialized float32 LlamaForCausalLM from `arch` (LlamaConfig kwargs)."""
    config = LlamaConfig(**arch)
    config._attn_implementation = ATTN_IMPLEMENTATION
    # fork_rng: HF initializes from the global RNG; seeding it in place would silently reseed
    # whatever the caller (a sampler, a test) was doing.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.float()
    model.eval()
    return model


def load_pretrained(
    path: str,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    chat: bool = False,
) -> tuple[PreTrainedModel, HFTokenizerAdapter]:
    """Load a local HF causal LM directory (or a GGUF file in it) in `dtype` on `device`, with its
    tokenizer (`chat`: prompts go through its chat template). Never downloads: a path that is not
    a local model directory is an error naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_file is None and not (Path(path) / "config.json").is_file():
        raise ValueError(f"--model {path}: not a local Hugging Face model directory (no config.json there)")
    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION, "local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if gguf_file is not None:
        drop_quantisation_marks(model)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps Module.to in functools.wraps: mypy sees the unbound function
    model.eval()
    tok_kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        tok_kwargs["gguf_file"] = gguf_file
    tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(path, **tok_kwargs), path=path, chat=chat)
    return model, tokenizer


def drop_quantisation_marks(model: Any) -> None:
    """transformers marks a model loaded from GGUF as quantised (its GGUF quantizer) and then
    refuses casts (`.float()`, `.to(dtype)`) and `save_pretrained`; the tensors are plain
    dequantised ones already, so a GGUF-loaded model is a plain model from here on."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def canonical_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent tensors, each storage once (first name in state_dict order wins).

    state_dict order is module registration order, so for HF models the embedding is kept and
    the tied `lm_head.weight` alias is dropped — the same choice `save_pretrained` makes.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize a name→tensor map; safetensors orders the header itself, so this is deterministic."""
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def state_to_bytes(model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> bytes:
    """The canonical state as a safetensors blob, on the CPU; `dtype`: cast floating tensors to
    it first (the learner publishes its fp32 master weights in the rollout dtype)."""
    return tensors_to_bytes(cast_state(canonical_state(model), dtype))


def cast_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU, floating ones in `dtype` (None: as they are). Round to nearest, as
    `Tensor.to` does, so every node casting the same weights gets the same bits."""
    return {
        k: v.to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
        for k, v in tensors.items()
    }


def load_state_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, widen: bool = False) -> None:
    """Copy `tensors` into the model in place; strict on keys, shapes and dtypes. `widen`: a
    floating tensor may be of a narrower floating dtype than the model's (bf16 weights into a
    float32 model), cast exactly by the copy itself, with no temporary of the whole state."""
    target = canonical_state(model)
    missing = sorted(target.keys() - tensors.keys())
    extra = sorted(tensors.keys() - target.keys())
    if missing or extra:
        raise ValueError(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, dst in target.items():
        src = tensors[name]
        widened = widen and src.is_floating_point() and dst.is_floating_point() and src.dtype.itemsize <= dst.dtype.itemsize
        if src.shape != dst.shape or (src.dtype != dst.dtype and not widened):
            raise ValueError(
                f"{name}: got {src.dtype} {tuple(src.shape)}, model has {dst.dtype} {tuple(dst.shape)}"
            )
    # All checks pass before the first copy, so a rejected state never leaves a half-loaded model.
    # copy_ also moves a CPU blob's tensors onto a CUDA model.
    with torch.no_grad():
        for name, dst in target.items():
            dst.copy_(tensors[name])


def load_state_bytes(model: torch.nn.Module, data: bytes) -> None:
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types for malformed blobs
        raise ValueError(f"not a safetensors blob: {exc}") from exc
    load_state_tensors(model, tensors)


def save_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str], version: int) -> None:
    """Write the canonical state with `version` in the metadata, atomically (tmp + os.replace)."""
    save_state(canonical_state(model), path, version)


def save_state(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], version: int) -> None:
    """`save_checkpoint` of a canonical state taken earlier (`owned_copy(canonical_state(m))`)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    st_save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={_VERSION_KEY: str(int(version))})
    os.replace(tmp, path)


T = TypeVar("T")


def owned_copy(obj: T) -> T:
    """`obj` with every tensor in it (through dicts, lists and tuples) replaced by a detached copy
    of its own in host memory: a snapshot that later in-place updates (an optimizer step) leave
    unchanged, and that costs an accelerator no memory while it is written out."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)  # type: ignore[return-value]
    if isinstance(obj, dict):
        return {k: owned_copy(v) for k, v in obj.items()}  # type: ignore[return-value]
    if isinstance(obj, (list, tuple)):
        return type(obj)(owned_copy(v) for v in obj)
    return obj


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[bytes, int]:
    """(state bytes exactly as `state_to_bytes` would give, version)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if _VERSION_KEY not in metadata:
        raise ValueError(f"{path} is not an echo-node checkpoint (no version in its metadata)")
    return tensors_to_bytes(tensors), int(metadata[_VERSION_KEY])


# --- The canonical state written in place (publication without whole-model copies) ------------

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}
_ST_HEADER_LEN = 8
# A state's header lists every tensor once; no model here has a header near this.
MAX_STATE_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Where each tensor of a canonical state lies in its safetensors blob: the header bytes
    and, per tensor, (name, dtype, shape, start, end) with absolute byte offsets."""

    header: bytes
    slots: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]
    size: int


def state_layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> StateLayout:
    """The layout `tensors_to_bytes(cast_state(tensors, dtype))` has, without serializing them:
    safetensors' own order (asked of it on one-element stand-ins: the order depends only on
    names and dtypes), offsets packed in that order, the compact JSON header padded to 8 bytes."""
    dtypes = {k: dtype if dtype is not None and v.is_floating_point() else v.dtype for k, v in tensors.items()}
    standin = st_save({k: torch.zeros(1, dtype=d) for k, d in dtypes.items()})
    (n,) = struct.unpack_from("<Q", standin)
    order = list(json.loads(standin[_ST_HEADER_LEN : _ST_HEADER_LEN + n]))
    entries: dict[str, Any] = {}
    placed: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    offset = 0
    for name in order:
        if name == "__metadata__":
            continue
        d, shape = dtypes[name], tuple(tensors[name].shape)
        size = tensors[name].numel() * torch.empty(0, dtype=d).element_size()
        entries[name] = {"dtype": _ST_DTYPES[d], "shape": list(shape), "data_offsets": [offset, offset + size]}
        placed.append((name, d, shape, offset, offset + size))
        offset += size
    head = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    start = _ST_HEADER_LEN + len(head)
    slots = tuple((name, d, shape, start + lo, start + hi) for name, d, shape, lo, hi in placed)
    return StateLayout(struct.pack("<Q", len(head)) + head, slots, start + offset)


def write_state(tensors: dict[str, torch.Tensor], layout: StateLayout, out: Any) -> None:
    """Write `tensors` (cast per `layout`, rounding to nearest as `Tensor.to` does) into `out`, a
    writable buffer of `layout.size` bytes: the bytes `tensors_to_bytes(cast_state(...))` gives,
    with no intermediate copy of the state."""
    view = memoryview(out).cast("B")
    if len(view) != layout.size:
        raise ValueError(f"a state of {layout.size} B does not fit a buffer of {len(view)} B")
    view[: len(layout.header)] = layout.header
    with torch.no_grad():
        for name, dtype, shape, lo, hi in layout.slots:
            if hi > lo:
                torch.frombuffer(view, dtype=dtype, count=(hi - lo) // _itemsize(dtype), offset=lo).view(shape).copy_(tensors[name])


def state_tensors(data: Any) -> dict[str, torch.Tensor]:
    """A safetensors blob's tensors as views of `data` (bytes, mmap, any buffer), no copy. The
    header is parsed strictly and bounded (length, JSON, known dtypes, offsets that tile the
    data exactly), ValueError otherwise."""
    view = memoryview(data).cast("B")
    if len(view) < _ST_HEADER_LEN:
        raise ValueError("not a safetensors blob: shorter than its header length")
    (n,) = struct.unpack_from("<Q", view)
    if n > min(MAX_STATE_HEADER_BYTES, len(view) - _ST_HEADER_LEN):
        raise ValueError(f"not a safetensors blob: header of {n} B in {len(view)} B")
    try:
        header = json.loads(bytes(view[_ST_HEADER_LEN : _ST_HEADER_LEN + n]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not a safetensors blob: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors blob: its header is not a map")
    start = _ST_HEADER_LEN + n
    spans: list[tuple[int, int]] = []
    out: dict[str, torch.Tensor] = {}
    readonly = view.readonly
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_TORCH[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            lo, hi = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a safetensors blob: tensor {name!r}: {exc!r}") from None
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= lo <= hi <= len(view) - start or hi - lo != count * _itemsize(dtype):
            raise ValueError(f"not a safetensors blob: tensor {name!r} does not fit its offsets")
        spans.append((lo, hi))
        out[name] = _view(view, dtype, count, start + lo, readonly).view(shape)
    spans.sort()
    if [lo for lo, _ in spans] != [0, *(hi for _, hi in spans[:-1])] or (spans and spans[-1][1] != len(view) - start):
        raise ValueError("not a safetensors blob: tensors do not tile its data")
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _view(view: memoryview, dtype: torch.dtype, count: int, offset: int, readonly: bool) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if readonly:  # only ever read: torch warns that it could write through the view
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
    return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)


def copy_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of `model` whose floating parameters and buffers are in `dtype`, made without
    a full-precision copy first (each tensor is cast straight into the copy; ties stay tied)."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype if p.is_floating_point() else p.dtype, copy=True), requires_grad=False)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = b.detach().to(dtype if b.is_floating_point() else b.dtype, copy=True)
    return copy.deepcopy(model, memo)
