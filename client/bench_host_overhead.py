"""Engine host overhead per decode step: the time of `engine.step()` minus the model forward.

Fills the engine with N sequences, runs their prefills, then times decode-only steps. The model forward is
timed by wrapping the model's `forward`; on CUDA the forward timer synchronizes, so the overhead figure is
the CPU work around it (scheduling, input preparation, sampling, stop checks, detokenization).

The forward includes the attention backend's per-step metadata (which the torch backend plans on the host).
`--host-only` replaces the forward, the LM head and the sampler by outputs computed beforehand (random token
ids), so that a step is the engine's host work alone, with warm CPU caches: what a GPU server's host sees,
where the forward runs on the device. With a real forward on the CPU, the forward evicts the CPU caches
and the host work after it pays for refilling them (several hundred microseconds per step here, whatever N).

Each figure is the median over the timed steps, in wall time and in this process's CPU time (the CPU figure
leaves out time the process waits for a core on a shared machine). `--phases` splits a step into
schedule / prepare (batch arrays + tensors) / forward / lm_head / sampling metadata / sampler / postprocess /
outputs (appending tokens, stop checks, detokenization, RequestOutputs: the rest of step()), and also reports
the overhead without lm_head and the sampler, the parts that are device work on a GPU (on CPU they are
tensor math over [N, vocab]). Medians of phases need not add up to the median of the whole.

    OMP_NUM_THREADS=1 python client/bench_host_overhead.py --num-seqs 64 256 --phases
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

PHASES = ("schedule", "prepare", "forward", "lm_head", "sampling_meta", "sampler", "postprocess")


class PhaseTimer:
    """Wraps methods of live objects and accumulates their wall and CPU time per phase name."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, owner, method: str, phase: str, sync: bool = False) -> None:
        """Replace owner.method (or a callable attribute, e.g. the runner's sampler) by a timed version."""
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = original(*args, **kwargs)
            if sync and isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.synchronize()
            self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - wall
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.process_time() - cpu
            return out

        setattr(owner, method, timed)

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        return dict(self.wall), dict(self.cpu)


def _wrap_phases(engine, timer: PhaseTimer, phases: bool, host_only: bool) -> None:
    runner = engine.executor.runner
    timer.wrap(runner.model, "forward", "forward", sync=True)
    if not host_only:  # stubbed out there: a timer around it would only add its own cost to the overhead
        timer.wrap(runner.backend, "build", "forward")  # the attention backend's per-step metadata: forward work
    if not phases:
        return
    timer.wrap(runner.model, "compute_logits", "lm_head", sync=True)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update", "postprocess")
    for owner, method in ((runner.batch, "update"), (runner.batch, "prepare"), (runner, "_upload")):
        timer.wrap(owner, method, "prepare")
    timer.wrap(runner.batch, "sampling_metadata", "sampling_meta")
    timer.wrap(runner, "sampler", "sampler")


def stub_device_work(engine, num_seqs: int, steps: int, evict_mb: int = 0, seed: int = 0) -> None:
    """Forward (with the attention backend's metadata), LM head and sampler -> outputs made beforehand: a step is
    host work only. evict_mb > 0: the stand-in forward reads that many MB twice, evicting the CPU caches as a
    real CPU forward does (its time is the forward column, not the overhead)."""
    from nanoserve.layers.sampler import SamplerOutput

    runner, hf = engine.executor.runner, engine.config.hf_config
    hidden = torch.zeros(num_seqs, hf.hidden_size)
    logits = torch.zeros(num_seqs, hf.vocab_size)
    scratch = torch.ones(evict_mb * 2 ** 18)  # float32: evict_mb MB
    generator = torch.Generator().manual_seed(seed)
    token_rows = iter([SamplerOutput(tokens, torch.zeros(num_seqs)) for tokens in
                       torch.randint(0, hf.vocab_size, (steps + 2, num_seqs), generator=generator)])

    def forward(input_ids, *args, **kwargs):
        for _ in range(2 if evict_mb else 0):
            scratch.sum()
        return hidden[:len(input_ids)]
    runner.model.forward = forward
    runner.backend.build = lambda batch: None
    runner.model.compute_logits = lambda h: logits[:len(h)]

    def sample(logits, meta):
        out = next(token_rows)
        return out if len(logits) == num_seqs else SamplerOutput(out.token_ids[:len(logits)],
                                                                  out.sampled_logprobs[:len(logits)])
    runner.sampler = sample


