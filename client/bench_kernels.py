"""GPU benchmark of the nanoserve Triton kernels at Qwen3-0.6B shapes (not a test).

    python client/bench_kernels.py [--batch 256] [--ctx 600] [--block-sizes 16 256] [--dtype bfloat16]

Times each kernel with triton.testing.do_bench and prints the achieved bandwidth: bytes the kernel must
read + write (each K/V context token once, inputs and outputs once) divided by the median time. The decode
step's GEMMs (cuBLAS, at --batch tokens) are listed too, with their TFLOP/s. client/bench_gpu.py reuses
`run_all` to set these against the device's copy bandwidth.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

# Qwen3-0.6B
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB = 16, 8, 128, 1024, 3072, 151936


@dataclass
class KernelResult:
    name: str
    ms: float
    nbytes: int
    flops: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.ms / 1e6

    def line(self) -> str:
        extra = f"  {self.flops / self.ms / 1e9:8.1f} TFLOP/s" if self.flops else ""
        return f"{self.name:58s} {self.ms * 1e3:9.1f} us  {self.gbps:8.1f} GB/s{extra}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="decode batch size")
    p.add_argument("--ctx", type=int, default=600, help="mean context length (uniform +-100)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens per prefill batch (512 per sequence)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    return p.parse_args(argv)


class Recorder:
    """Collects results, printing each as it comes (when verbose)."""

    def __init__(self, verbose: bool = True):
        self.results: list[KernelResult] = []
        self.verbose = verbose

    def __call__(self, name: str, ms: float, nbytes: int, flops: int = 0) -> None:
        result = KernelResult(name, ms, nbytes, flops)
        self.results.append(result)
        if self.verbose:
            print(result.line(), flush=True)


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def paged_cache(seq_lens: list[int], block_size: int, dtype, gen):
    """A cache holding exactly these contexts, with block tables of shuffled block ids."""
    blocks = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(sum(blocks), generator=gen)
    shape = (sum(blocks), block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = ids[start:start + n]
        start += n
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables.cuda(), seq_lens_t


def kv_bytes(seq_lens: list[int], elem: int) -> int:
    return 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * elem


def bench_decode(args, block_size, dtype, gen, report):
    from nanoserve.kernels import ops

    elem = torch.finfo(dtype).bits // 8
    for batch, ctx in [(args.batch, args.ctx), (4, 8192)]:
        spread = min(100, ctx // 2)
        seq_lens = torch.randint(ctx - spread, ctx + spread + 1, (batch,), generator=gen).tolist()
        k_cache, v_cache, tables, lens = paged_cache(seq_lens, block_size, dtype, gen)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        nbytes = kv_bytes(seq_lens, elem) + 2 * q.numel() * elem
        scale = HEAD_DIM ** -0.5
        tag = f"block={block_size} batch={batch} ctx~{ctx}"
        ms = bench(lambda: ops.paged_attention(q, k_cache, v_cache, tables, qsl, lens, scale, max_query_len=1,
                                               max_seq_len=max(seq_lens)))
        report(f"paged_attention decode {tag}", ms, nbytes)
        for splits in (1, 8):
            ms = bench(lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, splits))
            report(f"paged_decode_attention splits={splits} {tag}", ms, nbytes)


def bench_prefill(args, block_size, dtype, gen, report):
    from nanoserve.kernels import ops

    elem = torch.finfo(dtype).bits // 8
    per_seq = 512
    for prefix in (0, 1024):  # plain prompts, then chunks after a cached prefix
        seq_lens = [prefix + per_seq] * (args.prefill_tokens // per_seq)
        k_cache, v_cache, tables, lens = paged_cache(seq_lens, block_size, dtype, gen)
        q = torch.randn(len(seq_lens) * per_seq, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
        qsl = torch.arange(0, q.shape[0] + 1, per_seq, dtype=torch.int32, device="cuda")
        nbytes = kv_bytes(seq_lens, elem) + 2 * q.numel() * elem
        visible = sum(prefix * per_seq + per_seq * (per_seq + 1) // 2 for _ in seq_lens)  # causal pairs
        flops = 4 * visible * NUM_HEADS * HEAD_DIM
        ms = bench(lambda: ops.paged_attention(q, k_cache, v_cache, tables, qsl, lens, HEAD_DIM ** -0.5))
        report(f"paged_attention prefill block={block_size} {len(seq_lens)}x{per_seq} prefix={prefix}",
               ms, nbytes, flops)


def bench_store(tokens: int, block_size: int, dtype, report):
    from nanoserve.kernels import ops

    elem = torch.finfo(dtype).bits // 8
    num_blocks = -(-tokens // block_size) * 2
    k_cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    ms = bench(lambda: ops.store_kvcache(k, v, k_cache, v_cache, slots))
    report(f"store_kvcache block={block_size} tokens={tokens}", ms, 4 * k.numel() * elem + slots.numel() * 8)


def bench_elementwise(tokens: int, dtype, report):
    from nanoserve.kernels import ops

    elem = torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device="cuda")
    res, w = torch.randn_like(x), torch.randn(HIDDEN, dtype=dtype, device="cuda")
    report(f"rms_norm tokens={tokens}", bench(lambda: ops.rms_norm(x, w, 1e-6)), 2 * x.numel() * elem)
    report(f"fused_add_rms_norm tokens={tokens}", bench(lambda: ops.fused_add_rms_norm(x, res, w, 1e-6)),
           4 * x.numel() * elem)
    q = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    cos = torch.randn(tokens, HEAD_DIM // 2, dtype=dtype, device="cuda")
    report(f"rotary tokens={tokens}", bench(lambda: ops.rotary(q, k, cos, cos)),
           (2 * (q.numel() + k.numel()) + 2 * cos.numel()) * elem)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype, device="cuda")
    report(f"silu_and_mul tokens={tokens}", bench(lambda: ops.silu_and_mul(gate_up)),
           gate_up.numel() * elem * 3 // 2)


def decode_gemm_shapes() -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the linear layers of one Qwen3-0.6B decode step."""
    qkv = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return [("qkv_proj", HIDDEN, qkv), ("o_proj", NUM_HEADS * HEAD_DIM, HIDDEN),
            ("gate_up_proj", HIDDEN, 2 * INTERMEDIATE), ("down_proj", INTERMEDIATE, HIDDEN), ("lm_head", HIDDEN, VOCAB)]


