"""The text model's request contract from outside, through a real tritonserver: a prompt of megabytes is
rejected untokenized without the stub's memory growing, and a property-based fuzz over tensor names, dtypes,
shapes and sampling values gets, for every request, an error naming a field or a valid completion, after which
the server is ready with the same stub processes and no KV block in use."""
import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serving_utils import TIMEOUT, http_post, is_ready, metrics_when, stream, triton
from triton_server import group_members

from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.shared.contracts.vllm_text import TEXT_INPUTS

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "nanoserve"
ENGINE_ARGS = {"device": "cpu", "kvcache_block_size": 16, "num_kvcache_blocks": 256}  # max_model_len 2048


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with triton(tmp_path_factory.mktemp("contract"), qwen3_dir, [MODEL], **ENGINE_ARGS) as server:
        yield server


def stub_pids(server) -> list[int]:
    return sorted(pid for pid in group_members(server.process.pid) if pid != server.process.pid)


def rss_bytes(pids) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def test_a_multi_megabyte_prompt_is_rejected_untokenized_and_memory_stays_flat(server):
    huge = "word " * 1_000_000  # 5 MB: tokenizing it took ~1 s and ~60 MB of the stub's memory, each time
    expected = "text_input: 5000000 bytes of text cannot fit max_model_len"

    def send() -> str:
        status, body = http_post(server, f"/v2/models/{MODEL}/generate",
                                 {"text_input": huge, "parameters": {"max_tokens": 4}})
        assert status == 400, body  # INVALID_ARG
        return json.loads(body)["error"]

    first = send()  # also sizes the stub's shared-memory pool for inputs this large
    assert first.startswith(expected) and first.endswith("rejected without tokenizing"), first
    grpc = stream(server, MODEL, text_input=huge, stream=True)
    assert grpc.error is not None and grpc.error.message().startswith(expected), grpc.error
    before = rss_bytes(stub_pids(server))
    for _ in range(10):
        assert send().startswith(expected)
    assert rss_bytes(stub_pids(server)) - before < 128 << 20
    assert is_ready(server)


# ---- the fuzz ---------------------------------------------------------------------------------------------
DECLARED = {i.name: ("BYTES" if i.data_type == "TYPE_STRING" else i.data_type[5:], list(i.dims))
            for i in TEXT_INPUTS.values()}
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
         "FP32": np.float32, "FP16": np.float16}
INT_RANGES = {"INT32": (-2 ** 31, 2 ** 31 - 1), "INT64": (-2 ** 63, 2 ** 63 - 1), "UINT64": (0, 2 ** 64 - 1)}
SAMPLING_KEYS = [f.name for f in SamplingParams.__dataclass_fields__.values()] + ["bogus", "lora_name", ""]
EDGE_NUMBERS = [0, 1, -1, 2, 0.5, 1e-9, 100.5, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30, 1e308, float("nan"),
                float("inf"), -float("inf")]

json_leaf = (st.sampled_from(EDGE_NUMBERS) | st.integers(-5, 40) | st.floats(-3, 3) | st.booleans() | st.none()
             | st.text(max_size=8) | st.sampled_from(["32", "0.5", "true", "null", "[1, 2]", "[[["]))
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=4), inner, max_size=2), max_leaves=6)


@st.composite
def sampling_json(draw) -> str:
    values = draw(st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=4))
    values.setdefault("max_tokens", draw(st.integers(1, 6)))  # keep valid completions short
    text = json.dumps(values)  # NaN and Infinity come out as JSON's extensions, which Python's parser takes
    return draw(st.sampled_from([text, text, text, text[:-1], "[" * 50, "not json"]))


def values_of(dtype: str, name: str, shape: tuple, draw):
    size = int(np.prod(shape))
    if dtype == "BYTES":
        if name == "sampling_parameters":
            items = [draw(sampling_json()).encode() for _ in range(size)]
        else:
            items = draw(st.lists(st.text(min_size=1, max_size=12).map(str.encode), min_size=size, max_size=size))
        return np.array(items, dtype=np.object_).reshape(shape)
    if dtype == "BOOL":
        return np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), np.bool_).reshape(shape)
    if dtype in INT_RANGES:
        lo, hi = INT_RANGES[dtype]
        ints = st.sampled_from([v for v in (-1, 0, 1, 4, 2 ** 31 - 1, 2 ** 32, 2 ** 63, lo, hi) if lo <= v <= hi])
        return np.array(draw(st.lists(ints, min_size=size, max_size=size)), NUMPY[dtype]).reshape(shape)
    floats = st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5, 1e-7, 60000.0, float("nan"), float("inf")])
    return np.array(draw(st.lists(floats, min_size=size, max_size=size)), NUMPY[dtype]).reshape(shape)


