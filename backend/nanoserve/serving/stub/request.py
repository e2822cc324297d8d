"""Parsing + validation of one request to the text or the token model (pure Python: no Triton import); the
tensors are the contracts' (serving/shared/contracts/vllm_text.py, trtllm_scalars.py, token_model.py).

`get(name)` returns an input tensor as a numpy array, or None when the client did not send it. Every error is a
RequestError naming the offending field, e.g. "top_p: must be in (0, 1], got 2.0".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from nanoserve.coercion import optional_bool
from nanoserve.errors import RequestError
from nanoserve.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from nanoserve.serving.shared.contracts.trtllm_scalars import SCALAR_INPUTS, STOP_WORDS, is_integer
from nanoserve.serving.shared.contracts.vllm_text import (FLAG_INPUTS, INPUT_IDS, OPTIONAL_OUTPUTS,
                                                          SAMPLING_PARAMETERS, TEXT_INPUT)

# Size bounds, checked before anything is decoded or parsed. The text prompt's bound depends on the tokenizer
# and max_model_len: the engine thread checks it before tokenizing (engine/tokenize.py).
MAX_JSON_BYTES = 1 << 20  # sampling_parameters, and the request parameters
MAX_STOP_WORD_BYTES = 4 * MAX_STOP_STRING_CHARS  # a stop_words element (UTF-8: at most 4 bytes per character)


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
    tensor = get(SAMPLING_PARAMETERS.name)
    if tensor is None:
        values = _request_parameters(parameters)
        flag_values = {name: values.pop(name) for name in FLAG_INPUTS if name in values}  # may come this way too
    else:
        values, flag_values = json_object(SAMPLING_PARAMETERS.name, single(SAMPLING_PARAMETERS.name, tensor)), {}
    flags = {name: _flag(get, name, flag_values.get(name)) for name in FLAG_INPUTS}
    params = SamplingParams.from_dict({**values, **_scalar_tensors(get)})
    if tokens and params.n > 1:
        raise RequestError("n", f"the token model (the ensemble) generates one sequence per request, got {params.n}")
    # return_logprobs without a `logprobs` sampling parameter returns null, as vllm_backend does
    outputs = frozenset(name for name in OPTIONAL_OUTPUTS if flags[f"return_{name}"])
    return ParsedRequest(prompt, params, flags["stream"], flags["exclude_input_in_output"], outputs)


def text_model_prompt(get: Getter, max_model_len: int | None) -> str | list[int]:
    """The text model's prompt: text_input's text, or input_ids' token ids."""
    if get(INPUT_IDS.name) is None:
        return parse_text_prompt(get)
    if get(TEXT_INPUT.name) is not None:
        raise RequestError("input_ids", "give text_input or input_ids, not both")
    return _token_prompt(get, max_model_len)


def parse_text_prompt(get: Getter) -> str:
    value = utf8(TEXT_INPUT.name, single(TEXT_INPUT.name, required(get, TEXT_INPUT.name)))
    if not value:
        raise RequestError("text_input", "empty prompt")
    return value


def _token_prompt(get: Getter, max_model_len: int | None) -> list[int]:
    array = required(get, INPUT_IDS.name)
    if array.dtype.kind not in "iu":
        raise RequestError("input_ids", f"expected integer token ids, got {array.dtype}")
    if max_model_len is not None and array.size >= max_model_len:
        raise RequestError("input_ids", f"{array.size} tokens leave no room to generate within max_model_len "
                         f"({max_model_len})")
    ids = array.reshape(-1).tolist()
    if not ids:
        raise RequestError("input_ids", "empty prompt")
    return ids


def required(get: Getter, name: str) -> np.ndarray:
    array = get(name)
    if array is None:
        raise RequestError(name, "missing required input")
    return array


def single(name: str, array: np.ndarray):
    if array.size != 1:
        raise RequestError(name, f"expected one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _request_parameters(text: str) -> dict:
    params = json_object("parameters", text)
    # Triton adds its own request parameters (e.g. triton_enable_empty_final_response): not sampling ones.
    return {k: v for k, v in params.items() if not k.startswith("triton_")}


def json_object(name: str, text: str | bytes) -> dict:
    if isinstance(text, (str, bytes)) and len(text) > MAX_JSON_BYTES:
        raise RequestError(name, f"{len(text)} bytes, at most {MAX_JSON_BYTES}")
    text = utf8(name, text)
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(name, f"invalid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise RequestError(name, "invalid JSON (nested too deeply)") from None
    if not isinstance(value, dict):
        raise RequestError(name, f"expected a JSON object, got {type(value).__name__}")
    return value


def _flag(get: Getter, name: str, fallback) -> bool:
    array = get(name)
    value = fallback if array is None else single(name, array)
    return optional_bool(name, value)


def _scalar_tensors(get: Getter) -> dict:
    values = {}
    for name, spec in SCALAR_INPUTS.items():  # each sets the SamplingParams field of its name
        array = get(name)
        if array is None:
            continue
        value = single(name, array)
        integer = is_integer(spec)
        if integer and not isinstance(value, np.integer) or not integer and not isinstance(value, np.number):
            raise RequestError(name, f"expected {spec.data_type[5:]}, got {np.asarray(value).dtype}")
        values[name] = int(value) if integer else float(value)
    stop_words = get(STOP_WORDS.name)
    if stop_words is not None:
        values["stop"] = _stop_words(stop_words)
    return values


def _stop_words(array: np.ndarray) -> list[str]:
    if array.size > MAX_STOP_STRINGS:
        raise RequestError("stop_words", f"at most {MAX_STOP_STRINGS} entries, got {array.size}")
    words = array.reshape(-1).tolist()
    if any(isinstance(w, (bytes, str)) and len(w) > MAX_STOP_WORD_BYTES for w in words):
        raise RequestError("stop_words", f"an entry has at most {MAX_STOP_STRING_CHARS} characters")
    return [utf8(STOP_WORDS.name, w) for w in words if w]


def utf8(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(name, f"not valid UTF-8 (byte 0x{value[e.start]:02x} at position {e.start})") from None
    except AttributeError:
        raise RequestError(name, f"expected a string, got {type(value).__name__}") from None
