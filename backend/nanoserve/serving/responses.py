"""The response thread: engine outputs -> Triton responses, cancellation sweeps, metrics.

Every sender.send() and every metric call happens on this one thread (tritonserver 2.51 crashes on concurrent
custom-metric updates). pb_utils is passed in: this module imports nothing from Triton.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from nanoserve.serving.engine_thread import StepResult
from nanoserve.serving.request import ParsedRequest

logger = logging.getLogger(__name__)
TOKEN_LEVEL_OUTPUTS = frozenset({"logprobs", "cumulative_logprob", "num_output_tokens"})


@dataclass
class Stream:
    """One in-flight request as the response thread sees it."""
    sender: object
    request: ParsedRequest
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    cancelled: bool = False
    text: str = ""  # non-streaming: accumulated output
    token_ids: list[int] = field(default_factory=list)  # all generated ids so far
    logprobs: list = field(default_factory=list)  # non-streaming: accumulated per-token logprobs


@dataclass
class Register:
    request_id: str
    stream: Stream


@dataclass
class Reject:
    sender: object
    message: str


STOP = object()


class ResponseThread:
    """formatter(stream, output) -> dict of output arrays to send now, or None (nothing to send yet); it is
    called before stream.token_ids is extended with output.new_token_ids."""

    def __init__(self, pb_utils, events: queue.Queue, engine_thread, metrics, formatter, prompt_field: str,
                 cancel_sweep_interval: float = 0.5):
        self.pb = pb_utils
        self.events = events
        self.engine_thread = engine_thread
        self.metrics = metrics
        self.formatter = formatter
        self.prompt_field = prompt_field  # the input the engine's "prompt: ..." errors are about
        self.cancel_sweep_interval = cancel_sweep_interval
        self.streams: dict[str, Stream] = {}
        self._next_sweep = 0.0
        self._thread = threading.Thread(target=self._run, name="nanoserve-responses", daemon=True)

    def start(self) -> "ResponseThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Handle what is queued, end every request still in flight with a FINAL error, and exit."""
        self.events.put(STOP)
        self._thread.join(timeout)

    # ---- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                event = self.events.get(timeout=self.cancel_sweep_interval)
            except queue.Empty:
                event = None
            try:
                if event is STOP:
                    break
                self._handle(event)
                self._sweep_cancelled()
            except Exception:  # a failing send must not kill the thread that serves everyone else
                logger.exception("nanoserve response thread")
        for request_id in list(self.streams):
            self._fail(request_id, "the model is being unloaded", self.pb.TritonError.UNAVAILABLE)

    def _handle(self, event) -> None:
        if isinstance(event, Register):
            self.streams[event.request_id] = event.stream
        elif isinstance(event, Reject):
            self._send_error(event.sender, event.message, self.pb.TritonError.INVALID_ARG)
        elif isinstance(event, StepResult):
            for request_id, message in event.rejected:
                self._fail(request_id, self._name_field(message), self.pb.TritonError.INVALID_ARG)
            for request_id, message in event.failed:
                self._fail(request_id, message, self.pb.TritonError.INTERNAL)
            for output in event.outputs:
                self._on_output(output)
            self.metrics.record_engine(event.stats)
            self.metrics.record_generated(sum(len(o.new_token_ids) for o in event.outputs))

    def _sweep_cancelled(self) -> None:
        """Outputs check their own request; this catches the ones that produce none (waiting, preempted)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.cancel_sweep_interval
        for request_id, stream in self.streams.items():
            self._check_cancelled(request_id, stream)

    def _check_cancelled(self, request_id: str, stream: Stream) -> bool:
        if not stream.cancelled and stream.sender.is_cancelled():
            stream.cancelled = True
            self.engine_thread.abort(request_id)  # blocks are freed; the "abort" output ends the stream
        return stream.cancelled

    # ---- one output ---------------------------------------------------------------------------------
    def _on_output(self, output) -> None:
        stream = self.streams.get(output.request_id)
        if stream is None:  # already ended (a failure raced with a last output)
            return
        self._record_timing(stream, output)
        if self._check_cancelled(output.request_id, stream):
            if output.finished:
                self._fail(output.request_id, "request cancelled", self.pb.TritonError.CANCELLED, output)
            return
        arrays = self.formatter(stream, output)
        stream.token_ids += output.new_token_ids
        if output.finished:
            self._finish(output.request_id, output, arrays)
        elif arrays is not None:
            stream.sender.send(self._response(arrays))

    def _record_timing(self, stream: Stream, output) -> None:
        if not output.new_token_ids:
            return
        now = time.monotonic()
        if stream.first_token is None:
            stream.first_token = now
            self.metrics.record_first_token(now - stream.arrival, output.num_prompt_tokens)
        else:
            self.metrics.record_inter_token(now - stream.last_token)
        stream.last_token = now

    def _finish(self, request_id: str, output, arrays: dict | None) -> None:
        stream = self.streams.pop(request_id)
        response = self._response(arrays) if arrays is not None else self.pb.InferenceResponse(output_tensors=[])
        stream.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._record_finished(stream, output)

    def _fail(self, request_id: str, message: str, code, output=None) -> None:
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        self._send_error(stream.sender, message, code)
        if output is not None:
            self._record_finished(stream, output)

    def _record_finished(self, stream: Stream, output) -> None:
        end = stream.last_token or time.monotonic()
        self.metrics.record_finished(output.finish_reason, end - stream.arrival, output.num_prompt_tokens,
                                     output.num_output_tokens)

    # ---- Triton objects -----------------------------------------------------------------------------
    def _response(self, arrays: dict):
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(name, a) for name, a in arrays.items()])

    def _send_error(self, sender, message: str, code) -> None:
        error = self.pb.TritonError(message, code)
        sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _name_field(self, message: str) -> str:
        return self.prompt_field + message[len("prompt"):] if message.startswith("prompt:") else message


# ---- formatters: (stream, RequestOutput) -> arrays -----------------------------------------------------
def text_arrays(stream: Stream, output) -> dict | None:
    """Text model: streaming sends deltas (never the prompt); otherwise one response when finished."""
    request = stream.request
    if request.stream:
        token_level = output.new_token_ids and request.outputs & TOKEN_LEVEL_OUTPUTS
        if not (output.text_delta or output.finished or token_level):
            return None  # text held back (an incomplete character or a possible stop string)
        return {"text_output": _strings(output.text_delta),
                **optional_arrays(request, output, output.new_logprobs, len(output.new_token_ids))}
    stream.text += output.text_delta
    stream.logprobs += output.new_logprobs
    if not output.finished:
        return None
    text = stream.text if request.exclude_input else request.prompt + stream.text
    return {"text_output": _strings(text),
            **optional_arrays(request, output, stream.logprobs, output.num_output_tokens)}


def optional_arrays(request: ParsedRequest, output, logprobs: list, num_output_tokens: int) -> dict:
    arrays = {}
    if "finish_reason" in request.outputs:
        arrays["finish_reason"] = _strings(output.finish_reason or "")
    if "cumulative_logprob" in request.outputs:
        arrays["cumulative_logprob"] = np.array([output.cumulative_logprob], dtype=np.float32)
    if "logprobs" in request.outputs:
        per_token = [{str(token): logprob for token, logprob in entry.items()} for entry in logprobs]
        arrays["logprobs"] = _strings(json.dumps(per_token))
    if "num_input_tokens" in request.outputs:
        arrays["num_input_tokens"] = np.array([output.num_prompt_tokens], dtype=np.uint32)
    if "num_output_tokens" in request.outputs:
        arrays["num_output_tokens"] = np.array([num_output_tokens], dtype=np.uint32)
    return arrays


def _strings(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)
