"""Ensemble step 1: text_input (+ apply_chat_template) -> input_ids, with the engine model's tokenizer."""
import triton_python_backend_utils as pb_utils

from nanoserve.errors import RequestError
from nanoserve.serving.shared.contracts.token_model import APPLY_CHAT_TEMPLATE, PREPROCESSING_OUTPUTS, TEXT_INPUT
from nanoserve.serving.stub.ensemble import encode_prompt, engine_max_prompt_bytes, engine_tokenizer
from nanoserve.serving.stub.request import parse_text_prompt


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.max_prompt_bytes = engine_max_prompt_bytes(args, self.tokenizer)  # longer texts cannot fit

    def execute(self, requests):
        return [self._tokenize(request) for request in requests]

    def _tokenize(self, request):
        try:
            text = parse_text_prompt(lambda name: _as_numpy(request, name))
            chat = _as_numpy(request, APPLY_CHAT_TEMPLATE.name)
            ids = encode_prompt(self.tokenizer, text, chat=chat is not None and bool(chat.reshape(-1)[0]),
                                max_bytes=self.max_prompt_bytes)
        except ValueError as e:
            message = str(RequestError.of(e).renamed({"prompt": TEXT_INPUT.name}))
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
        (output,) = PREPROCESSING_OUTPUTS.values()
        return pb_utils.InferenceResponse([pb_utils.Tensor(output.name, output.array(ids))])


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
