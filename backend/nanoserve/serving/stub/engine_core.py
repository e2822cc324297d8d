"""The engine core in its own process, vLLM V1's EngineCoreProc at nanoserve's size (docs/architecture.md,
"Engine core process").

The Triton stub keeps request intake, tokenization, response sending and cancellation; the core process owns the
LLMEngine (scheduler, executor with its tensor-parallel workers, sampling, detokenization) and steps it on its
EngineThread. So the engine's steps never wait for the GIL of the stub, whose threads serve the streams, and the
stub's work runs on another core beside the engine's.

Two pipes join them, each carrying msgspec messages, never pickled objects: commands (add, abort, stop) one way,
one StepResult per engine step the other. In the core, the main thread reads commands and a writer thread encodes
and sends results, so that encoding overlaps the next step. A core that dies closes its pipe: the client's reader
sees the end at once, and `failure` says so (the response thread then ends every request with UNAVAILABLE). A stub
that dies closes the command pipe, and the core exits.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import traceback

import msgspec

from nanoserve.engine.executor import use_a_python_executable
from nanoserve.engine.tokenize import max_prompt_bytes
from nanoserve.errors import RequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.stub.engine_thread import EngineThread, StepResult
from nanoserve.thread_names import set_os_thread_name

logger = logging.getLogger(__name__)
STARTUP_POLL = 0.5  # seconds between looks at a core that is still loading


class Add(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Stop(msgspec.Struct, tag="stop"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    stats: dict  # the engine's stats() once loaded


class StartFailed(msgspec.Struct, tag="start_failed"):
    message: str  # why the engine could not load


Command = Add | Abort | Stop


# ---- the core process ---------------------------------------------------------------------------------------------
def core_main(config, adapters: dict[str, str], commands, results) -> None:
    """The core process: load the engine (and its LoRA adapters), say Ready, then step it until Stop or until the
    stub's end of the command pipe closes."""
    set_os_thread_name("ns-core")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        from nanoserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        for name, path in adapters.items():
            engine.add_lora(name, path)
    except BaseException as e:
        traceback.print_exc()
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"  # bad input says its field
        results.send_bytes(msgspec.msgpack.encode(StartFailed(message)))
        return
    steps = queue.SimpleQueue()
    engine_thread = EngineThread(engine, steps).start()
    results.send_bytes(msgspec.msgpack.encode(Ready(engine.stats())))
    writer = threading.Thread(target=_send_results, args=(steps, results), name="ns-core-out", daemon=True)
    writer.start()
    try:
        _read_commands(commands, engine_thread)
    finally:
        engine_thread.stop()
        steps.put(None)
        writer.join(10)
        engine.shutdown()


def _read_commands(commands, engine_thread: EngineThread) -> None:
    decoder = msgspec.msgpack.Decoder(Command)
    while True:
        try:
            command = decoder.decode(commands.recv_bytes())
        except (EOFError, OSError):  # the stub has gone
            return
        if isinstance(command, Add):
            engine_thread.add(command.request_id, command.prompt_token_ids, command.sampling_params)
        elif isinstance(command, Abort):
            engine_thread.abort(command.request_id)
        else:
            return


def _send_results(steps: queue.SimpleQueue, results) -> None:
    """Encode and send each StepResult (None ends); a stub that has gone ends it too."""
    set_os_thread_name("ns-core-out")
    encoder, _ = step_codec()
    while (step := steps.get()) is not None:
        try:
            results.send_bytes(encoder.encode(step))
        except OSError:
            return


def step_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    """StepResults as the core sends them: a RequestError (their one type msgspec does not know) as its parts."""
    return (msgspec.msgpack.Encoder(enc_hook=lambda error: [error.field, error.message, error.kind]),
            msgspec.msgpack.Decoder(StepResult, dec_hook=lambda kind, parts: RequestError(*parts)))


# ---- the stub's side ----------------------------------------------------------------------------------------------
class EngineCoreClient:
    """Starts the core process and talks to it; the stub's replacement for an EngineThread of its own. StepResults
    go to `results` in order, with those of requests rejected here (a prompt that cannot fit)."""

    def __init__(self, config, results: queue.Queue, adapters: dict[str, str] | None = None):
        from transformers import AutoTokenizer

        self.results = results
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)  # (for the response thread's formatter)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, config.max_model_len)
        self._failure: str | None = None
        self._stopping = False  # stop() was called: the core's end is no failure
        self._send_lock = threading.Lock()  # execute() adds while the response thread aborts
        self._encoder = msgspec.msgpack.Encoder()
        self.process, self._commands, self._results = _spawn_core(config, adapters or {})
        self.initial_stats = self._wait_ready().stats
        self._reader = threading.Thread(target=self._read_results, name="ns-core-in", daemon=True)
        self._reader.start()

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more (None while it can)."""
        return self._failure

    def add(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> None:
        self._send(Add(request_id, prompt_ids, sampling_params))

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the core (its engine shuts down, its workers exit) and wait for it; kill one that does not stop."""
        self._stopping = True
        self._send(Stop())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._commands.close()
        self._reader.join(5)

    def _send(self, command: Command) -> None:
        data = self._encoder.encode(command)
        with self._send_lock:
            try:
                self._commands.send_bytes(data)
            except OSError:  # the core has gone: the reader reports it
                pass

    def _wait_ready(self) -> Ready:
        """Wait for the core to load its engine; raise RuntimeError with its reason when it cannot."""
        while not self._results.poll(STARTUP_POLL):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited while loading (exit code "
                                   f"{self.process.exitcode}); see its traceback above")
        try:
            message = msgspec.msgpack.decode(self._results.recv_bytes(), type=Ready | StartFailed)
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine core process exited while loading (exit code {self.process.exitcode}); "
                               "see its traceback above") from None
        if isinstance(message, StartFailed):
            self.process.join(30)
            raise RuntimeError(message.message)
        return message

    def _read_results(self) -> None:
        set_os_thread_name("ns-core-in")
        _, decoder = step_codec()
        while True:
            try:
                step = decoder.decode(self._results.recv_bytes())
            except (EOFError, OSError):
                break
            if step.failure is not None:
                self._failure = step.failure
            self.results.put(step)
        if self._failure is None and not self._stopping:
            self.process.join(5)
            self._failure = f"the engine core process exited (exit code {self.process.exitcode})"
            logger.error("nanoserve: %s", self._failure)


def _spawn_core(config, adapters: dict[str, str]):
    """The core process and the stub's ends of its two pipes. Not a daemon: it starts tensor-parallel workers of
    its own; it exits when the stub's end of the command pipe closes."""
    ctx = mp.get_context("spawn")
    use_a_python_executable(ctx)
    commands_out, commands_in = ctx.Pipe(duplex=False)  # (receiving end, sending end)
    results_out, results_in = ctx.Pipe(duplex=False)
    process = ctx.Process(target=core_main, args=(config, adapters, commands_out, results_in),
                          name="nanoserve-core", daemon=False)
    process.start()
    commands_out.close()
    results_in.close()
    return process, commands_in, results_out

