"""vllm_backend's text model: the prompt in text_input (or, nanoserve's addition, token ids in input_ids), the
sampling_parameters JSON, TRT-LLM's scalars (trtllm_scalars.py) and boolean flags in; text_output and the outputs
the return_* flags ask for out, one entry per sequence of the request (n of them).

The stub parses a request with stub/request.py and formats its responses with stub/responses.py; a client builds
a request with `TextRequest`, reads a response with `decode_response` and an error with `decode_error`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from nanoserve.errors import ErrorKind, RequestError
from nanoserve.serving.shared.contracts import trtllm_scalars
from nanoserve.serving.shared.contracts.tensors import TensorSpec, grpc_inputs, json_values, specs, values_of

# return_<name> flags and the optional outputs they switch on
OPTIONAL_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens",
                    "prompt_logprobs")
FLAG_INPUTS = ("stream", "exclude_input_in_output", *(f"return_{name}" for name in OPTIONAL_OUTPUTS))
PENDING = ("None", "")  # a finish_reason before the sequence has ended

TEXT_INPUT = TensorSpec("text_input", "TYPE_STRING", (1,), optional=True)
INPUT_IDS = TensorSpec("input_ids", "TYPE_INT32", (-1,), optional=True)
SAMPLING_PARAMETERS = TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True)
COMMON_INPUTS = specs(
    SAMPLING_PARAMETERS,
    *(TensorSpec(name, "TYPE_BOOL", (1,), optional=True) for name in FLAG_INPUTS),
    *trtllm_scalars.INPUTS.values(),
)
COMMON_OUTPUTS = specs(
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),
    TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,)),
    TensorSpec("logprobs", "TYPE_STRING", (-1,)),
    TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,)),
    TensorSpec("prompt_logprobs", "TYPE_STRING", (1,)),
)
# exactly one of text_input and input_ids (the parser checks it)
TEXT_INPUTS = specs(TEXT_INPUT, INPUT_IDS, *COMMON_INPUTS.values())
TEXT_OUTPUTS = specs(TensorSpec("text_output", "TYPE_STRING", (-1,)), *COMMON_OUTPUTS.values())


def prompt_input(prompt: str | list[int]) -> str:
    """The input a prompt travels in: text in text_input, token ids in input_ids."""
    return TEXT_INPUT.name if isinstance(prompt, str) else INPUT_IDS.name


# ---- the client half -------------------------------------------------------------------------------------
@dataclass
class TextRequest:
    """A request as a client sends it; what it leaves None or empty is not sent (the server's defaults apply)."""
    prompt: str | list[int]
    sampling_parameters: dict | None = None  # sent as the sampling_parameters JSON
    flags: dict[str, bool] = field(default_factory=dict)  # FLAG_INPUTS
    scalars: dict[str, int | float] = field(default_factory=dict)  # trtllm_scalars.SCALAR_INPUTS
    stop_words: list[str] | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        unknown = sorted(set(self.flags) - set(FLAG_INPUTS))
        if unknown:
            raise ValueError(f"{unknown[0]}: not a flag of the text model (known: {', '.join(FLAG_INPUTS)})")
        name = prompt_input(self.prompt)
        arrays = {name: TEXT_INPUTS[name].array(self.prompt)}
        if self.sampling_parameters is not None:
            arrays[SAMPLING_PARAMETERS.name] = SAMPLING_PARAMETERS.array(json.dumps(self.sampling_parameters))
        arrays.update({flag: COMMON_INPUTS[flag].array(bool(value)) for flag, value in self.flags.items()})
        return {**arrays, **trtllm_scalars.scalar_arrays(self.scalars, self.stop_words)}

    def grpc_inputs(self) -> list:
        """tritonclient.grpc (and .grpc.aio) InferInputs."""
        return grpc_inputs(self.arrays(), TEXT_INPUTS)

    def generate_body(self, parameters: dict | None = None) -> dict:
        """The JSON of HTTP /generate and /generate_stream; `parameters` become Triton request parameters."""
        return {**json_values(self.arrays(), TEXT_INPUTS), **(parameters or {})}


def control_body(parameters: dict) -> dict:
    """An HTTP /generate body for a control request (shared/engine_model.py): the prompt Triton requires, unread."""
    return TextRequest("").generate_body(parameters)


def accepted_flags(flags: dict[str, bool], input_names) -> dict[str, bool]:
    """The flags a model declares among its inputs (its metadata's names): the ensemble takes only `stream`."""
    names = set(input_names)
    return {name: value for name, value in flags.items() if name in names}


@dataclass
class TextResponse:
    """One response, per sequence index: its text (a delta when streamed), finish reason (None until it ends),
    tokens, cumulative logprob and logprobs (vllm_backend's format; None when not asked); empty lists for outputs
    the response does not carry."""
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    cumulative_logprobs: list[float] = field(default_factory=list)
    logprobs: list[list[dict] | None] = field(default_factory=list)
    num_input_tokens: int | None = None
    prompt_logprobs: list | None = None  # None first, then per prompt token as logprobs; in one response only

    @property
    def final(self) -> bool:
        """Every sequence has its finish reason."""
        return bool(self.finish_reasons) and all(reason is not None for reason in self.finish_reasons)


def decode_response(get) -> TextResponse:
    """get(output name) -> a tritonclient result's array (`result.as_numpy`), an HTTP /generate JSON value
    (`event.get`), or None when the response does not carry it."""
    def strings(name: str) -> list[str]:
        return [str(v) for v in values_of(get(name)) or []]

    def numbers(name: str, kind=int) -> list:
        return [kind(v) for v in values_of(get(name)) or []]

    num_input, prompt_logprobs = numbers("num_input_tokens"), strings("prompt_logprobs")
    return TextResponse(strings("text_output"),
                        [None if reason in PENDING else reason for reason in strings("finish_reason")],
                        numbers("num_output_tokens"), numbers("cumulative_logprob", float),
                        [json.loads(entry) for entry in strings("logprobs")],
                        num_input[0] if num_input else None,
                        json.loads(prompt_logprobs[0]) if prompt_logprobs else None)


# A Triton error without a field: its kind by its words (tritonserver's, the stub's: stub/responses.py, ...)
MARKERS = {ErrorKind.INTERNAL: ("Traceback",),
           ErrorKind.UNAVAILABLE: ("is being unloaded", "has no available versions", "the model is unavailable",
                                   "the server is shutting down"),
           ErrorKind.NOT_FOUND: ("unknown model", "is not found")}


def decode_error(message: str) -> RequestError:
    """A Triton error's text (gRPC streams carry no code) as the RequestError it reports; str() gives it back."""
    error = RequestError.parse(message)
    kind = next((kind for kind, words in MARKERS.items() if any(w in message for w in words)), error.kind)
    kind = ErrorKind.INTERNAL if message.startswith("internal error") else kind
    return error if error.field else RequestError(None, message, kind)
