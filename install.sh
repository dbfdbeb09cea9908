#!/usr/bin/env bash
# Install megatron-lite in editable mode, with optional extras: `bash install.sh dev`.
# PyTorch is left alone when already installed (a cluster's CUDA build stays); on a machine
# without it, torch 2.13.0 is installed first (the CPU build where one is available locally).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${1:-}
if [ -n "$extras" ]; then
    "$PY" -m pip install --quiet -e ".[$extras]"
else
    "$PY" -m pip install --quiet -e .
fi
