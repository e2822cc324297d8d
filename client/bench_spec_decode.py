"""Speculative decoding (n-gram proposals) against none, side by side in one run, alternating, on the trained
SmolLM2-135M-Instruct (the demo's GGUF): two offline engines of the same checkpoint, one with speculative_config.

Workloads (greedy):
- grounded: chat prompts whose answer repeats much of the prompt (repeat a text, edit a code snippet, extract
  sentences), at 1 concurrent request (one after the other) and at 8 (all 8 at once);
- random: prompts of random token ids, whose output never repeats them, 64 at once.
Prints, per workload and engine, output tokens / second and the mean time per output token of the requests, the
median ratio over the rounds (the two engines take turns going first), and the acceptance rate.

    python client/bench_spec_decode.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
        "members agreed to increase funding for the public library by ten percent. The mayor thanked the volunteers "
        "who organized the book fair, which raised more than four thousand dollars. The next meeting will take "
        "place in the town hall on the first Monday of March, and residents are invited to attend.")
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    averages = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        averages.append(sum(chunk) / window)
    return averages


def normalize(values):
    total = sum(values)
    return [value / total for value in values]
'''
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rename the function moving_average to rolling_mean in this code and output the whole code:\n\n{CODE}",
    f"Copy every sentence of this text that mentions the library or the meeting:\n\n{TEXT}",
    f"Rewrite this code with the variable 'values' renamed to 'data'. Output only the code.\n\n{CODE}",
]


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def run(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[float, float, int]:
    """Serve prompts concurrency at a time (a new one as one ends): (output tokens / s, mean time per output
    token of the requests, output tokens)."""
    pending, started, ended, tokens = list(enumerate(prompts)), {}, {}, {}
    begin = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(started) - len(ended) < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, params, stream=False)
            started[str(index)] = time.perf_counter()
        for out in engine.step():
            if out.finished:
                ended[out.request_id], tokens[out.request_id] = time.perf_counter(), out.num_output_tokens
    wall = time.perf_counter() - begin
    total = sum(tokens.values())
    tpot = statistics.mean((ended[i] - started[i]) / max(tokens[i], 1) for i in ended)
    return total / wall, tpot, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--random-count", type=int, default=64)
    parser.add_argument("--random-max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--only", help="run only the workloads whose name contains this (grounded, random)")
    args = parser.parse_args()
    import torch

    from nanoserve.demo_model import smollm2_gguf
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = str(smollm2_gguf())
    spec = json.loads(args.speculative_config)
    engines = {"off": LLMEngine.from_engine_args(gguf, device="cpu"),
               "ngram": LLMEngine.from_engine_args(gguf, device="cpu", speculative_config=spec)}
    tokenizer = engines["off"].tokenizer
    grounded = chat_prompts(tokenizer, GROUNDED)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {
        "grounded, 1 at a time": (grounded, greedy, 1),
        "grounded x2, 8 at once": (grounded * 2, greedy, 8),
        f"random tokens, {args.random_count} at once": (
            random_prompts(args.random_count, 48, tokenizer.vocab_size, 0),
            SamplingParams(temperature=0.0, max_tokens=args.random_max_tokens, ignore_eos=True), args.random_count),
    }
    for engine in engines.values():  # warm-up: kernels built, caches touched
        run(engine, grounded[:1], SamplingParams(temperature=0.0, max_tokens=8), 1)
    print(f"speculative_config: {json.dumps(spec)}; rounds: {args.rounds}, alternating\n")
    for name, (prompts, params, concurrency) in workloads.items():
        results = {key: [] for key in engines}
        if args.only and args.only not in name:
            continue
        for round_index in range(args.rounds):
            order = list(engines.items())
            for key, engine in order if round_index % 2 == 0 else order[::-1]:  # each goes first in turn
                before = dict(engine.stats())
                results[key].append(run(engine, prompts, params, concurrency))
                after = engine.stats()
                if key == "ngram":
                    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                    results[key][-1] += (accepted / drafted if drafted else 0.0,)
        ratios = [on[0] / off[0] for off, on in zip(results["off"], results["ngram"])]
        tpot_ratios = [off[1] / on[1] for off, on in zip(results["off"], results["ngram"])]
        off, on = results["off"], results["ngram"]
        print(f"{name}: output tok/s off {statistics.median(r[0] for r in off):.1f}, ngram "
              f"{statistics.median(r[0] for r in on):.1f}; TPOT ms off {1e3 * statistics.median(r[1] for r in off):.1f}"
              f", ngram {1e3 * statistics.median(r[1] for r in on):.1f}; speedup (tok/s) median "
              f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}), TPOT "
              f"{statistics.median(tpot_ratios):.2f}x; acceptance {statistics.median(r[3] for r in on):.2f}; "
              f"output tokens off {off[0][2]}, ngram {on[0][2]}", flush=True)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
