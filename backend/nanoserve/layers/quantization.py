"""Quantized weights for the linear layers. On the CPU (client/bench_quant.py measured the kernels against oneDNN's
packed float32 and bfloat16; docs/benchmarks.md):

- int8: one scale per output channel, w = q * scale (q in [-127, 127]). Where the kernels are built for AVX2,
  cpu_ops.cpp's int8_block_linear: activations in int16 blocks, as llama.cpp's Q8_0 blocks but with int16 codes
  (each group of BLOCK inputs of a row with its own scale, so an outlier coarsens only its own group), AVX2's
  int16 products summed exactly per group. Where the CPU also has int8 dot products (AVX-512 VNNI:
  kernels/cpu_ops.int8_dot_products; `runs_w8a8`), cpu_ops.cpp's int8_linear runs that for a few rows of a step
  and, for more, quantizes each row (token) with its own scale to int16 codes, each the two int8 digits of
  c = 256 hi + lo, so that one oneDNN int8 GEMM of twice the rows computes them (w8a8_linear): with int8 codes
  (W8A8 as vLLM runs it) SmolLM2's outlier channels (a row's max |x| up to 20,000 times its median) cost most of
  the greedy agreement with float weights (2/10 prompts against 4/10 for weight-only int8), with int16 ones none
  of it. Last, weight-only: `aten._weight_int8pack_mm`, which needs in_features a multiple of
  INT8_INPUTS_MULTIPLE.
- int4: a scale and an offset per group of GROUP_SIZE inputs of a row, w = q * scale + offset (q in [0, 15]).
  Where the CPU has AMX and VNNI, cpu_ops.cpp's int4_linear (ChunkedInt4Weight): for up to 4 rows VNNI dot
  products of the codes with int16 activation codes, for more AMX tile products of the weight dequantized to
  bfloat16 once per 64 rows. Without them, where the kernels are built for AVX2, cpu_ops.cpp's int4_block_linear
  (InterleavedInt4Weight: 8 output channels interleaved, so that AVX2's int16 pair products land in one lane per
  channel): the codes times activations in int16 blocks of BLOCK inputs (llama.cpp's Q4 x Q8 dot products with
  int16 codes: int8 ones tripled SmolLM2's logprob error), each group's integer sum scaled by both groups' scales,
  the offsets' part from each group's exact sum of x. Built with AVX-512 VNNI, from 7 rows a step it multiplies two
  blocks of 8 channels at once (one 512-bit register, VNNI's fused pair products) on the same layout.
  Elsewhere `aten._weight_int4pack_mm_for_cpu` (Int4Weight), whose layout holds (scale, offset + 8 * scale): it
  computes (q - 8) * s + z, and reads and dequantizes the weight again for each row of the activations (it falls
  behind float32 from ~16 rows). An int8 copy for many rows (requantized per output channel) is not kept: it costs
  16% of float32's bytes more and, unlike the codes, is not the weight the file holds (SmolLM2's greedy agreement
  fell from 9/10 prompts to 4/10).

`GroupQuantized` is the one format weights arrive in before they reach a kernel's layout: a GGUF file's blocks
(models/gguf.py keeps their codes, scales and mins) and float weights quantized at load both become one.
torch's two weight-only kernels take bfloat16 activations (with float32 ones they are 5-30x slower): a float32
model's activations are rounded to bfloat16 on the way in and its outputs widened on the way out; the kernels
accumulate in float32.
Scales and offsets are held in bfloat16 too, and the codes are computed against the rounded scales, so that what
the kernel multiplies is exactly the quantized weight.

On CUDA, by Triton kernels that dequantize inside the matmul (kernels/quant_matmul.py), in the activations' dtype
with float32 sums: an Int8Weight's own int8 codes and scales, and a PackedInt4Weight (two codes a byte, with the
groups' float32 scales and offsets as GroupQuantized holds them, so w = q * scale + offset exactly).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.kernels.cpu_ops import cpu_op, int8_dot_products
from nanoserve.kernels.reference import (INT4_CHUNK, BLOCK, dequantize_codes, dequantize_int4_chunks,
                                        dequantize_int4_groups, dequantize_int4_interleaved, int4_group_matmul_ref,
                                        int8_matmul_ref, interleave_groups, pack_int4, pack_int4_chunks,
                                        pack_int4_interleaved)
from nanoserve.layers.activation import cuda_op

QUANTIZATIONS = ("int8", "int4")
QUANTIZED_PARTS = ("codes", "scale", "offset")  # a GroupQuantized weight's tensors: "<weight name>.<part>"
GROUP_SIZE = 32  # inputs per int4 group: llama.cpp's block size, and a divisor of every hidden size we serve
INT4_ROWS_MULTIPLE = 16  # the int4 kernel's layout packs 16 output rows together
INT8_INPUTS_MULTIPLE = 16  # aten._weight_int8pack_mm crashes (SIGSEGV) on other in_features
KERNEL_DTYPE = torch.bfloat16
TINY = torch.finfo(KERNEL_DTYPE).tiny


@dataclass(frozen=True)
class CpuKernel:
    """A weight's cpu_ops.cpp matmul: the kernel's name, the weight's tensors and the int arguments after them.
    `linear` calls it, and layers/decode_layer.py hands the same to its one-op decoder layer."""
    name: str
    tensors: tuple[torch.Tensor, ...]
    args: tuple[int, ...] = ()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = cpu_op(self.name)(x, *self.tensors, *self.args)
        return y if bias is None else y + bias


def rounded_up(scale: torch.Tensor) -> torch.Tensor:
    """scale in KERNEL_DTYPE, no smaller than it was (bfloat16 keeps 8 significant bits)."""
    return (scale.clamp_min(TINY) * (1 + 2 ** -7)).to(KERNEL_DTYPE)


@dataclass
class GroupQuantized:
    """codes [N, K] (uint8), scale and offset [N, K / group] float32: w[n, k] = codes * scale + offset of the group
    of k. Sharded like a weight: dim 0 by output rows, dim 1 by input groups."""
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        return dequantize_codes(self.codes, self.scale, self.offset)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int = 4, group: int = GROUP_SIZE) -> GroupQuantized:
        """Asymmetric round-to-nearest over each group's [min, max]: |error| <= scale / 2."""
        groups = weight.detach().float().reshape(weight.shape[0], -1, group)
        low = groups.amin(dim=-1).to(KERNEL_DTYPE).float()  # (kept exactly by the kernel)
        scale = rounded_up((groups.amax(dim=-1) - low) / (2 ** bits - 1)).float()
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 2 ** bits - 1)
        return cls(codes.reshape(weight.shape).to(torch.uint8), scale, low)


