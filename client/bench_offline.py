"""Offline throughput: nano-vllm's workload shape, nanoserve vs HF transformers `generate`, one run.

N sequences of random token ids, prompt and output lengths uniform in [min_len, max_len], ignore_eos.
Prints output tokens / wall time for each and the ratio. Builds a random-weight Qwen3-shaped model locally
unless --model is given.

    python client/bench_offline.py --num-seqs 64 --min-len 16 --max-len 256            # CPU-sized
    python client/bench_offline.py --model DIR --num-seqs 256 --min-len 100 --max-len 1024 --device cuda
"""
from __future__ import annotations

import argparse
import os
import random
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
    """(seconds, output tokens, engine stats) of one timed `generate`, after a warm-up on other prompts (so the
    timed run gets no prefix-cache hits from it) decoding as far as the longest output: the first long contexts
    pay one-off allocation costs (page faults, allocator growth) that a running server has already paid."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    try:
        warmup = SamplingParams(temperature=temperature, max_tokens=max(output_lens), ignore_eos=True)
        llm.generate(warmup_prompts, warmup, use_tqdm=False)
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.token_ids) for o in outputs), llm.stats()
    finally:
        llm.shutdown()


@torch.inference_mode()
def bench_hf(model: str, prompts, output_lens, device: str, batch_size: int, temperature: float):
    """HF static batching: left-padded batches, each run to its longest requested output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    hf = hf.to(device).eval()
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
    args = parser.parse_args()

    model = args.model or build_bench_model(args.hidden, args.layers)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts, output_lens = make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    engine_args = {"device": args.device, "max_model_len": 2 * args.max_len + 16,
                   **dict(kv.split("=", 1) for kv in args.engine_arg)}
    print(f"model={model} device={args.device} seqs={args.num_seqs} lens=[{args.min_len},{args.max_len}] "
          f"torch_threads={torch.get_num_threads()} engine_args={engine_args}")
    warmup_prompts, _ = make_workload(2, args.min_len, args.max_len, vocab, args.seed + 1)
    seconds, tokens, _ = bench_nanoserve(model, prompts, output_lens, engine_args, args.temperature, warmup_prompts)
    ours = tokens / seconds
    print(f"nanoserve: {tokens} output tokens in {seconds:.2f} s = {ours:.1f} tok/s")
    if not args.skip_hf:
        seconds, tokens = bench_hf(model, prompts, output_lens, args.device, args.hf_batch_size or args.num_seqs,
                                   args.temperature)
        theirs = tokens / seconds
        print(f"HF generate: {tokens} output tokens in {seconds:.2f} s = {theirs:.1f} tok/s")
        print(f"ratio nanoserve / HF = {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
