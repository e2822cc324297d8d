"""The executor owns the model runners (docs/architecture.md, "Executor and model runner"). A worker exits on
("exit", ()) or when rank 0's end of its pipe closes, so no process outlives the engine."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable

from nanoserve.config import EngineConfig
from nanoserve.distributed import destroy_tp, free_port, init_tp
from nanoserve.engine.model_runner import BitmaskOf, LaunchedStep, ModelRunner, RunnerOutput, pick_device
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.thread_names import set_os_thread_name


class Executor:
    def __init__(self, config: EngineConfig, eos_token_ids=()):
        self.runner: ModelRunner | None = None
        self.conns, self.procs = [], []
        try:
            if config.tensor_parallel_size > 1:
                port = free_port()
                self._start_workers(config, eos_token_ids, port)
                device = pick_device(config, 0)  # before the process group: NCCL binds the current GPU
                init_tp(0, config.tensor_parallel_size, port, config.device_type)
            else:
                device = pick_device(config, 0)
            self.runner = ModelRunner(config, device, eos_token_ids)
            self.num_kv_blocks: int = self.call("init_kv_cache")
        except BaseException:
            self.shutdown()
            raise

    def execute(self, out: SchedulerOutput, bitmask_of: BitmaskOf | None = None,
                while_running: Callable[[], None] | None = None) -> RunnerOutput:
        """One step on every rank; rank 0 makes the bitmask of structured outputs, samples, and calls
        while_running once the step is launched (see ModelRunner.execute)."""
        self._send_workers("execute", (out,))
        return self.runner.execute(out, bitmask_of, while_running)

    # async scheduling runs on one rank (EngineConfig refuses it with tensor parallelism)
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Prepare and launch a step while `previous` may still run (ModelRunner.launch)."""
        return self.runner.launch(out, previous)

    def sample_launched(self, step: LaunchedStep, bitmask) -> None:
        self.runner.sample_launched(step, bitmask)

    def result(self, step: LaunchedStep) -> RunnerOutput:
        return self.runner.result(step)

    def call(self, method: str, *args):
        """Run runner.<method>(*args) on every rank; returns rank 0's result."""
        self._send_workers(method, args)
        return getattr(self.runner, method)(*args)

    def _send_workers(self, method: str, args: tuple) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise RuntimeError(f"tensor-parallel rank {rank} has exited") from None

    def _start_workers(self, config: EngineConfig, eos_token_ids, port: int, timeout: float = 600.0) -> None:
        """Spawn ranks 1.., and wait until each has started (imports done), so that a worker that dies early is
        reported instead of leaving rank 0 blocked forever in the process-group rendezvous."""
        ctx = mp.get_context("spawn")
        use_a_python_executable(ctx)
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, eos_token_ids, rank, port, child),
                               name=f"nanoserve-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        deadline = time.monotonic() + timeout
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited during startup (exit code "
                                       f"{proc.exitcode}); see its traceback above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {timeout:.0f} s")
            conn.recv()

    def shutdown(self, timeout: float = 30.0) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker is already gone
                conn.send(("exit", ()))
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        destroy_tp()


def worker_main(config: EngineConfig, eos_token_ids, rank: int, port: int, conn) -> None:
    set_os_thread_name(f"ns-tp{rank}")  # what `top` and `ps -e` show for the worker, not "python"
    runner = None
    try:
        conn.send("ready")
        device = pick_device(config, rank)
        init_tp(rank, config.tensor_parallel_size, port, config.device_type)
        runner = ModelRunner(config, device, eos_token_ids)
        while True:
            method, args = conn.recv()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except EOFError:  # rank 0 went away
        pass
    except BaseException:
        traceback.print_exc()
        sys.stderr.write(f"nanoserve tensor-parallel rank {rank} failed; exiting\n")
        raise
    finally:
        if runner is not None:
            runner.shutdown()
        destroy_tp()
        conn.close()


def use_a_python_executable(ctx) -> None:
    """Spawned children start sys.executable; inside an embedding host (Triton's Python stub) that may not
    be a Python interpreter, so point multiprocessing at the environment's python instead."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return
    candidate = os.path.join(sys.exec_prefix, "bin", "python3")
    if os.path.exists(candidate):
        ctx.set_executable(candidate)
