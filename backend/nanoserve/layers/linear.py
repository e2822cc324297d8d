"""Tensor-parallel linear layers (Megatron style). Weights are [out, in] like nn.Linear.

Column-parallel layers split the output dim across ranks and need no communication; row-parallel layers
split the input dim and all-reduce their partial sums. Every parameter carries a
`weight_loader(param, loaded, shard_id=None)` that copies this rank's part of a full checkpoint tensor.
A layer given LoRA weights (`lora`, layers/lora.py) adds the adapters' deltas of a step's LoRABatch.

On the CPU, `pack_cpu_weights` gives each layer a copy of its weight in oneDNN's blocked layout, and the matmul
runs in oneDNN: fp32 F.linear goes to MKL's sgemm, which on this project's CPUs (AMD, AVX-512) runs at half
oneDNN's speed, and a weight reordered once spares each call the reorder. A bf16 weight is packed as bf16 where
oneDNN has bf16 kernels for this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), and as float32 elsewhere (AVX2): there
torch's own bf16 matmul runs 4-7x slower than the float32 one from 16 rows up (docs/benchmarks.md).
A quantized weight (layers/quantization.py, given by models/quantize.py) takes the packed weight's place and
runs its own kernel.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed import all_reduce, get_tp_rank, get_tp_size
from nanoserve.kernels.cpu_ops import cpu_isa


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter (shard) has {tuple(dst.shape)}, "
                         f"checkpoint gives {tuple(src.shape)}")
    dst.copy_(src)


def take_shard(loaded: torch.Tensor, dim: int, full: int, start: int, size: int) -> torch.Tensor:
    """loaded.narrow(dim, start, size), after checking that loaded is the full (unsharded) tensor."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(f"shape mismatch: expected size {full} along dim {dim}, "
                         f"checkpoint gives {tuple(loaded.shape)}")
    return loaded.narrow(dim, start, size)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    copy_checked(param.data, loaded)


# the batch size oneDNN picks the packed layout for: decode batches, where every step reads every weight
PACK_BATCH_SIZE = 64
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN holds and multiplies a weight of this dtype in, on this CPU."""
    # a cap by ATEN_CPU_CAPABILITY (cpu_isa) makes an AVX-512 machine take the path of an AVX2-only one
    capped = cpu_isa() != cpu_isa(capped=False)
    if dtype == torch.bfloat16 and (capped or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.float32
    return dtype


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] in oneDNN's layout for `linear`, or None where F.linear stays (not CPU, other dtypes)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(packed_dtype(weight.dtype)), PACK_BATCH_SIZE)


# oneDNN builds and caches a primitive (and scratch memory) for every row count it sees, and the cache outlives
# each call: fed every step's token count as it comes, a stub grew by hundreds of MiB. So packed matmuls see only
# these row counts: fewer rows are padded up to the next, more are cut into pieces of the largest (a prefill's
# pieces of 512 rows run ~15% faster than pieces of 128).
PACKED_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 384, 512)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed weight (a oneDNN tensor, or a quantized weight with its own
    `linear`) where there is one (x [T, in])."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):
        return packed.linear(x, bias)
    if packed.dtype != x.dtype:  # a bf16 model on a CPU without oneDNN's bf16 kernels: its weights pack as float32
        return linear(x.to(packed.dtype), weight, None if bias is None else bias.to(packed.dtype), packed).to(x.dtype)
    if x.shape[0] > PACKED_ROWS[-1]:
        return torch.cat([linear(piece, weight, bias, packed) for piece in x.split(PACKED_ROWS[-1])])
    rows = x.shape[0]
    padding = next(bucket for bucket in PACKED_ROWS if bucket >= rows) - rows
    return onednn_linear(F.pad(x, (0, 0, 0, padding)) if padding else x, packed, bias)[:rows]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_cpu_weights(model: nn.Module) -> None:
    """Pack every linear layer's float weight (LinearBase and the LM head; not the quantized ones), once its
    weights are loaded. The packed copy takes the place of a weight nothing else shares (a tied LM head's is the
    embedding's too), so the weights are held once."""
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    for module in model.modules():
        if hasattr(module, "packed_weight") and module.packed_weight is None:
            module.packed_weight = pack_weight(module.weight)
            if module.packed_weight is not None and uses[id(module.weight)] == 1:
                module.weight.data = module.weight.data.new_empty(0)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # shard_id -> (first row of this rank's output it fills, rows, rows of the checkpoint tensor, the first of
        # them this rank takes); the output of a row-parallel layer is not sharded
        self.shards: dict = {None: (0, output_size, output_size, 0)}
        self.lora: nn.Module | None = None  # StackedLoRA (layers/lora.py), when the engine serves LoRA adapters
        self.packed_weight = None  # a oneDNN tensor (pack_cpu_weights) or a quantized weight (models/quantize.py)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the checkpoint tensor of shard_id (a weight or a bias)."""
        if shard_id not in self.shards:
            raise ValueError(f"{type(self).__name__} needs a shard_id in {tuple(self.shards)}, got {shard_id!r}")
        offset, size, full, start = self.shards[shard_id]
        copy_checked(param.data.narrow(0, offset, size), take_shard(loaded, 0, full, start, size))

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the step's LoRABatch (layers/lora.py), None when no token has an adapter."""
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if lora is not None:
            self.lora.add_to(y, x, lora)
        return y


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size()), bias)
        size = self.weight.shape[0]
        self.shards = {None: (0, size, output_size, self.tp_rank * size)}


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate_up_proj); shard_id is the index of the
    sub-projection. Each rank holds its slice of every sub-projection, concatenated."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        sizes = [full // self.tp_size for full in output_sizes]
        self.shards = {i: (sum(sizes[:i]), size, full, self.tp_rank * size)
                       for i, (size, full) in enumerate(zip(sizes, output_sizes))}


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused, split by heads. With fewer kv heads than ranks, kv heads are
    replicated so that each rank keeps one."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp_size, tp_rank = get_tp_size(), get_tp_rank()
        self.num_heads = divide(num_heads, tp_size)
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size)
            kv_head_start = tp_rank * self.num_kv_heads
        else:
            divide(tp_size, num_kv_heads)
            self.num_kv_heads = 1
            kv_head_start = tp_rank * num_kv_heads // tp_size
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias)
        full_q, full_kv, kv_start = num_heads * head_dim, num_kv_heads * head_dim, kv_head_start * head_dim
        self.shards = {"q": (0, self.q_size, full_q, tp_rank * self.q_size),
                       "k": (self.q_size, self.kv_size, full_kv, kv_start),
                       "v": (self.q_size + self.kv_size, self.kv_size, full_kv, kv_start)}


class RowParallelLinear(LinearBase):
    """Input dim split across ranks (the input is a column-parallel output); partial sums are all-reduced.
    The bias is added once, on rank 0, before the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size()), output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: not sharded
            return super().weight_loader(param, loaded)
        size = param.shape[1]
        copy_checked(param.data, take_shard(loaded, 1, size * self.tp_size, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed_weight)
        if lora is not None:
            self.lora.add_to(y, x, lora)  # this rank's partial delta: the all-reduce sums them
        return all_reduce(y)
