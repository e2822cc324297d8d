"""When the response thread sends a stream's outputs.

A response costs CPU per response, not per token: an IPC round trip to tritonserver, which then builds it,
serializes it and writes it to the client, all on the cores the engine runs on. So outputs wait in `pending`,
merged per request, and the regular flush of all of them is paced to take at most `send_budget` of the wall
time: after a flush that took d seconds the next comes d / send_budget after it began. With a few streams a
flush takes far less than an engine step and every step is sent at once; with many, each response carries the
steps that came meanwhile. Urgent outputs (a request's first and last responses, the caller decides) go at any
flush: time to first token and end-to-end latency never wait.

every_step: vllm_backend's streaming instead: each engine step's outputs are sent at once, one response per step
and request; no merging across steps, no pacing.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from nanoserve.engine.outputs import joined, joined_all

DEFAULT_SEND_BUDGET = 0.1

Send = Callable[[str, list], None]  # (request_id, its RequestOutputs: one per sample that has any, merged)


class Pacer:
    def __init__(self, send_budget: float = DEFAULT_SEND_BUDGET, every_step: bool = False, clock=time.monotonic):
        if not 0 < send_budget <= 1:
            raise ValueError(f"send_budget: must be in (0, 1], got {send_budget}")
        self.send_budget, self.every_step, self.clock = send_budget, every_step, clock
        self.pending: dict[str, list] = {}  # request_id -> its merged RequestOutputs not sent yet (merge_into)
        self.next_flush = 0.0  # clock() before which only urgent outputs are sent

    def add(self, step_outputs: list[list], send: Send) -> None:
        """The outputs of steps, in order: sent now (every_step), else pending."""
        if self.every_step:
            for outputs in step_outputs:
                for request_id, request_outputs in merge_into({}, outputs).items():
                    send(request_id, request_outputs)
        else:  # a round's steps joined per request in one pass, then into what is pending: few objects held
            arrived: dict[str, list] = {}
            for outputs in step_outputs:
                for output in outputs:
                    queued = arrived.get(output.request_id)
                    if queued is None:
                        arrived[output.request_id] = [output]
                    else:
                        queued.append(output)
            merge_into(self.pending, [output for outputs in arrived.values() for output in merged(outputs)])

    def flush(self, send: Send, urgent: Callable[[str, list], bool], force: bool = False) -> None:
        """Send the pending outputs that are due: all of them at the paced flush (or when forced), else only the
        urgent ones."""
        start = self.clock()
        regular = force or start >= self.next_flush
        due = [(request_id, outputs) for request_id, outputs in self.pending.items()
               if regular or urgent(request_id, outputs)]
        for request_id, outputs in due:
            del self.pending[request_id]
            send(request_id, outputs)
        if regular and due:
            self.next_flush = start + (self.clock() - start) / self.send_budget


def merged(outputs: list) -> list:
    """A request's outputs, in step order, as merge_into gives them: one sample's (n = 1, the common case) joined
    in one pass."""
    if len(outputs) == 1:
        return outputs
    first = outputs[0].index
    if any(output.index != first for output in outputs):
        return merge_into({}, outputs)[outputs[0].request_id]
    return [joined_all(outputs)]


def merge_into(pending: dict, outputs) -> dict:
    """Add outputs to pending (request_id -> its outputs, one per sample that has any, the latest last) and return
    it: a sample's consecutive outputs joined into its latest one, which has the latest counts and finish state."""
    for output in outputs:
        merged = pending.get(output.request_id)
        if merged is None:
            pending[output.request_id] = [output]
            continue
        for i, earlier in enumerate(merged):
            if earlier.index == output.index:
                joined(earlier, output)
                del merged[i]
                break
        merged.append(output)  # the latest last: the one that finishes the request, if it has
    return pending
