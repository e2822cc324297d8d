"""CPU benchmark of the linear layers of one decode step at SmolLM2-135M's shapes, per weight format (not a test).

    python client/bench_quant.py [--rows 1 16 64] [--rounds 5] [--layers 30]

A step's linears: --layers decoder layers of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536],
each layer's weights its own (as in the model: what one step reads does not sit in a cache), then the LM head
[49152, 576]. Formats: oneDNN's packed float32 (nanoserve's float path) and bfloat16, torch's weight-only int8
and int4 CPU kernels (with float32 and with bfloat16 activations), nanoserve's int4 kernel (cpu_ops.cpp's
int4_linear, where the CPU has AMX and VNNI: ChunkedInt4Weight), nanoserve's AVX2 kernels with activations in
blocks of 32 (int4_block_linear and int8_block_linear, int16 codes), int8 weights with each activation row
quantized with its own scale (cpu_ops.cpp's w8a8_linear, oneDNN's int8 GEMM): to int8 codes (W8A8) and to int16
codes as two int8 digits (W8A16, nanoserve's int8 path from 9 rows where the CPU has VNNI), and
oneDNN/fbgemm's dynamic int8 linear (activations quantized per tensor per call: what `torch.ao` reaches of
oneDNN's int8). The formats alternate, --rounds times; each line is the median step time and its ratio to packed
float32.

Times are the CPU time of the (one, by default) thread that runs the step, not wall time: on a machine whose
cores other processes share, wall time measures their load as much as the kernels.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import nanoserve  # noqa: F401  (Intel OpenMP, as the engine runs)
from nanoserve.kernels.cpu_ops import cpu_op
from nanoserve.layers.linear import linear, pack_weight
from nanoserve.layers.quantization import (KERNEL_DTYPE, ChunkedInt4Weight, GroupQuantized, Int4Weight, Int8Weight,
                                           InterleavedInt4Weight, int4_kernel_works)

HIDDEN, INTERMEDIATE, VOCAB, QKV = 576, 1536, 49152, 960
LAYER_SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def raw_int8_matmul(weight):
    """torch's int8 kernel with float32 activations (nanoserve's Int8Weight feeds it bfloat16)."""
    quantized = Int8Weight.from_float(weight)
    qweight, scales = quantized.qweight, quantized.scales.float()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, qweight, scales)


def raw_int4_matmul(weight):
    """torch's int4 kernel with float32 activations (nanoserve's Int4Weight feeds it bfloat16)."""
    quantized = Int4Weight.from_groups(GroupQuantized.from_float(weight))
    packed, scale_and_zero = quantized.packed, quantized.scale_and_zero.float()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, quantized.group, scale_and_zero)


def float_matmul(dtype):
    def make(weight):
        weight = weight.to(dtype)
        packed = pack_weight(weight)
        return lambda x: linear(x.to(dtype), weight, None, packed)
    return make


def int8_matmul(weight):
    """torch's int8 weight-only kernel, with bfloat16 activations (Int8Weight's path on CPUs without VNNI)."""
    quantized = Int8Weight.from_float(weight)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), quantized.qweight,
                                                        quantized.scales).float()


def int4_matmul(weight):
    quantized = Int4Weight.from_groups(GroupQuantized.from_float(weight))
    return lambda x: quantized.linear(x, None)


def chunked_int4_matmul(weight):
    """nanoserve's int4 kernel (ChunkedInt4Weight: cpu_ops.cpp's int4_linear, where the CPU has AMX and VNNI)."""
    quantized = ChunkedInt4Weight.from_groups(GroupQuantized.from_float(weight))
    return lambda x: quantized.linear(x, None)


def int4_block_matmul(weight):
    """cpu_ops.cpp's int4_block_linear: activations in int16 blocks of 32 (InterleavedInt4Weight, without AMX)."""
    quantized = InterleavedInt4Weight.from_groups(GroupQuantized.from_float(weight))
    return lambda x: quantized.linear(x, None)


