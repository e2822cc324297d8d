"""TRT-LLM's sampling inputs (as Triton's OpenAI frontend sends them too): one scalar tensor per sampling parameter
and stop_words. The text model, the token model and the ensemble take them besides the sampling_parameters JSON;
a scalar tensor wins over the same parameter in the JSON (stub/request.py)."""
from __future__ import annotations

import numpy as np

from nanoserve.serving.shared.contracts.tensors import TensorSpec, specs

# tensor name -> the SamplingParams field it sets (the same name)
SCALAR_INPUTS = specs(
    TensorSpec("max_tokens", "TYPE_INT32", (1,), optional=True),
    TensorSpec("temperature", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_p", "TYPE_FP32", (1,), optional=True),
    TensorSpec("top_k", "TYPE_INT32", (1,), optional=True),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), optional=True),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), optional=True),
    TensorSpec("seed", "TYPE_UINT64", (1,), optional=True),
)
STOP_WORDS = TensorSpec("stop_words", "TYPE_STRING", (-1,), optional=True)  # the SamplingParams field `stop`
INPUTS = {**SCALAR_INPUTS, STOP_WORDS.name: STOP_WORDS}


def is_integer(spec: TensorSpec) -> bool:
    return spec.data_type != "TYPE_FP32"


def scalar_arrays(scalars: dict, stop_words: list[str] | None = None) -> dict[str, np.ndarray]:
    """The client half: sampling values (tensor name -> number) and stop words as their tensors."""
    unknown = sorted(set(scalars) - set(SCALAR_INPUTS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a scalar sampling tensor (known: {', '.join(SCALAR_INPUTS)})")
    arrays = {name: SCALAR_INPUTS[name].array(value) for name, value in scalars.items()}
    if stop_words is not None:
        arrays[STOP_WORDS.name] = STOP_WORDS.array(list(stop_words))
    return arrays
