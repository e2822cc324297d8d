"""Request intake, on a thread of its own: execute() hands tritonserver's requests here and returns at once.

tritonserver calls a decoupled Python model's execute() with one request at a time, and the next call waits for
the last one's return (a round trip through the stub's shared-memory channel). Parsing and tokenizing inside
execute() added their time to every round trip: 64 requests arriving together entered the engine over about
150 ms on a busy 2-vCPU machine, 2.4 ms each. Here the requests waiting are taken together, in arrival order:
each is parsed (`admit`: a control event, a rejection, or an Admission), the text prompts admitted are
tokenized in one call (which a fast tokenizer runs without holding the GIL, beside the engine's thread), and
then each request's event goes to the response thread and its prompt to the engine, in arrival order.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from nanoserve.engine.tokenize import encode_prompt_texts
from nanoserve.errors import ErrorKind, RequestError
from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.responses import Register, Stream
from nanoserve.thread_names import set_os_thread_name

logger = logging.getLogger(__name__)
STOP = object()


@dataclass
class Admission:
    """A request that parsed: registered with the response thread and added to the engine once its prompt is
    token ids."""
    request_id: str
    stream: Stream


Admit = Callable[[object, float], "Admission | object"]  # (request, arrival) -> an Admission or an event


class Intake:
    """`admit(request, arrival)` parses one request on this thread (it must not raise); `events` is the response
    thread's inbox; `engine` the engine core (its add() takes token ids); the tokenizer is this thread's own."""

    def __init__(self, admit: Admit, events, engine, tokenizer, max_prompt_bytes: int, name: str = "ns-intake"):
        self._admit, self._events, self._engine = admit, events, engine
        self._tokenizer, self._max_prompt_bytes = tokenizer, max_prompt_bytes
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, request) -> None:
        """execute()'s thread: queue a request, stamped with its arrival."""
        self._waiting.put((request, time.monotonic()))

    def stop(self, timeout: float = 30.0) -> None:
        """Enter every request queued so far, then end the thread."""
        self._waiting.put(STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        set_os_thread_name(self._thread.name)
        while True:
            batch = [self._waiting.get()]
            while not self._waiting.empty():
                batch.append(self._waiting.get())
            stopping = batch[-1] is STOP
            try:
                self.enter([item for item in batch if item is not STOP])
            except Exception:  # (admit and tokenizing fail only their own requests): a bug must not end the intake
                logger.exception("nanoserve: entering requests failed")
            if stopping:
                return

    def enter(self, batch: list[tuple[object, float]]) -> None:
        """Parse, tokenize and hand on a batch of (request, arrival), in order."""
        admitted = [self._admit(request, arrival) for request, arrival in batch]
        prompts = iter(self._token_ids([item for item in admitted if isinstance(item, Admission)]))
        for item in admitted:
            if not isinstance(item, Admission):
                self._events.put(item)
                continue
            prompt_ids = next(prompts)
            self._events.put(Register(item.request_id, item.stream))  # before the engine can answer
            if isinstance(prompt_ids, RequestError):  # rejected as the engine rejects (naming the prompt's input)
                self._events.put(StepResult(rejected=[(item.request_id, prompt_ids)]))
                continue
            self._engine.add(item.request_id, prompt_ids, item.stream.request.sampling_params)

    def _token_ids(self, admitted: list[Admission]) -> list[list[int] | RequestError]:
        """Each admission's prompt as token ids, or the error that rejects it, in order."""
        prompts = [item.stream.request.prompt for item in admitted]
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        try:
            encoded = encode_prompt_texts(self._tokenizer, texts, self._max_prompt_bytes)
        except Exception as e:  # a tokenizer bug must fail these requests only, never the intake
            logger.exception("nanoserve: tokenizing prompts failed")
            error = RequestError(None, f"internal error: tokenizing the prompt failed ({type(e).__name__})",
                                 ErrorKind.INTERNAL)
            encoded = [error] * len(texts)
        encoded = iter(encoded)
        return [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]
