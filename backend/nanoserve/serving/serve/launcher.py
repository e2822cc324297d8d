"""Run a real `tritonserver` with the nanoserve backend.

Finds the binary (on PATH as in an NGC container, else the one inside the nvidia-pytriton wheel), assembles a
backend directory (Triton's backends + the Python stub for this interpreter + `nanoserve/model.py`), makes the
stub import from the current virtualenv, binds 127.0.0.1 and stops the server cleanly.

    with TritonServer("model_repository", http_port=8000, grpc_port=8001, metrics_port=8002) as server:
        server.wait_ready(timeout=120)
        ...  # talk to server.url_grpc / server.url_http
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from nanoserve import openmp
from nanoserve.cache import build_once, default_cache_dir
from nanoserve.serving.serve import drain, liveness, triton_log
from nanoserve.tiny_model import build_tiny_model

BACKEND_NAME = "nanoserve"
STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
_PACKAGE_DIR = Path(__file__).resolve().parents[2]  # backend/nanoserve
_live_servers: set["TritonServer"] = set()
_counter = itertools.count()


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backends: Path  # the install's backends/ directory (holds python/)
    stub: Path | None  # the stub to put into backends/python/; None: the install already has one there
    lib_dirs: tuple[Path, ...] = ()  # shared libraries the binary needs on LD_LIBRARY_PATH


def find_tritonserver() -> TritonInstall:
    """`tritonserver` on PATH (an NGC container), else the binary shipped in the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        binary = Path(on_path).resolve()
        return TritonInstall(binary, binary.parent.parent / "backends", None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("tritonserver: not on PATH and nvidia-pytriton is not installed "
                                "(pip install 'nanoserve[serve]')")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub})")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends", stub, (libs,) if libs.is_dir() else ())


def default_backend_model() -> Path | None:
    """The repo's backend/model.py (a source checkout or an editable install); None when not installed that way."""
    root = repo_root()
    path = root / "backend" / "model.py" if root else None
    return path if path and path.is_file() else None


def assemble_backend_dir(install: TritonInstall, dest: Path, backend_model: Path | None = None) -> Path:
    """Fill dest with the install's backends: python/ as a real copy (+ the stub), the others as symlinks
    (an NGC image's onnxruntime/pytorch backends are GBs), and nanoserve/model.py."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in install.backends.iterdir():
        if entry.name == "python":
            shutil.copytree(entry, dest / "python", ignore=shutil.ignore_patterns("__pycache__"))
        elif entry.name != BACKEND_NAME or backend_model is None:
            (dest / entry.name).symlink_to(entry)
    if install.stub is not None:
        shutil.copy2(install.stub, dest / "python" / STUB_NAME)
    if not (dest / "python" / STUB_NAME).is_file():
        raise FileNotFoundError(f"no {STUB_NAME} in {install.backends / 'python'}")
    if backend_model is not None:
        (dest / BACKEND_NAME).mkdir()
        shutil.copy2(backend_model, dest / BACKEND_NAME / "model.py")
    elif not (dest / BACKEND_NAME).exists():
        warnings.warn(f"no {BACKEND_NAME} backend (backend/model.py of a source checkout): models with backend "
                      f"\"{BACKEND_NAME}\" will not load", stacklevel=2)
    return dest


def stub_environment(install: TritonInstall, base: dict | None = None) -> dict:
    """The stub's embedded interpreter ignores PYTHONPATH; it finds the virtualenv through the first python on
    PATH, and needs this interpreter's own libpython (LIBDIR) first, not the system's."""
    env = dict(os.environ if base is None else base)
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))  # not resolved: that would leave the venv
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
    libs = [sysconfig.get_config_var("LIBDIR") or "", *map(str, install.lib_dirs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    return env


def free_ports(count: int = 3, host: str = "127.0.0.1") -> list[int]:
    """Ports free right now (another process may still take one before tritonserver binds it)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _prepare_child(cpus: set[int]) -> None:
    # Runs in the child before exec. tritonserver installs its handlers only once models are loaded: until then
    # SIGINT/SIGTERM must kill it, even when this process was started with them ignored (a background job).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: SIGTERM when the starting thread dies
    # Intel OpenMP's fork handler (nanoserve/openmp.py loads it) binds a forked child to one CPU, and exec keeps the
    # mask: tritonserver, its stubs and their engines would all run on the first CPU alone.
    os.sched_setaffinity(0, cpus)