CORRUPTIONS = ["dtype", "shape", "unknown name", "no text_input", "text_input bytes"]


@st.composite
def requests(draw) -> tuple[dict, dict]:
    """({input name: numpy array}, request parameters): well-formed tensors with fuzzed values, or (one time in
    three) one tensor-level corruption."""
    names = sorted(draw(st.sets(st.sampled_from(sorted(DECLARED)), max_size=4)) | {"text_input"})
    if draw(st.booleans()):
        names = sorted(set(names) | {"sampling_parameters"})
    inputs = {}
    for name in names:
        dtype, dims = DECLARED[name]
        inputs[name] = values_of(dtype, name, tuple(draw(st.integers(0, 3)) if d == -1 else d for d in dims), draw)
    corruption = draw(st.sampled_from(CORRUPTIONS + [None] * 10))
    victim = draw(st.sampled_from(names))
    if corruption == "dtype":
        dtype = draw(st.sampled_from(sorted(set(NUMPY) - {DECLARED[victim][0]})))
        inputs[victim] = values_of(dtype, victim, inputs[victim].shape, draw)
    elif corruption == "shape":
        shape = tuple(draw(st.lists(st.integers(0, 2), max_size=2)))
        inputs[victim] = values_of(DECLARED[victim][0], victim, shape, draw)
    elif corruption == "unknown name":
        inputs[draw(st.sampled_from(["texts_input", "lora", "input_ids"]))] = inputs[victim]
    elif corruption == "no text_input":
        del inputs["text_input"]
    elif corruption == "text_input bytes":
        inputs["text_input"] = np.array([draw(st.binary(max_size=6))], dtype=np.object_)
    parameters = draw(st.dictionaries(st.sampled_from(SAMPLING_KEYS + ["stream", "return_logprobs"]),
                                      st.booleans() | st.integers(-3, 2 ** 40) | st.text(max_size=6), max_size=3))
    return inputs, parameters


def send(server, inputs: dict, parameters: dict):
    """One request on its own gRPC stream: ("error", message) or ("ok", [responses])."""
    tensors = []
    for name, array in inputs.items():
        dtype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client = grpcclient.InferenceServerClient(server.url_grpc)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(MODEL, tensors, parameters=parameters or None, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = events.get(timeout=TIMEOUT)
            if error is not None:
                return "error", error.message()
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "ok", responses
    finally:
        client.stop_stream()
        client.close()


def named_fields(inputs: dict, parameters: dict) -> set[str]:
    names = set(inputs) | set(parameters) | {"text_input", "parameters"}
    for array in inputs.values():  # the keys of any JSON object sent
        for item in array.reshape(-1).tolist() if array.dtype == np.object_ else []:
            try:
                value = json.loads(item)
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
            names |= set(value) if isinstance(value, dict) else set()
    return {name for name in names if name}


def as_request(text_input: str, sampling_parameters: dict) -> tuple[dict, dict]:
    return {"text_input": np.array([text_input.encode()], dtype=np.object_),
            "sampling_parameters": np.array([json.dumps(sampling_parameters).encode()], dtype=np.object_)}, {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
@example(request=as_request("x", {"top_k": 2 ** 63, "max_tokens": 4, "temperature": 1}))  # failed every stream
@example(request=as_request("x", {"seed": 10 ** 100, "max_tokens": 4}))
@example(request=as_request("x", {"stop_token_ids": [10 ** 6], "min_tokens": 2, "max_tokens": 4}))
def fuzz_case(server, request):
    inputs, parameters = request
    outcome, detail = send(server, inputs, parameters)
    if outcome == "error":
        assert "internal" not in detail.lower() and "Traceback" not in detail, detail
        assert any(name in detail for name in named_fields(inputs, parameters)), (detail, inputs, parameters)
        return
    for response in detail:
        text = response.as_numpy("text_output")
        if text is not None:
            [item.decode("utf-8") for item in text.reshape(-1).tolist()]


def test_fuzzed_requests_get_an_error_naming_a_field_or_a_completion(server):
    stubs = stub_pids(server)
    fuzz_case(server)
    assert is_ready(server) and stub_pids(server) == stubs
    values = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 0)
    assert values["nanoserve_kv_blocks_used"] == 0 and values["nanoserve_requests_waiting"] == 0