def runs_w8a8(weight: torch.Tensor) -> bool:
    """Whether an int8 weight on this device computes with quantized activations by cpu_ops.cpp's int8_linear
    (activations in int16 blocks for a few rows, per row through w8a8_linear for more): on a CPU with int8 dot
    products whose int8 GEMM is exact, where the C++ kernels are built."""
    return weight.is_cpu and int8_dot_products() and exact_int8_gemm() and cpu_op("int8_linear") is not None


@functools.cache
def exact_int8_gemm() -> bool:
    """Whether torch._int_mm (oneDNN's int8 GEMM) sums exactly here. Without VNNI (an AVX2 CPU, or oneDNN capped
    by ONEDNN_MAX_CPU_ISA) it multiplies pairs into saturating int16s (pmaddubsw): 127 * 127 sums come out wrong."""
    codes = torch.full((17, 64), 127, dtype=torch.int8)
    return bool((torch._int_mm(codes, codes.t()) == 64 * 127 * 127).all())


def runs_blocks(weight: torch.Tensor) -> bool:
    """Whether an int8 weight on this device computes with activations in int16 blocks (int8_block_linear): on a CPU
    without w8a8_linear, where the kernels are built for AVX2, with inputs in whole blocks."""
    return (weight.is_cpu and weight.shape[1] % BLOCK == 0 and not runs_w8a8(weight)
            and cpu_op("int8_block_linear") is not None)


def runs_triton(weight: torch.Tensor) -> bool:
    """Whether a weight's matmul is a Triton kernel: on CUDA. (Tests send CPU tensors there, in the interpreter.)"""
    return weight.is_cuda


def matmul_for(weight: torch.Tensor, name: str, reference):
    """The Triton kernel nanoserve.kernels.ops.<name> for a weight on CUDA, where triton is importable; else the
    reference (dequantize, then F.linear)."""
    kernel = cuda_op(name) if runs_triton(weight) else None
    return kernel or reference