class TritonServer:
    """One tritonserver process. `url_http`/`url_grpc` are "host:port" (tritonclient style).

    log_file: where tritonserver's output goes (None: inherit this process's stdout/stderr).
    backend_model: the nanoserve backend's model.py (default: the repo's backend/model.py, if there is one).
    Start it from a thread that outlives it: the server gets SIGTERM when the starting thread exits.
    """

    def __init__(self, model_repository, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1", log_verbose: int = 0, exit_timeout_secs: int = 10,
                 disable_auto_complete_config: bool = False, extra_args=(), log_file=None,
                 backend_model=None, install: TritonInstall | None = None):
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.log_verbose = log_verbose
        self.exit_timeout_secs = exit_timeout_secs
        self.disable_auto_complete_config = disable_auto_complete_config
        self.extra_args = list(extra_args)
        self.log_path = Path(log_file) if log_file else None
        self.backend_model = Path(backend_model) if backend_model else default_backend_model()
        self.install = install
        self.shm_prefix = f"triton_nanoserve_{os.getpid()}_{next(_counter)}_"
        self.process: subprocess.Popen | None = None
        self.starts = 0  # how many times a tritonserver was started (restart() starts another)
        self._work_dir: Path | None = None
        self._log = None

    # ---- addresses ----------------------------------------------------------------------------------
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def url_http(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def url_grpc(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def url_metrics(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    # ---- lifecycle ----------------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        install = self.install or find_tritonserver()
        cmd = [str(install.binary), f"--model-repository={self.model_repository}",
               f"--backend-directory={backend_dir}",
               f"--http-address={self.host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
               f"--exit-timeout-secs={self.exit_timeout_secs}", f"--log-verbose={self.log_verbose}"]
        if not any("shm-region-prefix-name" in arg for arg in self.extra_args):
            # Our own prefix: the shared-memory regions this server's stubs create can be found and removed.
            cmd.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        if self.disable_auto_complete_config:
            cmd.append("--disable-auto-complete-config")
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        if self.process is not None:
            raise RuntimeError("tritonserver: already started")
        self.install = self.install or find_tritonserver()
        self._work_dir = Path(tempfile.mkdtemp(prefix="nanoserve-triton-"))
        try:
            backend_dir = assemble_backend_dir(self.install, self._work_dir / "backends", self.backend_model)
            if self.log_path is not None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = open(self.log_path, "ab" if self.starts else "wb")  # a restart appends
            self.process = subprocess.Popen(self.command(backend_dir), env=stub_environment(self.install),
                                            stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=functools.partial(_prepare_child, os.sched_getaffinity(0)))
        except BaseException:
            self._cleanup()
            raise
        self.starts += 1
        _live_servers.add(self)
        return self

    def restart(self, grace: float) -> "TritonServer":
        """SIGTERM, the whole process group killed after `grace` seconds, then a new tritonserver with the same
        settings (ports, models, shared-memory prefix)."""
        self.stop(timeout=grace)
        self.process = None
        return self.start()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_ready(self, timeout: float = 120.0, models=()) -> "TritonServer":
        """Until the server (and each named model) reports ready; raises with the log's tail when tritonserver
        exits or the timeout passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.poll()} before it was ready"
                                   f"{self._log_excerpt()}")
            if self.is_ready(models):
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{self._log_excerpt()}")
            time.sleep(0.2)

    def is_live(self) -> bool:
        """tritonserver answers: the models it loads at startup are loaded, or failed to load, by then."""
        return self._http_ok("/v2/health/live")

    def model_states(self) -> dict[str, tuple[str, str]]:
        """The repository index: model -> (state, the first line of its reason), e.g. ("UNAVAILABLE", "ValueError:
        ...") for a model that failed to load, ("", "") for one not loaded; {} when the index does not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.url_http}/v2/repository/index", data=b"{}",
                                        timeout=30) as response:
                index = json.loads(response.read())
        except (OSError, ValueError):
            return {}
        return {model["name"]: (model.get("state", ""), triton_log.message(model.get("reason", "")))
                for model in index}

    def is_ready(self, models=()) -> bool:
        paths = ["/v2/health/ready"] + [f"/v2/models/{name}/ready" for name in models]
        return all(self._http_ok(path) for path in paths)

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.url_http}{path}", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def drain(self, seconds: float, received: list[int] = ()) -> list[str]:
        """Before stop(): the engine models' requests in flight get up to `seconds` to finish, new ones are refused
        (serving/serve/drain.py). Returns why a model was not drained, one line each."""
        return drain.drain(self.url_http, liveness.engine_models(self.url_http), seconds, received)

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int | None:
        """Forward sig, wait for a graceful exit (default: exit timeout + 15 s), then kill the whole process
        group (orphaned stubs included) and remove the shared memory this server created. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(self.exit_timeout_secs + 15 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        self._cleanup()
        return self.process.returncode

    def _kill_group(self, timeout: float = 10.0) -> None:
        """SIGKILL the process group and wait until it is gone: a killed stub lingers a moment (it may be in
        the middle of a page fault) before it dies."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stubs share tritonserver's process group
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        deadline = time.monotonic() + timeout
        while group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _cleanup(self) -> None:
        for region in SHM_DIR.glob(self.shm_prefix + "*"):
            region.unlink(missing_ok=True)
        openmp.remove_stale_registrations()  # tritonserver's, forked from here, and its killed stubs'
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
        if self._log is not None:
            self._log.close()
            self._log = None
        _live_servers.discard(self)

    def log_tail(self, max_chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - max_chars))
            return f.read().decode(errors="replace")

    def _log_excerpt(self) -> str:
        tail = self.log_tail()
        return f"; log {self.log_path}:\n{tail}" if tail else ""

    def __enter__(self) -> "TritonServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgid) of every process, from /proc/PID/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # exited meanwhile
            continue
        found.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in a process group (tritonserver and its stubs share one)."""
    return [pid for pid, state, _, group in processes() if group == pgid and state != "Z"]


class SignalWatcher:
    """Within `with`, SIGINT and SIGTERM are recorded (in `received`) instead of ending this process."""

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict = {}

    def __enter__(self) -> "SignalWatcher":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, lambda signum, _frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def say(message: str) -> None:
    """One line of `nanoserve serve`'s own on stderr (tritonserver's log goes elsewhere)."""
    print(f"nanoserve: {message}", file=sys.stderr, flush=True)


def exit_code(code: int | None, received: list[int]) -> int:
    """A stopped server's exit code for this process: the shell's 128 + N for a signal."""
    if code is None:  # the signal came before the server started
        return 128 + received[0]
    return code if code >= 0 else 128 - code


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_live_servers):
        server.stop(timeout=5)


# ---- model repositories ---------------------------------------------------------------------------------
def repo_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None."""
    root = _PACKAGE_DIR.parents[1]
    return root if (root / "model_repository").is_dir() else None


