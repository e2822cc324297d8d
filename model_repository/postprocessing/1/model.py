"""Ensemble step 3: output_ids + context_ids -> text_output, statelessly (nanoserve/serving/stub/ensemble.py); and the
ensemble's cancellation: Triton's ensemble scheduler marks this step's request cancelled once the client cancelled
but never tells the engine model, whose request is already running, so this model does (CancelChecks)."""
import triton_python_backend_utils as pb_utils

from nanoserve.serving.shared.contracts.token_model import FINISH_REASON, TEXT_OUTPUT, control_arrays, is_final
from nanoserve.serving.shared.engine_model import CANCEL_PARAMETER
from nanoserve.serving.shared.model_json import max_model_len_bound
from nanoserve.serving.stub.ensemble import (CancelChecks, DetokenizeRequest, decode_delta, engine_dir,
                                             engine_model, engine_tokenizer)


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.max_ids = max_model_len_bound(engine_dir(args))  # no response carries more ids than that
        self.engine_model = engine_model(args)
        self.cancel_checks = CancelChecks()

    def execute(self, requests):
        return [self._detokenize(request) for request in requests]

    def _detokenize(self, request):
        try:
            inputs = DetokenizeRequest.parse(lambda name: _as_numpy(request, name), self.max_ids)
        except ValueError as e:  # called directly with junk: name the input, never a raw Python exception
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        final = is_final(inputs.finish_reason)
        try:
            self._pass_on_cancel(request, inputs.request_id, final)
        except Exception as e:  # not this response's error: one would keep the ensemble from releasing the request
            pb_utils.Logger.log_error(f"postprocessing: passing a cancel on failed: {e!r}")
        text = decode_delta(self.tokenizer, inputs.context_ids, inputs.new_ids, final=final, **inputs.params)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor(TEXT_OUTPUT.name, TEXT_OUTPUT.array(text)),
            pb_utils.Tensor(FINISH_REASON.name, FINISH_REASON.array(inputs.finish_reason)),
        ])

    def _pass_on_cancel(self, request, request_id: str | None, final: bool) -> None:
        """A response of a stream whose client cancelled: abort its request in the engine model (a control request
        with its id). The response itself goes out as usual; the engine's request then ends with finish_reason
        "abort" (an error here would keep Triton 2.51's ensemble from ever releasing the request)."""
        if request_id is None:
            return
        if not self.cancel_checks.due(request_id, final) or not request.is_cancelled():
            return
        self.cancel_checks.cancelled(request_id)
        control = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            inputs=[pb_utils.Tensor(name, array) for name, array in control_arrays().items()],
            requested_output_names=[], parameters={CANCEL_PARAMETER: request_id})
        for response in control.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"postprocessing: cancelling {request_id}: {response.error().message()}")


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
