"""The response thread: engine outputs -> Triton responses, cancellation sweeps, metrics.

Every sender.send() and every metric call happens on this one thread (tritonserver 2.51 crashes on concurrent
custom-metric updates). pb_utils is passed in: this module imports nothing from Triton.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from nanoserve.engine.outputs import joined
from nanoserve.engine.tokenize import token_decoder
from nanoserve.errors import ErrorKind, RequestError
from nanoserve.serving.shared.contracts.vllm_text import COMMON_OUTPUTS, TEXT_OUTPUTS, prompt_input
from nanoserve.serving.shared.engine_model import UNAVAILABLE
from nanoserve.serving.stub.control import CancelById, Drain
from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.metrics import PUBLISH_INTERVAL, SAMPLES_PER_ROUND
from nanoserve.serving.stub.pacing import DEFAULT_SEND_BUDGET, Pacer
from nanoserve.serving.stub.request import ParsedRequest
from nanoserve.thread_names import set_os_thread_name

logger = logging.getLogger(__name__)
TEXT_OUTPUT = TEXT_OUTPUTS["text_output"]
TOKEN_LEVEL_OUTPUTS = frozenset({"logprobs", "cumulative_logprob", "num_output_tokens"})


@dataclass
class Sample:
    """One sequence of a request (one of its n samples) as the response thread sees it."""
    token_ids: list[int] = field(default_factory=list)  # all generated ids so far
    last: object = None  # its latest RequestOutput (finish reason, cumulative logprob); None before its first
    whole: object = None  # non-streaming: its outputs so far joined into one (text, logprobs, prompt logprobs)


@dataclass
class Stream:
    """One in-flight request as the response thread sees it."""
    sender: object
    request: ParsedRequest
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    cancelled: bool = False
    responded: bool = False  # a response was sent (the first one is never held back)
    samples: list[Sample] = field(init=False)  # the request's n sequences, by index
    formatter_state: object = None  # the formatter's own per-request state, if it keeps one
    # Cancelled by a CancelById: end with a final response (finish_reason "abort") instead of a CANCELLED error, so
    # that the ensemble ends as usual (an error from a step that is still streaming would keep Triton 2.51's
    # ensemble from ever releasing the request).
    abort_with_final: bool = False
    triton_request_id: str = ""  # the id the client gave the Triton request, if any (for the log)

    def __post_init__(self):
        self.samples = [Sample() for _ in range(self.request.sampling_params.n)]

    def add(self, outputs: list) -> None:
        """The outputs of a response: each one's sample gets its tokens, and it as its latest output."""
        for output in outputs:
            sample = self.samples[output.index]
            sample.token_ids += output.new_token_ids
            sample.last = output


@dataclass
class Register:
    request_id: str
    stream: Stream


@dataclass
class Reject:
    sender: object
    error: RequestError


STOP = object()
CANCEL_CHECKS_PER_ROUND = 8  # 64 streams: each asked every 0.8 s


