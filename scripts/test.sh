#!/usr/bin/env bash
# The README's test command: set up (tests, serving, perf tools) and run the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "serve,test"
[ ! -f scripts/setup_perf_tools.sh ] || bash scripts/setup_perf_tools.sh
. .venv/bin/activate
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1
exec python -m pytest -q "$@"
