"""Control requests: a request to an engine model whose parameters hold one of these is an order, not a prompt.

    cancel_request_id   the ensemble's postprocessing, for a client that cancelled: cancel the request with
                        that request_id output (its stream ends with finish_reason "abort")
    drain_seconds       `nanoserve serve`, before it stops tritonserver: take no new request, give those in
                        flight up to this many seconds to finish, end the rest, then answer

Each is answered with one FINAL response once done (a cancel with the flag alone, a drain with a response without
outputs, which HTTP /generate expects). Triton's ensemble scheduler passes no cancel on to a
decoupled step that is running, and once tritonserver stops, its composing models take no new request, so an
ensemble whose token stream is still running can never end; the drain ends every stream before that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nanoserve.errors import RequestError
from nanoserve.serving.shared.engine_model import CANCEL_PARAMETER, DRAIN_PARAMETER, MAX_DRAIN_SECONDS
from nanoserve.serving.stub.request import json_object


@dataclass
class CancelById:
    sender: object
    request_id: str


@dataclass
class Drain:
    sender: object
    deadline: float  # the response thread's clock() by which every stream must have ended


def control_event(parameters: str, sender, now: float) -> CancelById | Drain | None:
    """The control a request's parameters JSON orders (None for every other request, whose parameters, even
    invalid ones, are the request parser's to judge); ValueError names a bad control value."""
    try:
        values = json_object("parameters", parameters)
    except ValueError:
        return None
    if CANCEL_PARAMETER in values:
        target = values[CANCEL_PARAMETER]
        if not isinstance(target, str) or not target:
            raise RequestError(CANCEL_PARAMETER, f"expected a non-empty request id, got {target!r}")
        return CancelById(sender, target)
    if DRAIN_PARAMETER in values:
        seconds = values[DRAIN_PARAMETER]
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
                or not 0 <= seconds <= MAX_DRAIN_SECONDS):
            raise RequestError(DRAIN_PARAMETER, f"expected seconds in [0, {MAX_DRAIN_SECONDS:g}], got {seconds!r}")
        return Drain(sender, now + seconds)
    return None