class ResponseThread:
    """formatter(stream, outputs) -> dict of output arrays to send now, or None (nothing to send yet; never when
    the request has finished). `outputs` are the request's RequestOutputs to send, one per sample that has any
    (merged), after each sample's token_ids and last output were updated with them.

    The Pacer (pacing.py, send_budget and every_step) decides when outputs go; a request's first and last
    responses are urgent: time to first token and end-to-end latency never wait. With every_step the formatter
    sends held-back text as an empty delta. `events`: the stub's Inbox (inbox.py), which imports this module.
    """

    def __init__(self, pb_utils, events, engine_core, metrics, formatter,
                 cancel_check_interval: float = 0.1, send_budget: float = DEFAULT_SEND_BUDGET,
                 every_step: bool = False, clock=time.monotonic, on_engine_failure=None, shutdown_watch=None,
                 ended_arrays=None):
        self.pacer = Pacer(send_budget, every_step, clock)
        self.pb = pb_utils
        self.events = events
        self.engine_core = engine_core
        self.metrics = metrics
        self.formatter = formatter
        self.cancel_check_interval = cancel_check_interval
        self.clock = clock
        self.on_engine_failure = on_engine_failure  # called once, on this thread, with engine_core.failure
        self._engine_failed = False
        self.shutdown_watch = shutdown_watch  # its deadline: when tritonserver's exit timeout cuts every stream
        # ended_arrays(stream, request_id): the last response of a stream that fails after it responded, sent in
        # place of the error (None: the error is sent)
        self.ended_arrays = ended_arrays
        self.drains: list[Drain] = []  # drain controls to answer once every stream has ended
        self.streams: dict[str, Stream] = {}
        self._next_check = 0.0
        self._next_publish = 0.0  # clock() from which recorded metrics are published
        self._cancel_cursor = 0  # where the next round of cancellation checks starts in self.streams
        self._thread = threading.Thread(target=self._run, name="ns-responses", daemon=True)

    def start(self) -> "ResponseThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Handle what is queued, end every request still in flight with a FINAL error, and exit."""
        self.events.put(STOP)
        self._thread.join(timeout)

    # ---- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        set_os_thread_name(self._thread.name)
        while not self.handle_events(self._next_events(self._wait_time())):
            pass
        for request_id in list(self.streams):
            self._fail(request_id, RequestError(None, "the model is being unloaded", ErrorKind.UNAVAILABLE))
        self._check_drained()

    def handle_events(self, events: list) -> bool:
        """One round of the loop (called directly by tests); True when STOP came."""
        stopping = any(event is STOP for event in events)
        for event in events:  # requests first: the steps below may hold their first outputs
            if isinstance(event, (Register, Reject, CancelById, Drain)):
                self._guarded(self._handle_request_event, event)
        steps = [event for event in events if isinstance(event, StepResult)]
        if steps:
            self._guarded(self._handle_steps, steps)
        self._guarded(self._flush, stopping)
        self._guarded(self._check_engine)
        self._guarded(self._check_shutdown)
        self._guarded(self._check_drained)
        self._guarded(self._check_cancelled)
        self._guarded(self._publish_metrics, stopping)
        return stopping

    @staticmethod
    def _guarded(handler, *args) -> None:
        """A failure in one event must neither kill the thread that serves everyone nor skip the other events."""
        try:
            handler(*args)
        except Exception:
            logger.exception("nanoserve response thread")

    def _handle_request_event(self, event) -> None:
        if isinstance(event, Register):
            self.streams[event.request_id] = event.stream
        elif isinstance(event, CancelById):
            if event.request_id in self.streams:
                self.streams[event.request_id].abort_with_final = True
                self._cancel(event.request_id, "was cancelled by a control request")
            event.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        elif isinstance(event, Drain):
            self.drains.append(event)
        else:
            self._send_error(event.sender, event.error)

    def _wait_time(self) -> float | None:
        """Until the next cancellation check, flush or metrics publish that is due; None: nothing is."""
        deadlines = [self._next_check] if self.streams else []
        if self.pacer.pending:
            deadlines.append(self.pacer.next_flush)
        if self.metrics.unpublished:
            deadlines.append(self._next_publish)
        return max(min(deadlines) - self.clock(), 0.0) if deadlines else None

    def _next_events(self, timeout: float | None) -> list:
        """The events queued once one wakes this thread (waiting at most `timeout` seconds, None: until one does);
        an engine step with nothing urgent wakes it only once the pacer's next flush is due (inbox.py)."""
        return self.events.take(timeout, None if self.pacer.every_step else self.pacer.next_flush)

    def _handle_steps(self, steps: list[StepResult]) -> None:
        for step in steps:
            self._record_timing(step)
            for request_id, error in step.rejected:
                self._fail(request_id, error)
            for request_id, message in step.failed:
                self._fail(request_id, RequestError(None, message, ErrorKind.INTERNAL))
        self.metrics.record_engine(steps[-1].stats)
        self.metrics.record_generated(sum(len(o.new_token_ids) for step in steps for o in step.outputs))
        self.pacer.add([step.outputs for step in steps], self._send_output)  # after counting: merging joins them

    def _flush(self, force: bool = False) -> None:
        self.pacer.flush(self._send_output, self._urgent, force)

    def _urgent(self, request_id: str, outputs: list) -> bool:
        stream = self.streams.get(request_id)
        return outputs[-1].finished or stream is None or stream.cancelled or not stream.responded

    def _send_output(self, request_id: str, outputs: list) -> None:
        try:
            self._on_output(request_id, outputs)
        except Exception:  # this request fails, not the others
            logger.exception("nanoserve: sending a response failed")
            self.engine_core.abort(request_id)
            self._fail(request_id, RequestError(None, "internal error: sending a response failed", ErrorKind.INTERNAL))

    def _publish_metrics(self, force: bool = False) -> None:
        """Every PUBLISH_INTERVAL; a backlog of histogram samples goes a slice per round (responses go out between
        the slices) until it is gone; force publishes everything."""
        now = self.clock()
        if self.metrics.unpublished and (force or now >= self._next_publish):
            self.metrics.publish(None if force else SAMPLES_PER_ROUND)
            self._next_publish = now if self.metrics.unpublished else now + PUBLISH_INTERVAL

    def _check_engine(self) -> None:
        """Once the engine has failed, no request in flight can end otherwise: end each with UNAVAILABLE (the
        checks run every cancel_check_interval while requests are in flight)."""
        failure = self.engine_core.failure
        if failure is None:
            return
        self._end_all(UNAVAILABLE + failure)  # first: unloading the model may take a while
        if not self._engine_failed:
            self._engine_failed = True
            if self.on_engine_failure is not None:
                self.on_engine_failure(failure)

    def _check_shutdown(self) -> None:
        """tritonserver is shutting down and its exit timeout is about to cut the requests in flight without a
        word (serving/stub/shutdown.py): end them with an error their clients see."""
        deadline = None if self.shutdown_watch is None else self.shutdown_watch.deadline
        if deadline is not None and self.clock() >= deadline:
            self._end_all("the server is shutting down: its exit timeout ends this request")

    def _check_drained(self) -> None:
        """Answer the drain controls once no stream is left; at the earliest one's deadline, end those left (a token
        stream that responded ends with finish_reason "abort", see ended_arrays)."""
        if not self.drains:
            return
        if self.streams and self.clock() >= min(drain.deadline for drain in self.drains):
            self._end_all("the server is shutting down: its drain deadline ends this request")
        if not self.streams:
            for drain in self.drains:  # a response, not just the flag: HTTP /generate expects one
                drain.sender.send(self._response({}), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.drains = []

    def _end_all(self, message: str) -> None:
        for request_id in list(self.streams):
            self.engine_core.abort(request_id)  # frees its blocks (a no-op for a failed engine)
            self._fail(request_id, RequestError(None, message, ErrorKind.UNAVAILABLE))

    def _check_cancelled(self) -> None:
        """Every cancel_check_interval: ask up to CANCEL_CHECKS_PER_ROUND streams in turn whether their client
        cancelled, and abort those requests (frees their KV blocks); the engine's "abort" output then ends the
        stream with a CANCELLED error. Each ask is an IPC round trip to tritonserver, so with many streams each
        is asked less often rather than the checks eating the cores the engine runs on."""
        now = self.clock()
        if now < self._next_check or not self.streams:
            return
        self._next_check = now + self.cancel_check_interval
        turn, self._cancel_cursor = next_turn(list(self.streams), self._cancel_cursor)
        for request_id in turn:
            if not self.streams[request_id].cancelled and self.streams[request_id].sender.is_cancelled():
                self._cancel(request_id, "was cancelled")

    def _cancel(self, request_id: str, why: str) -> None:
        """Abort the request in the engine (its KV blocks are freed at once); its "abort" output ends it."""
        stream = self.streams[request_id]
        if not stream.cancelled:
            stream.cancelled = True
            triton_id = f" (Triton request id {stream.triton_request_id!r})" if stream.triton_request_id else ""
            logger.info("nanoserve: request %s%s %s; aborting it", request_id, triton_id, why)
            self.engine_core.abort(request_id)

    # ---- one response ---------------------------------------------------------------------------------
    def _on_output(self, request_id: str, outputs: list) -> None:
        stream = self.streams.get(request_id)
        if stream is None:  # already ended (a failure raced with a last output)
            return
        stream.add(outputs)
        finished = outputs[-1].finished  # merge_into puts the latest last
        if stream.cancelled and not (finished and stream.abort_with_final):
            if finished:
                self._fail(request_id, RequestError(None, "request cancelled", ErrorKind.CANCELLED), finished=True)
            return
        arrays = self.formatter(stream, outputs)
        if finished:
            self._finish(request_id, arrays)
        elif arrays is not None:
            stream.sender.send(self._response(arrays))
            stream.responded = True
            self.events.eager.discard(request_id)

    def _record_timing(self, step: StepResult) -> None:
        """TTFT, and the times of the first and last tokens, from the time the engine step produced them (once per
        request and step, whatever number of its samples got a token)."""
        gaps, now, streams = [], step.time, self.streams
        for output in step.outputs:
            stream = streams.get(output.request_id)
            if stream is None or not output.new_token_ids or stream.last_token == now:
                continue
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.record_first_token(now - stream.arrival, output.num_prompt_tokens)
            else:
                gaps.append(now - stream.last_token)
            stream.last_token = now
        self.metrics.record_token_gaps(gaps)

    def _finish(self, request_id: str, arrays: dict) -> None:
        stream = self.streams.pop(request_id)
        self.events.eager.discard(request_id)
        self._record_finished(stream)
        stream.sender.send(self._response(arrays), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _fail(self, request_id: str, error: RequestError, finished: bool = False) -> None:
        """End the request with an error (or ended_arrays); finished: the engine ended it (its metrics are
        recorded). An error about the prompt names the input the client sent it in."""
        stream = self.streams.pop(request_id, None)
        self.events.eager.discard(request_id)
        if stream is None:
            return
        error = error.renamed({"prompt": prompt_input(stream.request.prompt)})
        if finished:
            self._record_finished(stream)
        if stream.responded and self.ended_arrays is not None:
            logger.warning("nanoserve: request %s ends early: %s", request_id, error)
            stream.sender.send(self._response(self.ended_arrays(stream, request_id)),
                               flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self._send_error(stream.sender, error)

    def _record_finished(self, stream: Stream) -> None:
        """Before the last response is sent; the last request in flight also publishes every metric then, so a
        client that has its last response reads metrics that count it."""
        self._record_latencies(stream)
        if not self.streams:
            self._publish_metrics(force=True)

    def _record_latencies(self, stream: Stream) -> None:
        """One request: the reason of its last sample to end, and the tokens of all its samples."""
        last = max((sample.last for sample in stream.samples if sample.last is not None), key=lambda o: o.finished)
        end = stream.last_token or time.monotonic()
        self.metrics.record_finished(last.finish_reason, end - stream.arrival, last.num_prompt_tokens,
                                     sum(len(sample.token_ids) for sample in stream.samples),
                                     stream.request.sampling_params)
        longest = max(len(sample.token_ids) for sample in stream.samples)
        if stream.first_token is not None and longest > 1:
            # one sample per request, its mean (genai-perf's inter-token latency): a sample per token would be
            # an IPC round trip to tritonserver per token, ~15% of the throughput at 64 streams on 2 cores
            self.metrics.record_inter_token((end - stream.first_token) / (longest - 1))

    # ---- Triton objects -----------------------------------------------------------------------------
    def _response(self, arrays: dict):
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(name, a) for name, a in arrays.items()])

    def _send_error(self, sender, error: RequestError) -> None:
        triton_error = self.pb.TritonError(str(error), getattr(self.pb.TritonError, error.kind.value))
        sender.send(self.pb.InferenceResponse(error=triton_error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def next_turn(keys: list, cursor: int, count: int = CANCEL_CHECKS_PER_ROUND) -> tuple[list, int]:
    """Round-robin: up to count keys from position cursor on (wrapping around), and the cursor after them."""
    if not keys:
        return [], 0
    start = cursor % len(keys)
    turn = (keys[start:] + keys[:start])[:count]
    return turn, start + len(turn)


# ---- formatters: (stream, RequestOutputs) -> arrays ----------------------------------------------------
class Generated(NamedTuple):
    """The tokens one response reports: their ids, and with logprobs each one's {token_id: logprob} (the sampled
    token and the top ones) and the sampled token's rank."""
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    ranks: list[int]


NOTHING = Generated([], [], [])


class Entry(NamedTuple):
    """What one response says about one sample: its text, its tokens, and its latest output (finish reason,
    cumulative logprob; None before it has one)."""
    text: str
    generated: Generated
    output: object


def text_formatter(tokenizer, send_empty: bool = False):
    """The text model's formatter for the response thread, decoding logprobs' tokens with the engine's tokenizer.
    send_empty: streamed outputs whose text is held back still get a response (an empty delta), as vllm_backend
    sends one per step."""
    token_text = token_decoder(tokenizer)
    return lambda stream, outputs: text_arrays(stream, outputs, token_text, send_empty, tokenizer.decode)


def text_arrays(stream: Stream, outputs: list, token_text, send_empty: bool = False, decode=None) -> dict | None:
    """Text model: one entry per sample in every output tensor. Streaming sends each sample's delta (never the
    prompt; empty for a sample with nothing new); otherwise one response when the request has finished. Runs for
    every streamed response, so its checks are loops rather than generators."""
    request = stream.request
    if not request.stream:
        return whole_text_arrays(stream, outputs, token_text, decode)
    token_level, send, prompt_logprobs = bool(request.outputs & TOKEN_LEVEL_OUTPUTS), send_empty, None
    for output in outputs:
        send = send or output.text_delta or output.finished or (token_level and output.new_token_ids)
        if output.prompt_logprobs is not None:
            prompt_logprobs = output.prompt_logprobs
    if not send:
        return None  # text held back (an incomplete character or a possible stop string)
    entries = streamed_entries(stream, outputs)
    return {TEXT_OUTPUT.name: TEXT_OUTPUT.array([entry.text for entry in entries]),
            **optional_arrays(request, entries, prompt_logprobs, token_text)}


def whole_text_arrays(stream: Stream, outputs: list, token_text, decode=None) -> dict | None:
    """Not streamed: each sample's whole text (the prompt first, unless exclude_input_in_output: input_ids decoded
    by `decode`), once the request has finished."""
    if not accumulate(stream, outputs):
        return None
    prompt = stream.request.prompt
    prefix = "" if stream.request.exclude_input else prompt if isinstance(prompt, str) else decode(prompt)
    entries = [Entry(prefix + sample.whole.text_delta, whole_generated(sample), sample.last)
               for sample in stream.samples]
    return {TEXT_OUTPUT.name: TEXT_OUTPUT.array([entry.text for entry in entries]),
            **optional_arrays(stream.request, entries, prompt_logprobs_of(stream), token_text)}


def streamed_entries(stream: Stream, outputs: list) -> list[Entry]:
    """Per sample: what these outputs bring, or nothing new."""
    entries = [None] * len(stream.samples)
    for output in outputs:
        entries[output.index] = Entry(output.text_delta, Generated(output.new_token_ids, output.new_logprobs,
                                                                   output.new_logprob_ranks), output)
    if len(outputs) < len(entries):
        for index, sample in enumerate(stream.samples):
            entries[index] = entries[index] or Entry("", NOTHING, sample.last)
    return entries


def accumulate(stream: Stream, outputs: list) -> bool:
    """A non-streamed request: join each sample's outputs into one; True when the request has finished."""
    for output in outputs:
        sample = stream.samples[output.index]
        sample.whole = output if sample.whole is None else joined(sample.whole, output)
    return outputs[-1].finished


def whole_generated(sample: Sample) -> Generated:
    """A non-streamed sample's tokens and their logprobs, once accumulated."""
    return Generated(sample.token_ids, sample.whole.new_logprobs, sample.whole.new_logprob_ranks)


def prompt_logprobs_of(stream: Stream):
    """A non-streamed request's PromptLogprobs (on its first sample's outputs), or None."""
    wholes = [sample.whole for sample in stream.samples if sample.whole is not None]
    return next((whole.prompt_logprobs for whole in wholes if whole.prompt_logprobs is not None), None)


def optional_arrays(request: ParsedRequest, entries: list[Entry], prompt_logprobs, token_text) -> dict:
    """The outputs the request asked for with return_* flags, in vllm_backend's formats, one entry per sample
    (num_input_tokens and prompt_logprobs: one per request)."""
    values, outputs = {}, request.outputs
    if "finish_reason" in outputs:
        values["finish_reason"] = [finish_reason_text(entry.output) for entry in entries]
    if "cumulative_logprob" in outputs:
        values["cumulative_logprob"] = [0.0 if entry.output is None else entry.output.cumulative_logprob
                                        for entry in entries]
    if "logprobs" in outputs:
        top_n = request.sampling_params.logprobs
        values["logprobs"] = [json.dumps(None if top_n is None else vllm_logprobs(entry.generated, top_n, token_text))
                              for entry in entries]
    if "num_input_tokens" in outputs:
        first = next(entry.output for entry in entries if entry.output is not None)
        values["num_input_tokens"] = [first.num_prompt_tokens]
    if "num_output_tokens" in outputs:
        values["num_output_tokens"] = [len(entry.generated.token_ids) for entry in entries]
    if "prompt_logprobs" in outputs:
        values["prompt_logprobs"] = [json.dumps(prompt_logprobs_json(request, prompt_logprobs, token_text))]
    return {name: COMMON_OUTPUTS[name].array(value) for name, value in values.items()}


def finish_reason_text(output) -> str:
    """A sample's "stop", "length" or "abort" once it has ended; "None" before, as vllm_backend sends."""
    return "None" if output is None or output.finish_reason is None else str(output.finish_reason)


def prompt_logprobs_json(request: ParsedRequest, prompt_logprobs, token_text) -> list | None:
    """vLLM's prompt_logprobs in vllm_backend's logprobs format: None for the first prompt token, then per token
    the token itself and the top `prompt_logprobs` ones; None in a response that does not carry them."""
    top_n = request.sampling_params.prompt_logprobs
    if top_n is None or prompt_logprobs is None:
        return None
    generated = Generated(prompt_logprobs.token_ids, prompt_logprobs.logprobs, prompt_logprobs.ranks)
    return [None, *vllm_logprobs(generated, top_n, token_text)]


def vllm_logprobs(generated: Generated, top_n: int, token_text) -> list[dict]:
    """vllm_backend's `logprobs`: per token {token_id: {"logprob", "rank", "decoded_token"}}, the sampled token
    first, then the top_n most likely ones by rank (the sampled one among them keeps its place first)."""
    per_token = []
    for token_id, entry, rank in zip(*generated):
        top = sorted(entry, key=entry.__getitem__, reverse=True)[:top_n]
        ranks = {t: i for i, t in enumerate(top, 1)}
        ranks.setdefault(token_id, rank)
        per_token.append({str(t): {"logprob": entry[t], "rank": ranks[t], "decoded_token": token_text(t)}
                          for t in [token_id, *top]})
    return per_token
