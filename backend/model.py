"""nanoserve's Triton adapter: a Python-based backend (installed as backends/nanoserve/model.py).

A model that uses it:

    model_repository/nanoserve/config.pbtxt    backend: "nanoserve"
                                               instance_group [{ kind: KIND_MODEL, count: 1 }]
    model_repository/nanoserve/1/model.json    {"model": "/path/to/checkpoint", "max_model_len": 4096}

Without installing the backend, the plain Python backend works too: copy this file to
`<model>/1/model.py` and write `backend: "python"` in config.pbtxt (the venv holding nanoserve must be the
stub's interpreter environment, e.g. through the EXECUTION_ENV_PATH parameter or PATH; see docs/serving.md).

config.pbtxt parameter `mode`: "text" (default; the vllm_backend tensor contract: text_input -> text_output)
or "tokens" (the ensemble's token-level engine: input_ids -> output_ids + decode context). Parameters
`send_budget` and `send_every_step` choose how streams are sent, `REPORT_CUSTOM_METRICS` adds the vllm:* metrics
(docs/serving.md).

execute() only queues each request for the intake thread, which parses, validates and tokenizes the requests
waiting and hands them on (serving/stub/intake.py). The engine thread owns the LLMEngine and steps the
continuous batch, in this process or (config.pbtxt parameter `engine_core_process`) in an engine core process of
its own (serving/stub/engine_core.py); the response thread sends every response, sweeps for cancelled requests and
updates the metrics.
"""
import copy
import faulthandler
import gc
import itertools
import json
import logging

import triton_python_backend_utils as pb_utils

from nanoserve.coercion import optional_bool
from nanoserve.errors import ErrorKind, RequestError
from nanoserve.serving.shared.engine_model import UNAVAILABLE
from nanoserve.serving.shared.contracts import token_model, vllm_text
from nanoserve.serving.stub.request import parse_request
from nanoserve.serving.stub.control import Drain, control_event
from nanoserve.serving.stub.engine_thread import EngineInProcess
from nanoserve.serving.stub.inbox import Inbox
from nanoserve.serving.stub.intake import Admission, Intake
from nanoserve.serving.stub.metrics import Metrics
from nanoserve.serving.stub.pacing import DEFAULT_SEND_BUDGET
from nanoserve.serving.stub.responses import Reject, ResponseThread, Stream, text_formatter
from nanoserve.serving.stub.shutdown import ServerArgs, ShutdownWatch

logger = logging.getLogger(__name__)
GC_YOUNG_OBJECTS = 20_000  # the stub's threshold of its youngest generation (Python's default: 700)
faulthandler.enable()  # a crash in the stub leaves every thread's Python stack in tritonserver's log
MODES = {  # mode -> (inputs, outputs)
    "text": (vllm_text.TEXT_INPUTS, vllm_text.TEXT_OUTPUTS),
    "tokens": (token_model.TOKEN_INPUTS, token_model.TOKEN_OUTPUTS),
}


def _mode(model_config: dict) -> str:
    mode = model_config.get("parameters", {}).get("mode", {}).get("string_value", "text") or "text"
    if mode not in MODES:
        raise pb_utils.TritonModelException(f"mode: must be one of {sorted(MODES)}, got {mode!r}")
    return mode


def _send_budget(model_config: dict) -> float:
    """config.pbtxt parameter `send_budget` (serving/stub/pacing.py): the share of wall time streaming may spend
    sending responses; 1 sends every engine step at once."""
    value = model_config.get("parameters", {}).get("send_budget", {}).get("string_value", "")
    try:
        budget = float(value) if value.strip() else DEFAULT_SEND_BUDGET
    except ValueError:
        budget = -1.0
    if not 0 < budget <= 1:
        raise pb_utils.TritonModelException(f"send_budget: must be a number in (0, 1], got {value!r}")
    return budget


def _parameter(model_config: dict, name: str) -> str:
    return model_config.get("parameters", {}).get(name, {}).get("string_value", "")