class Int8Weight:
    """An int8 weight [N, K] with one scale per output row. Also an embedding table: a tied LM head's rows are
    its embeddings."""
    name = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        self.qweight, self.scales = qweight, scales
        self.w8a8, self.blocks = runs_w8a8(qweight), runs_blocks(qweight)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric round-to-nearest per row: |error| <= scale / 2, scale ~ max |w| of the row / 127."""
        weight = weight.detach().float()
        scales = rounded_up(weight.abs().amax(dim=1) / 127)
        qweight = (weight / scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return cls(qweight, scales)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.cpu_kernel()
        if kernel is not None:
            return kernel(x, bias)
        if runs_triton(self.qweight):
            y = matmul_for(self.qweight, "int8_matmul", int8_matmul_ref)(x, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)
        return y if bias is None else y + bias

    def cpu_kernel(self) -> CpuKernel | None:
        """The cpu_ops.cpp kernel `linear` calls, or None where it calls another."""
        if runs_triton(self.qweight):
            return None
        if self.w8a8:
            return CpuKernel("int8_linear", (self.qweight, self.scales))
        return CpuKernel("int8_block_linear", (self.qweight, self.scales)) if self.blocks else None

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scales.to(device))

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight[ids].to(dtype) * self.scales[ids, None].to(dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


class Int4Weight:
    """A 4-bit weight [N, K] in the int4 kernel's packed layout, with its groups' scales and offsets."""
    name = "int4"

    def __init__(self, packed: torch.Tensor, scale_and_zero: torch.Tensor, group: int):
        self.packed, self.scale_and_zero, self.group = packed, scale_and_zero, group

    @classmethod
    def from_groups(cls, groups: GroupQuantized) -> Int4Weight:
        """ValueError where the layout cannot hold the weight: codes not uint8 in [0, 15], or a shape it lacks."""
        rows, cols = groups.codes.shape
        if rows % INT4_ROWS_MULTIPLE or cols % 2:
            raise ValueError(f"int4 weights need a multiple of {INT4_ROWS_MULTIPLE} output rows and an even number "
                             f"of inputs, got [{rows}, {cols}]")
        check_int4_codes(groups)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32).contiguous(), 1)
        zero = groups.offset + 8 * groups.scale  # the kernel computes (q - 8) * scale + zero
        scale_and_zero = torch.stack([groups.scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        return cls(packed, scale_and_zero, groups.group)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE), self.packed, self.group,
                                                       self.scale_and_zero).to(x.dtype)
        return y if bias is None else y + bias

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_and_zero.nbytes


@functools.cache
def int4_kernel_works() -> bool:
    """Whether cpu_ops.cpp's int4_linear runs here: built (AMX and VNNI) and allowed AMX's tile state by the OS."""
    kernel = cpu_op("int4_linear")
    if kernel is None:
        return False
    try:
        x, packed = torch.ones(5, INT4_CHUNK), torch.zeros(INT4_ROWS_MULTIPLE, INT4_CHUNK // 2, dtype=torch.uint8)
        scale = torch.ones(INT4_ROWS_MULTIPLE, INT4_CHUNK // GROUP_SIZE)
        return bool((kernel(x, packed, scale, scale) == INT4_CHUNK).all())  # 5 rows: the AMX path
    except RuntimeError:
        return False


def cpu_int4_weight(groups: GroupQuantized) -> ChunkedInt4Weight | InterleavedInt4Weight | Int4Weight:
    """A 4-bit weight for the CPU in the layout of the kernel that runs here: int4_linear (AMX and VNNI; 16 | rows),
    else int4_block_linear (AVX2), else torch's (ValueError for a shape or codes none can hold)."""
    rows, cols = groups.codes.shape
    if groups.group == GROUP_SIZE:
        if int4_kernel_works() and cols % INT4_CHUNK == 0 and rows % INT4_ROWS_MULTIPLE == 0:
            return ChunkedInt4Weight.from_groups(groups)
        if cpu_op("int4_block_linear") is not None:
            return InterleavedInt4Weight.from_groups(groups)
    return Int4Weight.from_groups(groups)


def check_int4_codes(groups: GroupQuantized) -> None:
    if groups.codes.dtype != torch.uint8 or int(groups.codes.max()) > 15:
        raise ValueError("int4 weights need uint8 codes in [0, 15]")


