"""The engine on a thread of this process vs in an engine core process of its own (serving/stub/engine_core.py): the
same streamed workload (N requests, at most C running, every step's tokens and text) through an EngineThread and
through an EngineCoreClient, alternating; prints output tok/s of each and the ratio core / thread. With
--simulated-device-ms X both run on the simulated device and each also gives its share of the device-bound rate.

    OMP_NUM_THREADS=1 python client/bench_engine_core.py --model DIR --rounds 3 --simulated-device-ms 8

This says which mode `LLM` (offline) should use: in this process, a consumer that only collects outputs.
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a script: make `client` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.bench_serving import make_prompts  # noqa: E402
from nanoserve.engine.simulated_device import ENV_STEP_MS, ENV_WAIT  # noqa: E402


def run(engine, results: queue.Queue, prompts: list[str], params, concurrency: int, tokenizer) -> float:
    """Seconds to serve every prompt, at most `concurrency` at once (a finished one lets the next in)."""
    waiting = list(enumerate(prompts))
    running, started = 0, time.perf_counter()
    while waiting or running:
        while waiting and running < concurrency:
            index, prompt = waiting.pop()
            engine.add(f"r{index}", tokenizer.encode(prompt), params)
            running += 1
        result = results.get(timeout=600)
        if result.rejected or result.failed or result.failure:
            raise RuntimeError(f"{result.rejected} {result.failed} {result.failure}")
        running -= sum(output.finished for output in result.outputs)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--simulated-device-ms", type=float)
    parser.add_argument("--simulated-device-wait", default="sync")
    args = parser.parse_args(argv)
    if args.simulated_device_ms:
        os.environ[ENV_STEP_MS], os.environ[ENV_WAIT] = str(args.simulated_device_ms), args.simulated_device_wait
    from transformers import AutoTokenizer

    from nanoserve.config import EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.serving.stub.engine_core import EngineCoreClient
    from nanoserve.serving.stub.engine_thread import EngineThread

    config = EngineConfig.from_kwargs(args.model, device="cpu", max_num_seqs=args.concurrency)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    thread_results, core_results = queue.Queue(), queue.Queue()
    engine = LLMEngine(config)
    sides = {"thread": (EngineThread(engine, thread_results).start(), thread_results),
             "core": (EngineCoreClient(config, core_results), core_results)}
    rates = {name: [] for name in sides}
    device_bound = args.concurrency * 1000 / args.simulated_device_ms if args.simulated_device_ms else None
    try:
        for round_ in range(args.rounds):
            prompts = make_prompts(config.tokenizer, args.num_prompts, args.input_len, seed=round_)
            for name in (("thread", "core") if round_ % 2 == 0 else ("core", "thread")):
                engine_side, results = sides[name]
                seconds = run(engine_side, results, prompts, params, args.concurrency, tokenizer)
                rate = args.num_prompts * args.output_len / seconds
                rates[name].append(rate)
                share = f", {rate / device_bound:.3f} of the device-bound rate" if device_bound else ""
                print(f"round {round_} {name}: {rate:.0f} tok/s{share}", flush=True)
    finally:
        for engine_side, _ in sides.values():
            engine_side.stop()
        engine.shutdown()
    ratios = [core / thread for core, thread in zip(rates["core"], rates["thread"])]
    print(f"core process / engine thread: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
