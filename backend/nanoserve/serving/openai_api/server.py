"""Runs the API with uvicorn on a thread of the calling process (`nanoserve serve` starts it once Triton's
models are ready, and stops it before tritonserver).

    with OpenAIServer("127.0.0.1:8001", Path("model_repository"), "127.0.0.1", 9000) as api:
        ...  # http://127.0.0.1:9000/v1
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn

from nanoserve.serving.openai_api.app import create_app

GRACEFUL_SHUTDOWN_SECONDS = 5  # then open streams are closed (their Triton requests cancelled)


class OpenAIServer:
    def __init__(self, grpc_url: str, repository: Path, host: str, port: int, log_level: str = "warning",
                 metrics_url: str | None = None, tool_call_parser: str | None = None):
        app = create_app(grpc_url, Path(repository), metrics_url, tool_call_parser)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS, lifespan="on")
        self.server = uvicorn.Server(config)
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v1"
        self._thread = threading.Thread(target=self.server.run, name="ns-openai", daemon=True)

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        """Until it listens; raises if it could not start (e.g. the port was taken meanwhile)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI API did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_SECONDS + 5) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
