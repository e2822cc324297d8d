"""Offline throughput: nano-vllm's workload shape, nanoserve vs HF transformers `generate`, in one run.

N sequences of random token ids, prompt and output lengths uniform in [min_len, max_len], ignore_eos.
Prints output tokens / wall time for each and the ratio; with --rounds R the two alternate R times, each round
on a new workload, and the median ratio is printed last. nanoserve is timed after a warm-up workload of the
same shape. Builds a random-weight Qwen3-shaped model locally unless --model is given.

    python client/bench_offline.py --num-seqs 64 --min-len 16 --max-len 256            # CPU-sized
    python client/bench_offline.py --model DIR --num-seqs 256 --min-len 100 --max-len 1024 --device cuda
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch


def build_bench_model(hidden: int, layers: int) -> str:
    from nanoserve.tiny_model import build_tiny_model

    out = os.path.join(tempfile.gettempdir(), f"nanoserve-bench-qwen3-h{hidden}-l{layers}")
    if not os.path.exists(os.path.join(out, "config.json")):
        build_tiny_model(out, "qwen3", hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 64, 2), num_key_value_heads=max(hidden // 128, 1),
                         head_dim=64, max_position_embeddings=4096)
    return out


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, output_lens


def bench_nanoserve(model: str, prompts, output_lens, engine_args: dict, temperature: float,
                    warmup_prompts) -> tuple[float, int, dict]:
    """(seconds, output tokens, engine stats) of one timed `generate`, after a warm-up (see warmed_up_llm)."""
    llm = warmed_up_llm(model, engine_args, temperature, warmup_prompts, [max(output_lens)] * len(warmup_prompts))
    try:
        seconds, tokens = time_nanoserve(llm, prompts, output_lens, temperature)
        return seconds, tokens, llm.stats()
    finally:
        llm.shutdown()


def warmed_up_llm(model: str, engine_args: dict, temperature: float, warmup_prompts, warmup_lens: list[int]):
    """An LLM that has generated warmup_lens tokens for other prompts (so timed runs get no prefix-cache hits from
    them): the first long contexts and large batches pay one-off costs (page faults, allocator and workspace
    growth) that a running server has already paid."""
    from nanoserve import LLM

    llm = LLM(model, **engine_args)
    time_nanoserve(llm, warmup_prompts, warmup_lens, temperature)
    return llm


def time_nanoserve(llm, prompts, output_lens, temperature: float) -> tuple[float, int]:
    from nanoserve import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def bench_hf(model: str, prompts, output_lens, device: str, batch_size: int, temperature: float):
    return time_hf(load_hf(model, device), prompts, output_lens, device, batch_size, temperature)


def load_hf(model: str, device: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    return hf.to(device).eval()


@torch.inference_mode()
def time_hf(hf, prompts, output_lens, device: str, batch_size: int, temperature: float) -> tuple[float, int]:
    """HF static batching: left-padded batches, each run to its longest requested output."""
    pad = hf.config.eos_token_id or 0
    useful, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                    do_sample=temperature > 0, temperature=temperature or None, top_k=None, top_p=None,
                    pad_token_id=pad)
        useful += sum(lens)
    return time.perf_counter() - start, useful


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build a random-weight Qwen3-shaped model)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: all sequences in one batch")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate nanoserve and HF this many times, each round on a new workload; on a "
                             "shared machine whose speed drifts, the median ratio is the steadier figure")
    args = parser.parse_args()

    model = args.model or build_bench_model(args.hidden, args.layers)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    engine_args = {"device": args.device, "max_model_len": 2 * args.max_len + 16,
                   **dict(kv.split("=", 1) for kv in args.engine_arg)}
    print(f"model={model} device={args.device} seqs={args.num_seqs} lens=[{args.min_len},{args.max_len}] "
          f"torch_threads={torch.get_num_threads()} engine_args={engine_args}")
    # the warm-up is a workload of the same shape: a first run at full batch pays one-off costs (allocator and
    # workspace growth) that a running server has already paid
    warmup_prompts, warmup_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed + 1)
    llm = warmed_up_llm(model, engine_args, args.temperature, warmup_prompts, warmup_lens)
    hf = None if args.skip_hf else load_hf(model, args.device)
    ratios = []
    for round_ in range(args.rounds):  # each round a new workload (no prefix-cache hits), the same for both
        if round_:
            prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab,
                                                 args.seed + 100 * round_)
        seconds, tokens = time_nanoserve(llm, prompts, output_lens, args.temperature)
        ours = tokens / seconds
        print(f"round {round_}: nanoserve: {tokens} output tokens in {seconds:.2f} s = {ours:.1f} tok/s")
        if hf is not None:
            seconds, tokens = time_hf(hf, prompts, output_lens, args.device, args.hf_batch_size or args.num_seqs,
                                      args.temperature)
            theirs = tokens / seconds
            ratios.append(ours / theirs)
            print(f"round {round_}: HF generate: {tokens} output tokens in {seconds:.2f} s = {theirs:.1f} tok/s  "
                  f"ratio {ratios[-1]:.2f}x")
    llm.shutdown()
    if ratios:
        print(f"ratio nanoserve / HF = {statistics.median(ratios):.2f}x (median of {len(ratios)} round(s): "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