class TritonLogHandler(logging.Handler):
    """Python log records -> tritonserver's log, in its format and levels. pb_utils.Logger only queues the message
    for the stub's own sender thread, so any thread may log."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = pb_utils.Logger
        log = (logger.log_error if record.levelno >= logging.ERROR else logger.log_warn
               if record.levelno >= logging.WARNING else logger.log_info)
        log(self.format(record))


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config
        inputs, outputs = MODES[_mode(config.as_dict())]
        for tensor in inputs.values():
            config.add_input(tensor.config())
        for tensor in outputs.values():
            config.add_output(tensor.config(is_input=False))
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
        logging.getLogger().addHandler(TritonLogHandler())
        logging.getLogger("nanoserve").setLevel(logging.INFO)
        self.mode = _mode(model_config)
        send_budget = _send_budget(model_config)  # checked before the engine loads
        every_step = optional_bool("send_every_step", _parameter(model_config, "send_every_step"))
        core_process = optional_bool("engine_core_process", _parameter(model_config, "engine_core_process"))
        make_formatter, ended_arrays = _formatting(self.mode)
        self.name = args["model_name"]
        config, adapters, vllm_metrics = _engine_config(args, model_config)
        self.max_model_len = config.max_model_len
        self.events = Inbox()  # -> response thread: Register/Reject from here, StepResults from the engine
        self.engine_core = _start_engine(config, self.events, adapters, core_process)
        # The stub's heap is now torch, transformers (and the model, in this process): long-lived objects. Frozen,
        # a full collection (set off by the response thread's allocations) skips them instead of walking them all.
        gc.collect()
        gc.freeze()
        # Each engine step makes a few objects per stream that live a few steps (outputs until the response thread
        # merges them): at the default 700 they set off collections that move them to older generations, and full
        # collections follow, on the engine's thread. They die by reference count; cycles are rare here.
        gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
        self.metrics = Metrics(pb_utils, self.name, args["model_version"], vllm_names=vllm_metrics,
                               max_model_len=config.max_model_len,
                               num_speculative_tokens=_num_speculative_tokens(config))
        self.metrics.record_engine(self.engine_core.initial_stats)  # the pool's size from the start
        self.metrics.publish()
        # one response per step (send_every_step), or as soon as possible (send_budget 1): a step whose text is
        # held back (an incomplete character, a possible stop string) sends "", as vllm_backend does
        formatter = make_formatter(self.engine_core.tokenizer, send_empty=every_step or send_budget == 1)
        server_args = ServerArgs.of_parent()
        self.may_unload = server_args is not None and server_args.explicit_model_control
        self.shutdown_watch = None if server_args is None else ShutdownWatch(server_args).start()
        self.responses = ResponseThread(pb_utils, self.events, self.engine_core, self.metrics, formatter,
                                        send_budget=send_budget, every_step=every_step,
                                        on_engine_failure=self._unload_failed_model,
                                        shutdown_watch=self.shutdown_watch, ended_arrays=ended_arrays).start()
        self._request_ids = itertools.count()
        self.draining = False  # a drain control came: every new request is refused
        # the intake's own tokenizer: a Rust tokenizer used from two threads at once fails ("Already borrowed")
        self.intake = Intake(self._admit, self.events, self.engine_core, copy.deepcopy(self.engine_core.tokenizer),
                             self.engine_core.max_prompt_bytes)

    def execute(self, requests):
        for request in requests:
            self.intake.put(request)
        return None

    def _admit(self, request, arrival: float):
        """The intake's parser (serving/stub/intake.py): one request -> an Admission, or the event that answers
        it (a control, a rejection). Never raises: a bad request fails alone."""
        sender = request.get_response_sender()
        failure = self.engine_core.failure
        if failure is not None:
            return Reject(sender, RequestError(None, UNAVAILABLE + failure, ErrorKind.UNAVAILABLE))
        try:
            parameters = request.parameters()  # (a JSON text the stub builds at each call)
            control = control_event(parameters, sender, self.responses.clock())
            if control is not None:
                self.draining = self.draining or isinstance(control, Drain)
                return control
            if self.draining:
                return Reject(sender, RequestError(None, "the server is shutting down: the model takes no new "
                                                         "request", ErrorKind.UNAVAILABLE))
            inputs = {tensor.name(): tensor for tensor in request.inputs()}  # pb_utils looks up by a linear scan
            parsed = parse_request(lambda name: _as_numpy(inputs, name), parameters,
                                   tokens=self.mode == "tokens", max_model_len=self.max_model_len)
        except ValueError as e:
            return Reject(sender, RequestError.of(e))
        except Exception as e:  # a parser bug must fail this request only, never the rest of the batch
            logger.exception("nanoserve: parsing a request failed")
            return Reject(sender, RequestError(None, f"internal error: parsing the request failed "
                                                     f"({type(e).__name__})", ErrorKind.INTERNAL))
        request_id = f"{self.name}-{next(self._request_ids)}"
        return Admission(request_id, Stream(sender, parsed, arrival=arrival, triton_request_id=request.request_id()))

    def _unload_failed_model(self, failure: str) -> None:
        """The health check (vllm_backend's ENABLE_VLLM_HEALTH_CHECK, always on): a failed engine unloads its
        model, which Triton then reports not ready. Triton 2.51 lets a model unload itself only when it runs with
        --model-control-mode=explicit; otherwise the model stays "ready" and every request gets UNAVAILABLE."""
        if not self.may_unload:  # tritonserver 2.51's python_backend crashes the stub that tries
            logger.error("nanoserve: the engine of model %r has failed (%s); it answers every request with "
                         "UNAVAILABLE (a model unloads itself only under --model-control-mode=explicit)",
                         self.name, failure)
            return
        logger.error("nanoserve: the engine of model %r has failed (%s); unloading the model", self.name, failure)
        try:
            pb_utils.unload_model(self.name)
        except pb_utils.TritonModelException as e:
            logger.error("nanoserve: model %r could not unload itself (%s); it answers every request with "
                         "UNAVAILABLE until it is reloaded", self.name, e)

    def finalize(self):
        if self.shutdown_watch is not None:
            self.shutdown_watch.stop()
        self.intake.stop()  # enters what execute() queued: the response thread answers every request it registers
        self.engine_core.stop()
        self.responses.stop()  # ends every request still in flight with a FINAL response
        self.metrics.close()  # see serving/stub/metrics.py: a family left for the stub's teardown crashes it


# The engine's modules (torch, transformers) are imported by the functions below, when a model instance starts,
# and not with this file: tritonserver first runs auto_complete_config in a stub process of its own, which then
# starts without them (seconds of every model load).
def _engine_config(args: dict, model_config: dict):
    """The engine's configuration (model.json), its LoRA adapters (multi_lora.json) and whether the model reports
    the vllm:* metrics."""
    from nanoserve.config import EngineConfig
    from nanoserve.serving.shared.model_json import (engine_args_of, instance_device, lora_modules, read_model_json,
                                                     reports_vllm_metrics)

    model_json = read_model_json(args["model_repository"], args["model_version"])
    engine_args = instance_device(engine_args_of(model_json), args["model_instance_kind"],
                                  args["model_instance_device_id"])
    vllm_metrics = reports_vllm_metrics(_parameter(model_config, "REPORT_CUSTOM_METRICS"), model_json)
    adapters = lora_modules(args["model_repository"], args["model_version"])
    return EngineConfig.from_kwargs(**engine_args), adapters, vllm_metrics


def _start_engine(config, events: Inbox, adapters: dict, core_process: bool):
    """The engine: in an engine core process of its own (config.pbtxt parameter engine_core_process), else on a
    thread of this stub."""
    if core_process:
        from nanoserve.serving.stub.engine_core import EngineCoreClient as engine
    else:
        engine = EngineInProcess
    try:
        return engine(config, events, adapters)
    except RuntimeError as e:
        raise pb_utils.TritonModelException(str(e)) from None


def _formatting(mode: str):
    """The mode's formatter (made for the engine's tokenizer) and a stream's early end."""
    if mode == "text":
        return text_formatter, None
    from nanoserve.serving.stub.ensemble import ended_token_arrays, token_formatter

    return token_formatter, ended_token_arrays


def _num_speculative_tokens(config) -> int:
    """Draft positions the spec_decode metrics count (0: speculation off, no such metrics)."""
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def _as_numpy(inputs: dict, name: str):
    tensor = inputs.get(name)
    return None if tensor is None else tensor.as_numpy()
