"""Ensemble step 3: output_ids + context_ids -> text_output, statelessly (nanoserve/serving/ensemble.py)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from nanoserve.serving.ensemble import DetokenizeRequest, decode_delta, engine_dir, engine_tokenizer, is_final
from nanoserve.serving.model_json import max_model_len_bound


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.max_ids = max_model_len_bound(engine_dir(args))  # no response carries more ids than that

    def execute(self, requests):
        return [self._detokenize(request) for request in requests]

    def _detokenize(self, request):
        try:
            inputs = DetokenizeRequest.parse(lambda name: _as_numpy(request, name), self.max_ids)
        except ValueError as e:  # called directly with junk: name the input, never a raw Python exception
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        text = decode_delta(self.tokenizer, inputs.context_ids, inputs.new_ids, final=is_final(inputs.finish_reason),
                            **inputs.params)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.array([inputs.finish_reason.encode()], dtype=np.object_)),
        ])


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
