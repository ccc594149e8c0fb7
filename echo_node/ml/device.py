"""Where a node computes and in which precision: `model.device` and `model.dtype` resolved.

Rules:
- `auto` device is the first CUDA device when torch sees one, else the CPU; an explicit `cuda`
  on a machine without one is an error that says so, never a silent fallback to the CPU.
- `auto` dtype is bfloat16 on CUDA and float32 on the CPU: bf16 matmuls are what GPUs are fast
  at, while CPUs without AMX run bf16 slower than fp32. The dtype named here is the *rollout*
  dtype (engines, publications); the learner's master weights and optimizer state stay fp32.
- Dtypes travel (run specs, checkpoints) by these names, never as torch reprs.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"model.device is {name!r}, but torch sees no CUDA device here: use cpu (or auto)")
    device = torch.device(name if ":" in name else "cuda:0")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"model.device is {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} is not a rollout dtype ({', '.join(DTYPES)})")


def autocast_dtype(rollout: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The learner's forward precision: the rollout dtype under autocast on CUDA (fp32 master
    weights, bf16 matmuls); None (plain fp32) on the CPU, where autocast only adds casts."""
    return rollout if device.type == "cuda" and rollout != torch.float32 else None
