"""`nanoserve serve` asks each model a question every few seconds, and a model that gives no answer in time is
stuck: tritonserver 2.51's gRPC frontend can deadlock so that the stub's response thread blocks in
`ResponseSender.send` forever, and from then on the model answers nothing while `/v2/health/ready` stays 200.

The question is a request with `max_tokens` -1: the model rejects it (HTTP 400) from the same response thread that
sends every answer, without the engine. So it is cheap, waits behind no queued request however busy the engine
is, and its answer shows that the frontend and the stub's response path still work. A refused connection (a
server starting or stopping) is no verdict either way.

Listed with the tritonserver workarounds: serving/workarounds.py, 'grpc-frontend-deadlock'.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

from nanoserve.serving.shared.contracts.vllm_text import TextRequest
from nanoserve.serving.shared.engine_model import UNAVAILABLE, engine_mode

PROBE_INTERVAL = 5.0  # seconds from one answer to the next question
PROBE = json.dumps(TextRequest("liveness probe", scalars={"max_tokens": -1}).generate_body()).encode()


class Liveness:
    """Asks `models` (their text_input contract) in turn from a daemon thread; `stuck` says which model did not
    answer (see `unanswered`), None while all answer."""

    def __init__(self, url_http: str, models: list[str], timeout: float):
        self.url_http, self.models, self.timeout = url_http, list(models), timeout
        self.stuck: str | None = None
        self.stuck_since = 0.0  # time.monotonic() when `stuck` was set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-liveness", daemon=True)

    def start(self) -> "Liveness":
        if self.models and self.timeout > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            for model in self.models:
                why = unanswered(self.url_http, model, self.timeout)
                if why and not self._stop.is_set():
                    self.stuck_since, self.stuck = time.monotonic(), why
                    return


def unanswered(url_http: str, model: str, timeout: float) -> str | None:
    """Why the model did not answer the question (None: it did). It did not when it took the question and gave no
    answer within `timeout` seconds, or when tritonserver answered for it that its stub is not healthy (a stub that
    hangs whole, or was stopped)."""
    try:
        with urllib.request.urlopen(generate_request(url_http, model, PROBE), timeout=timeout) as response:
            response.read()
        return None
    except urllib.error.HTTPError as e:
        with e:  # an error answer is an answer, but not python_backend's for a stub it gave up on
            body = e.read()
        if b"is not healthy" in body:
            return f"the stub of model {model} is not healthy"
        if UNAVAILABLE.encode() in body:  # its engine has failed (its core process died, say): a restart serves again
            return f"model {model} is unavailable: its engine has failed"
        return None
    except TimeoutError:
        timed_out = True
    except urllib.error.URLError as e:
        timed_out = isinstance(e.reason, TimeoutError)
    except (ConnectionError, http.client.HTTPException):
        timed_out = False  # a server going away: the supervisor sees it exit
    return f"model {model} answered no request within {timeout:g} s" if timed_out else None


def generate_request(url_http: str, model: str, body: bytes) -> urllib.request.Request:
    """A POST of a JSON body to the model's HTTP /generate."""
    return urllib.request.Request(f"http://{url_http}/v2/models/{model}/generate", data=body,
                                  headers={"Content-Type": "application/json"})


def text_models(url_http: str) -> list[str]:
    """The ready nanoserve text models of a running tritonserver (the token-level engine takes another request)."""
    return sorted(name for name, mode in engine_models(url_http).items() if mode == "text")


def engine_models(url_http: str) -> dict[str, str]:
    """The ready nanoserve models of a running tritonserver and their modes, as Triton reports their configs; none
    when its HTTP endpoint does not answer."""
    try:
        ready = [model["name"] for model in _triton_json(url_http, "/v2/repository/index", data=b"{}")
                 if model.get("state") == "READY"]
        modes = {name: engine_mode(_triton_json(url_http, f"/v2/models/{name}/config")) for name in ready}
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    return {name: mode for name, mode in modes.items() if mode is not None}


def _triton_json(url_http: str, path: str, data: bytes | None = None):
    with urllib.request.urlopen(f"http://{url_http}{path}", data=data, timeout=30) as response:
        return json.loads(response.read())
