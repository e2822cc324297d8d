"""Structured outputs' cost per decode step: the same batch (N requests with the same prompts, the same model and
sampling parameters) decoded without a constraint and with a JSON schema (or a regex), side by side in one run,
the two alternating over --rounds.

A step is timed whole (engine.step()), and within it the engine's bitmask fill (the matchers, on the host) and the
sampler (where the bitmask is applied). Only decode steps in which all N requests run count: a constrained request
ends when its grammar is complete, and a smaller batch is not the same work. Each figure is the median over the
counted steps of all rounds; the ratio is constrained / free.

    OMP_NUM_THREADS=1 python client/bench_structured_outputs.py --model /models/Qwen3-0.6B --num-seqs 32 --steps 40
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

SCHEMA = {  # free-text strings: the masks inside a string allow most of the vocabulary
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "author": {"type": "object", "properties": {"name": {"type": "string"},
                                                               "email": {"type": "string"}}}},
    "required": ["title", "year", "tags", "author"],
}
SPECS = {"json": {"json": SCHEMA}, "regex": {"regex": r"([a-z]+ ){1,400}[a-z]+\."}}


class Timer:
    """Wraps methods of live objects and sums their wall time per name."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def wrap(self, owner, method: str, name: str) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, method, timed)


def decode_steps(engine, timer: Timer, prompts: list[list[int]], params, steps: int, tag: str) -> list[dict]:
    """Per decode step with every request running: its wall time and the timed parts' (seconds)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, stream=True)
    while engine.scheduler.waiting or engine.last_step.num_prefill_tokens:  # the prefills
        engine.step()
    rows = []
    for _ in range(steps):
        if len(engine.scheduler.running) < len(prompts):
            break
        before, start = dict(timer.totals), time.perf_counter()
        engine.step()
        row = {"step": time.perf_counter() - start}
        row.update({name: total - before.get(name, 0.0) for name, total in timer.totals.items()})
        rows.append(row)
    engine.abort_all()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build the tiny test model)")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per round and arm (at most)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spec", choices=sorted(SPECS), default="json")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    model = args.model
    if model is None:
        from nanoserve.tiny_model import build_tiny_model
        model = build_tiny_model(tempfile.mkdtemp(prefix="nanoserve-structured-"), "qwen3")
    torch.manual_seed(0)
    engine = LLMEngine.from_engine_args(model, device=args.device, max_num_seqs=args.num_seqs, max_model_len=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, min(engine.vocab_size, 30000)) for _ in range(args.prompt_len)]
               for _ in range(args.num_seqs)]
    common = dict(temperature=1.0, max_tokens=args.steps + 8)
    arms = {"free": SamplingParams(**common, ignore_eos=True),
            "constrained": SamplingParams(**common, structured_outputs=SPECS[args.spec])}
    timer = Timer()
    timer.wrap(engine, "_token_bitmask", "bitmask fill")
    timer.wrap(engine.executor.runner, "sampler", "sampler")
    rows = {name: [] for name in arms}
    for round_index in range(args.rounds):
        order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
        for name in order:
            rows[name] += decode_steps(engine, timer, prompts, arms[name], args.steps, f"{name}{round_index}")
    engine.shutdown()
    print(f"model={model} seqs={args.num_seqs} spec={args.spec} rounds={args.rounds} device={args.device}")
    medians = {name: {key: statistics.median(r[key] for r in arm) * 1e3 for key in arm[0]}
               for name, arm in rows.items() if arm}
    for name, figures in medians.items():
        parts = "  ".join(f"{key}={value:8.3f} ms" for key, value in figures.items())
        print(f"{name:12s} steps counted={len(rows[name]):4d}  {parts}")
    if len(medians) == 2:
        free, constrained = medians["free"], medians["constrained"]
        print(f"constrained / free step time: {constrained['step'] / free['step']:.3f}  "
              f"(+{constrained['step'] - free['step']:.3f} ms per step, "
              f"{(constrained['step'] - free['step']) / args.num_seqs * 1e3:.1f} us per request)")


if __name__ == "__main__":
    main()
