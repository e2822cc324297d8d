"""The fp8 KV cache against the model-dtype cache, side by side on the CPU (not a test):

    python client/bench_kv_cache_dtype.py --dtype bfloat16 --rounds 3

1. The C++ decode kernel (cpu_ops.cpp, one thread) over the same contexts held as bf16 and as fp8.
2. The offline engine: the same workload (bench_offline.py's shape, random-weight Qwen3-shaped model) with
   kv_cache_dtype auto and fp8 in the same KV memory, alternating each round; output tok/s and KV blocks.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_offline import build_bench_model, make_workload, time_nanoserve, warmed_up_llm

from nanoserve.kernels import reference as ref
from nanoserve.kernels.cpu_ops import cpu_op


def decode_ms(cache_dtype, batch: int, ctx: int, calls: int = 30) -> float:
    """One decode attention call over batch rows of ctx tokens (block 16, 2 KV heads, 8 heads, head_dim 64)."""
    block, kv_heads, heads, dim = 16, 2, 8, 64
    blocks = batch * ctx // block
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    starts, lens = torch.arange(batch + 1, dtype=torch.int32), torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, dim).bfloat16()
    k, v = (ref.to_cache(torch.randn(blocks, block, kv_heads, dim), cache_dtype) for _ in range(2))
    out, op = torch.empty_like(q), cpu_op("paged_decode_attention")
    op(out, q, k, v, tables, starts, lens, dim ** -0.5)
    start = time.perf_counter()
    for _ in range(calls):
        op(out, q, k, v, tables, starts, lens, dim ** -0.5)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--kv-gib", type=float, default=0.25)
    args = parser.parse_args()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for batch, ctx in ((32, 256), (64, 1024)):
        bf16, fp8 = decode_ms(torch.bfloat16, batch, ctx), decode_ms(ref.FP8, batch, ctx)
        print(f"decode kernel {batch} x {ctx}: bf16 {bf16:.2f} ms, fp8 {fp8:.2f} ms, fp8 / bf16 time {fp8 / bf16:.2f}")
    torch.set_num_threads(threads)

    model = build_bench_model(256, 4)
    engine = {"device": "cpu", "dtype": args.dtype, "cpu_kvcache_space_gib": args.kv_gib,
              "max_model_len": 2 * args.max_len + 16}
    warmup = make_workload(args.num_seqs, args.min_len, args.max_len, 1000, seed=1)
    llms = {kv: warmed_up_llm(model, {**engine, "kv_cache_dtype": kv}, 0.6, *warmup) for kv in ("auto", "fp8")}
    ratios = []
    for round_ in range(args.rounds):
        prompts, lens = make_workload(args.num_seqs, args.min_len, args.max_len, 1000, seed=100 + round_)
        rate = {}
        for kv, llm in llms.items():
            seconds, tokens = time_nanoserve(llm, prompts, lens, 0.6)
            rate[kv] = tokens / seconds
        ratios.append(rate["fp8"] / rate["auto"])
        print(f"round {round_}: auto {rate['auto']:.0f} tok/s, fp8 {rate['fp8']:.0f} tok/s, ratio {ratios[-1]:.2f}")
    blocks = {kv: llm.stats()["num_total_blocks"] for kv, llm in llms.items()}
    print(f"KV blocks in {args.kv_gib} GiB: auto {blocks['auto']}, fp8 {blocks['fp8']}; "
          f"fp8 / auto tok/s median {statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
