"""The tensor contracts (serving/shared/contracts/): model_repository's config.pbtxt files declare what the contract
owners say, read by Triton's own ModelConfig protobuf; and each contract's client half round-trips with the stub's
server half: a request a client encodes parses (stub/request.py) to the same prompt, sampling parameters and flags,
and a response the stub formats (stub/responses.py, stub/ensemble.py) decodes to the same texts, finish reasons,
counts and logprobs."""
import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2

from nanoserve.engine.outputs import PromptLogprobs, RequestOutput
from nanoserve.serving.shared.contracts import token_model, trtllm_scalars, vllm_text
from nanoserve.serving.shared.contracts.tensors import DATA_TYPES, TensorSpec
from nanoserve.serving.shared.engine_model import engine_mode
from nanoserve.serving.stub.ensemble import DetokenizeRequest, token_arrays
from nanoserve.serving.stub.request import parse_request
from nanoserve.serving.stub.responses import Stream, text_arrays

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
STEP_MODELS = {  # the ensemble's steps: model -> (inputs, outputs) as the contract declares them
    "preprocessing": (token_model.PREPROCESSING_INPUTS, token_model.PREPROCESSING_OUTPUTS),
    "nanoserve_tokens": (token_model.TOKEN_INPUTS, token_model.TOKEN_OUTPUTS),
    "postprocessing": (token_model.POSTPROCESSING_INPUTS, token_model.POSTPROCESSING_OUTPUTS),
}


def model_config(model: str):
    return text_format.Parse((REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def declared(tensors) -> dict[str, TensorSpec]:
    """A config's inputs or outputs as TensorSpecs (outputs have no `optional`)."""
    return {t.name: TensorSpec(t.name, model_config_pb2.DataType.Name(t.data_type), tuple(t.dims),
                               getattr(t, "optional", False)) for t in tensors}


# ---- config.pbtxt against the contract owners -----------------------------------------------------------
@pytest.mark.parametrize("model, inputs, outputs", [
    ("ensemble", token_model.ENSEMBLE_INPUTS, token_model.ENSEMBLE_OUTPUTS),
    ("preprocessing", token_model.PREPROCESSING_INPUTS, token_model.PREPROCESSING_OUTPUTS),
    ("postprocessing", token_model.POSTPROCESSING_INPUTS, token_model.POSTPROCESSING_OUTPUTS),
])
def test_a_config_declares_the_contracts_tensors(model, inputs, outputs):
    config = model_config(model)
    assert declared(config.input) == inputs
    assert declared(config.output) == outputs
    assert list(declared(config.input)) == list(inputs)  # in the contract's order too


@pytest.mark.parametrize("model, mode", [("nanoserve", "text"), ("nanoserve_tokens", "tokens")])
def test_the_engine_models_leave_their_tensors_to_the_backend(model, mode):
    """backend/model.py's auto_complete_config declares them from the contract (TEXT_*, TOKEN_* by mode)."""
    config = model_config(model)
    assert not config.input and not config.output
    assert engine_mode(json_format.MessageToDict(config, preserving_proto_field_name=True)) == mode


def fits(sent: TensorSpec, taken: TensorSpec) -> bool:
    """A tensor of `sent`'s type and dims is a valid value of `taken`."""
    dims_fit = len(sent.dims) == len(taken.dims) and all(t == -1 or s == t for s, t in zip(sent.dims, taken.dims))
    return sent.data_type == taken.data_type and dims_fit


def test_the_ensembles_steps_connect_as_their_contracts_declare():
    """Each step's inputs come from the ensemble's inputs or an earlier step's outputs, with the types and dims the
    step takes, every required one mapped; the last step yields the ensemble's outputs."""
    config = model_config("ensemble")
    available = dict(token_model.ENSEMBLE_INPUTS)  # ensemble tensor name -> the spec of what fills it
    consumed = set()
    assert [step.model_name for step in config.ensemble_scheduling.step] == list(STEP_MODELS)
    for step in config.ensemble_scheduling.step:
        inputs, outputs = STEP_MODELS[step.model_name]
        for key, value in step.input_map.items():
            assert key in inputs and value in available, (step.model_name, key, value)
            assert fits(available[value], inputs[key]), (step.model_name, key)
            consumed.add(value)
        required = {name for name, spec in inputs.items() if not spec.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        for key, value in step.output_map.items():
            assert key in outputs, (step.model_name, key)
            available[value] = outputs[key]
    assert consumed == set(available) - set(token_model.ENSEMBLE_OUTPUTS)  # nothing produced or taken for nothing
    for name, spec in token_model.ENSEMBLE_OUTPUTS.items():
        assert fits(available[name], spec), name


def test_the_ensemble_takes_the_text_models_inputs():
    """A client of the text model (client/stream.py, its accepted_flags) talks to the ensemble with the same tensors:
    every ensemble input but apply_chat_template is a text model input of the same type and dims."""
    for name, spec in token_model.ENSEMBLE_INPUTS.items():
        if name != "apply_chat_template":
            text = vllm_text.TEXT_INPUTS[name]
            assert (spec.data_type, spec.dims) == (text.data_type, text.dims), name


# ---- requests: the client half encodes, the stub parses -------------------------------------------------
FP32 = st.floats(-2, 2, width=32)
SAMPLING = {  # sampling_parameters JSON values that SamplingParams takes as they are
    "max_tokens": st.integers(1, 4096), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100), "seed": st.integers(0, 2 ** 63), "n": st.integers(1, 4),
    "ignore_eos": st.booleans(), "logprobs": st.none() | st.integers(0, 5), "min_p": st.floats(0, 1),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3), "repetition_penalty": st.floats(0.5, 2),
    "skip_special_tokens": st.booleans(), "prompt_logprobs": st.none() | st.integers(0, 3),
}
SCALARS = {  # TRT-LLM scalar tensors (FP32 values as float32 can hold them)
    "max_tokens": st.integers(1, 4096), "temperature": st.floats(0, 2, width=32),
    "top_p": st.floats(0.5, 1, width=32), "top_k": st.integers(-1, 100), "frequency_penalty": FP32,
    "presence_penalty": FP32, "seed": st.integers(0, 2 ** 64 - 1),
}
prompts = st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 2 ** 31 - 1), min_size=1, max_size=8)


