"""The response thread's inbox: every event comes out in the order it went in, and an engine step wakes the
response thread exactly when it holds something urgent or the thread is due. Pure Python, no server."""
import threading
from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.engine.outputs import RequestOutput
from nanoserve.errors import RequestError
from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.inbox import MAX_QUIET, Inbox
from nanoserve.serving.stub.responses import Register, Reject


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def step(*outputs, **fields) -> StepResult:
    return StepResult(outputs=[RequestOutput(request_id, [1], "x", finished, "stop" if finished else None, 3, 1)
                               for request_id, finished in outputs], **fields)


def register(request_id: str) -> Register:
    return Register(request_id, SimpleNamespace(request=None))


def test_quiet_steps_wait_until_the_response_thread_is_due():
    clock = Clock()
    inbox = Inbox(clock)
    inbox.put(register("a"))
    assert inbox.take(0, wake_at=clock.now + 1) == [register("a")] and not inbox.woken
    inbox.put(step(("a", False)))  # a's first output: a has no response yet
    assert inbox.woken
    inbox.take(0, wake_at=clock.now + 1)
    inbox.eager.discard("a")  # a responded
    quiet = step(("a", False))
    inbox.put(quiet)
    assert not inbox.woken
    clock.now += 1  # the response thread's deadline
    later = step(("a", False))
    inbox.put(later)
    assert inbox.woken and inbox.take(None, wake_at=clock.now + 1) == [quiet, later] and not inbox.woken


def test_a_due_response_thread_takes_quiet_steps_without_waiting():
    """Quiet steps queued before the thread's deadline: once it has passed, take() returns them at once (a take that
    waited here would wait for a wake-up that no quiet step owes)."""
    clock = Clock()
    inbox = Inbox(clock)
    inbox.take(0, wake_at=clock.now + 1)
    quiet = step(("a", False))
    inbox.put(quiet)
    clock.now += 2
    taken = []
    thread = threading.Thread(target=lambda: taken.extend(inbox.take(None, wake_at=clock.now - 1)))
    thread.start()
    thread.join(60)
    if thread.is_alive():  # (unblock it, so that the test fails rather than hangs)
        inbox.put(register("b"))
        thread.join()
    assert taken == [quiet]


@given(st.lists(st.one_of(
    st.tuples(st.just("step"), st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=3),
              st.sampled_from(["", "rejected", "failed", "failure"])),
    st.tuples(st.just("register"), st.sampled_from("abc"), st.just("")),
    st.tuples(st.just("reject"), st.just("x"), st.just("")),
    st.tuples(st.just("respond"), st.sampled_from("abc"), st.just("")),
    st.tuples(st.just("take"), st.sampled_from([None, -1.0, 0.0, 1.0]), st.just("")),
    st.tuples(st.just("tick"), st.sampled_from([0.0, MAX_QUIET / 3, MAX_QUIET, 1.0]), st.just(""))), max_size=30))
def test_each_event_wakes_exactly_when_urgent_or_due_and_all_come_out_in_order(actions):
    clock = Clock()
    inbox = Inbox(clock)
    eager, wake_at, taken, put, queued, oldest = set(), -np.inf, [], [], False, 0.0
    for kind, value, extra in actions:
        if kind == "take":
            wake_at = -np.inf if value is None else clock.now + value
            taken += inbox.take(0, None if value is None else clock.now + value)
            queued = False
            assert not inbox.woken
            continue
        if kind == "tick":
            clock.now += value
            continue
        if kind == "respond":
            inbox.eager.discard(value)
            eager.discard(value)
            continue
        woken_before = inbox.woken
        oldest = clock.now if not queued else oldest
        queued = True
        if kind == "step":
            fields = {"rejected": {"rejected": [("r", RequestError(None, "no"))]}, "failed": {"failed": [("f", "no")]},
                      "failure": {"failure": "dead"}}.get(extra, {})
            event = step(*value, **fields)
            urgent = bool(extra) or any(finished or r in eager for r, finished in value)
            should_wake = urgent or clock.now >= wake_at or clock.now - oldest >= MAX_QUIET
        else:
            event = register(value) if kind == "register" else Reject(None, RequestError(None, "no"))
            eager |= {value} if kind == "register" else set()
            should_wake = True
        inbox.put(event)
        put.append(event)
        assert inbox.woken == (woken_before or should_wake)
    taken += inbox.take(0)
    assert taken == put and inbox.eager == eager


def test_quiet_steps_wake_the_response_thread_once_the_oldest_has_waited_max_quiet():
    clock = Clock()
    inbox = Inbox(clock)
    inbox.take(0, wake_at=clock.now + 10)  # the next flush is far
    first = step(("a", False))
    inbox.put(first)
    clock.now += MAX_QUIET / 2
    inbox.put(step(("a", False)))
    assert not inbox.woken
    clock.now += MAX_QUIET / 2
    inbox.put(step(("a", False)))
    assert inbox.woken and len(inbox.take(0, wake_at=clock.now + 10)) == 3
    inbox.put(step(("a", False)))  # a new oldest
    assert not inbox.woken
