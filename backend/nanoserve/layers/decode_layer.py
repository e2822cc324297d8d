"""A decoder layer of a decode step as one CPU op (cpu_ops.cpp's decode_layer): both norms (and Qwen3's q/k norms),
the four quantized linear layers with their biases, the rotary embedding, the KV store and paged decode attention
in one call.

At one request a small quantized model's decode step is a few hundred small ops, and the Python between them cost
about as much as the quantized matmuls themselves (docs/benchmarks.md). The op calls the same kernels in the same
order as the layer's modules, so it computes exactly what they compute, and it runs only where they would call
those kernels: on the CPU, on one rank, in a step whose every row decodes (one query token, a valid slot) and that
has no LoRA adapter, for a layer whose linear layers are quantized weights with a C++ kernel.
Everything else (prefills, speculative verification, float weights, CUDA) takes the modules' path.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import get_tp_size
from nanoserve.kernels.cpu_ops import cpu_op
from nanoserve.kernels.torch_attention import AttentionPlan, cpu_reads_cache
from nanoserve.layers.attention import Attention
from nanoserve.layers.linear import LinearBase
from nanoserve.layers.norm import RMSNorm

LINEAR_KERNELS = ("int4_block_linear", "int8_block_linear", "int4_linear", "int8_linear")  # cpu_ops.cpp's order
NO_TENSOR = torch.empty(0)


class DecodeLayerOp:
    """One layer's constant arguments of decode_layer (norm weights, the linear layers' kernels and weights), and
    the call that adds the step's (its angles, cache, attention plan)."""

    def __init__(self, norms: list[torch.Tensor], eps: float, kernels: list[int], params: list[int],
                 weights: list[torch.Tensor], biases: list[torch.Tensor | None], attn: Attention):
        self.op = cpu_op("decode_layer")
        self.norms, self.eps, self.kernels, self.params, self.weights = norms, eps, kernels, params, weights
        self.biases, self.attn = biases, attn

    @classmethod
    def of(cls, norms: tuple[RMSNorm, ...], linears: tuple[LinearBase, ...], attn: Attention):
        """The op for a layer of these norms (input, post-attention, and q and k or none), linear layers (qkv, o,
        gate_up, down) and attention, or None where the op cannot run it."""
        if (not norms[0].weight.is_cpu or get_tp_size() != 1 or len({norm.eps for norm in norms}) != 1
                or cpu_op("decode_layer") is None):
            return None
        specs = [linear_kernel(linear) for linear in linears]
        if None in specs:
            return None
        kernels = [LINEAR_KERNELS.index(name) for name, _, _ in specs]
        weights = [tensor for _, tensors, _ in specs for tensor in tensors]
        return cls([norm.weight for norm in norms], norms[0].eps, kernels, [param for *_, param in specs], weights,
                   [linear.bias for linear in linears], attn)

    def runs(self, x: torch.Tensor, plan) -> bool:
        """Whether this step's layer is the op's: every row decodes, and the cache is one its kernel reads."""
        return (isinstance(plan, AttentionPlan) and plan.has_decode and not plan.prefill and plan.all_slots_valid
                and cpu_reads_cache(x, self.attn.k_cache))

    def __call__(self, angles, x: torch.Tensor, residual: torch.Tensor | None, plan: AttentionPlan):
        """(the layer's output, the residual stream), as LlamaDecoderLayer.forward returns them."""
        attn = self.attn
        return self.op(x, residual, *angles, attn.k_cache, attn.v_cache, *attn.kv_scales, plan.slot_mapping,
                       plan.block_tables, plan.query_start_loc, plan.seq_lens, self.norms, self.eps, self.kernels,
                       self.params, self.weights, self.biases, attn.num_heads, attn.num_kv_heads, attn.scale)


def linear_kernel(linear: LinearBase) -> tuple[str, tuple[torch.Tensor, ...], int] | None:
    """(kernel of LINEAR_KERNELS, its three weight tensors, its int argument or 0) for a linear layer's weight, or
    None where the op has no kernel for it (a float or torch-kernel weight, CUDA)."""
    kernel_of = getattr(linear.packed_weight, "cpu_kernel", None)
    kernel = None if kernel_of is None else kernel_of()
    if kernel is None:
        return None
    return kernel.name, kernel.tensors + (NO_TENSOR,) * (3 - len(kernel.tensors)), kernel.args[0] if kernel.args else 0


def fuse_decode_layers(model: nn.Module) -> None:
    """Give every decoder layer that has a `fuse_decode` method its DecodeLayerOp (once the weights are in their
    final form: quantized and packed)."""
    for module in model.modules():
        if hasattr(module, "fuse_decode"):
            module.fuse_decode()
