"""Ensemble step 3: output_ids + context_ids -> text_output, statelessly (nanoserve/serving/ensemble.py); and the
ensemble's cancellation: Triton's ensemble scheduler marks this step's request cancelled once the client cancelled
but never tells the engine model, whose request is already running, so this model does (CancelChecks)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from nanoserve.serving.ensemble import CANCEL_PARAMETER, CancelChecks, decode_delta, engine_model, engine_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.engine_model = engine_model(args)
        self.cancel_checks = CancelChecks()

    def execute(self, requests):
        return [self._detokenize(request) for request in requests]

    def _detokenize(self, request):
        new_ids = _input(request, "output_ids").reshape(-1).tolist()
        context_ids = _input(request, "context_ids").reshape(-1).tolist()
        finish_reason = _input(request, "finish_reason")
        final = bool(finish_reason.reshape(-1)[0])
        params = _input(request, "detokenize_params")  # skip_special_tokens, stop, include_stop_str_in_output
        params = {} if params is None else json.loads(params.reshape(-1)[0])
        try:
            self._pass_on_cancel(request, final)
        except Exception as e:  # not this response's error: one would keep the ensemble from releasing the request
            pb_utils.Logger.log_error(f"postprocessing: passing a cancel on failed: {e!r}")
        text = decode_delta(self.tokenizer, context_ids, new_ids, final=final, **params)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", finish_reason),
        ])

    def _pass_on_cancel(self, request, final: bool) -> None:
        """A response of a stream whose client cancelled: abort its request in the engine model (a control request
        with its id). The response itself goes out as usual; the engine's request then ends with finish_reason
        "abort" (an error here would keep Triton 2.51's ensemble from ever releasing the request)."""
        request_id = _input(request, "request_id")
        if request_id is None:
            return
        request_id = request_id.reshape(-1)[0].decode()
        if not self.cancel_checks.due(request_id, final) or not request.is_cancelled():
            return
        self.cancel_checks.cancelled(request_id)
        control = pb_utils.InferenceRequest(
            model_name=self.engine_model, inputs=[pb_utils.Tensor("input_ids", np.zeros(0, dtype=np.int32))],
            requested_output_names=[], parameters={CANCEL_PARAMETER: request_id})
        for response in control.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"postprocessing: cancelling {request_id}: {response.error().message()}")


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