def bench_gemms(tokens: int, dtype, report):
    """cuBLAS (F.linear) at the decode step's shapes: bytes are the weight plus input and output once."""
    elem = torch.finfo(dtype).bits // 8
    for name, k, n in decode_gemm_shapes():
        x = torch.randn(tokens, k, dtype=dtype, device="cuda")
        w = torch.randn(n, k, dtype=dtype, device="cuda")
        ms = bench(lambda: torch.nn.functional.linear(x, w))
        report(f"linear {name} tokens={tokens} ({k}->{n})", ms, (n * k + tokens * (k + n)) * elem, 2 * tokens * k * n)


def run_all(args, verbose: bool = True) -> list[KernelResult]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    report = Recorder(verbose)
    for block_size in args.block_sizes:
        bench_decode(args, block_size, dtype, gen, report)
        bench_prefill(args, block_size, dtype, gen, report)
        bench_store(args.batch, block_size, dtype, report)
        bench_store(args.prefill_tokens, block_size, dtype, report)
    for tokens in (args.batch, args.prefill_tokens):
        bench_elementwise(tokens, dtype, report)
    bench_gemms(args.batch, dtype, report)
    return report.results


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine.")
    args = parse_args()
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype}  heads={NUM_HEADS}/{NUM_KV_HEADS} "
          f"head_dim={HEAD_DIM}")
    run_all(args)


if __name__ == "__main__":
    main()