@st.composite
def text_requests(draw) -> vllm_text.TextRequest:
    sampling = draw(st.fixed_dictionaries({}, optional=SAMPLING))
    scalars = draw(st.fixed_dictionaries({}, optional=SCALARS))
    flags = draw(st.dictionaries(st.sampled_from(vllm_text.FLAG_INPUTS), st.booleans()))
    stop_words = draw(st.none() | st.lists(st.text(max_size=5), max_size=3))
    return vllm_text.TextRequest(draw(prompts), draw(st.none() | st.just(sampling)), flags, scalars, stop_words)


def expected_sampling(request: vllm_text.TextRequest) -> dict:
    """What the parsed SamplingParams must hold: the JSON's values, each scalar tensor's (as its type holds it)
    over them, stop_words' non-empty words as `stop`."""
    values = dict(request.sampling_parameters or {})
    for name, value in request.scalars.items():
        values[name] = int(value) if trtllm_scalars.is_integer(trtllm_scalars.SCALAR_INPUTS[name]) else float(
            np.float32(value))
    if request.stop_words is not None:
        values["stop"] = [word for word in request.stop_words if word]
    return values


def check_parsed(request: vllm_text.TextRequest, parsed) -> None:
    assert parsed.prompt == request.prompt
    for name, value in expected_sampling(request).items():
        assert getattr(parsed.sampling_params, name) == value, name
    flags = {name: request.flags.get(name, False) for name in vllm_text.FLAG_INPUTS}
    assert (parsed.stream, parsed.exclude_input) == (flags["stream"], flags["exclude_input_in_output"])
    assert parsed.outputs == {name for name in vllm_text.OPTIONAL_OUTPUTS if flags[f"return_{name}"]}


@settings(max_examples=200, deadline=None)
@given(request=text_requests())
def test_an_encoded_request_parses_to_what_the_client_sent(request):
    arrays = request.arrays()
    for name, array in arrays.items():  # each tensor as the contract declares it
        spec = vllm_text.TEXT_INPUTS[name]
        assert array.dtype == DATA_TYPES[spec.data_type][1] and (spec.dims == (-1,) or array.shape == spec.dims)
    check_parsed(request, parse_request(arrays.get))
    if isinstance(request.prompt, list) and (request.sampling_parameters or {}).get("n", 1) == 1:
        check_parsed(request, parse_request(arrays.get, tokens=True))  # the token model takes the same request


