"""ShutdownWatch: tritonserver's arguments, noticing its HTTP front end go away, and the response thread ending
the streams by the deadline (the whole path through a real tritonserver: test_fault_tolerance.py)."""
import http.server
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from serving_utils import wait_until
from test_serving_request import ErrorPb, FakeClock, RecordingSender, parse, response_thread, text

from nanoserve.serving.serve.launcher import free_ports
from nanoserve.serving.stub.responses import Register, Stream
from nanoserve.serving.stub.shutdown import MARGIN, ServerArgs, ShutdownWatch


@pytest.mark.parametrize("argv, expected", [
    (["tritonserver", "--model-repository=/m"], ServerArgs("127.0.0.1", 8000, 30.0)),
    (["tritonserver", "--http-port=9000", "--exit-timeout-secs", "5"], ServerArgs("127.0.0.1", 9000, 5.0)),
    (["tritonserver", "--http-address", "10.0.0.2", "--http-port", "81"], ServerArgs("10.0.0.2", 81, 30.0)),
    (["tritonserver", "--http-address=0.0.0.0"], ServerArgs("127.0.0.1", 8000, 30.0)),
    (["tritonserver", "--model-control-mode", "explicit"], ServerArgs("127.0.0.1", 8000, 30.0, True)),
    (["tritonserver", "--model-control-mode=poll"], ServerArgs("127.0.0.1", 8000, 30.0, False)),
    (["tritonserver", "--allow-http=false"], None),
    (["tritonserver", "--http-port=eighty"], None),
])
def test_server_args(argv, expected):
    assert ServerArgs.parse(argv) == expected


class Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_watch_sets_a_deadline_once_http_that_was_up_refuses_connections():
    port = free_ports(1)[0]
    clock = FakeClock()
    watch = ShutdownWatch(ServerArgs("127.0.0.1", port, 10.0), interval=0.2, clock=clock)
    assert watch.http_state() == "refused"
    watch.start()  # not up yet (models still loading): refusals do not count
    assert watch.deadline is None and not watch.seen_up
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Live)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    wait_until(lambda: watch.seen_up)
    assert watch.deadline is None
    httpd.shutdown()
    httpd.server_close()
    watch._thread.join(30)
    assert watch.deadline == clock.now + 10.0 - MARGIN


def test_streams_end_with_unavailable_at_the_deadline():
    clock = FakeClock()
    thread = response_thread(clock, send_budget=1.0)
    aborted = []
    thread.pb, thread.engine_core = ErrorPb, SimpleNamespace(abort=aborted.append, failure=None)
    thread.shutdown_watch = SimpleNamespace(deadline=None)
    senders = [RecordingSender(), RecordingSender()]
    for i, sender in enumerate(senders):
        thread.handle_events([Register(str(i), Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    thread.shutdown_watch.deadline = clock.now + 1.0
    thread.handle_events([])
    assert len(thread.streams) == 2  # before the deadline: they may still finish
    clock.now += 1.0
    thread.handle_events([])
    assert thread.streams == {} and aborted == ["0", "1"]
    for sender in senders:
        [(response, flags)] = sender.sent
        assert response["error"].code == "UNAVAILABLE" and "shutting down" in response["error"].message


def test_a_front_end_that_drops_connections_is_draining_even_if_never_seen_up():
    """A model loaded just before SIGTERM never saw the front end up; a drain drops connections (not refused)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def drop_connections():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST
            connection.close()

    threading.Thread(target=drop_connections, daemon=True).start()
    clock = FakeClock()
    watch = ShutdownWatch(ServerArgs("127.0.0.1", port, 10.0), interval=0.2, clock=clock)
    assert watch.http_state() == "reset"
    watch.start()
    watch._thread.join(30)
    listener.close()
    assert watch.deadline == clock.now + 10.0 - MARGIN and not watch.seen_up
