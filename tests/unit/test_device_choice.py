"""What `auto` chose for model.device and model.dtype, and why, in the one line a node logs at start."""

from __future__ import annotations

import pytest
import torch

from echo_node.ml.device import cpu_bf16_flags, describe_choice

NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 avx512f\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert cpu_bf16_flags(NO_BF16) == []
    assert cpu_bf16_flags(AMX) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags(ARM) == ["bf16"]
    assert cpu_bf16_flags("processor\t: 0\n") is None  # no flags line: unknown, not "none"


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the GPU here")
def test_auto_on_a_cpu_says_float32_and_why() -> None:
    line = describe_choice("auto", "auto", cpuinfo=NO_BF16)
    assert line == ("device auto -> cpu: torch sees no CUDA device; dtype auto -> float32 on cpu: "
                    "this CPU has no native bf16 (bf16 is emulated in fp32 there, slower to generate)")
    line = describe_choice("auto", "auto", cpuinfo=AMX)
    assert "dtype auto -> float32 on cpu" in line and "native bf16 (amx_bf16, avx512_bf16)" in line
    assert "bf16 support is unknown" in describe_choice("cpu", "auto", cpuinfo="")


def test_explicit_settings_and_a_peer_are_named_as_such() -> None:
    assert describe_choice("cpu", "bfloat16") == "device cpu (model.device); dtype bfloat16 (model.dtype)"
    assert describe_choice("cpu", None).endswith("dtype: the run's rollout dtype, as its learner chose it")
    with pytest.raises(ValueError):
        describe_choice("cpu", "float8")


def test_auto_on_a_gpu_names_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch, on any machine: the GPU is faked, the line is real. (It once called a
    torch.cuda function that does not exist, so every node on a GPU with device auto failed at
    start; the type checker found it.)"""
    monkeypatch.setattr("echo_node.ml.device.resolve_device", lambda setting: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    line = describe_choice("auto", "auto")
    assert line.startswith("device auto -> cuda:0 (NVIDIA H200); dtype auto -> bfloat16 on cuda:0"), line
    assert describe_choice("auto", None).startswith("device auto -> cuda:0 (NVIDIA H200); dtype: the run's")