def int8_block_matmul(weight):
    """cpu_ops.cpp's int8_block_linear: activations in int16 blocks of 32 (Int8Weight without VNNI)."""
    quantized, kernel = Int8Weight.from_float(weight), cpu_op("int8_block_linear")
    return lambda x: kernel(x, quantized.qweight, quantized.scales)


def w8a_matmul(digits: int):
    def make(weight):
        quantized, kernel = Int8Weight.from_float(weight), cpu_op("w8a8_linear")
        return lambda x: kernel(x, quantized.qweight, quantized.scales, digits)
    return make


def dynamic_int8_matmul(weight):
    layer = torch.ao.nn.quantized.dynamic.Linear(weight.shape[1], weight.shape[0], dtype=torch.qint8)
    layer.set_weight_bias(torch.quantize_per_channel(weight, weight.abs().amax(1) / 127,
                                                     torch.zeros(weight.shape[0], dtype=torch.long), 0,
                                                     torch.qint8), None)
    return layer


FORMATS = {
    "float32 oneDNN packed": float_matmul(torch.float32),
    "bfloat16 oneDNN packed": float_matmul(torch.bfloat16),
    "int8 weight-only, fp32 activations": raw_int8_matmul,
    "int8 weight-only, bf16 activations": int8_matmul,
    "int4 weight-only, group 32, fp32 activations": raw_int4_matmul,
    "int4 weight-only, group 32, bf16 activations": int4_matmul,
    "int4, group 32, int4_linear (VNNI up to 4 rows, AMX above)": chunked_int4_matmul,
    "int4, group 32, int4_block_linear (AVX2, AVX-512 VNNI from 7 rows; int16 activation blocks of 32)":
        int4_block_matmul,
    "int8, int8_block_linear (AVX2; int16 activation blocks of 32)": int8_block_matmul,
    "W8A8: int8 activations per row (w8a8_linear, digits=1)": w8a_matmul(1),
    "W8A16: int16 activations per row as two int8 digits (digits=2)": w8a_matmul(2),
    "dynamic int8 (x86 quantized engine)": dynamic_int8_matmul,
}


def build_step(make, layers: int):
    """The step's matmuls in order: each decoder layer's four, then the LM head."""
    torch.manual_seed(0)
    matmuls = [make(torch.randn(out, inp) * inp ** -0.5) for _ in range(layers) for out, inp in LAYER_SHAPES]
    return matmuls + [make(torch.randn(VOCAB, HIDDEN) * HIDDEN ** -0.5)]


def run_step(matmuls, rows: int) -> None:
    hidden, inter = torch.randn(rows, HIDDEN), torch.randn(rows, INTERMEDIATE)
    for i, matmul in enumerate(matmuls):
        matmul(inter if i % 4 == 3 and i < len(matmuls) - 1 else hidden)


def time_step(matmuls, rows: int, repeats: int) -> float:
    run_step(matmuls, rows)  # warm-up: primitives built, pages touched
    start = time.thread_time()
    for _ in range(repeats):
        run_step(matmuls, rows)
    return (time.thread_time() - start) / repeats * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="tokens per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="steps timed per format per round")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU time is the calling thread's)")
    p.add_argument("--skip", nargs="*", default=[], help="leave out the formats whose name contains one of these")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    skip = [*args.skip, *([] if int4_kernel_works() else ["int4_linear"]),
            *([] if cpu_op("int4_block_linear") else ["block_linear"])]
    steps = {name: build_step(make, args.layers) for name, make in FORMATS.items()
             if not any(word in name for word in skip)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); CPU ms per step, median of {args.rounds}")
    print("| format | " + " | ".join(f"{rows} rows: ms (x fp32)" for rows in args.rows) + " |")
    print("| --- |" + " ---: |" * len(args.rows))
    times = {(name, rows): [] for name in steps for rows in args.rows}
    for _ in range(args.rounds):
        for rows in args.rows:
            for name, matmuls in steps.items():
                times[name, rows].append(time_step(matmuls, rows, args.repeats))
    baseline = next(iter(steps))
    for name in steps:
        cells = []
        for rows in args.rows:
            ms = statistics.median(times[name, rows])
            cells.append(f"{ms:.1f} ({statistics.median(times[baseline, rows]) / ms:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
