"""The continuous-batching loop: one thread owns the LLMEngine (not thread-safe), applies the add/abort commands
queued by other threads between steps, and sleeps on a condition while there is nothing to do.

A step that raises must not fail the requests that did nothing wrong. The suspects are the requests admitted
since the last step that succeeded: they are failed, every other request is preempted by recompute
(LLMEngine.fail_and_recover), and the step is retried without them. If the retry raises too, or the thread dies,
the engine has failed (`failure`): every request in flight ends with UNAVAILABLE and the model reports not ready
(see backend/model.py)."""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from nanoserve.engine.outputs import RequestOutput
from nanoserve.errors import RequestError
from nanoserve.thread_names import set_os_thread_name

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What the engine thread reports after each step (the engine core process sends it as a message)."""
    outputs: list[RequestOutput] = field(default_factory=list)  # this step's
    rejected: list[tuple[str, RequestError]] = field(default_factory=list)  # (request_id, error): bad input
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message): internal errors
    stats: dict = field(default_factory=dict)  # engine.stats() after the step
    time: float = 0.0  # time.monotonic() when the step's tokens were ready
    failure: str | None = None  # the last result of an engine that has failed: why


class EngineThread:
    def __init__(self, engine, results: queue.Queue, name: str = "ns-engine"):
        self.engine = engine
        self.results = results  # StepResults go here, in order
        self._commands: list[tuple] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._admitted: set[str] = set()  # added since the last step that succeeded: the suspects if one fails
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more (None while it can)."""
        return self._failure

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def add(self, request_id: str, prompt: list[int], sampling_params) -> None:
        """Structured outputs are compiled here, on the caller's thread, so that a slow grammar stalls only its own
        request and never the streams the engine thread is serving. One whose grammar does not compile is
        rejected (its StepResult.rejected entry comes like any other)."""
        try:
            grammar = self.engine.compile_grammar(sampling_params)
        except ValueError as e:
            self._push(("reject", request_id, RequestError.of(e)))
            return
        self._push(("add", request_id, prompt, sampling_params, grammar))

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
        try:
            self._loop()
        except BaseException as e:  # whatever ends the thread ends the engine
            logger.error("nanoserve engine thread died:\n%s", traceback.format_exc())
            self._failure = f"the engine thread died ({type(e).__name__}: {e})"
        if self._failure is not None:
            with contextlib.suppress(Exception):  # (the results queue may be what failed)
                self.results.put(StepResult(time=time.monotonic(), failure=self._failure))

    def _loop(self) -> None:
        while self._failure is None:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            result = StepResult()
            self._apply(commands, result)
            if self.engine.has_unfinished_requests():
                self._step(result)
            result.stats, result.time = self.engine.stats(), time.monotonic()
            self.results.put(result)

    def _step(self, result: StepResult) -> None:
        in_flight = self.engine.output_processor.request_ids()
        try:
            result.outputs = self.engine.step(overlap=True)
        except Exception:
            logger.error("nanoserve engine step failed; retrying it without the %d request(s) admitted since the "
                         "last step that succeeded:\n%s", len(self._admitted), traceback.format_exc())
            self._recover(in_flight, result)
        self._admitted.clear()

    def _recover(self, in_flight: set[str], result: StepResult) -> None:
        suspects = self.engine.fail_and_recover(self._admitted)
        result.failed += [(request_id, "internal error: the engine step failed with this request in it (see the "
                                       "server log)") for request_id in suspects]
        # finished by the failed step before it raised: their last output is lost
        lost = in_flight - self.engine.output_processor.request_ids() - set(suspects)
        result.failed += [(request_id, "internal error: the engine step failed (see the server log)")
                          for request_id in sorted(lost)]
        try:
            result.outputs = self.engine.step(overlap=True)
        except Exception:
            logger.error("nanoserve engine step failed again after recovery; the engine has failed:\n%s",
                         traceback.format_exc())
            self.engine.abort_all()  # frees the blocks; the response thread ends the requests
            self._failure = "an engine step failed again after recovering from a failed step"

    def _apply(self, commands: list[tuple], result: StepResult) -> None:
        for kind, request_id, *args in commands:
            if kind == "abort":
                self.engine.abort_request(request_id)  # its "abort" output comes with the next step()
                continue
            if kind == "reject":
                result.rejected.append((request_id, *args))
                continue
            prompt, sampling_params, grammar = args
            try:
                self.engine.add_request(request_id, prompt, sampling_params, grammar=grammar)
                self._admitted.add(request_id)
            except ValueError as e:
                result.rejected.append((request_id, RequestError.of(e)))
            except Exception as e:
                logger.error("nanoserve add_request failed:\n%s", traceback.format_exc())
                result.failed.append((request_id, f"internal error: {e}"))


class EngineInProcess:
    """The engine on an EngineThread of the stub's own process, with EngineCoreClient's interface: the stub's
    default (config.pbtxt parameter engine_core_process)."""

    def __init__(self, config, results: queue.Queue, adapters: dict[str, str] | None = None):
        from nanoserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer  # (for the response thread's formatter)
        self.max_prompt_bytes = self.engine.max_prompt_bytes
        try:
            for name, path in (adapters or {}).items():
                self.engine.add_lora(name, path)
        except ValueError as e:
            self.engine.shutdown()
            raise RuntimeError(str(e)) from None
        self.results = results
        self.initial_stats = self.engine.stats()
        self._thread = EngineThread(self.engine, results).start()

    @property
    def failure(self) -> str | None:
        return self._thread.failure

    def add(self, request_id: str, prompt_ids: list[int], sampling_params) -> None:
        self._thread.add(request_id, prompt_ids, sampling_params)

    def abort(self, request_id: str) -> None:
        self._thread.abort(request_id)

    def stop(self) -> None:
        self._thread.stop()
        self.engine.shutdown()
