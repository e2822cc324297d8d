"""Real tritonservers for tests: free ports on 127.0.0.1, the log under the test's tmp dir, and always stopped
(process group and /dev/shm regions included), even when the test fails.

    from triton_server import running_server, tiny_repository, nanoserve_server  # noqa: F401 (fixture)

    with running_server(repository, tmp_path, models=["nanoserve"]) as server:
        server.url_grpc, server.url_http, server.log_path

Fixture `nanoserve_server` (module scope): the `nanoserve` text model of model_repository/ serving the
default tiny Qwen3 checkpoint (conftest's `qwen3_dir`) with TEST_ENGINE_ARGS.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nanoserve.serving.serve.launcher import (SHM_DIR, TritonServer, free_ports, group_members, make_model_repository,
                                              processes)

# Small CPU KV cache: a stub with the default 1 GiB takes ~1.4 GB of memory.
TEST_ENGINE_ARGS = {"device": "cpu", "cpu_kvcache_space_gib": 0.125}
LOAD_TIMEOUT = 240.0


@contextmanager
def running_server(model_repository, log_dir, models=(), timeout: float = LOAD_TIMEOUT, **server_args):
    """A started, ready TritonServer (tritonserver's log: log_dir/tritonserver.log); stopped on exit."""
    log_file = Path(log_dir) / "tritonserver.log"
    server = TritonServer(model_repository, *free_ports(3), log_file=log_file, **server_args)
    try:
        server.start()
        server.wait_ready(timeout, models=list(models))
        yield server
    finally:
        server.stop()
    assert_no_stub_crash(log_file)


def assert_no_stub_crash(log_file) -> None:
    """The nanoserve backend enables faulthandler in its stub: a crash (even on unload) leaves this in the log."""
    log = Path(log_file).read_text(errors="replace")
    assert "Fatal Python error" not in log, log[log.index("Fatal Python error"):][:3000]


def tiny_repository(dest, checkpoint, models=("nanoserve",), **engine_args) -> Path:
    """A copy of the repo's model_repository/ (only `models`) serving checkpoint."""
    return make_model_repository(dest, checkpoint, models=list(models), **{**TEST_ENGINE_ARGS, **engine_args})


def shm_regions(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*"))


def assert_nothing_left(server: TritonServer) -> None:
    assert server.poll() is not None, "tritonserver still running"
    assert group_members(server.process.pid) == [], "processes (stubs?) left in tritonserver's group"
    assert shm_regions(server.shm_prefix) == [], "shared memory regions left behind"


def child_pid(parent: int, timeout: float = LOAD_TIMEOUT, exclude=()) -> int:
    """A child process of parent (not one of exclude), once there is one. A parent that starts it late (a busy
    machine slows its imports) is waited for as long as a model load; one that exits without it fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children, alive = [], False
        for pid, state, ppid, _ in processes():
            alive |= pid == parent and state != "Z"
            if ppid == parent and pid not in exclude:
                children.append(pid)
        if children:
            return children[0]
        if not alive:
            raise RuntimeError(f"{parent} exited without starting a child")
        time.sleep(0.1)
    raise TimeoutError(f"no child of {parent} in {timeout:.0f} s")


def http_ready(http_port: int, path: str = "/v2/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def kill_group(pgid: int) -> None:
    """Last resort for servers started outside TritonServer (e.g. by the CLI in a subprocess)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def nanoserve_server(qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nanoserve_server")
    repository = tiny_repository(tmp / "model_repository", qwen3_dir)
    with running_server(repository, tmp, models=["nanoserve"]) as server:
        yield server


# ---- `nanoserve serve` in a subprocess --------------------------------------------------------------------
@dataclass
class Served:
    """A running `nanoserve serve`: its process, ports and what it printed so far."""
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int
    output: list[str] = field(default_factory=list)

    @property
    def url_http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url_grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url_metrics(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}/v1"


@contextmanager
def nanoserve_serve(model, log_dir, *flags, timeout: float = LOAD_TIMEOUT):
    """`nanoserve serve MODEL --device cpu ... FLAGS` (model None: FLAGS name a --model-repository) on free ports,
    yielded once it printed its banner (the models are ready then). On exit: SIGTERM, exit code 0, tritonserver
    and its stubs gone."""
    http, grpc, metrics, openai = free_ports(4)
    log_file = Path(log_dir) / "tritonserver.log"
    engine = [] if model is None else [str(model), "--device", "cpu", "--cpu-kvcache-space-gib",
                                       str(TEST_ENGINE_ARGS["cpu_kvcache_space_gib"])]
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", *engine, "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai), "--log-file", str(log_file),
           "--exit-timeout-secs", "30", *flags]  # 30: stubs unload slowly on a busy machine; flags may override it
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    served = Served(process, http, grpc, metrics, openai)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr] + [lines.put(None)],
                     daemon=True).start()
    triton_pid = None
    try:
        deadline = time.monotonic() + timeout
        while not served.output or not served.output[-1].startswith("Ctrl-C stops"):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "nanoserve serve exited:\n" + "".join(served.output)
            served.output.append(line)
        triton_pid = next(pid for pid, _, ppid, _ in processes() if ppid == process.pid)
        yield served
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        if triton_pid is not None:
            kill_group(triton_pid)
    assert code == 0, "".join(served.output)
    assert triton_pid is None or group_members(triton_pid) == []
    assert_no_stub_crash(log_file)
