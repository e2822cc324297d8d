"""A vllm_backend model directory served by nanoserve with only `backend:` changed: vllm_backend's sample
config.pbtxt and model.json (vLLM's engine argument names), plus `send_every_step` for vllm_backend's
one-response-per-step streaming (and beside it the same model with `send_budget` 1). Through a real
tritonserver."""
import json
import shutil
import time

import pytest
from serving_utils import metrics, open_stream, stream

from triton_server import running_server

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "vllm_model"
# vllm_backend's samples/model_repository/vllm_model/config.pbtxt, backend renamed: the decoupled policy, inputs
# and outputs are auto-completed.
CONFIG = """backend: "nanoserve"
instance_group [{ count: 1, kind: KIND_MODEL }]
parameters { key: "send_every_step" value: { string_value: "true" } }
"""
SOON = "vllm_model_send_budget_1"  # the same model, sending as soon as it can instead of once per step
SOON_CONFIG = CONFIG.replace('key: "send_every_step" value: { string_value: "true" }',
                             'key: "send_budget" value: { string_value: "1" }')
# longer than any 12-token text (stop strings: at most 256 chars): all of it is held back to the end
NEVER = "never-matching stop string " * 9


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_backend_model")
    (tmp / "repo" / MODEL / "1").mkdir(parents=True)
    (tmp / "repo" / MODEL / "config.pbtxt").write_text(CONFIG)
    # vllm_backend's sample model.json, with vLLM's names for a small KV cache
    model_json = {"model": qwen3_dir, "disable_log_requests": True, "gpu_memory_utilization": 0.5,
                  "enforce_eager": True, "block_size": 8, "num_gpu_blocks_override": 64}
    (tmp / "repo" / MODEL / "1" / "model.json").write_text(json.dumps(model_json))
    assert "send_budget" in SOON_CONFIG and "send_every_step" not in SOON_CONFIG
    shutil.copytree(tmp / "repo" / MODEL, tmp / "repo" / SOON)
    (tmp / "repo" / SOON / "config.pbtxt").write_text(SOON_CONFIG)
    with running_server(tmp / "repo", tmp, models=[MODEL, SOON]) as server:
        yield server


def log_lines(server, text: str) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines() if text in line]


def test_vllm_argument_names_load_and_the_inapplicable_are_a_warning(server):
    lines = log_lines(server, "vLLM engine arguments that do not apply to nanoserve")
    assert len(lines) == 2 and lines[0].startswith("W")  # one per model, in Triton's warning format
    assert lines[0].endswith('ignored: disable_log_requests"')
    values = metrics(server, MODEL)
    assert values["nanoserve_kv_blocks_total"] == 64  # num_gpu_blocks_override


def test_no_vllm_metrics_without_report_custom_metrics(server):
    assert stream(server, MODEL, text_input="Hello", sampling_parameters={"max_tokens": 2}).error is None
    assert metrics(server, MODEL, prefix="vllm:") == {}  # vllm_backend's default
    assert metrics(server, MODEL)["nanoserve_generation_tokens_total"] >= 2


def test_send_every_step_sends_one_response_per_token(server):
    params = {"max_tokens": 12, "ignore_eos": True, "temperature": 0, "stop": [NEVER]}
    streamed = stream(server, MODEL, text_input="The licence", stream=True, sampling_parameters=params,
                      return_num_output_tokens=True)
    whole = stream(server, MODEL, text_input="The licence", exclude_input_in_output=True, sampling_parameters=params)
    assert streamed.error is None and whole.error is None
    assert len(streamed.responses) == 12  # one per engine step, as vllm_backend sends
    assert [r["num_output_tokens"][0] for r in streamed.responses] == [1] * 12
    assert streamed.texts[:11] == [""] * 11  # the text is held back (a possible stop string) until the end
    assert streamed.text == whole.text and whole.text


def test_send_budget_1_sends_held_back_text_as_empty_deltas(server):
    """As vllm_backend does, a streamed step whose text is held back still sends a response, with "" (steps that
    reach the response thread together are merged, so there may be fewer responses than steps)."""
    params = {"max_tokens": 12, "ignore_eos": True, "temperature": 0, "stop": [NEVER]}
    streamed = stream(server, SOON, text_input="The licence", stream=True, sampling_parameters=params)
    whole = stream(server, SOON, text_input="The licence", exclude_input_in_output=True, sampling_parameters=params)
    assert streamed.error is None and whole.error is None
    assert len(streamed.responses) >= 2  # the first step's response is never held back: ""
    assert streamed.texts[:-1] == [""] * (len(streamed.responses) - 1)
    assert streamed.text == whole.text and whole.text


def test_a_cancelled_request_is_logged_with_its_ids(server):
    client, events = open_stream(server, MODEL, request_id="client-id-7", text_input="Hi", stream=True,
                                 sampling_parameters={"ignore_eos": True, "max_tokens": 400})
    assert events.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 60
    while not (lines := log_lines(server, "'client-id-7'")):
        assert time.monotonic() < deadline, "no log line for the cancelled request"
        time.sleep(0.1)
    assert lines[0].startswith("I") and "request vllm_model-" in lines[0] and "was cancelled" in lines[0]
    assert "Triton request id 'client-id-7'" in lines[0]
