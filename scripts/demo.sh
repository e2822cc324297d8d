#!/usr/bin/env bash
# The README's main job: set up, build the default tiny model locally, serve it with tritonserver and
# stream one completion to the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
exec .venv/bin/nanoserve demo "$@"