def measure(model: str, num_seqs: int, steps: int, engine_args: dict, phases: bool = False,
            stream: bool = False, host_only: bool = False, evict_mb: int = 0) -> dict:
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(model, max_num_seqs=max(num_seqs, 1), **engine_args)
    params = SamplingParams(temperature=0.6, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(16)], params, stream=stream)
    while engine.scheduler.waiting or engine.last_step.num_prefill_tokens:  # the prefills
        engine.step()
    engine.step()  # first decode step: warms caches built on the first decode
    if host_only:
        stub_device_work(engine, num_seqs, steps, evict_mb)
    timer = PhaseTimer()
    _wrap_phases(engine, timer, phases, host_only)
    rows = []
    for _ in range(steps):
        before = timer.snapshot()
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = timer.snapshot()
        row = {"step": wall, "step_cpu": cpu}
        for phase in PHASES:
            row[phase] = after[0].get(phase, 0.0) - before[0].get(phase, 0.0)
            row[phase + "_cpu"] = after[1].get(phase, 0.0) - before[1].get(phase, 0.0)
        row["overhead"] = wall - row["forward"]
        row["overhead_cpu"] = cpu - row["forward_cpu"]
        row["host"] = row["overhead"] - row["lm_head"] - row["sampler"]
        row["host_cpu"] = row["overhead_cpu"] - row["lm_head_cpu"] - row["sampler_cpu"]
        row["outputs"] = wall - sum(row[p] for p in PHASES)
        row["outputs_cpu"] = cpu - sum(row[p + "_cpu"] for p in PHASES)
        rows.append(row)
    engine.abort_all()
    engine.shutdown()
    result = {key: statistics.median(r[key] for r in rows) * 1e6 for key in rows[0]}
    result["num_seqs"] = num_seqs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build the tiny test model)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--phases", action="store_true", help="also time each phase of a step (adds ~1 us each)")
    parser.add_argument("--modes", nargs="+", choices=["generate", "stream"], default=["generate", "stream"],
                        help="generate: outputs only when a request finishes (as LLM.generate); stream: a "
                             "RequestOutput with a text delta per request per step (as the Triton backend)")
    parser.add_argument("--evict-mb", type=int, default=0,
                        help="with --host-only: the stand-in forward reads this many MB, evicting the CPU caches")
    parser.add_argument("--host-only", action="store_true",
                        help="forward, LM head and sampler replaced by outputs made beforehand (see above)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine argument (default: the engine's default for --device)")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from nanoserve.tiny_model import build_tiny_model
        model = build_tiny_model(tempfile.mkdtemp(prefix="nanoserve-overhead-"), "qwen3")
    for mode, n in [(mode, n) for mode in args.modes for n in args.num_seqs]:
        engine_args = {"device": args.device, "max_model_len": 512}
        if args.async_scheduling is not None:
            engine_args["async_scheduling"] = args.async_scheduling
        r = measure(model, n, args.steps, engine_args, args.phases,
                    stream=mode == "stream", host_only=args.host_only, evict_mb=args.evict_mb)
        print(f"{mode:8s}  seqs={r['num_seqs']:4d}  step={r['step']:8.0f} us  forward={r['forward']:8.0f} us  "
              f"host overhead={r['overhead']:6.0f} us  (cpu time: {r['overhead_cpu']:6.0f} us)")
        if args.phases:
            names = (*PHASES, "outputs")
            print("    phase  " + " ".join(f"{p:>13s}" for p in names))
            print("    wall   " + " ".join(f"{r[p]:13.0f}" for p in names))
            print("    cpu    " + " ".join(f"{r[p + '_cpu']:13.0f}" for p in names))
            print(f"    host overhead without lm_head and sampler (device work on a GPU): {r['host']:6.0f} us  "
                  f"(cpu time: {r['host_cpu']:6.0f} us)")


if __name__ == "__main__":
    main()
