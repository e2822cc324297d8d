"""Engine host overhead per decode step: the time of `engine.step()` minus the model forward.

Fills the engine with N sequences, runs their prefills, then times decode-only steps. The model forward is
timed by wrapping the model's `forward`; on CUDA the forward timer synchronizes, so the overhead figure is
the CPU work around it (scheduling, input preparation, sampling, stop checks, detokenization).

    python client/bench_host_overhead.py --num-seqs 64 256
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


class ForwardTimer:
    """Wraps a module's forward and accumulates its wall time."""

    def __init__(self, module: torch.nn.Module):
        self.seconds = 0.0
        self.original = module.forward
        module.forward = self._timed

    def _timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        return out


def measure(model: str, num_seqs: int, steps: int, engine_args: dict) -> dict:
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(model, max_num_seqs=max(num_seqs, 1), **engine_args)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(16)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    timer = ForwardTimer(engine.model_runner.model)
    totals, forwards = [], []
    for _ in range(steps):
        before = timer.seconds
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
        forwards.append(timer.seconds - before)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    engine.step()
    engine.shutdown()
    overheads = [t - f for t, f in zip(totals, forwards)]
    return {"num_seqs": num_seqs, "step_us": statistics.median(totals) * 1e6,
            "forward_us": statistics.median(forwards) * 1e6, "overhead_us": statistics.median(overheads) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build the tiny test model)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from nanoserve.tiny_model import build_tiny_model
        model = build_tiny_model(tempfile.mkdtemp(prefix="nanoserve-overhead-"), "qwen3")
    for n in args.num_seqs:
        r = measure(model, n, args.steps, {"device": args.device, "max_model_len": 512})
        print(f"seqs={r['num_seqs']:4d}  step={r['step_us']:8.0f} us  forward={r['forward_us']:8.0f} us  "
              f"host overhead={r['overhead_us']:6.0f} us")


if __name__ == "__main__":
    main()
