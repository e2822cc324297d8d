"""The engine's steps with and without overlap (LLMEngine.step(overlap=True), what the engine thread of a served
engine runs): the same streamed workload, alternating, on the simulated device, so that the host work that
overlapping moves beside the device's step shows. Prints each run's share of the device-bound rate and the
median ratio overlapped / step by step. With --compare async: an engine with async_scheduling (each step
scheduled and prepared while the one before it runs) against one without it, both stepped with overlap=True.
With --simulated-device-ms 0 the model's own forward runs on the CPU, and each run's output tok/s is printed.

    OMP_NUM_THREADS=1 python client/bench_overlap.py --simulated-device-ms 2 --rounds 3
    OMP_NUM_THREADS=1 python client/bench_overlap.py --compare async --simulated-device-ms 8 --rounds 4
    OMP_NUM_THREADS=1 python client/bench_overlap.py --compare async --simulated-device-ms 0 --model FILE.gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make `client` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanoserve.engine.simulated_device import ENV_STEP_MS  # noqa: E402


NAMES = {"overlap": {False: "step by step", True: "overlapped"},
         "async": {False: "synchronous scheduling", True: "async scheduling"}}


def run(engine, overlap: bool, rows: int, input_len: int, output_len: int, name: str) -> float:
    """Seconds to stream rows requests of output_len tokens each, all at once."""
    from nanoserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for index in range(rows):
        engine.add_request(f"{name}-{index}", list(range(10, 10 + input_len)), params)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(overlap=overlap)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: the tiny test model)")
    parser.add_argument("--simulated-device-ms", type=float, default=2.0)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", choices=("overlap", "async"), default="overlap",
                        help="overlap: step(overlap=True) against step(); async: async_scheduling on against off")
    args = parser.parse_args(argv)
    if args.simulated_device_ms > 0:
        os.environ[ENV_STEP_MS] = str(args.simulated_device_ms)
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.serving.serve.launcher import tiny_model

    model, names = args.model or str(tiny_model()), NAMES[args.compare]
    engine_args = dict(device="cpu", cpu_kvcache_space_gib=0.5)
    engines = {False: LLMEngine.from_engine_args(model, **engine_args, async_scheduling=False)}
    engines[True] = engines[False] if args.compare == "overlap" else \
        LLMEngine.from_engine_args(model, **engine_args, async_scheduling=True)
    # shares of the device-bound rate, or with the model's forward tok/s
    unit, bound = (("of the device-bound rate", args.rows * 1000 / args.simulated_device_ms)
                   if args.simulated_device_ms > 0 else ("tok/s", 1.0))
    shares = {False: [], True: []}
    for round_ in range(args.rounds):
        for on in ((False, True) if round_ % 2 == 0 else (True, False)):
            overlap = on or args.compare == "async"
            seconds = run(engines[on], overlap, args.rows, args.input_len, args.output_len, f"{round_}-{on}")
            shares[on].append(args.rows * args.output_len / seconds / bound)
            print(f"round {round_} {names[on]}: {shares[on][-1]:.3f} {unit}", flush=True)
    for engine in set(engines.values()):
        engine.shutdown()
    for on in (False, True):
        print(f"{names[on]}: median {statistics.median(shares[on]):.3f} ({min(shares[on]):.3f}-{max(shares[on]):.3f})"
              f" {unit}")
    ratios = [on / off for on, off in zip(shares[True], shares[False])]
    print(f"{names[True]} / {names[False]}: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
