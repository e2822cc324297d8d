"""`nanoserve serve` notices a Python backend stub that died (tritonserver 2.51 does not) and restarts tritonserver:
the streams in flight end with an error, the model serves again, and SIGTERM afterwards exits cleanly."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from serving_utils import BACKEND_MODEL, TIMEOUT, add_parameters, collect, open_stream, process_name, stream
from triton_server import (LOAD_TIMEOUT, child_pid, free_ports, group_members, http_ready, kill_group,
                           running_server, shm_regions, tiny_repository)

from nanoserve.serving.serve import liveness, supervisor
from nanoserve.serving.serve.launcher import STUB_NAME, processes


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
@pytest.mark.parametrize("fault, target, reported", [
    (signal.SIGKILL, "stub", "the stub of nanoserve_0_0 (pid {stub}) killed by signal 9; restarting tritonserver"),
    # a stub that hangs whole: python_backend answers for it that it is not healthy, and nothing restarts it
    (signal.SIGSTOP, "stub", "the stub of model nanoserve is not healthy; restarting tritonserver"),
    # the stub ends its requests with UNAVAILABLE and answers so from then on
    (signal.SIGKILL, "core", "model nanoserve is unavailable: its engine has failed; restarting tritonserver"),
    # tritonserver itself crashes
    (signal.SIGSEGV, "tritonserver", "tritonserver (pid {triton}) was killed by signal 11; restarting tritonserver")])
def test_a_killed_or_hung_stub_or_core_fails_its_streams_and_the_model_serves_again(qwen3_dir, tmp_path, fault,
                                                                                   target, reported):
    """The model's name comes from the repository (--model-repository): the supervisor asks the models whose
    backend is nanoserve in text mode."""
    repository = tiny_repository(tmp_path / "model_repository", qwen3_dir)
    if target == "core":
        add_parameters(repository / "nanoserve" / "config.pbtxt", {"engine_core_process": "true"})
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
        victim = {"stub": stub, "tritonserver": tritons[0]}.get(target) or next(
            pid for pid, _, ppid, _ in processes() if ppid == stub and process_name(pid) == "ns-core")
        os.kill(victim, fault)
        killed = time.monotonic()
        for client, events in streams:
            error = collect(events).error
            assert error is not None  # not a hang: the old server went away, or the stub ended the stream
            assert target != "core" or "the engine core process exited (exit code -9)" in str(error)
            client.close()
        failed = time.monotonic() - killed
        tritons.append(new_tritonserver(cli, tritons))
        wait_until(lambda: http_ready(ports[0], "/v2/models/nanoserve/ready"), LOAD_TIMEOUT, cli)
        serving = time.monotonic() - killed
        assert stream(server, "nanoserve", text_input="Hi", sampling_parameters={"max_tokens": 4}).error is None
        print(f"streams failed {failed:.1f} s and the model served again {serving:.1f} s after {fault!r}")
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(TIMEOUT) == 0
        output = "".join(banner) + cli.stdout.read()
        # tritonserver 2.51's python_backend may abort itself (boost::interprocess::lock_exception) when the stub
        # dies holding the lock of their shared memory: the crashed tritonserver is restarted then
        assert reported.format(stub=stub, triton=tritons[0]) in output or (
            target == "stub" and fault == signal.SIGKILL and
            f"tritonserver (pid {tritons[0]}) was killed by signal 6; restarting tritonserver" in output)
        assert all(group_members(pid) == [] for pid in tritons)
        assert shm_regions(f"triton_nanoserve_{cli.pid}_") == []
        assert "Fatal Python error" not in output
    finally:
        cli.kill()
        for pid in tritons:
            kill_group(pid)
        cli.wait()
        cli.stdout.close()


def new_tritonserver(cli, known: list[int]) -> int:
    """The tritonserver the CLI started after `known`; fails with what the CLI printed if there is none."""
    deadline = time.monotonic() + TIMEOUT
    while not (children := [pid for pid, _, ppid, _ in processes() if ppid == cli.pid and pid not in known]):
        if cli.poll() is None and time.monotonic() > deadline:
            cli.kill()
        if cli.poll() is not None:
            pytest.fail(f"no new tritonserver; nanoserve serve exited with code {cli.wait()}:\n{cli.stdout.read()}")
        time.sleep(0.1)
    return children[0]


def test_a_closed_port_is_no_verdict():
    """A server that is not listening (starting, stopping) is not stuck. (Which models are asked: a text model
    here in the --model-repository tests, none of the ensemble's in tests/test_ensemble.py.)"""
    port = free_ports(1)[0]
    assert liveness.unanswered(f"127.0.0.1:{port}", "nanoserve", timeout=5) is None


GREEDY = {"temperature": 0, "max_tokens": 8}
FREEZE_PROMPT = "freeze the response thread"
FREEZE_HOOK = f'''

# ---- injected by tests/test_supervisor.py: a response thread that blocks for good, as in a frontend deadlock ----
import threading as _threading

from nanoserve.serving.stub import responses as _responses

_real_handle = _responses.ResponseThread._handle_request_event


def _freezing_handle(self, event):
    if isinstance(event, _responses.Register) and event.stream.request.prompt == {FREEZE_PROMPT!r}:
        _threading.Event().wait()
    return _real_handle(self, event)


_responses.ResponseThread._handle_request_event = _freezing_handle
'''


@pytest.mark.triton_server
def test_a_model_that_stops_answering_is_restarted(qwen3_dir, tmp_path):
    """tritonserver 2.51's gRPC frontend can deadlock so that the stub's response thread blocks in send: the stub
    is alive and healthy, and the model answers nothing. Here the response thread blocks on a marked request; the
    liveness question gets no answer, the supervisor restarts tritonserver, and the model answers again."""
    repository = tiny_repository(tmp_path / "model_repository", qwen3_dir)
    config = repository / "nanoserve" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "nanoserve"', 'backend: "python"'))
    (repository / "nanoserve" / "1" / "model.py").write_text(BACKEND_MODEL.read_text() + FREEZE_HOOK)
    with running_server(repository, tmp_path, ["nanoserve"]) as server:
        supervision, received, returned = supervisor.Supervisor(server, ["nanoserve"], liveness_timeout=15), [], []
        watching = threading.Thread(target=lambda: returned.append(supervision.run(received)))
        watching.start()
        try:
            before = stream(server, "nanoserve", text_input="Hi", sampling_parameters=GREEDY)
            assert before.error is None and liveness.unanswered(server.url_http, "nanoserve", TIMEOUT) is None
            frozen = open_stream(server, "nanoserve", text_input=FREEZE_PROMPT, stream=True)
            assert collect(frozen[1]).error is not None  # not a hang: the old server went away
            frozen[0].close()
            deadline = time.monotonic() + TIMEOUT
            while server.starts < 2:  # the restart's new tritonserver
                assert time.monotonic() < deadline, "no restart"
                time.sleep(0.1)
            server.wait_ready(LOAD_TIMEOUT, models=["nanoserve"])
            after = stream(server, "nanoserve", text_input="Hi", sampling_parameters=GREEDY)
            assert after.error is None and after.text == before.text
            assert server.starts == 2 and supervision.restarts and supervision.liveness.stuck is None
        finally:
            received.append(signal.SIGTERM)
            watching.join(TIMEOUT)
        assert returned == [True]  # the server was still up when the signal came
