"""Triton rms_norm / fused_add_rms_norm / rotary / silu_and_mul against kernels/reference.py.

Interpreter (TRITON_INTERPRET=1) in float32 without CUDA; bfloat16 and float16 on a GPU
(NANOSERVE_TEST_DEVICE=cuda), where the kernels round intermediate results where the reference does, so they match
it to a 16-bit ulp or so.
"""
from __future__ import annotations

import pytest
import torch
from device import TEST_DEVICE

from nanoserve.kernels import ops
from nanoserve.kernels import reference as ref

DEVICE = TEST_DEVICE


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def randn(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 64), (1, 1000)])  # 1000: a non-power-of-two row
def test_rms_norm(shape, dtype):
    x, w = randn(*shape, dtype=dtype), randn(shape[-1], seed=1, dtype=dtype)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref.rms_norm_ref(x, w, 1e-6), **tol(dtype))


def test_rms_norm_strided_rows(dtype):
    """Per-head q/k norm on a view of the fused qkv output (rows with a gap between them)."""
    qkv = randn(5, 3 * 64 + 16, dtype=dtype)
    x = qkv[:, 16:16 + 64]
    w = randn(64, seed=2, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5), **tol(dtype))


@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 160)])
def test_fused_add_rms_norm(shape, dtype):
    x, res = randn(*shape, dtype=dtype), randn(*shape, seed=1, dtype=dtype)
    w = randn(shape[-1], seed=2, dtype=dtype)
    normed, summed = ops.fused_add_rms_norm(x, res, w, 1e-6)
    exp_normed, exp_summed = ref.fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(summed, exp_summed, **tol(dtype))
    torch.testing.assert_close(normed, exp_normed, **tol(dtype))
    assert x.data_ptr() != normed.data_ptr() and res.data_ptr() != summed.data_ptr()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (6, 2, 24), (16, 8, 128)])
def test_rotary(heads, kv_heads, head_dim, dtype):
    tokens = 9
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q, k: strided views, as in the model
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    q_out, k_out = ops.rotary(q, k, cos, sin)
    q_exp, k_exp = ref.rotary_ref(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_exp, **tol(dtype))
    torch.testing.assert_close(k_out, k_exp, **tol(dtype))


@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 1500)])  # 1500 > one 1024-wide tile
def test_silu_and_mul(shape, dtype):
    x = randn(*shape, dtype=dtype)
    out = ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, ref.silu_and_mul_ref(x), **tol(dtype))


def test_empty_inputs(dtype):
    x = randn(0, 64, dtype=dtype)
    assert ops.rms_norm(x, randn(64, dtype=dtype), 1e-6).shape == (0, 64)
    assert ops.fused_add_rms_norm(x, x, randn(64, dtype=dtype), 1e-6)[1].shape == (0, 64)
    assert ops.silu_and_mul(x).shape == (0, 32)
    cos = randn(0, 8, dtype=dtype)
    q, k = ops.rotary(randn(0, 2, 16, dtype=dtype), randn(0, 1, 16, dtype=dtype), cos, cos)
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)
