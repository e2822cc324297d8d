"""Ensemble step 3: output_ids + context_ids -> text_output, statelessly (nanoserve/serving/ensemble.py)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from nanoserve.serving.ensemble import decode_delta, engine_tokenizer, is_final


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)

    def execute(self, requests):
        return [self._detokenize(request) for request in requests]

    def _detokenize(self, request):
        new_ids = _input(request, "output_ids").reshape(-1).tolist()
        context_ids = _input(request, "context_ids").reshape(-1).tolist()
        finish_reason = _input(request, "finish_reason")
        params = _input(request, "detokenize_params")  # skip_special_tokens, stop, include_stop_str_in_output
        params = {} if params is None else json.loads(params.reshape(-1)[0])
        text = decode_delta(self.tokenizer, context_ids, new_ids, final=is_final(finish_reason.reshape(-1)[0]),
                            **params)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", finish_reason),
        ])


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
