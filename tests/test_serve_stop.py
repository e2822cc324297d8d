"""`nanoserve serve` on SIGTERM (serving/serve/drain.py): the engine models take no new request, the streams in
flight end (or are ended at the drain's deadline), and only then does tritonserver stop. An ensemble stream in flight
included, it exits with code 0: tritonserver 2.51 alone never releases an ensemble whose token stream runs when it
stops (its composing models then refuse the postprocessing of the next response)."""
import signal

import pytest
from serving_utils import TIMEOUT, collect, http_post, open_stream
from triton_server import nanoserve_serve

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
LONG = {"ignore_eos": True, "max_tokens": 1900}  # the tiny model's 2048 positions, less the prompt
SHUTTING_DOWN = "the server is shutting down"


def test_sigterm_lets_the_streams_end_then_exits_cleanly(qwen3_dir, tmp_path):
    with nanoserve_serve(qwen3_dir, tmp_path, "--ensemble") as served:  # exit timeout 30 s: the drain's too
        streams = [open_stream(served, model, text_input="Hi", stream=True, sampling_parameters=LONG)
                   for model in ("ensemble", "nanoserve")]
        for _, events in streams:
            assert events.get(timeout=TIMEOUT)[1] is None  # running
        served.process.send_signal(signal.SIGTERM)
        refused = _first_refusal(served, streams)
        ended = []
        for client, events in streams:
            ended.append(collect(events))
            client.close()
        assert served.process.wait(TIMEOUT) == 0
    ensemble, text = ended
    assert ensemble.error is None and ensemble.responses[-1]["finish_reason"].tolist()[0] in (b"abort", b"length")
    assert text.error is None or SHUTTING_DOWN in text.error.message()  # cut at the deadline: no text "abort"
    if refused is not None:  # else the streams had ended before the drain came
        assert refused == (400, b'{"error":"the server is shutting down: the model takes no new request"}')


def _first_refusal(served, streams) -> tuple[int, bytes] | None:
    """Ask for new requests until one is refused (its HTTP status and body: /generate answers 400 for any model
    error; the model's code is UNAVAILABLE, which the OpenAI API answers with 503) or the streams have ended (None).
    Until the drain reaches the model, a new request is served; after it, tritonserver stops taking connections."""
    while any(_running(events) for _, events in streams):
        try:
            status, body = http_post(served, "/v2/models/nanoserve/generate",
                                     {"text_input": "Hi", "max_tokens": 2})
        except OSError:  # tritonserver stopped: the streams ended before the drain came
            return None
        if status != 200:
            return status, body
    return None


def _running(events) -> bool:
    """Whether the stream's queued responses hold no final one (they stay queued for collect)."""
    return not any(error is not None or result.get_response().parameters["triton_final_response"].bool_param
                   for result, error in list(events.queue))
