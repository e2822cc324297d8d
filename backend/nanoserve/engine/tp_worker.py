"""Tensor-parallel ranks 1..tp-1: spawned processes, each running its own ModelRunner shard.

Rank 0 (the engine's runner) sends every call as a pickled (method, args) through one pipe per worker and
then runs the same method itself; the collectives inside the forward keep all ranks in step. Workers never
answer: only rank 0 returns logits and samples. A worker exits on ("exit", ()) or when rank 0's end of the
pipe closes, so no process outlives the engine (the Triton stub must be able to exit).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback


class TPWorkers:
    def __init__(self, config, dist_port: int):
        ctx = mp.get_context("spawn")
        _use_a_python_executable(ctx)
        self.conns, self.procs = [], []
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, rank, dist_port, child),
                               name=f"nanoserve-tp{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait until every worker has started (imports done), so that a worker that dies early is reported
        instead of leaving rank 0 blocked forever in the process-group rendezvous."""
        deadline = time.monotonic() + timeout
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited during startup (exit code "
                                       f"{proc.exitcode}); see its traceback above")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {timeout:.0f} s")
            conn.recv()

    def call(self, method: str, *args) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise RuntimeError(f"tensor-parallel rank {rank} has exited") from None

    def shutdown(self, timeout: float = 30.0) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except (BrokenPipeError, OSError):  # that worker is already gone
                pass
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def worker_main(config, rank: int, dist_port: int, conn) -> None:
    from nanoserve.engine.model_runner import ModelRunner
    from nanoserve.thread_names import set_os_thread_name

    set_os_thread_name(f"ns-tp{rank}")  # what `top` and `ps -e` show for the worker, not "python"
    runner = None
    try:
        conn.send("ready")
        runner = ModelRunner(config, rank=rank, dist_port=dist_port)
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
        conn.close()


def _use_a_python_executable(ctx) -> None:
    """Spawned children start sys.executable; inside an embedding host (Triton's Python stub) that may not
    be a Python interpreter, so point multiprocessing at the environment's python instead."""
    if os.path.basename(sys.executable or "").startswith("python"):
        return
    candidate = os.path.join(sys.exec_prefix, "bin", "python3")
    if os.path.exists(candidate):
        ctx.set_executable(candidate)
