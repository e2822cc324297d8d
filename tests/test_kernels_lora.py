"""Triton add_lora (kernels/lora.py) against reference.add_lora_ref, the torch path of layers/lora.py: tokens of
mixed adapter slots and of none (-1) in one batch, fused linears of one to three parts, several ranks.

Interpreter (TRITON_INTERPRET=1) without CUDA; NANOSERVE_TEST_DEVICE=cuda runs the same cases compiled, and the
16-bit case in float16 too. Small shapes: the interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch
from device import ON_CUDA, TEST_DEVICE

from nanoserve.kernels import ops
from nanoserve.kernels import reference as ref

DEVICE = TEST_DEVICE
SIXTEEN_BIT = (torch.bfloat16, torch.float16) if ON_CUDA else (torch.bfloat16,)
PARTS = {"qkv": [(0, 32), (32, 16), (48, 16)], "gate_up": [(0, 24), (24, 24)], "one": [(0, 40)]}
SLOTS = [0, -1, 2, 2, 1, 0, -1, 2, 1]  # slot 1 is empty (zero weights), like a cleared slot


def stacks(parts, rank, in_size, dtype, num_slots=3):
    gen = torch.Generator().manual_seed(rank)
    out_size = sum(size for _, size in parts)
    a = torch.randn(num_slots, len(parts) * rank, in_size, generator=gen) / in_size ** 0.5
    b = torch.randn(num_slots, out_size, rank, generator=gen)
    a[1], b[1] = 0, 0
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def run_both(parts, rank, in_size, dtype, slots):
    a, b = stacks(parts, rank, in_size, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), in_size, generator=gen).to(DEVICE, dtype)
    y = torch.randn(len(slots), b.shape[1], generator=gen).to(DEVICE, dtype)
    token_slots = torch.tensor(slots, device=DEVICE)
    expected, out = y.clone(), y.clone()
    ref.add_lora_ref(expected, x, a, b, token_slots, parts)
    ops.add_lora(out, x, a, b, token_slots, parts)
    return y, out, expected


@pytest.mark.parametrize("parts,rank,in_size", [("qkv", 8, 48), ("gate_up", 4, 160), ("one", 1, 24)])
def test_add_lora_matches_reference(parts, rank, in_size):
    """160 > one 128-wide block of the input dim; rank 1 and 3 parts of different sizes."""
    y, out, expected = run_both(PARTS[parts], rank, in_size, torch.float32, SLOTS)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    base = torch.tensor(SLOTS) < 0
    assert torch.equal(out[base], y[base]) and not torch.equal(out[~base], y[~base])


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_add_lora_16_bit_within_rounding(dtype):
    """The kernel adds in float32 and rounds once; the reference rounds the shrunk activations too."""
    y, out, expected = run_both(PARTS["qkv"], 4, 32, dtype, SLOTS)
    torch.testing.assert_close(out.float(), expected.float(), atol=5e-2, rtol=2e-2)


def test_add_lora_without_adapter_tokens_changes_nothing():
    y, out, _ = run_both(PARTS["gate_up"], 4, 16, torch.float32, [-1, -1, -1])
    assert torch.equal(out, y)
    y, out, _ = run_both(PARTS["gate_up"], 4, 16, torch.float32, [])
    assert out.shape == (0, 48)
