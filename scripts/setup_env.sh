#!/usr/bin/env bash
# Shared set-up for the README's two commands: torch (a CUDA build, >= 2.11), build tools, the extension.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 11) and torch.version.cuda else 1)" 2>/dev/null; then
  echo "== installing torch 2.14.1 (CUDA 13 build)"
  $PY -m pip install -q "torch==2.14.1"
fi
$PY -m pip install -q ninja pybind11 pytest numpy "setuptools>=64" wheel
echo "== building tk_backend._C for sm_90a (MAX_JOBS=${MAX_JOBS:-$(nproc)})"
MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY -m pip install -q --no-build-isolation --no-deps -e .
