#!/usr/bin/env bash
# Long soak of nanoserve in Triton (client/soak.py): 16 clients over gRPC streams, HTTP SSE and /generate, to the text
# model and the ensemble, with cancellations, SIGKILLed client processes and bad input, on small KV pools. Prints requests
# sent/completed/cancelled/rejected/hung, preemptions, and the RSS of tritonserver and each stub at start and end;
# exits 1 when a check failed.
#   bash scripts/soak.sh --minutes 30 [--clients 16] [--work-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve > /dev/null 2>&1 || { echo "soak.sh: scripts/setup.sh failed" >&2; exit 1; }
export TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python client/soak.py "$@"
