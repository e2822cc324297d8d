"""The ensemble (model_repository/ensemble): text in, streamed text out, through three steps

    preprocessing      text_input (+ apply_chat_template) -> input_ids
    the token model    input_ids -> output_ids, with the ids before them (context_ids), finish_reason, the
                       detokenize_params and the engine's request_id in every response (decoupled)
    postprocessing     output_ids + context_ids + finish_reason (+ detokenize_params, request_id) -> text_output

The token model takes the text model's sampling inputs and flags and returns its optional outputs
(vllm_text.py); the stub formats its responses in stub/ensemble.py, where the postprocessing also reads them.
The ensemble's own inputs are the text model's that it passes on; its config.pbtxt is tested against this module.
"""
from __future__ import annotations

import numpy as np

from nanoserve.serving.shared.contracts import trtllm_scalars
from nanoserve.serving.shared.contracts.tensors import TensorSpec, specs
from nanoserve.serving.shared.contracts.vllm_text import (COMMON_INPUTS, COMMON_OUTPUTS, INPUT_IDS, PENDING,
                                                          SAMPLING_PARAMETERS)

FINISH_REASONS = (*PENDING, "stop", "length", "abort")  # "None" (or "") before the last response
DETOKENIZE_KEYS = ("skip_special_tokens", "stop", "include_stop_str_in_output")  # detokenize_params' JSON keys

OUTPUT_IDS = TensorSpec("output_ids", "TYPE_INT32", (-1,))
CONTEXT_IDS = TensorSpec("context_ids", "TYPE_INT32", (-1,))
DETOKENIZE_PARAMS = TensorSpec("detokenize_params", "TYPE_STRING", (1,))
REQUEST_ID = TensorSpec("request_id", "TYPE_STRING", (1,))  # what a cancel_request_id control names
TEXT_OUTPUT = TensorSpec("text_output", "TYPE_STRING", (-1,))
FINISH_REASON = COMMON_OUTPUTS["finish_reason"]

TOKEN_INPUTS = specs(TensorSpec(INPUT_IDS.name, INPUT_IDS.data_type, INPUT_IDS.dims), *COMMON_INPUTS.values())
TOKEN_OUTPUTS = specs(OUTPUT_IDS, CONTEXT_IDS, DETOKENIZE_PARAMS, REQUEST_ID, *COMMON_OUTPUTS.values())

TEXT_INPUT = TensorSpec("text_input", "TYPE_STRING", (1,))
APPLY_CHAT_TEMPLATE = TensorSpec("apply_chat_template", "TYPE_BOOL", (1,), optional=True)
PREPROCESSING_INPUTS = specs(TEXT_INPUT, APPLY_CHAT_TEMPLATE)
PREPROCESSING_OUTPUTS = specs(TensorSpec(INPUT_IDS.name, INPUT_IDS.data_type, INPUT_IDS.dims))
POSTPROCESSING_INPUTS = specs(OUTPUT_IDS, CONTEXT_IDS, FINISH_REASON,
                              TensorSpec(DETOKENIZE_PARAMS.name, "TYPE_STRING", (1,), optional=True),
                              TensorSpec(REQUEST_ID.name, "TYPE_STRING", (1,), optional=True))
POSTPROCESSING_OUTPUTS = specs(TEXT_OUTPUT, FINISH_REASON)

ENSEMBLE_INPUTS = specs(TEXT_INPUT, APPLY_CHAT_TEMPLATE, COMMON_INPUTS["stream"], SAMPLING_PARAMETERS,
                        *trtllm_scalars.INPUTS.values())
ENSEMBLE_OUTPUTS = POSTPROCESSING_OUTPUTS


def is_final(finish_reason: bytes | str) -> bool:
    """Whether a token model's finish_reason value ends the request ("None" before the last response)."""
    value = finish_reason.decode() if isinstance(finish_reason, bytes) else finish_reason
    return value not in PENDING


def control_body(parameters: dict) -> dict:
    """An HTTP /generate body for a control request (shared/engine_model.py): the input_ids Triton requires,
    unread."""
    return {INPUT_IDS.name: [0], **parameters}


def control_arrays() -> dict[str, np.ndarray]:
    """A control request's inputs from another model (the postprocessing's cancel): input_ids, unread."""
    return {INPUT_IDS.name: np.zeros(0, dtype=np.int32)}
