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


FAKE_STUB = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'%s', 0, 0, 0); time.sleep(300)"  # PR_SET_NAME
             % STUB_NAME[:15])


def test_a_stub_that_stays_a_zombie_is_reported_dead(tmp_path):
    """Processes that look like stubs (their name, argv[0] and the instance as 8th argument) and one that does not,
    killed and never reaped: their parent becomes `sleep`, which waits for no child. One stub is killed before the
    watch ever saw it alive: a stub that dies right after loading is still noticed."""
    def fake_stub(instance: str) -> str:
        return f"exec -a {tmp_path / STUB_NAME} {sys.executable} -c \"{FAKE_STUB}\" 3 4 5 6 7 {instance}"

    script = f"{fake_stub('nanoserve_0_0')} & {fake_stub('ensemble_0_0')} & sleep 300 & exec sleep 300"
    group = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        children = child_pids(group.pid, 3)
        while sorted(supervisor.stub_instance(pid) for pid in children) != ["", "ensemble_0_0", "nanoserve_0_0"]:
            time.sleep(0.01)  # until the stubs have exec'd
        by_instance = {supervisor.stub_instance(pid): pid for pid in children}
        seen, unseen, other = by_instance["nanoserve_0_0"], by_instance["ensemble_0_0"], by_instance[""]
        while not (supervisor.is_stub(seen) and supervisor.is_stub(unseen)):
            time.sleep(0.01)  # until they have named themselves
        os.kill(unseen, signal.SIGKILL)
        now = [0.0]
        watch = supervisor.StubWatch(group.pid, clock=lambda: now[0])
        wait_for_zombie(unseen)
        assert watch.dead() == [] and watch.instances[seen] == "nanoserve_0_0"
        for pid in (seen, other):
            os.kill(pid, signal.SIGKILL)
            wait_for_zombie(pid)
        assert watch.dead() == []  # tritonserver reaps the stubs it stops itself: give it ZOMBIE_GRACE
        now[0] += supervisor.ZOMBIE_GRACE
        dead = sorted(watch.dead(), key=lambda d: d.pid != seen)
        assert [(d.pid, d.instance) for d in dead] == [(seen, "nanoserve_0_0"), (unseen, "an unknown model instance")]
        assert str(dead[0]).endswith("killed by signal 9")
    finally:
        kill_group(group.pid)
        group.wait()


def child_pids(parent: int, count: int) -> list[int]:
    deadline = time.monotonic() + TIMEOUT
    while len(children := [pid for pid, _, ppid, _ in processes() if ppid == parent]) < count:
        assert time.monotonic() < deadline, f"{parent} has {len(children)} children, not {count}"
        time.sleep(0.01)
    return children


def wait_for_zombie(pid: int) -> None:
    while dict((pid, state) for pid, state, _, _ in processes()).get(pid) != "Z":
        time.sleep(0.01)


class Addresses:
    def __init__(self, http: int, grpc: int, metrics: int):
        self.url_http, self.url_grpc = f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
        self.url_metrics = f"http://127.0.0.1:{metrics}/metrics"


def wait_until(condition, timeout: float, cli) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert cli.poll() is None, f"nanoserve serve exited with code {cli.poll()}"
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(0.1)


@pytest.mark.triton_server
def test_a_killed_stub_fails_its_streams_and_the_model_serves_again(qwen3_dir, tmp_path):
    repository = tiny_repository(tmp_path / "model_repository", qwen3_dir)
    ports = free_ports(3)
    cli = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model-repository", str(repository),
                            "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port",
                            str(ports[2]), "--openai-port", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server, tritons, banner = Addresses(*ports), [], []
    try:
        for line in cli.stdout:  # until the banner: the models are ready and the supervisor watches
            banner.append(line)
            if line.startswith("Ctrl-C stops"):
                break
        assert banner and banner[-1].startswith("Ctrl-C stops"), "".join(banner)
        tritons.append(child_pid(cli.pid))
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
        output = "".join(banner) + cli.stdout.read()
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
