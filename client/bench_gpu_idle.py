"""The share of an engine step the GPU waits for the host (client/bench_gpu.py): decode steps of the real engine
(scheduler, input preparation, forward, sampler, outputs), timed on the wall without a profiler, and the same
number of steps again under torch.profiler, whose device activity (kernels, copies, memsets, those of CUDA-graph
replays included) merged into busy intervals gives the device's busy time. idle share = 1 - busy / wall.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class IdleResult:
    batch: int
    step_ms: float  # wall time of one engine step, unprofiled
    busy_ms: float | None  # device busy time per step (None: no device activity seen, as on the CPU)

    @property
    def idle_share(self) -> float | None:
        if self.busy_ms is None:
            return None
        return max(0.0, 1.0 - self.busy_ms / self.step_ms)

    def as_json(self) -> dict:
        share = self.idle_share
        return {"batch": self.batch, "step_ms": round(self.step_ms, 4),
                "device_busy_ms": None if self.busy_ms is None else round(self.busy_ms, 4),
                "gpu_idle_share": None if share is None else round(share, 4)}


def merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def device_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of a profile's device-side events."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA]


def decoding_engine(model: str, batch: int, prompt_len: int, steps: int, engine_args: dict):
    """An engine with `batch` requests past their prefill, each with room for 2 * steps + 8 more decode steps."""
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(model, max_num_seqs=batch, **engine_args)
    params = SamplingParams(temperature=0.6, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"idle-{i}", [(7 * i + j) % 500 + 3 for j in range(prompt_len)], params)
    while engine.scheduler.waiting or engine.last_step.num_prefill_tokens:
        engine.step()
    engine.step()  # the first decode step
    return engine


def measure_idle(model: str, batch: int, prompt_len: int, steps: int, engine_args: dict) -> IdleResult:
    engine = decoding_engine(model, batch, prompt_len, steps, engine_args)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - start) * 1e3 / steps
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        intervals = device_intervals(prof.events())
        busy_ms = merged_length(intervals) * 1e-3 / steps if intervals else None
        return IdleResult(batch, step_ms, busy_ms)
    finally:
        engine.abort_all()
        engine.shutdown()
