"""`nanoserve serve`: run tritonserver until SIGINT/SIGTERM, and restart it when a Python backend stub dies.

tritonserver 2.51 does not notice a dead stub (SIGKILL, the OOM killer, a crash): the model stays ready, each new
request fails with "Stub process '<instance>' is not healthy.", and the requests in flight never get a final
response. python_backend restarts no stub of a decoupled model, and reloading the model through the repository API
does not help: the new version serves, but the old one keeps the in-flight requests' response factories, which
only the dead stub could release, so it never unloads and SIGTERM ends in the exit timeout (exit code 1). A new
tritonserver does help: the clients of the old one see their connection close (an error within seconds), and the
models serve again once loaded.

A stub that exits is a zombie until its parent reaps it. tritonserver reaps the stubs it stops itself (an unload,
a failed load) at once, so a stub that stays a zombie died on its own.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nanoserve.serving.launcher import STUB_NAME, TritonServer, processes

CHECK_INTERVAL = 1.0  # seconds between looks at the stubs
ZOMBIE_GRACE = 2.0  # seconds a stub stays a zombie before it counts as dead (tritonserver reaps its own at once)
RESTART_GRACE = 5.0  # seconds the old tritonserver's other requests get to finish before its group is killed
MAX_RESTARTS = 3  # within RESTART_WINDOW; a stub that keeps dying is left to the orchestrator (exit code 1)
RESTART_WINDOW = 600.0


@dataclass(frozen=True)
class DeadStub:
    pid: int
    instance: str  # the model instance it served, e.g. nanoserve_0_0
    wait_status: int  # as waitpid reports it

    def __str__(self) -> str:
        status = self.wait_status
        how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exited with code {os.WEXITSTATUS(status)}")
        return f"the stub of {self.instance} (pid {self.pid}) {how}"


class StubWatch:
    """The Python backend stubs of one tritonserver (its process group), and those that died on their own."""

    def __init__(self, pgid: int, clock=time.monotonic):
        self.pgid = pgid
        self.clock = clock
        self.instances: dict[int, str] = {}  # live stub pid -> model instance (a zombie has no command line)
        self.zombie_since: dict[int, float] = {}

    def dead(self) -> list[DeadStub]:
        now, found = self.clock(), []
        for pid, state, _, group in processes():
            if group != self.pgid or pid == self.pgid:
                continue
            if state != "Z":
                if not self.instances.get(pid):  # read again until the process has exec'd the stub
                    self.instances[pid] = stub_instance(pid)
            elif self.instances.get(pid) and now - self.zombie_since.setdefault(pid, now) >= ZOMBIE_GRACE:
                found.append(DeadStub(pid, self.instances[pid], wait_status(pid)))
        return found


def stub_instance(pid: int) -> str:
    """The model instance a stub serves (its 8th argument), "" for any other process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return argv[8].decode() if len(argv) > 8 and argv[0].endswith(STUB_NAME.encode()) else ""


def wait_status(pid: int) -> int:
    """A zombie's exit status (/proc/PID/stat field 52), 0 when unreadable."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[49])
    except (OSError, IndexError, ValueError):
        return 0


def serve_until_signal(server: TritonServer) -> int:
    """Start the server and run until it exits or SIGINT/SIGTERM arrives (forwarded, then the server stopped);
    restart it when a stub dies (at most MAX_RESTARTS times within RESTART_WINDOW, then exit code 1)."""
    received: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if server.process is None and not received:
            server.start()
        if not _supervise(server, received):
            server.stop(signal.SIGTERM, timeout=RESTART_GRACE)
            return 1
        code = server.stop(received[0] if received else signal.SIGTERM)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if code is None:  # the signal came before the server started
        return 128 + received[0]
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def _supervise(server: TritonServer, received: list[int]) -> bool:
    """Until the server exits or a signal came (True), or stubs died too often (False)."""
    restarts: list[float] = []
    watch, next_check = StubWatch(server.process.pid), time.monotonic() + CHECK_INTERVAL
    while server.poll() is None and not received:
        time.sleep(0.2)
        if time.monotonic() < next_check:
            continue
        next_check = time.monotonic() + CHECK_INTERVAL
        dead = watch.dead()
        if not dead:
            continue
        restarts = [t for t in restarts if time.monotonic() - t < RESTART_WINDOW] + [time.monotonic()]
        if len(restarts) > MAX_RESTARTS:
            _say(f"{dead[0]}: {len(restarts)} stub deaths within {RESTART_WINDOW:.0f} s; stopping")
            return False
        _say(f"{dead[0]}; restarting tritonserver")
        server.restart(RESTART_GRACE)
        watch = StubWatch(server.process.pid)
    return True


def _say(message: str) -> None:
    print(f"nanoserve: {message}", file=sys.stderr, flush=True)
