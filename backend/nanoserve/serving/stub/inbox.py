"""The response thread's events, in the order the stub's threads put them (requests from execute(), a StepResult
per engine step), and when they wake it.

Waking a thread costs the waker a futex wake and often a context switch; the engine's thread paid that at every
step, and the response thread a round of its loop, although most steps' outputs only wait in the pacer for its
next flush. So a StepResult wakes the response thread only when it holds something urgent: an output that
finishes, one of a request that has no response yet (`eager`: from its Register until its first response), a
rejection or failure; once the response thread's own `wake_at` (its next flush) has passed; or once the oldest
event queued has waited MAX_QUIET (a round of the response thread then merges a few steps' outputs, which do not
pile up for the garbage collector). Otherwise it waits here until the response thread wakes, at wake_at at the
latest: nothing is sent later than the pacer alone would send it. Every other event wakes it at once.
"""
from __future__ import annotations

import math
import queue
import time
from collections import deque

from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.responses import Register

MAX_QUIET = 0.02  # seconds: quiet steps queued longer wake the response thread (its round then joins few objects)


class Inbox:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._items: deque = deque()
        self._wake = queue.SimpleQueue()  # one entry per wake-up owed to the response thread
        self.wake_at = -math.inf  # clock() from which every event wakes the response thread
        self.eager: set[str] = set()  # request ids whose every output wakes the response thread
        self._oldest = 0.0  # clock() when the oldest event queued was put

    def put(self, event) -> None:
        """Any thread: queue the event; wake the response thread if it is urgent or the thread is due."""
        if isinstance(event, Register):  # no response yet
            self.eager.add(event.request_id)
        now = self.clock()
        if not self._items:
            self._oldest = now
        self._items.append(event)
        if (not isinstance(event, StepResult) or now >= self.wake_at or now - self._oldest >= MAX_QUIET
                or self._urgent(event)):
            self._wake.put(None)

    @property
    def woken(self) -> bool:
        """A wake-up is owed to the response thread (its next take() returns without waiting)."""
        return not self._wake.empty()

    def _urgent(self, step: StepResult) -> bool:
        if step.rejected or step.failed or step.failure is not None:
            return True
        eager = self.eager
        for output in step.outputs:
            if output.finished or output.request_id in eager:
                return True
        return False

    def take(self, timeout: float | None, wake_at: float | None = None) -> list:
        """The response thread: every event queued, in order, once woken or after `timeout` seconds (None: no limit;
        0: no wait). Until clock() `wake_at` a quiet StepResult does not wake it (None: every event does), and
        from then on the quiet ones queued are taken at once."""
        now, self.wake_at = self.clock(), -math.inf if wake_at is None else wake_at
        if timeout != 0 and not (self._items and now >= self.wake_at):
            if self.wake_at > now:
                timeout = self.wake_at - now if timeout is None else min(timeout, self.wake_at - now)
            try:
                self._wake.get(timeout=timeout)
            except queue.Empty:
                pass
        while self.woken:  # the wake-ups owed for what is taken below
            self._wake.get_nowait()
        events = []
        while self._items:
            events.append(self._items.popleft())
        return events
