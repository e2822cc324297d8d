"""A nanoserve engine model as every side of serving sees it: its mode in the config Triton reports, how it
answers once its engine has failed, and the control requests it takes (stub/control.py carries them out).

The Triton stub answers with these; `nanoserve serve` (liveness, drain) and the OpenAI API ask with them.
"""
from __future__ import annotations

UNAVAILABLE = "the model is unavailable: "  # + why: how a model whose engine has failed answers every request

# Control requests: a request whose parameters hold one of these is an order, not a prompt (stub/control.py)
CANCEL_PARAMETER = "cancel_request_id"
DRAIN_PARAMETER = "drain_seconds"
MAX_DRAIN_SECONDS = 3600.0


def engine_mode(config: dict) -> str | None:
    """A Triton model config's (as Triton reports it) nanoserve mode: "text" (contracts/vllm_text.py) or "tokens"
    (contracts/token_model.py); None for a model of another backend."""
    if config.get("backend") != "nanoserve":
        return None
    return config.get("parameters", {}).get("mode", {}).get("string_value", "") or "text"


def is_text_model(config: dict) -> bool:
    return engine_mode(config) == "text"
