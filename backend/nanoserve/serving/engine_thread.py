"""The continuous-batching loop: one thread owns the LLMEngine (not thread-safe), applies the add/abort commands
queued by other threads between steps, and sleeps on a condition while there is nothing to do."""
from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from nanoserve.engine.tokenize import encode_prompt_text
from nanoserve.thread_names import set_os_thread_name

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    outputs: list = field(default_factory=list)  # RequestOutput of this step
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message): bad input
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message): internal errors
    stats: dict = field(default_factory=dict)  # engine.stats() after the step
    time: float = 0.0  # time.monotonic() when the step's tokens were ready


class EngineThread:
    def __init__(self, engine, results: queue.Queue, name: str = "ns-engine"):
        self.engine = engine
        # The engine's tokenizer belongs to the engine thread: HF tokenizers are not safe to share across threads.
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self.results = results  # StepResults go here, in order
        self._commands: list[tuple] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def add(self, request_id: str, prompt, sampling_params) -> None:
        """Called from execute(): text is tokenized here, on the caller's thread, so that a huge prompt
        stalls only its own request and never the streams the engine thread is serving."""
        if isinstance(prompt, str):
            prompt = encode_prompt_text(self._tokenizer, prompt)
        self._push(("add", request_id, prompt, sampling_params))

    def abort(self, request_id: str) -> None:
        self._push(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _push(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        set_os_thread_name(self._thread.name)
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            result = StepResult()
            self._apply(commands, result)
            try:
                if self.engine.has_unfinished_requests():
                    result.outputs = self.engine.step()
            except Exception:  # keep serving: fail what was running, not the model
                logger.error("nanoserve engine step failed:\n%s", traceback.format_exc())
                result.failed += self._abort_all("internal error: the engine step failed (see the server log)")
            result.stats, result.time = self.engine.stats(), time.monotonic()
            self.results.put(result)

    def _apply(self, commands: list[tuple], result: StepResult) -> None:
        for kind, request_id, *args in commands:
            if kind == "abort":
                self.engine.abort_request(request_id)  # its "abort" output comes with the next step()
                continue
            try:
                self.engine.add_request(request_id, *args)
            except ValueError as e:
                result.rejected.append((request_id, str(e)))
            except Exception as e:
                logger.error("nanoserve add_request failed:\n%s", traceback.format_exc())
                result.failed.append((request_id, f"internal error: {e}"))

    def _abort_all(self, message: str) -> list[tuple[str, str]]:
        return [(request_id, message) for request_id in self.engine.abort_all()]
