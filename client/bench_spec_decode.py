"""Speculative decoding against none, side by side in one run, alternating, on the trained SmolLM2-135M-Instruct
(the demo's GGUF): offline engines of the same checkpoint, one without speculation and one per method asked for:
- ngram: --speculative-config (n-gram proposals by default);
- self: SmolLM2 as its own draft model (the acceptance rate's upper bound: only the tokenizer must match);
- cutN: a draft of SmolLM2's first N layers (with its embeddings, final norm and LM head), e.g. cut2.

Workloads (greedy):
- grounded: chat prompts whose answer repeats much of the prompt (repeat a text, edit a code snippet, extract
  sentences), at 1 concurrent request (one after the other) and at 8 (all 8 at once);
- random: prompts of random token ids, whose output never repeats them, 64 at once.
Prints, per workload and engine, output tokens / second and the mean time per output token of the requests, the
median ratio over the rounds against no speculation (the engines take turns going first), and the acceptance
rate.

    python client/bench_spec_decode.py --rounds 3
    python client/bench_spec_decode.py --rounds 3 --methods self,cut2 --num-speculative-tokens 4
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


def speculative_config(method: str, gguf: str, args) -> dict:
    """The speculative_config of a --methods entry (cutN: the N-layer draft is written once into the cache)."""
    if method == "ngram":
        return json.loads(args.speculative_config)
    if method == "self":
        return {"model": gguf, "num_speculative_tokens": args.num_speculative_tokens}
    if method.startswith("cut") and method[3:].isdigit():
        from nanoserve.cache import default_cache_dir
        from nanoserve.models.gguf import as_checkpoint_dir
        from nanoserve.tiny_model import cut_layers

        out_dir = default_cache_dir() / f"smollm2-{method}"
        if not (out_dir / "config.json").exists():
            cut_layers(as_checkpoint_dir(gguf), str(out_dir), int(method[3:]))
        return {"model": str(out_dir), "num_speculative_tokens": args.num_speculative_tokens}
    raise SystemExit(f"--methods: unknown method {method!r} (ngram, self, cutN)")


def run_rounds(engines: dict, prompts, params, concurrency: int, rounds: int) -> dict[str, list[tuple]]:
    """Per engine and round: (output tok/s, mean TPOT, output tokens, acceptance rate); the engines take turns
    going first."""
    results = {key: [] for key in engines}
    for round_index in range(rounds):
        order = list(engines.items())
        for key, engine in order[round_index % len(order):] + order[:round_index % len(order)]:
            before = dict(engine.stats())
            measured = run(engine, prompts, params, concurrency)
            after = engine.stats()
            drafted, accepted = (after.get(name, 0) - before.get(name, 0) for name in (
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
            results[key].append(measured + (accepted / drafted if drafted else 0.0,))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                        help="the ngram method's speculative_config")
    parser.add_argument("--methods", default="ngram", help="comma-separated: ngram, self, cutN (N layers)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K of the draft-model methods")
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
    specs = {method: speculative_config(method, gguf, args) for method in args.methods.split(",")}
    engines = {"off": LLMEngine.from_engine_args(gguf, device="cpu")}
    engines.update({method: LLMEngine.from_engine_args(gguf, device="cpu", speculative_config=spec)
                    for method, spec in specs.items()})
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
    for method, spec in specs.items():
        print(f"{method}: speculative_config {json.dumps(spec)}")
    print(f"rounds: {args.rounds}, alternating\n")
    for name, (prompts, params, concurrency) in workloads.items():
        if args.only and args.only not in name:
            continue
        results = run_rounds(engines, prompts, params, concurrency, args.rounds)
        off = results["off"]
        for method in specs:
            on = results[method]
            ratios = [b[0] / a[0] for a, b in zip(off, on)]
            tpot_ratios = [a[1] / b[1] for a, b in zip(off, on)]
            median = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
            print(f"{name}, {method}: output tok/s off {median(off, 0):.1f}, on {median(on, 0):.1f}; TPOT ms off "
                  f"{1e3 * median(off, 1):.1f}, on {1e3 * median(on, 1):.1f}; speedup (tok/s) median "
                  f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}), TPOT "
                  f"{statistics.median(tpot_ratios):.2f}x; acceptance {median(on, 3):.2f}; output tokens off "
                  f"{off[0][2]}, on {on[0][2]}", flush=True)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
