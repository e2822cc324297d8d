"""`nanoserve serve`'s stop: drain every engine model (serving/stub/control.py) before tritonserver gets the signal.

Once tritonserver 2.51 is stopping, its composing models take no new request, so an ensemble whose token stream
is still running fails its next postprocessing step and is never released: tritonserver waits out its exit
timeout and exits with code 1. Drained first, every stream has ended, its last response already handed on to the
postprocessing, before tritonserver stops; requests that come meanwhile get UNAVAILABLE.

Listed with the tritonserver workarounds: serving/workarounds.py, 'ensemble-never-released-at-stop'.
"""
from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

from nanoserve.serving.serve.liveness import generate_request
from nanoserve.serving.shared.contracts import token_model, vllm_text
from nanoserve.serving.shared.engine_model import DRAIN_PARAMETER

CONTROL_BODIES = {"text": vllm_text.control_body, "tokens": token_model.control_body}  # by the model's mode
ANSWER_GRACE = 30.0  # seconds a model may take beyond the drain's own to answer it
POLL_INTERVAL = 0.2


def drain(url_http: str, models: dict[str, str], seconds: float, received: list[int]) -> list[str]:
    """Drain `models` (name -> mode) at once, each given `seconds`; wait for their answers unless a second signal
    comes (`received`). Returns why a model was not drained, one line each."""
    failures: list[str] = []
    threads = [threading.Thread(target=_drain_one, args=(url_http, model, mode, seconds, failures), daemon=True)
               for model, mode in models.items()]
    for thread in threads:
        thread.start()
    signals = len(received)
    for thread in threads:
        while thread.is_alive() and len(received) == signals:
            thread.join(POLL_INTERVAL)
    return failures


def _drain_one(url_http: str, model: str, mode: str, seconds: float, failures: list[str]) -> None:
    body = json.dumps(CONTROL_BODIES[mode]({DRAIN_PARAMETER: seconds})).encode()
    request = generate_request(url_http, model, body)
    try:
        with urllib.request.urlopen(request, timeout=seconds + ANSWER_GRACE) as response:
            error = json.loads(response.read()).get("error")
        if error:
            failures.append(f"model {model}: {error}")
    except urllib.error.HTTPError as e:
        with e:
            failures.append(f"model {model}: {e.read().decode(errors='replace')}")
    except (OSError, http.client.HTTPException, ValueError) as e:
        failures.append(f"model {model}: {e}")
