#!/usr/bin/env bash
# The README's main job: set up, fetch SmolLM2-135M-Instruct once, serve it with tritonserver and stream
# its answer to a question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
exec .venv/bin/nanoserve demo "$@"
