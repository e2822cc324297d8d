#!/usr/bin/env bash
# Creates .venv and installs nanoserve into it. torch goes first, pinned, so no dependency pulls a newer
# build with several GB of CUDA wheels. Override with TORCH_SPEC (e.g. TORCH_SPEC="torch" on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${1:-serve}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
python -m pip install -q -e ".[$EXTRAS]"
echo "nanoserve installed in $(pwd)/.venv (extras: $EXTRAS)"
