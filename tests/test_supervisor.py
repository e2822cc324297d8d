"""`nanoserve serve` notices a Python backend stub that died (tritonserver 2.51 does not) and restarts tritonserver:
the streams in flight end with an error, the model serves again, and SIGTERM afterwards exits cleanly."""
import os
import signal
import subprocess
import sys
import time

import pytest
from serving_utils import TIMEOUT, collect, open_stream, stream
from triton_server import (LOAD_TIMEOUT, child_pid, free_ports, group_members, http_ready, kill_group, shm_regions,
                           tiny_repository)

from nanoserve.serving import supervisor
from nanoserve.serving.launcher import STUB_NAME, processes


def test_a_stub_that_stays_a_zombie_is_reported_dead(tmp_path):
    """A process that looks like a stub (argv[0] and the instance as its 8th argument), killed and never reaped:
    its parent becomes `sleep`, which waits for no child."""
    fake_stub = f"exec -a {tmp_path / STUB_NAME} {sys.executable} -c 'import time; time.sleep(300)' 3 4 5 6 7"
    group = subprocess.Popen(["bash", "-c", f"{fake_stub} nanoserve_0_0 & exec sleep 300"], start_new_session=True)
    try:
        stub = child_pid(group.pid)
        while supervisor.stub_instance(stub) != "nanoserve_0_0":  # until it has exec'd
            time.sleep(0.01)
        now = [0.0]
        watch = supervisor.StubWatch(group.pid, clock=lambda: now[0])
        assert watch.dead() == [] and watch.instances[stub] == "nanoserve_0_0"
        os.kill(stub, signal.SIGKILL)
        while dict((pid, state) for pid, state, _, _ in processes()).get(stub) != "Z":
            time.sleep(0.01)
        assert watch.dead() == []  # tritonserver reaps the stubs it stops itself: give it ZOMBIE_GRACE
        now[0] += supervisor.ZOMBIE_GRACE
        dead = watch.dead()
        assert [(d.pid, d.instance) for d in dead] == [(stub, "nanoserve_0_0")]
        assert str(dead[0]).endswith("killed by signal 9")
    finally:
        kill_group(group.pid)
        group.wait()


class Addresses:
    def __init__(self, http: int, grpc: int, metrics: int):
        self.url_http, self.url_grpc = f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
        self.url_metrics = f"http://127.0.0.1:{metrics}/metrics"


def wait_until(condition, timeout: float, cli) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert cli.poll() is None and time.monotonic() < deadline, cli.stdout.read()
        time.sleep(0.1)


@pytest.mark.triton_server
def test_a_killed_stub_fails_its_streams_and_the_model_serves_again(qwen3_dir, tmp_path):
    repository = tiny_repository(tmp_path / "model_repository", qwen3_dir)
    ports = free_ports(3)
    cli = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model-repository", str(repository),
                            "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port",
                            str(ports[2])], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server, tritons = Addresses(*ports), []
    try:
        tritons.append(child_pid(cli.pid))
        wait_until(lambda: http_ready(ports[0]), LOAD_TIMEOUT, cli)
        streams = [open_stream(server, "nanoserve", text_input="Hi", stream=True,
                               sampling_parameters={"ignore_eos": True, "max_tokens": 1500}) for _ in range(2)]
        assert all(events.get(timeout=TIMEOUT)[1] is None for _, events in streams)
        stub = next(pid for pid, _, ppid, _ in processes()
                    if ppid == tritons[0] and supervisor.stub_instance(pid) == "nanoserve_0_0")
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        for client, events in streams:
            assert collect(events).error is not None  # not a hang: the old server went away
            client.close()
        failed = time.monotonic() - killed
        tritons.append(child_pid(cli.pid, timeout=TIMEOUT, exclude=tritons))
        wait_until(lambda: http_ready(ports[0], "/v2/models/nanoserve/ready"), LOAD_TIMEOUT, cli)
        serving = time.monotonic() - killed
        assert stream(server, "nanoserve", text_input="Hi", sampling_parameters={"max_tokens": 4}).error is None
        print(f"streams failed {failed:.1f} s and the model served again {serving:.1f} s after the kill")
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(TIMEOUT) == 0
        output = cli.stdout.read()
        assert "the stub of nanoserve_0_0" in output and "killed by signal 9; restarting tritonserver" in output
        assert all(group_members(pid) == [] for pid in tritons)
        assert shm_regions(f"triton_nanoserve_{cli.pid}_") == []
        assert "Fatal Python error" not in output
    finally:
        cli.kill()
        for pid in tritons:
            kill_group(pid)
        cli.wait()
        cli.stdout.close()
