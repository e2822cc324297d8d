"""OS thread names (nanoserve.thread_names) and per-thread CPU / run-queue readings (client/thread_times.py):
against a /proc tree written by the test, and against this process's own threads."""
import os
import sys
import threading
import time

import pytest

from client import thread_times
from client.thread_times import ThreadTime
from nanoserve.thread_names import set_os_thread_name

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def write_thread(proc, pid: int, tid: int, name: str, cpu_ns: int, wait_ns: int) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "comm").write_text(name + "\n")
    (task / "schedstat").write_text(f"{cpu_ns} {wait_ns} 42\n")


def test_usage_is_the_difference_per_thread_name(tmp_path):
    write_thread(tmp_path, 10, 10, "tritonserver", 1_000_000_000, 0)
    write_thread(tmp_path, 10, 11, "grpc", 500_000_000, 100_000_000)
    write_thread(tmp_path, 20, 21, "ns-engine", 2_000_000_000, 300_000_000)
    write_thread(tmp_path, 20, 22, "ns-gone", 1, 1)
    before = thread_times.snapshot([10, 20, 99], proc=str(tmp_path))  # 99: no such process
    assert before[20, 21] == ("ns-engine", ThreadTime(2.0, 0.3))
    write_thread(tmp_path, 10, 11, "grpc", 750_000_000, 100_000_000)
    write_thread(tmp_path, 10, 12, "grpc", 250_000_000, 50_000_000)  # started meanwhile: counts from 0
    write_thread(tmp_path, 20, 21, "ns-engine", 5_000_000_000, 800_000_000)
    (tmp_path / "20" / "task" / "22" / "schedstat").unlink()  # ended meanwhile
    used = thread_times.usage(before, thread_times.snapshot([10, 20], proc=str(tmp_path)))
    assert used.keys() == {"tritonserver", "grpc", "ns-engine"}
    assert used["ns-engine"].cpu == pytest.approx(3.0) and used["ns-engine"].wait == pytest.approx(0.5)
    assert used["grpc"].cpu == pytest.approx(0.5) and used["grpc"].wait == pytest.approx(0.05)
    assert used["tritonserver"] == ThreadTime(0.0, 0.0)


def test_describe_ranks_threads_and_sums_the_rest():
    used = {"a": ThreadTime(0.1, 0.0), "ns-engine": ThreadTime(9.5, 0.25), "b": ThreadTime(0.2, 0.1),
            "ns-responses": ThreadTime(0.5, 0.5)}
    assert thread_times.describe(used, top=2) == ("ns-engine 9.50 s CPU + 0.25 s wait, ns-responses 0.50 + 0.50, "
                                                  "others 0.30 + 0.10")
    assert thread_times.describe({"x": ThreadTime(1.0, 2.0)}) == "x 1.00 s CPU + 2.00 s wait"
    assert thread_times.describe({}) == ""


@linux_only
def test_a_named_thread_is_found_with_the_cpu_it_used():
    stop = threading.Event()
    ready = threading.Event()

    def spin():
        set_os_thread_name("ns-spin-with-a-long-name")
        ready.set()
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        stop.wait()

    threads = [threading.Thread(target=spin) for _ in range(2)]
    before = thread_times.snapshot([os.getpid()])
    start = time.monotonic()
    for thread in threads:
        thread.start()
    ready.wait()
    time.sleep(0.05)
    while any(thread_times.read_thread(os.getpid(), t.native_id)[1].cpu < 0.2 for t in threads):
        time.sleep(0.02)
    used = thread_times.usage(before, thread_times.snapshot([os.getpid()]))
    wall = time.monotonic() - start
    stop.set()
    for thread in threads:
        thread.join()
    name = "ns-spin-with-a-long-name"[:15]  # the kernel keeps 15 bytes
    assert name in used and 0.4 <= used[name].cpu <= 2 * wall  # the two threads' CPU, summed
    mine = thread_times.this_thread()
    assert mine is not None and mine.cpu > 0