@settings(max_examples=100, deadline=None)
@given(request=text_requests(), drain=st.floats(0, 60))
def test_a_generate_body_parses_to_what_the_client_sent(request, drain):
    """HTTP /generate: tritonserver turns each key naming an input into that tensor, the rest into the request's
    parameters (a control's, here, which stub/control.py takes before any parsing)."""
    body = request.generate_body({"drain_seconds": drain})
    arrays = {name: vllm_text.TEXT_INPUTS[name].array(value) for name, value in body.items()
              if name in vllm_text.TEXT_INPUTS}
    assert set(body) - set(arrays) == {"drain_seconds"}
    assert {name: array.tolist() for name, array in arrays.items()} == {
        name: array.tolist() for name, array in request.arrays().items()}
    check_parsed(request, parse_request(arrays.get))


def test_grpc_inputs_carry_the_arrays_with_the_declared_datatypes():
    request = vllm_text.TextRequest([3, 4, 5], {"max_tokens": 2}, {"stream": True}, {"temperature": 0.5}, ["x"])
    inputs = {i.name(): i for i in request.grpc_inputs()}
    assert list(inputs) == ["input_ids", "sampling_parameters", "stream", "temperature", "stop_words"]
    for name, array in request.arrays().items():
        assert inputs[name].datatype() == DATA_TYPES[vllm_text.TEXT_INPUTS[name].data_type][0]
        assert inputs[name].shape() == list(array.shape)


def test_control_bodies_carry_the_prompt_each_model_requires():
    assert vllm_text.control_body({"drain_seconds": 3}) == {"text_input": "", "drain_seconds": 3}
    assert token_model.control_body({"drain_seconds": 3}) == {"input_ids": [0], "drain_seconds": 3}
    assert [spec.name for spec in token_model.TOKEN_INPUTS.values() if not spec.optional] == list(
        token_model.control_arrays())


def test_unknown_flags_and_scalars_name_themselves():
    with pytest.raises(ValueError, match="^streaming: not a flag"):
        vllm_text.TextRequest("x", flags={"streaming": True}).arrays()
    with pytest.raises(ValueError, match="^max_new_tokens: not a scalar"):
        vllm_text.TextRequest("x", scalars={"max_new_tokens": 3}).arrays()


# ---- responses: the stub formats, the client half decodes ---------------------------------------------
@st.composite
def step_outputs(draw, n: int) -> list[RequestOutput]:
    """One output per sample of a request (n of them): its new tokens with their logprobs, finished or not."""
    outputs = []
    for index in range(n):
        ids = draw(st.lists(st.integers(0, 1000), max_size=4))
        logprobs = [{**{j: -1.5 for j in draw(st.lists(st.integers(0, 1000), max_size=2))}, i: -0.25} for i in ids]
        finished = draw(st.booleans())
        outputs.append(RequestOutput("r", ids, draw(st.text(max_size=6)), finished,
                                     draw(st.sampled_from(["stop", "length", "abort"])) if finished else None,
                                     7, len(ids), draw(st.floats(-50, 0, width=32)), logprobs,
                                     new_logprob_ranks=[1] * len(ids), index=index))
    return outputs


def check_arrays_match(arrays: dict, declared_outputs: dict) -> None:
    for name, array in arrays.items():
        spec = declared_outputs[name]
        assert array.dtype == DATA_TYPES[spec.data_type][1] and (spec.dims == (-1,) or array.shape == spec.dims)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 3), returned=st.sets(st.sampled_from(vllm_text.OPTIONAL_OUTPUTS)),
       top_n=st.none() | st.integers(0, 3), with_prompt_logprobs=st.booleans())
