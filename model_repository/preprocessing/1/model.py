"""Ensemble step 1: text_input (+ apply_chat_template) -> input_ids, with the engine model's tokenizer."""
import numpy as np
import triton_python_backend_utils as pb_utils

from nanoserve.serving.ensemble import encode_prompt, engine_tokenizer
from nanoserve.serving.request import parse_text_prompt


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)

    def execute(self, requests):
        return [self._tokenize(request) for request in requests]

    def _tokenize(self, request):
        try:
            text = parse_text_prompt(lambda name: _as_numpy(request, name))
            chat = _as_numpy(request, "apply_chat_template")
            ids = encode_prompt(self.tokenizer, text, chat=chat is not None and bool(chat.reshape(-1)[0]))
        except ValueError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.array(ids, dtype=np.int32))])


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
