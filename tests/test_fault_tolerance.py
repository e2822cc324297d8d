"""Faults through a real tritonserver whose engine has an injected fault (the real sampler, raising for marked
requests): a bad request fails alone and the other streams finish with the same text; an engine that keeps
failing unloads its model (not ready), its requests get UNAVAILABLE, and a reload serves again; on SIGTERM a
stream the exit timeout would cut ends with an error event. Explicit model control, as the health check needs.
The tests run in file order: the last one shuts the server down."""
import json
import signal
import threading
import urllib.error
import urllib.request

import pytest
from serving_utils import (BACKEND_MODEL, collect, http_post, metrics_when, open_stream, sse_events, stream,
                           wait_until)
from triton_server import running_server, tiny_repository

from client.stream import first_sse_event, open_generate_stream
from nanoserve.tiny_model import build_tiny_model

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "nanoserve"
MAX_MODEL_LEN = 131072  # an unbounded stream runs for minutes: it is still running when the test acts on it
EXIT_TIMEOUT = 8
FAULT_SEED, LATE_SEED = 666, 777
HOOK = f'''

# ---- injected by tests/test_fault_tolerance.py: the real sampler, failing for marked requests ----
from nanoserve.layers import sampler as _sampler_module

_real_call, _late_calls = _sampler_module.Sampler.__call__, []


def _faulty_call(self, logits, meta):
    seeds = {{seed for _, seed in meta.seeds}}
    if {FAULT_SEED} in seeds:
        raise RuntimeError("injected sampler fault")
    if {LATE_SEED} in seeds:
        _late_calls.append(1)
        if len(_late_calls) > 5:  # admitted long before: never a suspect, so the retry fails too
            raise RuntimeError("injected sampler fault, late")
    return _real_call(self, logits, meta)


_sampler_module.Sampler.__call__ = _faulty_call
'''
GOOD = [{"temperature": 0, "max_tokens": 40, "ignore_eos": True},
        {"temperature": 0.9, "seed": 5, "max_tokens": 40, "ignore_eos": True},
        {"temperature": 1.0, "top_k": 30, "seed": 2 ** 63 + 5, "max_tokens": 40, "ignore_eos": True}]
PROMPT = "The licence grants you"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    checkpoint = build_tiny_model(str(tmp / "tiny-long"), max_position_embeddings=MAX_MODEL_LEN)
    repo = tiny_repository(tmp / "model_repository", checkpoint, max_model_len=MAX_MODEL_LEN)
    config = repo / MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "nanoserve"', 'backend: "python"'))
    (repo / MODEL / "1" / "model.py").write_text(BACKEND_MODEL.read_text() + HOOK)
    with running_server(repo, tmp, [MODEL], exit_timeout_secs=EXIT_TIMEOUT,
                        extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"]) as server:
        yield server


def model_ready(server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.url_http}/v2/models/{MODEL}/ready", timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def stream_texts(server, bad=None) -> tuple[list[str], object]:
    """GOOD streamed at once; when `bad` is given it is sent once every stream has its first response."""
    opened = [open_stream(server, MODEL, text_input=PROMPT, stream=True, sampling_parameters=params)
              for params in GOOD]
    firsts = [collect_one(events) for _, events in opened]
    bad_out = stream(server, MODEL, text_input=PROMPT, stream=True, sampling_parameters=bad) if bad else None
    texts = []
    for (client, events), first in zip(opened, firsts):
        rest = collect(events) if not first.get("final") else None
        client.stop_stream()
        client.close()
        assert rest is None or rest.error is None, rest.error
        texts.append(first["text"] + (rest.text if rest else ""))
    return texts, bad_out


def collect_one(events) -> dict:
    result, error = events.get(timeout=120)
    assert error is None, error
    return {"text": result.as_numpy("text_output")[0].decode(),
            "final": result.get_response().parameters["triton_final_response"].bool_param}


def test_a_bad_request_fails_alone_and_the_other_streams_finish_unchanged(server):
    reference, _ = stream_texts(server)
    texts, bad = stream_texts(server, bad={"temperature": 1.0, "seed": FAULT_SEED, "max_tokens": 40})
    assert bad.error is not None and "engine step failed with this request" in bad.error.message()
    assert texts == reference
    values = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 0)
    assert values["nanoserve_kv_blocks_used"] == 0 and model_ready(server)


def test_an_engine_that_keeps_failing_unloads_its_model_and_a_reload_serves_again(server):
    reference, _ = stream_texts(server)
    in_flight = {}
    worker = threading.Thread(target=lambda: in_flight.update(reply=http_post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"ignore_eos": True}})))
    worker.start()
    metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 1)
    late = stream(server, MODEL, text_input=PROMPT, stream=True,
                  sampling_parameters={"temperature": 1.0, "seed": LATE_SEED, "ignore_eos": True})
    assert late.error is not None and "the model is unavailable" in late.error.message(), late.error
    worker.join(120)
    status, body = in_flight["reply"]
    # Triton 2.51's generate endpoint answers 400 whatever the error's code (UNAVAILABLE here)
    assert status == 400 and "the model is unavailable" in json.loads(body)["error"], (status, body)
    wait_until(lambda: not model_ready(server))  # the health check unloaded it
    status, body = http_post(server, f"/v2/repository/models/{MODEL}/load", {})
    assert status == 200, body
    assert model_ready(server) and stream_texts(server)[0] == reference


def test_a_stream_cut_by_shutdown_ends_with_an_error_event(server):
    """tritonserver drains HTTP for the exit timeout, then cuts the stream without telling the model; the model
    notices the drain and ends the stream with an error event first."""
    body = {"text_input": PROMPT, "parameters": {"stream": True, "ignore_eos": True}}
    connection = open_generate_stream(server.url_http, MODEL, body, timeout=120)
    received = first_sse_event(connection)
    assert b"data:" in received, received
    server.process.send_signal(signal.SIGTERM)
    while not received.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
        chunk = connection.recv(65536)
        assert chunk, f"stream cut without an end: {received[-300:]!r}"
        received += chunk
    connection.close()
    events = sse_events(received.split(b"\r\n\r\n", 1)[1])
    assert "text_output" in events[0]
    assert events[-1] == {"error": "the server is shutting down: its exit timeout ends this request"}
    server.process.wait(EXIT_TIMEOUT + 30)  # (0 when the model also unloads within the exit timeout)
