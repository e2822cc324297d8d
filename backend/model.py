"""nanoserve's Triton adapter: a Python-based backend (installed as backends/nanoserve/model.py).

A model that uses it:

    model_repository/nanoserve/config.pbtxt    backend: "nanoserve"
                                               instance_group [{ kind: KIND_MODEL, count: 1 }]
    model_repository/nanoserve/1/model.json    {"model": "/path/to/checkpoint", "max_model_len": 4096}

Without installing the backend, the plain Python backend works too: copy this file to
`<model>/1/model.py` and write `backend: "python"` in config.pbtxt (the venv holding nanoserve must be the
stub's interpreter environment, e.g. through the EXECUTION_ENV_PATH parameter or PATH; see docs/serving.md).

config.pbtxt parameter `mode`: "text" (default; the vllm_backend tensor contract: text_input -> text_output)
or "tokens" (the ensemble's token-level engine: input_ids -> output_ids + decode context).

execute() only parses, validates and enqueues. The engine thread owns the LLMEngine and steps the continuous
batch; the response thread sends every response, sweeps for cancelled requests and updates the metrics.
"""
import faulthandler
import gc
import itertools
import json
import logging
import queue

import triton_python_backend_utils as pb_utils

from nanoserve.serving import request as contract
from nanoserve.serving.ensemble import cancel_target, token_formatter
from nanoserve.serving.engine_thread import EngineThread
from nanoserve.serving.metrics import Metrics
from nanoserve.serving.model_json import instance_device, load_engine_args
from nanoserve.serving.responses import (DEFAULT_SEND_BUDGET, CancelById, Register, Reject, ResponseThread, Stream,
                                         text_arrays)

logger = logging.getLogger(__name__)
faulthandler.enable()  # a crash in the stub leaves every thread's Python stack in tritonserver's log
MODES = {  # mode -> (inputs, outputs, prompt input, formatter for the engine's tokenizer)
    "text": (contract.TEXT_INPUTS, contract.TEXT_OUTPUTS, "text_input", lambda tokenizer: text_arrays),
    "tokens": (contract.TOKEN_INPUTS, contract.TOKEN_OUTPUTS, "input_ids", token_formatter),
}


def _mode(model_config: dict) -> str:
    mode = model_config.get("parameters", {}).get("mode", {}).get("string_value", "text") or "text"
    if mode not in MODES:
        raise pb_utils.TritonModelException(f"mode: must be one of {sorted(MODES)}, got {mode!r}")
    return mode


def _send_budget(model_config: dict) -> float:
    """config.pbtxt parameter `send_budget` (see ResponseThread): the share of wall time streaming may spend
    sending responses; 1 sends every engine step at once."""
    value = model_config.get("parameters", {}).get("send_budget", {}).get("string_value", "")
    try:
        budget = float(value) if value.strip() else DEFAULT_SEND_BUDGET
    except ValueError:
        budget = -1.0
    if not 0 < budget <= 1:
        raise pb_utils.TritonModelException(f"send_budget: must be a number in (0, 1], got {value!r}")
    return budget


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        inputs, outputs, _, _ = MODES[_mode(config.as_dict())]
        for tensor in inputs:
            config.add_input(tensor)
        for tensor in outputs:
            config.add_output(tensor)
        config.set_max_batch_size(0)
        config.set_model_transaction_policy({"decoupled": True})
        # instance_group cannot be auto-completed by a Python model (Triton keeps its own default):
        # config.pbtxt says KIND_MODEL, so the engine chooses its device(s) itself.
        return config

    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("nanoserve needs a decoupled model: model_transaction_policy "
                                                "{ decoupled: true }")
        self.mode = _mode(model_config)
        send_budget = _send_budget(model_config)  # checked before the engine loads
        _, _, prompt_field, make_formatter = MODES[self.mode]
        self.name = args["model_name"]
        engine_args = instance_device(load_engine_args(args["model_repository"], args["model_version"]),
                                      args["model_instance_kind"], args["model_instance_device_id"])

        from nanoserve.config import EngineConfig  # heavy (torch): after the cheap checks
        from nanoserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_args))
        # The stub's heap is now torch, transformers and the model: hundreds of thousands of objects that live as
        # long as it does. Frozen, a full collection (set off by the response thread's allocations) skips them
        # instead of walking them all under the GIL while the engine thread waits.
        gc.collect()
        gc.freeze()
        self.events = queue.Queue()  # -> response thread: Register/Reject from here, StepResults from the engine
        self.metrics = Metrics(pb_utils, self.name, args["model_version"])
        self.engine_thread = EngineThread(self.engine, self.events).start()
        formatter = make_formatter(self.engine.tokenizer)
        self.responses = ResponseThread(pb_utils, self.events, self.engine_thread, self.metrics, formatter,
                                        prompt_field, send_budget=send_budget).start()
        self._request_ids = itertools.count()

    def execute(self, requests):
        for request in requests:
            self._enqueue(request)
        return None

    def _enqueue(self, request) -> None:
        sender = request.get_response_sender()
        try:
            target = cancel_target(request.parameters())
            if target is not None:  # a control request: cancel the requests with that id
                self.events.put(CancelById(sender, target))
                return
            inputs = {tensor.name(): tensor for tensor in request.inputs()}  # pb_utils looks up by a linear scan
            parsed = contract.parse_request(lambda name: _as_numpy(inputs, name), request.parameters(),
                                            tokens=self.mode == "tokens")
        except ValueError as e:
            self.events.put(Reject(sender, str(e)))
            return
        except Exception as e:  # a parser bug must fail this request only, never the rest of the batch
            logger.exception("nanoserve: parsing a request failed")
            self.events.put(Reject(sender, f"internal error: parsing the request failed ({type(e).__name__})",
                                   code="INTERNAL"))
            return
        request_id = f"{self.name}-{next(self._request_ids)}"
        self.events.put(Register(request_id, Stream(sender, parsed)))  # before the engine can answer
        self.engine_thread.add(request_id, parsed.prompt, parsed.sampling_params)

    def finalize(self):
        self.engine_thread.stop()
        self.responses.stop()  # ends every request still in flight with a FINAL response
        self.metrics.close()  # see serving/metrics.py: a family left for the stub's teardown crashes it
        self.engine.shutdown()


def _as_numpy(inputs: dict, name: str):
    tensor = inputs.get(name)
    return None if tensor is None else tensor.as_numpy()
