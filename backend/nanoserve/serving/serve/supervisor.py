"""`nanoserve serve` restarts tritonserver when a Python backend stub dies.

tritonserver 2.51 does not notice a dead stub (SIGKILL, the OOM killer, a crash): the model stays ready, each new
request fails with "Stub process '<instance>' is not healthy.", and the requests in flight never get a final
response. python_backend restarts no stub of a decoupled model, and reloading the model through the repository API
does not help: the new version serves, but the old one keeps the in-flight requests' response factories, which
only the dead stub could release, so it never unloads and SIGTERM ends in the exit timeout (exit code 1). A new
tritonserver does help: the clients of the old one see their connection close (an error within seconds), and the
models serve again once loaded. A model that stops answering (serving/serve/liveness.py) gets the same restart.

A stub that exits is a zombie until its parent reaps it. tritonserver reaps the stubs it stops itself (an unload,
a failed load) at once, so a stub that stays a zombie died on its own. A zombie has no command line, but keeps its
name (/proc/PID/comm): that tells a stub, whether or not it was seen alive.

Listed with the tritonserver workarounds: serving/workarounds.py, 'dead-stub-unnoticed'.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from nanoserve.serving.serve.launcher import STUB_NAME, TritonServer, processes, say
from nanoserve.serving.serve.liveness import Liveness

CHECK_INTERVAL = 1.0  # seconds between looks at the stubs
ZOMBIE_GRACE = 2.0  # seconds a stub stays a zombie before it counts as dead (tritonserver reaps its own at once)
RESTART_GRACE = 5.0  # seconds the old tritonserver's other requests get to finish before its group is killed
STUCK_GRACE = ZOMBIE_GRACE + 2 * CHECK_INTERVAL  # a dead stub's model is "not healthy" too: its own report first
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
        self.instances: dict[int, str] = {}  # pid -> the model instance of a stub seen alive ("" for others)
        self.zombie_since: dict[int, float] = {}

    def dead(self) -> list[DeadStub]:
        now, found = self.clock(), []
        for pid, state, _, group in processes():
            if group != self.pgid or pid == self.pgid:
                continue
            if state != "Z":
                if not self.instances.get(pid):  # read again until the process has exec'd the stub
                    self.instances[pid] = stub_instance(pid)
            elif is_stub(pid) and now - self.zombie_since.setdefault(pid, now) >= ZOMBIE_GRACE:
                found.append(DeadStub(pid, self.instances.get(pid) or "an unknown model instance", wait_status(pid)))
        return found


def is_stub(pid: int) -> bool:
    """Whether a process (a zombie too) is a Python backend stub: its name, which the kernel cuts to 15 bytes."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().rstrip("\n") == STUB_NAME[:15]
    except OSError:
        return False


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


class Supervisor:
    """Restarts a running tritonserver whose stub died or whose model stopped answering (`liveness_models`, asked
    with a deadline of `liveness_timeout` seconds; 0: never), at most MAX_RESTARTS times within RESTART_WINDOW.
    Made once the models are ready, before clients are told to come: it reads which stub serves which model
    instance then."""

    def __init__(self, server: TritonServer, liveness_models: list[str] = (), liveness_timeout: float = 0):
        self.server = server
        self.liveness_models, self.liveness_timeout = list(liveness_models), liveness_timeout
        self._watch()
        self.restarts: list[float] = []

    def _watch(self) -> None:
        self.watch = StubWatch(self.server.process.pid)
        self.watch.dead()
        self.liveness = Liveness(self.server.url_http, self.liveness_models, self.liveness_timeout).start()

    def run(self, received: list[int]) -> bool:
        """Until a signal came or the server exited cleanly on its own (True), or it had to be restarted too often
        (False)."""
        next_check = time.monotonic() + CHECK_INTERVAL
        try:
            while not received and self.server.poll() != 0:
                time.sleep(0.2)
                failure = self._crashed()
                if failure is None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + CHECK_INTERVAL
                    failure = "; ".join(map(str, self.watch.dead())) or self._stuck()
                if failure and not self._restart(failure):
                    return False
            return True
        finally:
            self.liveness.stop()

    def _crashed(self) -> str | None:
        """How tritonserver ended, where it ended on its own with an error (2.51's python_backend aborts when a stub
        dies holding the lock of their shared memory; its HTTP front end crashes on a large non-JSON body)."""
        code = self.server.poll()
        if not code:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"tritonserver (pid {self.server.process.pid}) {how}"

    def _stuck(self) -> str | None:
        if self.liveness.stuck and time.monotonic() - self.liveness.stuck_since >= STUCK_GRACE:
            return self.liveness.stuck
        return None

    def _restart(self, failure: str) -> bool:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW] + [now]
        if len(self.restarts) > MAX_RESTARTS:
            say(f"{failure}: {len(self.restarts)} restarts within {RESTART_WINDOW:.0f} s; stopping")
            return False
        say(f"{failure}; restarting tritonserver")
        self.liveness.stop()
        self.server.restart(RESTART_GRACE)
        self._watch()
        return True
