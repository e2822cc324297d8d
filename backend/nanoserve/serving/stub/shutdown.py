"""Noticing tritonserver's shutdown from inside the stub, so that the streams it is about to cut get an error.

On SIGTERM, tritonserver 2.51 waits up to --exit-timeout-secs for its HTTP connections to close (meanwhile it
refuses new HTTP connections but still takes gRPC requests), then exits and cuts whatever still streams: an HTTP
SSE stream just stops (no error event), a gRPC stream gets GOAWAY. The model is never told: its requests are not
cancelled, it stays ready, finalize() is not called. What it can see is that the HTTP front end stops serving new
connections at once (it accepts and drops them), so ShutdownWatch asks it for /v2/health/live every `interval`
seconds; from the first refusal the requests in flight have until exit timeout - MARGIN (`deadline`) before the
response thread ends them with UNAVAILABLE. The address, port and exit timeout come from tritonserver's command
line (the stub's parent).

Listed with the tritonserver workarounds: serving/workarounds.py, 'shutdown-cuts-streams-silently'.
"""
from __future__ import annotations

import http.client
import os
import threading
import time
from dataclasses import dataclass

from nanoserve.coercion import optional_bool
from nanoserve.thread_names import set_os_thread_name

MARGIN = 3.0  # seconds before the exit timeout: a polling interval, sending the errors, unloading the model
DEFAULT_EXIT_TIMEOUT = 30.0  # tritonserver's


@dataclass(frozen=True)
class ServerArgs:
    http_host: str
    http_port: int
    exit_timeout: float
    explicit_model_control: bool = False  # --model-control-mode=explicit: a model may unload itself

    @classmethod
    def parse(cls, argv: list[str]) -> "ServerArgs | None":
        """tritonserver's arguments (--name=value or --name value); None when it serves no HTTP."""
        values = {}
        for i, arg in enumerate(argv):
            name, sep, value = arg.partition("=")
            if name.startswith("--"):
                values[name[2:]] = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
        host = values.get("http-address", "0.0.0.0")
        try:
            if not optional_bool("allow-http", values.get("allow-http"), default=True):
                return None
            return cls("127.0.0.1" if host in ("0.0.0.0", "") else host, int(values.get("http-port", 8000)),
                       float(values.get("exit-timeout-secs", DEFAULT_EXIT_TIMEOUT)),
                       values.get("model-control-mode") == "explicit")
        except ValueError:
            return None

    @classmethod
    def of_parent(cls) -> "ServerArgs | None":
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            return None
        return cls.parse(argv) if argv and os.path.basename(argv[0]) == "tritonserver" else None


class ShutdownWatch:
    def __init__(self, server: ServerArgs, interval: float = 1.0, clock=time.monotonic):
        self.server, self.interval, self.clock = server, interval, clock
        self.deadline: float | None = None  # clock() by which the requests in flight must have ended
        self.seen_up = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ns-shutdown", daemon=True)

    def start(self) -> "ShutdownWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        """Draining, the front end accepts a connection and drops it ("reset"). A closed port ("refused") means
        the same only once it was seen up: tritonserver opens it after every model has loaded."""
        set_os_thread_name(self._thread.name)
        while not self._stop.wait(self.interval):
            state = self.http_state()
            self.seen_up = self.seen_up or state == "up"
            if state == "reset" or state == "refused" and self.seen_up:
                self.deadline = self.clock() + max(self.server.exit_timeout - MARGIN, 0.0)
                return

    def http_state(self) -> str:
        """"up", "reset", "refused", or "unknown" (e.g. a timeout under load)."""
        connection = http.client.HTTPConnection(self.server.http_host, self.server.http_port, timeout=self.interval)
        try:
            connection.request("GET", "/v2/health/live")
            connection.getresponse().read()
            return "up"
        except ConnectionRefusedError:
            return "refused"
        except (ConnectionResetError, http.client.RemoteDisconnected):
            return "reset"
        except OSError:
            return "unknown"
        finally:
            connection.close()
