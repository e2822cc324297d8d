"""A simulated device, a benchmark tool: measures what the host side (batch preparation, scheduling,
detokenization, serving) lets a device do, on a machine without one (docs/benchmarks.md, "Simulated device").

With NANOSERVE_SIMULATED_DEVICE_MS=X in the environment of the process that builds the engine (a tritonserver's
stubs inherit it), the model runner replaces the model's forward and the sampler's tensor math by X ms of
simulated device time per step and uniformly random token ids; everything else runs as usual. The device time
starts when the step is launched (its inputs prepared) and is waited for without the GIL, as a GPU leaves the host
free. NANOSERVE_SIMULATED_DEVICE_WAIT says where and how:
- sync (default): where the host would synchronize with a GPU, reading the sampled ids; whatever would overlap a
  GPU's step (the host's work after the launch, other threads) overlaps the simulated one, and nothing else does;
- launch: at the launch, so that nothing of the step's own host work overlaps it (other threads still run);
- spin: as sync, but polling the clock, yielding the GIL at each poll, as a GPU sync that spins keeps its core hot.
Outputs are not the model's: logprobs are 0, top logprobs and prompt logprobs empty. Never for serving users.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from nanoserve.config import SIMULATED_DEVICE_ENV

ENV_STEP_MS = SIMULATED_DEVICE_ENV
ENV_WAIT = "NANOSERVE_SIMULATED_DEVICE_WAIT"
WAITS = ("sync", "launch", "spin")


def sleep_until(deadline: float) -> None:
    """Sleep (the GIL released) until time.perf_counter() reaches deadline."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def spin_until(deadline: float) -> None:
    """Poll the clock until deadline, releasing the GIL at each poll: a busy core, other threads free to run."""
    while time.perf_counter() < deadline:
        time.sleep(0)


@dataclass
class SimulatedStep:
    """A launched step: its token ids are readable once its device time is over."""
    ready_at: float  # time.perf_counter() when the device is done
    sampled: np.ndarray  # [rows] int64
    spin: bool = False

    def token_ids(self) -> np.ndarray:
        """The sampled ids, after waiting for the device: the host's synchronization point."""
        (spin_until if self.spin else sleep_until)(self.ready_at)
        return self.sampled


class SimulatedDevice:
    def __init__(self, step_ms: float, wait: str = "sync", seed: int = 0):
        if not step_ms > 0:
            raise ValueError(f"{ENV_STEP_MS}: expected a positive number of milliseconds, got {step_ms!r}")
        if wait not in WAITS:
            raise ValueError(f"{ENV_WAIT}: expected one of {', '.join(WAITS)}, got {wait!r}")
        self.step_seconds, self.wait = step_ms / 1000, wait
        self.rng = np.random.default_rng(seed)
        self.busy_until = 0.0  # when the last step launched is done: a device runs its steps in launch order

    @classmethod
    def from_env(cls, seed: int = 0, environ=os.environ) -> SimulatedDevice | None:
        """The simulated device the environment asks for; None without NANOSERVE_SIMULATED_DEVICE_MS."""
        text = environ.get(ENV_STEP_MS, "").strip()
        if not text:
            return None
        try:
            step_ms = float(text)
        except ValueError:
            raise ValueError(f"{ENV_STEP_MS}: expected a number of milliseconds, got {text!r}") from None
        return cls(step_ms, environ.get(ENV_WAIT, "sync").strip() or "sync", seed)

    def describe(self) -> str:
        return (f"simulated device ({ENV_STEP_MS}={self.step_seconds * 1000:g}, {ENV_WAIT}={self.wait}): no model "
                "forward, random token ids; a benchmark tool, not for serving")

    def launch(self, num_tokens: int, num_rows: int, vocab_size: int) -> SimulatedStep:
        """Start a step over num_tokens input tokens that samples num_rows rows, once the steps launched before it
        are done; a step without tokens (one that only preempted) takes no device time."""
        start = max(time.perf_counter(), self.busy_until)
        ready_at = self.busy_until = start + self.step_seconds if num_tokens else start
        if self.wait == "launch":
            sleep_until(ready_at)
        return SimulatedStep(ready_at, self.rng.integers(0, vocab_size, num_rows, dtype=np.int64),
                             spin=self.wait == "spin")
