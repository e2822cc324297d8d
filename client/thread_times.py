"""Where a run's time went, thread by thread: each thread's CPU time and run-queue wait (runnable, but another
thread had the core) from Linux's /proc/<pid>/task/<tid>/schedstat. bench_serving prints them for the server's
threads (nanoserve names its own: ns-engine, ns-responses) and for the in-process engine's. Elsewhere than on
Linux every reading is empty."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadTime:
    cpu: float = 0.0  # seconds on a CPU
    wait: float = 0.0  # seconds runnable, waiting for a CPU

    def __add__(self, other: "ThreadTime") -> "ThreadTime":
        return ThreadTime(self.cpu + other.cpu, self.wait + other.wait)

    def __sub__(self, other: "ThreadTime") -> "ThreadTime":
        return ThreadTime(self.cpu - other.cpu, self.wait - other.wait)


def read_thread(pid: int, tid: int, proc: str = "/proc") -> tuple[str, ThreadTime] | None:
    """(name, times since the thread started), or None when it is gone or the kernel keeps no schedstat."""
    task = f"{proc}/{pid}/task/{tid}"
    try:
        with open(f"{task}/comm") as comm, open(f"{task}/schedstat") as schedstat:
            name, fields = comm.read().strip(), schedstat.read().split()
        return name, ThreadTime(int(fields[0]) / 1e9, int(fields[1]) / 1e9)
    except (OSError, ValueError, IndexError):
        return None


def this_thread() -> ThreadTime | None:
    """The calling thread's times since it started."""
    reading = read_thread(os.getpid(), threading.get_native_id())
    return None if reading is None else reading[1]


def snapshot(pids, proc: str = "/proc") -> dict[tuple[int, int], tuple[str, ThreadTime]]:
    """{(pid, tid): (name, times)} for every thread of the given processes."""
    threads = {}
    for pid in pids:
        try:
            tids = [int(tid) for tid in os.listdir(f"{proc}/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            reading = read_thread(pid, tid, proc)
            if reading is not None:
                threads[pid, tid] = reading
    return threads


def usage(before: dict, after: dict) -> dict[str, ThreadTime]:
    """What the threads used between two snapshots, summed per thread name (a pool's threads share one).
    A thread started meanwhile counts from its start; one that ended meanwhile is not counted."""
    used: dict[str, ThreadTime] = {}
    for key, (name, times) in after.items():
        start = before.get(key, (name, ThreadTime()))[1]
        used[name] = used.get(name, ThreadTime()) + (times - start)
    return used


def describe(used: dict[str, ThreadTime], top: int = 4) -> str:
    """The `top` threads by CPU + wait, then the others together, e.g.
    "ns-engine 9.68 s CPU + 0.27 s wait, ns-responses 0.54 + 0.52, others 0.40 + 0.93"."""
    ranked = sorted(used.items(), key=lambda item: item[1].cpu + item[1].wait, reverse=True)
    shown = [f"{name} {t.cpu:.2f}{' s CPU' if i == 0 else ''} + {t.wait:.2f}{' s wait' if i == 0 else ''}"
             for i, (name, t) in enumerate(ranked[:top])]
    rest = sum((t for _, t in ranked[top:]), ThreadTime())
    if len(ranked) > top:
        shown.append(f"others {rest.cpu:.2f} + {rest.wait:.2f}")
    return ", ".join(shown)