def test_a_formatted_response_decodes_to_what_the_stub_sent(data, n, returned, top_n, with_prompt_logprobs):
    flags = {"stream": True, **{f"return_{name}": True for name in returned}}
    sampling = {"n": n, "logprobs": top_n, "prompt_logprobs": 1 if with_prompt_logprobs else None}
    stream = Stream(None, parse_request(vllm_text.TextRequest("Hi", sampling, flags).arrays().get))
    outputs = data.draw(step_outputs(n))
    if with_prompt_logprobs:
        outputs[0].prompt_logprobs = PromptLogprobs([11, 12], [{11: -2.0}, {12: -3.0, 4: -0.5}], [5, 2])
    stream.add(outputs)
    arrays = text_arrays(stream, outputs, lambda token_id: f"<{token_id}>", send_empty=True)
    check_arrays_match(arrays, vllm_text.TEXT_OUTPUTS)
    response = vllm_text.decode_response(arrays.get)
    assert response.texts == [output.text_delta for output in outputs]
    reasons = [output.finish_reason for output in outputs]
    assert response.finish_reasons == (reasons if "finish_reason" in returned else [])
    assert response.final == ("finish_reason" in returned and all(output.finished for output in outputs))
    counts = [len(output.new_token_ids) for output in outputs]
    assert response.num_output_tokens == (counts if "num_output_tokens" in returned else [])
    assert response.num_input_tokens == (7 if "num_input_tokens" in returned else None)
    cumulative = [output.cumulative_logprob for output in outputs]
    assert response.cumulative_logprobs == (cumulative if "cumulative_logprob" in returned else [])
    if "logprobs" not in returned:
        assert response.logprobs == []
    for output, logprobs in zip(outputs, response.logprobs):
        if top_n is None:
            assert logprobs is None
            continue
        assert len(logprobs) == len(output.new_token_ids)
        for token_id, entry in zip(output.new_token_ids, logprobs):
            first = next(iter(entry))  # the sampled token first, as vllm_backend sends it
            assert first == str(token_id) and entry[first]["logprob"] == -0.25
            assert entry[first]["decoded_token"] == f"<{token_id}>"
    if "prompt_logprobs" in returned and with_prompt_logprobs:
        assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == 3
        assert response.prompt_logprobs[2]["12"]["logprob"] == -3.0
    elif "prompt_logprobs" not in returned:
        assert response.prompt_logprobs is None


@pytest.mark.parametrize("transport", ["grpc", "json"])
def test_decode_takes_grpc_arrays_and_generate_json(transport):
    """tritonclient's as_numpy gives arrays; /generate's JSON a value for a tensor of one element, else a list."""
    arrays = {"text_output": np.array([b"caf\xc3\xa9"], dtype=object), "finish_reason": np.array([b"None"], object),
              "num_output_tokens": np.array([2], np.uint32), "num_input_tokens": np.array([5], np.uint32),
              "logprobs": np.array([b"null"], object)}
    if transport == "json":
        arrays = {"text_output": "café", "finish_reason": "None", "num_output_tokens": 2, "num_input_tokens": 5,
                  "logprobs": "null"}
    response = vllm_text.decode_response(arrays.get)
    assert response == vllm_text.TextResponse(["café"], [None], [2], [], [None], 5, None)
    assert not response.final


@settings(max_examples=100, deadline=None)
@given(data=st.data(), stop=st.lists(st.text(min_size=1, max_size=3), max_size=2), returned=st.booleans())
def test_a_token_model_response_decodes_in_the_postprocessing(data, stop, returned):
    """The token model's arrays (stub/ensemble.py) as the postprocessing reads them (DetokenizeRequest)."""
    flags = {"stream": True, "return_num_output_tokens": returned}
    request = vllm_text.TextRequest([1, 2, 3], {"stop": stop}, flags)
    stream = Stream(None, parse_request(request.arrays().get, tokens=True))
    (output,) = data.draw(step_outputs(1))
    output.request_id = "engine-7"
    stream.add([output])
    arrays = token_arrays(stream, [output])
    if arrays is None:  # nothing new to send yet
        assert not output.new_token_ids and not output.finished
        return
    check_arrays_match(arrays, token_model.TOKEN_OUTPUTS)
    assert set(arrays) <= set(token_model.TOKEN_OUTPUTS)
    parsed = DetokenizeRequest.parse(arrays.get, max_ids=64)
    assert parsed.new_ids == output.new_token_ids and parsed.request_id == "engine-7"
    assert token_model.is_final(parsed.finish_reason) == output.finished
    assert parsed.params["stop"] == stop
    posted = {name: arrays[name] for name in token_model.POSTPROCESSING_INPUTS}  # what the ensemble maps on
    assert json.loads(posted["detokenize_params"][0]) == parsed.params
