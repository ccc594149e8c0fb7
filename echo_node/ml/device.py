"""Where a node computes and in which precision: `model.device` and `model.dtype` resolved.

Rules:
- `auto` device is the first CUDA device when torch sees one, else the CPU; an explicit `cuda`
  on a machine without one is an error that says so, never a silent fallback to the CPU.
- `auto` dtype is bfloat16 on CUDA and float32 on the CPU: bf16 matmuls are what GPUs are fast
  at, while CPUs without AMX run bf16 slower than fp32. The dtype named here is the *rollout*
  dtype (engines, publications); the learner's master weights and optimizer state stay fp32.
- Dtypes travel (run specs, checkpoints) by these names, never as torch reprs.
- A node says at start what `auto` chose and why (`describe_choice`), in one INFO line: a bf16 run
  on a CPU without native bf16 is slow for a reason the operator cannot see otherwise.
"""

from __future__ import annotations

from pathlib import Path

import torch

# CPU feature flags (Linux /proc/cpuinfo) that mean bf16 matmuls run natively: Intel AMX and
# AVX512-BF16 on x86, the BF16 extension on Arm. Without them torch emulates bf16 in fp32.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})

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


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str] | None:
    """This CPU's native bf16 feature flags (empty: none, bf16 is emulated), or None when they
    cannot be read (not Linux). `cpuinfo`: the text of /proc/cpuinfo (tests pass their own)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(NATIVE_BF16_FLAGS & set(value.split()))
    return None


def describe_choice(device_setting: str, dtype_setting: str | None, *, cpuinfo: str | None = None) -> str:
    """One line: the device and rollout dtype this node resolved from `model.device` and
    `model.dtype`, and why. `dtype_setting` None: a rollout peer, whose dtype is the run's."""
    device = resolve_device(device_setting)
    if device_setting == "auto":
        where = (
            f"device auto -> {device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
            else "device auto -> cpu: torch sees no CUDA device"
        )
    else:
        where = f"device {device} (model.device)"
    if dtype_setting is None:
        return f"{where}; dtype: the run's rollout dtype, as its learner chose it"
    dtype = resolve_dtype(dtype_setting, device)
    name = dtype_name(dtype)
    if dtype_setting != "auto":
        return f"{where}; dtype {name} (model.dtype)"
    if device.type == "cuda":
        return f"{where}; dtype auto -> {name} on {device}: bf16 matmuls are what GPUs are fast at, and a publication is half the bytes of fp32"
    flags = cpu_bf16_flags(cpuinfo)
    if flags is None:
        why = "fp32 is the CPU default (this CPU's bf16 support is unknown)"
    elif flags:
        why = f"fp32 is the CPU default; this CPU has native bf16 ({', '.join(flags)}): --dtype bfloat16 halves the bytes per version (measure its speed here first)"
    else:
        why = "this CPU has no native bf16 (bf16 is emulated in fp32 there, slower to generate)"
    return f"{where}; dtype auto -> {name} on cpu: {why}"