def tiny_model(cache_dir=None) -> Path:
    """The default test checkpoint, built once (random weights, local tokenizer) under cache_dir."""
    return build_once(Path(cache_dir or default_cache_dir()) / "tiny-qwen3", lambda out: build_tiny_model(str(out)))


def make_model_repository(dest, checkpoint, models=None, template=None, rename=None, **engine_args) -> Path:
    """Copy the model repository template (default: the repo's model_repository/; only `models` if given) to
    dest, each model under the name `rename` gives it (if any), and point every model.json at checkpoint
    (absolute paths), with engine_args merged in."""
    from nanoserve.serving.shared.model_json import PATH_ARGS, with_draft_path

    template = Path(template) if template else (repo_root() or Path("/nonexistent")) / "model_repository"
    if not template.is_dir():
        raise FileNotFoundError(f"model repository template {template} not found (needs a source checkout)")
    dest = Path(dest)
    for model in models or [p.name for p in template.iterdir() if p.is_dir()]:
        shutil.copytree(template / model, dest / (rename or {}).get(model, model), dirs_exist_ok=True)
    checkpoint = str(Path(checkpoint).resolve())
    engine_args = with_draft_path(engine_args, os.getcwd())
    for model_json in dest.glob("*/*/model.json"):
        args = json.loads(model_json.read_text())
        args.update({name: checkpoint for name in PATH_ARGS if name in args}, **engine_args)
        model_json.write_text(json.dumps(args, indent=2) + "\n")
    return dest
