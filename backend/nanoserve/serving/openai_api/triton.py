"""One request to a text model over gRPC streaming (tritonclient.grpc.aio), with vllm_backend's tensors
(serving/shared/contracts/vllm_text.py), and its responses as Chunks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

import tritonclient.grpc.aio as grpcaio

from nanoserve.errors import RequestError
from nanoserve.serving.shared.contracts.vllm_text import (INPUT_IDS, TEXT_INPUT, TextRequest, decode_error,
                                                          decode_response)

PROMPT_PARAMS = {TEXT_INPUT.name: "prompt", INPUT_IDS.name: "prompt"}  # the API's name of the inputs a prompt takes


@dataclass
class Chunk:
    """One Triton response: per sequence index, the text delta, finish reason (None until it ends), tokens
    and their logprobs (vllm_backend's format; None when not asked). `final`: every sequence has ended."""
    texts: list[str]
    finish_reasons: list[str | None] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    logprobs: list[list[dict] | None] = field(default_factory=list)
    num_input_tokens: int | None = None
    final: bool = False
    prompt_logprobs: list | None = None  # vllm_backend's prompt_logprobs (None first), in the response carrying them
    prompt_index: int = 0  # which of the API request's prompts this is about


def request_inputs(prompt: str | list[int], sampling_parameters: dict, stream: bool, logprobs: bool,
                   prompt_logprobs: bool = False) -> list:
    """What the API asks of the text model: the sampling_parameters JSON, and the outputs it reports."""
    flags = {"stream": stream, "exclude_input_in_output": True, "return_finish_reason": True,
             "return_num_input_tokens": True, "return_num_output_tokens": True, "return_logprobs": logprobs,
             "return_prompt_logprobs": prompt_logprobs}
    return TextRequest(prompt, sampling_parameters, flags).grpc_inputs()


def parse_response(result) -> Chunk:
    response = decode_response(result.as_numpy)
    return Chunk(response.texts, response.finish_reasons, response.num_output_tokens, response.logprobs,
                 response.num_input_tokens, response.final, response.prompt_logprobs)


async def generate(client: grpcaio.InferenceServerClient, model: str, inputs: list, request_id: str,
                   prompt_index: int = 0, names: dict[str, str] | None = None) -> AsyncIterator[Chunk]:
    """The request's responses until its last one: the one where every sequence has its finish reason (the
    flags-only FINAL that may follow is not asked for: tritonclient 2.69 and newer refuse the parameter that asks
    for it). Leaving before the last response (the HTTP client went away: the consumer is cancelled or closes
    this generator) cancels the gRPC call, and with it the request in the engine. A Triton error is raised as
    the RequestError it reports, named as the API names its fields (triton_error)."""
    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id}

    responses = client.stream_infer(requests())
    ended = False  # the request's last response came: tritonserver then ends the stream itself
    try:
        async for result, error in responses:
            if error is not None:
                ended = True
                raise triton_error(error.message(), names)
            chunk = parse_response(result)
            chunk.prompt_index, ended = prompt_index, chunk.final
            yield chunk
            if ended:
                return
    finally:
        if not ended:  # cancelling a stream that has ended can leave tritonserver holding the model at shutdown
            responses.cancel()


def triton_error(message: str, names: dict[str, str] | None = None) -> RequestError:
    """A Triton error's text (decode_error) with its field as the API names it: the prompt's inputs are "prompt", a
    sampling parameter is what `names` (SamplingRequest.sampling_values) says, e.g. logprobs -> top_logprobs."""
    return decode_error(message).renamed({**PROMPT_PARAMS, **(names or {})})
