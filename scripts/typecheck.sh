#!/usr/bin/env bash
# The type check CI runs: mypy --strict on protocol/ (the sans-I/O wire code), then (unless the
# argument is `protocol`) mypy's default checks on echo_node/, bootstrap/ and benchmarks/.
# Settings live in pyproject.toml [tool.mypy].
#
# trio ships its own type information, but libp2p depends on trio-typing, whose older `trio-stubs`
# package mypy prefers to it (a stub package wins over inline types); a search path that holds only
# trio makes mypy read trio's own. It lives in the cache folder so mypy's cache stays valid.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
paths=.mypy_cache/search-path
mkdir -p "$paths"
ln -sfn "$("$PY" -c 'import os, trio; print(os.path.dirname(trio.__file__))')" "$paths/trio"
export MYPYPATH=$paths
"$PY" -m mypy --strict protocol
if [ "${1:-all}" != protocol ]; then
  "$PY" -m mypy echo_node bootstrap benchmarks
fi
