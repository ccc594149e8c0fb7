"""`echo-node import-gguf FILE DIR`: a GGUF file (llama.cpp's format) as a local HF model directory.

transformers reads GGUF itself (`gguf_file=`, dequantising every tensor); this module turns what it
reads into a plain `save_pretrained` directory — config, safetensors, tokenizer with its chat
template — that `--model DIR` (echo_node/ml/model.py `load_pretrained`) loads like any other.

Rules:
- A GGUF file is untrusted input (downloaded, handed over): everything wrong with it ends in one
  `GgufImportError` line naming the file and what was wrong, never a traceback. Checked before any
  tensor is read: the magic, that the header parses, an architecture transformers can load, and
  that the dequantised weights fit in this machine's available memory (a tiny file may declare
  tensors of any size).
- The directory appears whole or not at all: it is written next to DIR under a temporary name and
  renamed into place; DIR may not exist yet or be empty, never hold anything (nothing is
  overwritten).
- The weights are saved unquantised, in the dtype asked for (float32 by default: the learner keeps
  fp32 master weights whatever it samples in).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# Dequantised weights may use at most this share of the memory available now: loading also holds
# the file's mapping and transformers' own copies while it converts.
MEMORY_SHARE = 0.5
# A message quoted from a parser is cut to this many characters (a hostile file can make it long).
MAX_REASON_CHARS = 300


class GgufImportError(ValueError):
    """A GGUF file that cannot be imported, or an output directory that cannot take it (one line)."""


@dataclass(frozen=True, slots=True)
class ImportResult:
    out_dir: Path
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    parameters: int
    dtype: str
    chat_template: bool


@dataclass(frozen=True, slots=True)
class GgufHeader:
    architecture: str  # llama.cpp's name, e.g. "llama"
    tensors: int
    elements: int  # sum of the tensors' element counts, as declared


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


def check_output_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise GgufImportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise GgufImportError(f"{out_dir} is not empty: import into a new or empty directory")


def read_header(path: Path) -> GgufHeader:
    """The file's architecture and declared tensor sizes, from its header only (no tensor data)."""
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GgufImportError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise GgufImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GgufImportError("reading GGUF needs the gguf package: pip install gguf") from None
    try:
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        if field is None or not field.data:
            raise GgufImportError(f"{path} names no architecture (general.architecture)")
        architecture = str(field.contents())
        elements = sum(int(t.n_elements) for t in reader.tensors)
        tensors = len(reader.tensors)
    except GgufImportError:
        raise
    except Exception as exc:  # gguf raises ValueError, IndexError, struct and numpy errors on bad bytes
        raise GgufImportError(f"{path} is not a valid GGUF file: {_reason(exc)}") from None
    if tensors == 0:
        raise GgufImportError(f"{path} holds no tensors")
    return GgufHeader(architecture=architecture, tensors=tensors, elements=elements)


def _supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return list(GGUF_SUPPORTED_ARCHITECTURES)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(path: Path, header: GgufHeader, dtype: torch.dtype) -> None:
    need = header.elements * torch.empty((), dtype=dtype).element_size()
    available = available_memory_bytes()
    if available is not None and need > MEMORY_SHARE * available:
        raise GgufImportError(
            f"{path} declares {header.elements:,} weights: {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, "
            f"more than {MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB available here"
        )


def _load(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from echo_node.ml.model import ATTN_IMPLEMENTATION

    hf_logging.disable_progress_bar()  # one line per import, not a dequantisation bar
    where: dict[str, Any] = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name, "local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    except Exception as exc:  # transformers' errors for a bad file are of many types
        raise GgufImportError(f"{path}: transformers could not load its weights: {_reason(exc)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:
        raise GgufImportError(f"{path}: transformers could not build its tokenizer: {_reason(exc)}") from None
    return model, tokenizer


def _unquantise(model: Any) -> None:
    """A plain model to save (`drop_quantisation_marks`), that does not say where it came from."""
    from echo_node.ml.model import drop_quantisation_marks

    drop_quantisation_marks(model)
    # Where the weights came from is not part of the model (echo_node/policy.py hashes the config).
    model.config._name_or_path = ""


def import_gguf(path: Path, out_dir: Path, *, dtype: torch.dtype = torch.float32) -> ImportResult:
    """Convert the GGUF file at `path` into a new HF model directory `out_dir` (module rules)."""
    check_output_dir(out_dir)
    header = read_header(path)
    supported = _supported_architectures()
    if header.architecture not in supported:
        raise GgufImportError(
            f"{path}: architecture {header.architecture!r} cannot be loaded by this transformers "
            f"(it reads GGUF for {', '.join(sorted(supported))})"
        )
    check_fits(path, header, dtype)
    model, tokenizer = _load(path, dtype)
    _unquantise(model)
    out_dir = out_dir.absolute()
    tmp = out_dir.with_name(f".{out_dir.name}.import-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked first); a rename cannot replace a directory
        os.replace(tmp, out_dir)
    except OSError as exc:
        raise GgufImportError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(
        out_dir=out_dir,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype).removeprefix("torch."),
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
    )
