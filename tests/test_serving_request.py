"""Parsing and validation of Triton request tensors (no server): every bad input names its field."""
import json

import numpy as np
import pytest

from nanoserve.serving.request import (OPTIONAL_OUTPUTS, SCALAR_INPUTS, TEXT_INPUTS, TEXT_OUTPUTS, TOKEN_INPUTS,
                                       parse_request)


def text(value) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def getter(**tensors):
    return lambda name: tensors.get(name)


def parse(parameters="", tokens=False, **tensors):
    return parse_request(getter(**tensors), parameters, tokens=tokens)


def error_of(parameters="", tokens=False, **tensors) -> str:
    with pytest.raises(ValueError) as info:
        parse(parameters, tokens, **tensors)
    return str(info.value)


def test_defaults_never_truncate_silently():
    req = parse(text_input=text("Hello"))
    assert req.prompt == "Hello"
    assert req.sampling_params.max_tokens is None  # the engine's default: until a stop or max_model_len
    assert not req.stream and not req.exclude_input and req.outputs == frozenset()


def test_sampling_parameters_tensor_accepts_string_values():
    sp = json.dumps({"max_tokens": "32", "min_tokens": "4", "temperature": "0", "stop": ["\n\n"],
                     "ignore_eos": "true"})
    req = parse(text_input=text("Hi"), sampling_parameters=text(sp), stream=np.array([True]),
                exclude_input_in_output=np.array([True]))
    params = req.sampling_params
    assert (params.max_tokens, params.min_tokens, params.temperature) == (32, 4, 0.0)
    assert params.stop == ["\n\n"] and params.ignore_eos
    assert req.stream and req.exclude_input


def test_request_parameters_used_without_tensor_and_flags_taken_out():
    parameters = json.dumps({"max_tokens": 7, "top_p": "0.5", "stream": "true", "return_finish_reason": True,
                             "triton_enable_empty_final_response": True})
    req = parse(parameters, text_input=text("Hi"))
    assert req.sampling_params.max_tokens == 7 and req.sampling_params.top_p == 0.5
    assert req.stream and req.outputs == {"finish_reason"}


def test_sampling_parameters_tensor_wins_over_request_parameters():
    req = parse('{"max_tokens": 99}', text_input=text("Hi"), sampling_parameters=text('{"max_tokens": 3}'))
    assert req.sampling_params.max_tokens == 3


def test_trtllm_scalar_tensors():
    req = parse(text_input=text("Hi"), max_tokens=np.array([5], np.int32), temperature=np.array([0.5], np.float32),
                top_p=np.array([0.9], np.float32), top_k=np.array([40], np.int32), seed=np.array([7], np.uint64),
                frequency_penalty=np.array([0.25], np.float32), presence_penalty=np.array([-0.5], np.float32),
                stop_words=np.array([b"</s>", b"", "\u00e9t\u00e9".encode()], dtype=object))
    p = req.sampling_params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed) == (5, 0.5, 40, 7)
    assert p.top_p == pytest.approx(0.9) and p.frequency_penalty == 0.25 and p.presence_penalty == -0.5
    assert p.stop == ["</s>", "\u00e9t\u00e9"]


def test_return_flags_select_outputs_and_logprobs_default_to_sampled_token():
    flags = {f"return_{name}": np.array([True]) for name in OPTIONAL_OUTPUTS}
    req = parse(text_input=text("Hi"), **flags)
    assert req.outputs == set(OPTIONAL_OUTPUTS)
    assert req.sampling_params.logprobs == 0
    req = parse(text_input=text("Hi"), sampling_parameters=text('{"logprobs": 3}'), **flags)
    assert req.sampling_params.logprobs == 3


def test_token_prompt():
    req = parse(tokens=True, input_ids=np.array([[5, 6, 7]], np.int64))
    assert req.prompt == [5, 6, 7]
    assert "input_ids: empty" in error_of(tokens=True, input_ids=np.array([], np.int32))
    assert error_of(tokens=True).startswith("input_ids: missing")


@pytest.mark.parametrize("tensors, parameters, field", [
    ({}, "", "text_input"),
    ({"text_input": text("")}, "", "text_input"),
    ({"text_input": text(b"caf\xc3")}, "", "text_input"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "", "text_input"),
    ({"sampling_parameters": text("{max_tokens: 3")}, "", "sampling_parameters"),
    ({"sampling_parameters": text("[1, 2]")}, "", "sampling_parameters"),
    ({"sampling_parameters": text('{"max_token": 3}')}, "", "max_token"),
    ({"sampling_parameters": text('{"max_tokens": "many"}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": [3]}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": -1}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": 0}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"top_p": 1.5}')}, "", "top_p"),
    ({"sampling_parameters": text('{"top_p": "0"}')}, "", "top_p"),
    ({"sampling_parameters": text('{"temperature": "hot"}')}, "", "temperature"),
    ({"max_tokens": np.array([-3], np.int32)}, "", "max_tokens"),
    ({"max_tokens": np.array([2.0], np.float32)}, "", "max_tokens"),
    ({"temperature": np.array([b"x"], dtype=object)}, "", "temperature"),
    ({"top_p": np.array([0.0], np.float32)}, "", "top_p"),
    ({"stream": np.array([b"yes"], dtype=object)}, "", "stream"),
    ({"stop_words": np.array([b"\xff"], dtype=object)}, "", "stop_words"),
    ({}, "{not json", "parameters"),
    ({}, '{"unknown_knob": 1}', "unknown_knob"),
    ({}, '{"stream": "maybe"}', "stream"),
])
def test_bad_input_names_the_field(tensors, parameters, field):
    if field != "text_input":
        tensors = {"text_input": text("Hello"), **tensors}
    assert error_of(parameters, **tensors).startswith(f"{field}:")


def test_contract_tables_match_design():
    inputs = {i["name"]: i for i in TEXT_INPUTS}
    assert not inputs["text_input"]["optional"] and inputs["text_input"]["data_type"] == "TYPE_STRING"
    assert all(i["optional"] for name, i in inputs.items() if name != "text_input")
    for name in ("stream", "exclude_input_in_output", *(f"return_{o}" for o in OPTIONAL_OUTPUTS)):
        assert inputs[name]["data_type"] == "TYPE_BOOL"
    assert set(SCALAR_INPUTS) <= set(inputs) and inputs["stop_words"]["dims"] == [-1]
    outputs = {o["name"]: (o["data_type"], o["dims"]) for o in TEXT_OUTPUTS}
    assert outputs == {"text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
                       "cumulative_logprob": ("TYPE_FP32", [-1]), "logprobs": ("TYPE_STRING", [-1]),
                       "num_input_tokens": ("TYPE_UINT32", [1]), "num_output_tokens": ("TYPE_UINT32", [-1])}
    assert {i["name"] for i in TOKEN_INPUTS} == set(inputs) - {"text_input"} | {"input_ids"}
