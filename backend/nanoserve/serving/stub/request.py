"""The Triton tensor contract, and parsing + validation of one request (pure Python: no Triton import).

`get(name)` returns an input tensor as a numpy array, or None when the client did not send it. Every error is a
ValueError whose message starts with the offending field, e.g. "top_p: must be in (0, 1], got 2.0".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from nanoserve.coercion import optional_bool
from nanoserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

# return_<name> flags and the optional outputs they switch on
OPTIONAL_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens",
                    "prompt_logprobs")
# TRT-LLM-style scalar tensors (and Triton's OpenAI frontend): tensor name -> (Triton type, SamplingParams field)
SCALAR_INPUTS = {
    "max_tokens": ("TYPE_INT32", "max_tokens"),
    "temperature": ("TYPE_FP32", "temperature"),
    "top_p": ("TYPE_FP32", "top_p"),
    "top_k": ("TYPE_INT32", "top_k"),
    "frequency_penalty": ("TYPE_FP32", "frequency_penalty"),
    "presence_penalty": ("TYPE_FP32", "presence_penalty"),
    "seed": ("TYPE_UINT64", "seed"),
}
FLAG_INPUTS = ("stream", "exclude_input_in_output", *(f"return_{name}" for name in OPTIONAL_OUTPUTS))
# Size bounds, checked before anything is decoded or parsed. The text prompt's bound depends on the tokenizer
# and max_model_len: the engine thread checks it before tokenizing (engine/tokenize.py).
MAX_JSON_BYTES = 1 << 20  # sampling_parameters, and the request parameters
MAX_STOP_WORD_BYTES = 4 * MAX_STOP_STRING_CHARS  # a stop_words element (UTF-8: at most 4 bytes per character)


def _io(name, data_type, dims, optional=True):
    return {"name": name, "data_type": data_type, "dims": dims, "optional": optional}


_COMMON_INPUTS = [
    _io("sampling_parameters", "TYPE_STRING", [1]),
    *(_io(name, "TYPE_BOOL", [1]) for name in FLAG_INPUTS),
    *(_io(name, data_type, [1]) for name, (data_type, _) in SCALAR_INPUTS.items()),
    _io("stop_words", "TYPE_STRING", [-1]),
]
_COMMON_OUTPUTS = [
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},
]
# mode "text": the vllm_backend-compatible text model. The prompt is text_input, or (nanoserve's addition, as the
# token model names it) input_ids: token ids fed to the model as they are; exactly one of the two.
TEXT_INPUTS = [_io("text_input", "TYPE_STRING", [1]), _io("input_ids", "TYPE_INT32", [-1]), *_COMMON_INPUTS]
TEXT_OUTPUTS = [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}, *_COMMON_OUTPUTS]
# mode "tokens": the ensemble's token-level engine. Besides the new ids, each response carries the ids that
# precede them (see serving/stub/ensemble.py), so the postprocessing model can detokenize statelessly.
TOKEN_INPUTS = [_io("input_ids", "TYPE_INT32", [-1], optional=False), *_COMMON_INPUTS]
TOKEN_OUTPUTS = [
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "context_ids", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "detokenize_params", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "request_id", "data_type": "TYPE_STRING", "dims": [1]},  # what a cancel_request_id control names
    *_COMMON_OUTPUTS,
]


@dataclass
class ParsedRequest:
    prompt: str | list[int]
    sampling_params: SamplingParams
    stream: bool = False
    exclude_input: bool = False  # only matters when not streaming: streamed deltas never include the prompt
    outputs: frozenset[str] = field(default_factory=frozenset)  # optional outputs asked for (OPTIONAL_OUTPUTS)


Getter = Callable[[str], "np.ndarray | None"]


def parse_request(get: Getter, parameters: str = "", tokens: bool = False,
                  max_model_len: int | None = None) -> ParsedRequest:
    """One request's inputs -> ParsedRequest. `parameters` is the Triton request parameters JSON (HTTP
    "parameters": {...}); it holds the sampling parameters when there is no sampling_parameters tensor.
    max_model_len bounds input_ids before they are read."""
    prompt = _token_prompt(get, max_model_len) if tokens else text_model_prompt(get, max_model_len)
    tensor = get("sampling_parameters")
    if tensor is None:
        values = _request_parameters(parameters)
        flag_values = {name: values.pop(name) for name in FLAG_INPUTS if name in values}  # may come this way too
    else:
        values, flag_values = json_object("sampling_parameters", single("sampling_parameters", tensor)), {}
    flags = {name: _flag(get, name, flag_values.get(name)) for name in FLAG_INPUTS}
    params = _sampling_params({**values, **_scalar_tensors(get)})
    if tokens and params.n > 1:
        raise ValueError(f"n: the token model (the ensemble) generates one sequence per request, got {params.n}")
    # return_logprobs without a `logprobs` sampling parameter returns null, as vllm_backend does
    outputs = frozenset(name for name in OPTIONAL_OUTPUTS if flags[f"return_{name}"])
    return ParsedRequest(prompt, params, flags["stream"], flags["exclude_input_in_output"], outputs)


def _sampling_params(values: dict) -> SamplingParams:
    try:
        return SamplingParams.from_dict(values)
    except RecursionError:  # a string value parsed as JSON (e.g. stop_token_ids "[[[[...") nested too deeply
        for name, value in values.items():
            try:
                SamplingParams.from_dict({name: value})
            except RecursionError:
                raise ValueError(f"{name}: nested too deeply") from None
            except ValueError:
                pass
        raise ValueError("sampling_parameters: nested too deeply") from None


def name_prompt_input(message: str, input_name: str) -> str:
    """The engine's errors about the prompt start with "prompt:"; a client knows it as the input it sent."""
    return input_name + message[len("prompt"):] if message.startswith("prompt:") else message