class GroupPackedInt4:
    """4-bit codes [N, K] packed two a byte (by `pack`), scale and offset [N, K / group] float32, w = q * scale +
    offset exactly: a GGUF file's codes, scales and mins as they are. Subclasses: the packing and the kernel."""
    name = "int4"
    pack = None  # codes [N, K] -> packed [N, K / 2]

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
        self.packed, self.scale, self.offset = packed, scale, offset

    @classmethod
    def from_groups(cls, groups: GroupQuantized):
        check_int4_codes(groups)
        return cls(cls.pack(groups.codes), groups.scale.float().contiguous(), groups.offset.float().contiguous())

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.offset.nbytes


class ChunkedInt4Weight(GroupPackedInt4):
    """For cpu_ops.cpp's int4_linear (AMX and VNNI): codes in chunks of 64 (reference.pack_int4_chunks)."""
    pack = staticmethod(pack_int4_chunks)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.cpu_kernel()(x, bias)

    def cpu_kernel(self) -> CpuKernel:
        return CpuKernel("int4_linear", (self.packed, self.scale, self.offset))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4_chunks(self.packed, self.scale, self.offset)


class InterleavedInt4Weight(GroupPackedInt4):
    """For cpu_ops.cpp's int4_block_linear (AVX2, and AVX-512 VNNI without AMX): codes in blocks of 8 channels
    (reference.pack_int4_interleaved), the groups' scales and offsets interleaved alike (interleave_groups), in
    float16 where it holds them all exactly (a GGUF file's Q4_0 and Q4_1 scales and mins are float16): at one row
    the kernel's time is reading the weight, and float32 ones are a third of its bytes."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, out_features: int):
        super().__init__(packed, scale, offset)
        self.out_features = out_features

    @classmethod
    def from_groups(cls, groups: GroupQuantized) -> InterleavedInt4Weight:
        """ValueError where codes are not uint8 in [0, 15]."""
        check_int4_codes(groups)
        scale, offset = held_exactly(interleave_groups(groups.scale.float()), interleave_groups(groups.offset.float()))
        return cls(pack_int4_interleaved(groups.codes), scale, offset, groups.codes.shape[0])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.cpu_kernel()(x, bias)

    def cpu_kernel(self) -> CpuKernel:
        return CpuKernel("int4_block_linear", (self.packed, self.scale, self.offset), (self.out_features,))

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4_interleaved(self.packed, self.scale, self.offset, self.out_features)


def held_exactly(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The float32 tensors in float16 where it holds every value of each exactly, else as they are."""
    halves = [t.half() for t in tensors]
    exact = all(torch.equal(half.float(), t) for half, t in zip(halves, tensors))
    return tuple(halves) if exact else tensors


class PackedInt4Weight(GroupPackedInt4):
    """For the Triton kernel: code 2j in byte j's low nibble, 2j + 1 in its high one (reference.pack_int4)."""
    pack = staticmethod(pack_int4)

    @classmethod
    def from_groups(cls, groups: GroupQuantized) -> PackedInt4Weight:
        """ValueError where codes are not uint8 in [0, 15] or the inputs are odd in number."""
        if groups.codes.shape[1] % 2:
            raise ValueError(f"int4 weights need an even number of inputs, got {groups.codes.shape[1]}")
        return super().from_groups(groups)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = matmul_for(self.packed, "int4_group_matmul", int4_group_matmul_ref)(x, self.packed, self.scale,
                                                                                 self.offset)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4_groups(self.packed, self.scale, self.offset)

    def to(self, device: torch.device) -> PackedInt4Weight:
        return PackedInt4Weight(self.packed.to(device), self.scale.to(device), self.offset.to(device))


def split_part(name: str) -> tuple[str, str | None]:
    """'x.weight.codes' -> ('x.weight', 'codes'); a name of no GroupQuantized part -> (name, None)."""
    weight, _, part = name.rpartition(".")
    return (weight, part) if part in QUANTIZED_PARTS else (name, None)


def load_group_part(module: nn.Module, part: str, loaded: torch.Tensor, shard_id=None) -> None:
    """This rank's shard of one part of a GroupQuantized weight into module.weight_groups (sharded as the
    module's weight is, by its weight_loader: a group's scale goes where its inputs go)."""
    parts = module.__dict__.setdefault("weight_groups", {})
    if part not in parts:
        rows, cols = module.weight.shape
        if part != "codes" and cols % GROUP_SIZE:
            raise ValueError(f"group-quantized weights need {GROUP_SIZE} | inputs per rank, got {cols}")
        parts[part] = torch.empty(rows, cols if part == "codes" else cols // GROUP_SIZE, dtype=loaded.dtype)
    module.weight.weight_loader(parts[part], loaded, shard_id)
