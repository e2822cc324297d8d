"""Each weight matrix's format once the checkpoint is loaded (the `quantization` engine argument):

- "auto": a GGUF file's kept codes (models/gguf.py) run as their kernel's format, 8-bit codes as int8 and
  4-bit ones as FOUR_BIT; float weights stay float.
- "int8" / "int4": every linear layer quantized at load (a layer the int4 layout cannot hold, int8).
- "none": float weights; kept codes are dequantized.

The token embedding and the LM head are int8 (per row) whenever they are quantized: a tied LM head shares the
embedding's table. Norms and biases stay float, and so does a CPU layer whose in_features torch's int8 kernel
cannot take (not a multiple of INT8_INPUTS_MULTIPLE), with the reason in the summary. Runs after load_weights and
before pack_cpu_weights.
On the CPU the 4-bit format is ChunkedInt4Weight (nanoserve's kernel for AMX and VNNI), InterleavedInt4Weight
(its AVX2 kernel) or Int4Weight (torch's kernel), on CUDA PackedInt4Weight (the Triton kernel); nanoserve's keep a
GGUF file's scales and offsets in float32 as they are. int8 is Int8Weight on both devices, on the model's device.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import LinearBase
from nanoserve.layers.quantization import (GROUP_SIZE, INT8_INPUTS_MULTIPLE, GroupQuantized, Int8Weight,
                                           PackedInt4Weight, cpu_int4_weight, runs_triton)

FOUR_BIT = "int4"  # the format 4-bit GGUF codes run as (client/bench_quant.py)
INT8_INPUTS_REASON = (f"kept float: in_features not a multiple of {INT8_INPUTS_MULTIPLE}, which torch's int8 CPU "
                      "kernel needs")


def on_device(quantization: str, device: torch.device) -> str:
    """The quantization engine argument as a device runs it: on CUDA "auto" keeps float weights (the Triton
    kernels have not been measured on a GPU yet, so they run only when asked for by name)."""
    return "none" if quantization == "auto" and device.type == "cuda" else quantization


def quantize_weights(model: nn.Module, quantization: str, dtype: torch.dtype) -> str:
    """Give each linear layer and embedding its weight in the chosen format; returns how many modules got each,
    for the log ("int8: 2, int4: 120": SmolLM2's embedding and tied LM head, and its 30 x 4 linear layers), with
    the reason any module that was to be quantized kept float weights."""
    chosen, tables, reasons = Counter(), {}, set()  # tables: id(float weight) -> its Int8Weight (a tied LM head's)
    for module in model.modules():  # the embedding before a tied LM head
        if not isinstance(module, (LinearBase, VocabParallelEmbedding)):
            continue
        groups = _pop_groups(module)
        if id(module.weight) in tables:  # a tied LM head
            _install(module, tables[id(module.weight)])
            chosen["int8"] += 1
            continue
        target = _target(module, groups, quantization)
        float_weight = groups.dequantize() if groups is not None else module.weight
        weight = None if target is None else _quantized(float_weight, groups, target, module.weight)
        if weight is None:
            if groups is not None:
                module.weight.data = float_weight.to(device=module.weight.device, dtype=dtype)
            if target is not None:
                reasons.add(INT8_INPUTS_REASON)
            chosen["float"] += 1
            continue
        tables[id(module.weight)] = weight
        _install(module, weight)
        chosen[weight.name] += 1
    summary = ", ".join(f"{kind}: {count}" for kind, count in chosen.items())
    return "; ".join([summary, *sorted(reasons)])


def _target(module, groups: GroupQuantized | None, quantization: str) -> str | None:
    if quantization == "none" or (quantization == "auto" and groups is None):
        return None
    if isinstance(module, VocabParallelEmbedding):
        return "int8"
    if quantization == "auto":
        return "int8" if groups.codes.dtype == torch.int8 else FOUR_BIT
    return quantization


def _quantized(float_weight: torch.Tensor, groups: GroupQuantized | None, target: str, module_weight: torch.Tensor):
    """The weight in target's format, on the module's device (kept codes arrive on the CPU); None where the CPU's
    int8 kernel cannot take its inputs."""
    if runs_triton(module_weight):
        return _quantized_for_triton(float_weight, groups, target).to(module_weight.device)
    if target == "int4":
        source = groups if groups is not None and groups.codes.dtype == torch.uint8 else None
        try:
            return cpu_int4_weight(source or GroupQuantized.from_float(float_weight))
        except ValueError:
            pass  # a shape the int4 layout cannot hold
    if float_weight.shape[1] % INT8_INPUTS_MULTIPLE:
        return None
    return Int8Weight.from_float(float_weight)


def _quantized_for_triton(float_weight: torch.Tensor, groups: GroupQuantized | None, target: str):
    if target == "int4":
        if groups is not None and groups.codes.dtype == torch.uint8:
            return PackedInt4Weight.from_groups(groups)
        if float_weight.shape[1] % GROUP_SIZE == 0:
            return PackedInt4Weight.from_groups(GroupQuantized.from_float(float_weight))
    return Int8Weight.from_float(float_weight)  # 8-bit codes, or inputs not in whole groups


def _install(module: nn.Module, weight) -> None:
    """The module computes with weight from now on; its float weight is freed (a tied LM head takes the
    embedding's quantized table, quantize_weights)."""
    if isinstance(module, (LinearBase, ParallelLMHead)):
        module.packed_weight = weight
    else:
        module.quantized = weight
    module.weight.data = module.weight.data.new_empty(0)


def _pop_groups(module: nn.Module) -> GroupQuantized | None:
    parts = module.__dict__.pop("weight_groups", None)
    if parts is None:
        return None
    missing = {"codes", "scale", "offset"} - set(parts)
    if missing:
        raise ValueError(f"a group-quantized weight lacks its {', '.join(sorted(missing))}")
    return GroupQuantized(parts["codes"], parts["scale"], parts["offset"])