def prompt_input(prompt: str | list[int]) -> str:
    """The input a text model's prompt came in."""
    return "text_input" if isinstance(prompt, str) else "input_ids"


def text_model_prompt(get: Getter, max_model_len: int | None) -> str | list[int]:
    """The text model's prompt: text_input's text, or input_ids' token ids."""
    if get("input_ids") is None:
        return parse_text_prompt(get)
    if get("text_input") is not None:
        raise ValueError("input_ids: give text_input or input_ids, not both")
    return _token_prompt(get, max_model_len)


def parse_text_prompt(get: Getter) -> str:
    value = utf8("text_input", single("text_input", required(get, "text_input")))
    if not value:
        raise ValueError("text_input: empty prompt")
    return value


def _token_prompt(get: Getter, max_model_len: int | None) -> list[int]:
    array = required(get, "input_ids")
    if array.dtype.kind not in "iu":
        raise ValueError(f"input_ids: expected integer token ids, got {array.dtype}")
    if max_model_len is not None and array.size >= max_model_len:
        raise ValueError(f"input_ids: {array.size} tokens leave no room to generate within max_model_len "
                         f"({max_model_len})")
    ids = array.reshape(-1).tolist()
    if not ids:
        raise ValueError("input_ids: empty prompt")
    return ids


def required(get: Getter, name: str) -> np.ndarray:
    array = get(name)
    if array is None:
        raise ValueError(f"{name}: missing required input")
    return array


def single(name: str, array: np.ndarray):
    if array.size != 1:
        raise ValueError(f"{name}: expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _request_parameters(text: str) -> dict:
    params = json_object("parameters", text)
    # Triton adds its own request parameters (e.g. triton_enable_empty_final_response): not sampling ones.
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def json_object(name: str, text: str | bytes) -> dict:
    if isinstance(text, (str, bytes)) and len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{name}: {len(text)} bytes, at most {MAX_JSON_BYTES}")
    text = utf8(name, text)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: invalid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise ValueError(f"{name}: invalid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _flag(get: Getter, name: str, fallback) -> bool:
    array = get(name)
    value = fallback if array is None else single(name, array)
    return optional_bool(name, value)


def _scalar_tensors(get: Getter) -> dict:
    values = {}
    for name, (data_type, param) in SCALAR_INPUTS.items():
        array = get(name)
        if array is None:
            continue
        value = single(name, array)
        integer = data_type != "TYPE_FP32"
        if integer and not isinstance(value, np.integer) or not integer and not isinstance(value, np.number):
            raise ValueError(f"{name}: expected {data_type[5:]}, got {np.asarray(value).dtype}")
        values[param] = int(value) if integer else float(value)
    stop_words = get("stop_words")
    if stop_words is not None:
        values["stop"] = _stop_words(stop_words)
    return values


def _stop_words(array: np.ndarray) -> list[str]:
    if array.size > MAX_STOP_STRINGS:
        raise ValueError(f"stop_words: at most {MAX_STOP_STRINGS} entries, got {array.size}")
    words = array.reshape(-1).tolist()
    if any(isinstance(w, (bytes, str)) and len(w) > MAX_STOP_WORD_BYTES for w in words):
        raise ValueError(f"stop_words: an entry has at most {MAX_STOP_STRING_CHARS} characters")
    return [utf8("stop_words", w) for w in words if w]


def utf8(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not valid UTF-8 (byte 0x{value[e.start]:02x} at position {e.start})") from None
    except AttributeError:
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}") from None
