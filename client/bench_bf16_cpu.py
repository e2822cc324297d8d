"""The bf16 linear paths of a CPU at SmolLM2-135M's shapes: which one nanoserve should take where oneDNN has no
bf16 kernels (AVX2). An AVX-512 machine runs as an AVX2-only one under
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (torch's and oneDNN's own caps):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 python client/bench_bf16_cpu.py

Prints, per row count, the time of one layer's four matmuls (qkv, o, gate_up, down) on each path:
  bf16-packed    oneDNN bf16 with the weight packed in bf16 (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)
  bf16-torch     F.linear in bf16 with oneDNN off: torch's own bf16 gemm, what runs where oneDNN cannot
  bf16-as-fp32   the weight packed in float32, activations cast around it (nanoserve's path below AVX-512)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of qkv, o, gate_up, down


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def paths(x: torch.Tensor, weight: torch.Tensor) -> dict:
    xb, wb = x.bfloat16(), weight.bfloat16()
    found = {"bf16-as-fp32": lambda p=torch.ops.mkldnn._reorder_linear_weight(weight, 64):
             torch.ops.mkldnn._linear_pointwise(xb.float(), p, None, "none", [], "").bfloat16()}

    def torch_gemm():
        with torch.backends.mkldnn.flags(enabled=False):
            return F.linear(xb, wb)
    found["bf16-torch"] = torch_gemm
    if torch.ops.mkldnn._is_mkldnn_bf16_supported() and torch.backends.cpu.get_cpu_capability() != "AVX2":
        packed = torch.ops.mkldnn._reorder_linear_weight(wb, 64)
        found["bf16-packed"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    for rows in args.rows:
        totals: dict[str, float] = {}
        for k, n in SHAPES:
            for name, fn in paths(torch.randn(rows, k), torch.randn(n, k) * 0.02).items():
                totals[name] = totals.get(name, 0.0) + per_call_us(fn, args.calls)
        print(f"rows {rows:4d}  " + "  ".join(f"{name} {us:8.0f} us" for name, us in sorted(totals.items())))


if __name__ == "__main__":
    main()
