"""The launcher: finds tritonserver, assembles the backend directory, runs a real server on 127.0.0.1 whose
stub imports from this virtualenv, and stops it on SIGTERM/SIGINT leaving no process or /dev/shm region."""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

import nanoserve
from nanoserve.serving.serve import launcher
from triton_server import (LOAD_TIMEOUT, assert_nothing_left, child_pid, group_members, http_ready, kill_group,
                           running_server, shm_regions)

# A throw-away Python-based backend: reports where its interpreter found its packages.
ECHO_BACKEND = '''
import json, sys
import numpy as np
import triton_python_backend_utils as pb_utils
import nanoserve

class TritonPythonModel:
    def initialize(self, args):
        if args["model_name"] == "broken":
            raise RuntimeError("broken model says no")

    def execute(self, requests):
        where = json.dumps({"prefix": sys.prefix, "nanoserve": nanoserve.__file__})
        out = pb_utils.Tensor("OUT", np.array([where.encode()], dtype=np.object_))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
'''
ECHO_CONFIG = '''backend: "nanoserve"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_STRING, dims: [1] }]
output [{ name: "OUT", data_type: TYPE_STRING, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''


@pytest.fixture
def echo_repository(tmp_path):
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "backend_model.py").write_text(ECHO_BACKEND)
    return tmp_path


def infer_echo(server) -> dict:
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    request = urllib.request.Request(f"http://{server.url_http}/v2/models/echo/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(json.loads(response.read())["outputs"][0]["data"][0])


def _ip(hex_address: str) -> str:
    if hex_address.startswith("0" * 16 + "FFFF0000"):  # IPv4-mapped IPv6 (how gRPC listens on 127.0.0.1)
        hex_address = hex_address[24:]
    if len(hex_address) != 8:
        return f"ipv6:{hex_address}"
    return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))  # little-endian


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process pid listens on."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:  # closed since the listing: the server's threads open and close fds meanwhile
            pass
    inodes = {target[len("socket:["):-1] for target in targets if target.startswith("socket:[")}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.add((_ip(address), int(port, 16)))
    return found


def test_find_tritonserver():
    install = launcher.find_tritonserver()
    assert install.binary.is_file() and os.access(install.binary, os.X_OK)
    assert (install.backends / "python" / "libtriton_python.so").is_file()
    if install.stub is not None:  # the pytriton wheel: a stub per Python version
        assert install.stub.parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"


def test_assemble_backend_dir(tmp_path):
    model_py = tmp_path / "model.py"
    model_py.write_text("# backend\n")
    install = launcher.find_tritonserver()
    backends = launcher.assemble_backend_dir(install, tmp_path / "backends", model_py)
    stub = backends / "python" / launcher.STUB_NAME
    assert stub.is_file() and os.access(stub, os.X_OK)
    assert (backends / "python" / "libtriton_python.so").is_file()
    assert (backends / "nanoserve" / "model.py").read_text() == "# backend\n"
    assert launcher.default_backend_model() == Path(nanoserve.__file__).resolve().parents[1] / "model.py"


def test_stub_environment_puts_the_venv_and_libdir_first():
    install = launcher.find_tritonserver()
    env = launcher.stub_environment(install, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["PATH"].split(os.pathsep) == [os.path.dirname(os.path.abspath(sys.executable)), "/usr/bin"]
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[0] == sysconfig.get_config_var("LIBDIR") and libs[-1] == "/opt/x"


@pytest.mark.triton_server
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_server_runs_in_this_venv_on_localhost_and_stops(echo_repository, sig):
    with running_server(echo_repository, echo_repository, models=["echo"], disable_auto_complete_config=True,
                        backend_model=echo_repository / "backend_model.py") as server:
        assert server.url_grpc == f"127.0.0.1:{server.grpc_port}"
        where = infer_echo(server)
        assert where == {"prefix": sys.prefix, "nanoserve": nanoserve.__file__}
        ports = (server.http_port, server.grpc_port, server.metrics_port)
        assert listening_sockets(server.process.pid) == {("127.0.0.1", port) for port in ports}
        assert shm_regions(server.shm_prefix), "the stub's region should carry this server's prefix"
        assert server.stop(sig) == 0, server.log_tail()  # graceful
        assert "successfully unloaded 'echo'" in server.log_tail(100_000)
    assert_nothing_left(server)


@pytest.mark.triton_server
def test_killed_server_leaves_no_stub_or_shm(echo_repository):
    with running_server(echo_repository, echo_repository, models=["echo"],
                        backend_model=echo_repository / "backend_model.py") as server:
        stubs = [pid for pid in group_members(server.process.pid) if pid != server.process.pid]
        assert stubs, "the model's stub should run in tritonserver's process group"
        server.process.kill()  # a crash: nobody shuts the stubs down
        server.process.wait()
    assert_nothing_left(server)


@pytest.mark.triton_server
def test_model_that_fails_to_load_raises_with_the_log(echo_repository):
    os.rename(echo_repository / "echo", echo_repository / "broken")
    server = launcher.TritonServer(echo_repository, *launcher.free_ports(3), log_file=echo_repository / "log.txt",
                                   backend_model=echo_repository / "backend_model.py")
    with server, pytest.raises(RuntimeError, match="broken model says no"):
        server.wait_ready(120)
    assert_nothing_left(server)


def test_make_model_repository_points_at_the_checkpoint(tmp_path):
    from nanoserve.serving.shared.model_json import load_engine_args

    repo = launcher.make_model_repository(tmp_path / "repo", tmp_path / "ckpt", models=["nanoserve"], device="cpu")
    assert [p.name for p in repo.iterdir()] == ["nanoserve"]
    template = launcher.repo_root() / "model_repository" / "nanoserve"
    assert (repo / "nanoserve" / "config.pbtxt").read_text() == (template / "config.pbtxt").read_text()
    args = load_engine_args(str(repo / "nanoserve"))
    assert args["model"] == str((tmp_path / "ckpt").resolve()) and args["device"] == "cpu"


def test_tiny_model_is_built_once_with_the_default_weights(tmp_path, qwen3_dir):
    from safetensors.torch import load_file

    from nanoserve import cli

    assert cli.main(["build-tiny-model", str(tmp_path / "built")]) == 0
    built = launcher.tiny_model(tmp_path / "cache")
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert launcher.tiny_model(tmp_path / "cache") == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp, "rebuilt instead of cached"
    reference = load_file(Path(qwen3_dir) / "model.safetensors")
    for checkpoint in (built, tmp_path / "built"):
        weights = load_file(checkpoint / "model.safetensors")
        assert weights.keys() == reference.keys()
        assert all(weights[name].equal(reference[name]) for name in reference)


def test_the_suite_uses_its_own_cache():
    """conftest points NANOSERVE_CACHE at the checkout's .cache/tests (or NANOSERVE_TEST_CACHE): built kernels,
    converted GGUF files and `nanoserve serve`'s logs never land in the user's ~/.cache/nanoserve."""
    from nanoserve.cache import default_cache_dir

    assert default_cache_dir() != Path.home() / ".cache" / "nanoserve"
    repo = Path(__file__).resolve().parents[1]
    assert default_cache_dir() == Path(os.environ.get("NANOSERVE_TEST_CACHE", repo / ".cache" / "tests"))


@pytest.mark.triton_server
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_serve_stops_on_signal(echo_repository, sig):
    # The CLI installs the repo's backend/model.py as "nanoserve": serve the echo model with the python backend.
    config = echo_repository / "echo" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "nanoserve"', 'backend: "python"'))
    os.rename(echo_repository / "backend_model.py", echo_repository / "echo" / "1" / "model.py")
    http, grpc, metrics = launcher.free_ports(3)
    cli = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model-repository",
                            str(echo_repository), "--http-port", str(http), "--grpc-port", str(grpc),
                            "--metrics-port", str(metrics), "--", "--log-verbose=1"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    triton = None
    try:
        triton = child_pid(cli.pid)
        deadline = time.monotonic() + LOAD_TIMEOUT
        while not http_ready(http):
            assert cli.poll() is None and time.monotonic() < deadline, cli.stdout.read().decode()
            time.sleep(0.2)
        assert "--log-verbose=1" in Path(f"/proc/{triton}/cmdline").read_text()
        # on every CPU the CLI may use (not the one Intel OpenMP's fork handler binds a forked child to)
        assert all(os.sched_getaffinity(pid) == os.sched_getaffinity(0) for pid in group_members(triton))
        cli.send_signal(sig)
        assert cli.wait(60) == 0
        assert group_members(triton) == []
        assert shm_regions(f"triton_nanoserve_{cli.pid}_") == []
    finally:
        cli.kill()
        if triton is not None:
            kill_group(triton)
        cli.wait()
        cli.stdout.close()


@pytest.mark.parametrize("kind, engine_args, device", [
    ("GPU", {"model": "m"}, "cuda:1"),  # KIND_GPU: the instance's GPU
    ("GPU", {"model": "m", "device": "cpu"}, "cpu"),  # model.json names the device: it wins
    ("MODEL", {"model": "m"}, None),  # KIND_MODEL: the engine chooses
])
def test_instance_device(kind, engine_args, device):
    from nanoserve.serving.shared.model_json import instance_device

    assert instance_device(engine_args, kind, "1").get("device") == device
