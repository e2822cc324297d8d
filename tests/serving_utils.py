"""Helpers for the serving tests: a real tritonserver on free 127.0.0.1 ports, and small clients."""
from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from client.stream import first_sse_event, open_generate_stream

from triton_server import assert_nothing_left, running_server, tiny_repository

TIMEOUT = 120
BACKEND_MODEL = Path(__file__).resolve().parents[1] / "backend" / "model.py"


@contextlib.contextmanager
def triton(tmp_dir, checkpoint, models, plain_python=(), parameters=None, **engine_args):
    """A tritonserver serving `models` of the repo's model_repository/ template, pointed at checkpoint. On exit
    it checks that SIGTERM shut the server down cleanly (every FINAL sent, stubs gone, no shared memory left).
    plain_python: models switched to the documented `backend: "python"` form (backend/model.py copied in).
    parameters: config.pbtxt parameters added to every model."""
    repo = tiny_repository(tmp_dir / "model_repository", checkpoint, models, **engine_args)
    for name in models:
        add_parameters(repo / name / "config.pbtxt", parameters or {})
    for name in plain_python:
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace('backend: "nanoserve"', 'backend: "python"'))
        shutil.copy(BACKEND_MODEL, repo / name / "1" / "model.py")
    with running_server(repo, tmp_dir, models, exit_timeout_secs=30) as server:
        yield server
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(60)
        assert code == 0, f"tritonserver exited with {code}:\n{server.log_tail()}"
        assert_nothing_left(server)


def add_parameters(config_pbtxt: Path, parameters: dict) -> None:
    lines = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    config_pbtxt.write_text(config_pbtxt.read_text() + lines)


# ---- gRPC streaming ---------------------------------------------------------------------------------------
@dataclass
class Streamed:
    responses: list[dict] = field(default_factory=list)  # output name -> numpy array, per data response
    error: Exception | None = None
    num_empty_final: int = 0

    @property
    def texts(self) -> list[str]:
        return [r["text_output"][0].decode() for r in self.responses if "text_output" in r]

    @property
    def text(self) -> str:
        return "".join(self.texts)


def tensors(**values) -> list:
    """name=value -> InferInputs: str -> BYTES, bool -> BOOL, numpy arrays as they are."""
    inputs = []
    for name, value in values.items():
        if isinstance(value, str):
            array = np.array([value.encode()], dtype=np.object_)
        elif isinstance(value, bytes):
            array = np.array([value], dtype=np.object_)
        elif isinstance(value, bool):
            array = np.array([value])
        elif isinstance(value, dict):
            array = np.array([json.dumps(value).encode()], dtype=np.object_)
        else:
            array = np.asarray(value)
        dtype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


OUTPUT_NAMES = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                "num_output_tokens", "prompt_logprobs", "output_ids", "context_ids")


def stream(server, model: str, parameters: dict | None = None, first_response: threading.Event | None = None,
           **inputs) -> Streamed:
    """One request over a gRPC stream; returns once its FINAL response (or an error) arrived. first_response is
    set when the first response arrives."""
    client, events = open_stream(server, model, parameters, **inputs)
    try:
        return collect(events, first_response=first_response)
    finally:
        client.stop_stream()
        client.close()


def open_stream(server, model: str, parameters: dict | None = None, request_id: str = "", **inputs):
    """Send one request on a new gRPC stream: (client, queue of (result, error)). Close the client after."""
    client = grpcclient.InferenceServerClient(server.url_grpc)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(model, tensors(**inputs), parameters=parameters, request_id=request_id,
                              enable_empty_final_response=True)
    return client, events


def collect(events: queue.Queue, timeout: float = TIMEOUT, first_response: threading.Event | None = None) -> Streamed:
    out = Streamed()
    while True:
        result, error = events.get(timeout=timeout)
        if first_response is not None:
            first_response.set()
        if error is not None:
            out.error = error
            return out
        arrays = {name: result.as_numpy(name) for name in OUTPUT_NAMES if result.as_numpy(name) is not None}
        if arrays:
            out.responses.append(arrays)
        else:
            out.num_empty_final += 1
        if result.get_response().parameters["triton_final_response"].bool_param:
            return out


# ---- HTTP -------------------------------------------------------------------------------------------------
def http_post(server, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{server.url_http}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def process_name(pid: int) -> str:
    """/proc/PID/comm: a process's (or its main thread's) name; "" for one that has gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def open_sse(server, model: str, body: dict):
    """A /generate_stream request on a raw connection, once its first event came: returns the function that
    closes the connection (a client going away mid-stream)."""
    connection = open_generate_stream(server.url_http, model, body, timeout=TIMEOUT)
    try:  # closed on any failure too: a connection left open holds tritonserver's shutdown to its exit timeout
        received = first_sse_event(connection)
        assert b"data:" in received, f"the server closed the stream before its first event: {received!r}"
    except BaseException:
        connection.close()
        raise
    return connection.close


def sse_events(body: bytes) -> list[dict]:
    return [json.loads(line[len(b"data:"):]) for line in body.splitlines() if line.startswith(b"data:")]


def is_ready(server) -> bool:
    with urllib.request.urlopen(f"http://{server.url_http}/v2/health/ready", timeout=10) as response:
        return response.status == 200


# ---- metrics ----------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([\w:]+)(?:\{(.*)\})? (\S+)$')


def metrics(server, model: str, prefix: str = "nanoserve_") -> dict:
    """The samples of one model whose names start with prefix: {"name": value} or {"name{reason=x}": value}
    (labels model, version and model_name dropped)."""
    with urllib.request.urlopen(server.url_metrics, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match.group(1).startswith(prefix):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if labels.pop("model", None) != model or labels.pop("model_name", model) != model:
            continue
        labels.pop("version", None)
        key = match.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        samples[key] = float(match.group(3))
    return samples


def metrics_when(server, model: str, condition, timeout: float = TIMEOUT) -> dict:
    """The model's metrics once condition(metrics) holds (asserted within timeout seconds): while requests run,
    the backend publishes them every PUBLISH_INTERVAL."""
    deadline = time.monotonic() + timeout
    while not condition(values := metrics(server, model)):
        assert time.monotonic() < deadline, values
        time.sleep(0.05)
    return values


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    """Returns once condition() holds; fails after timeout seconds, long enough for a busy machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
