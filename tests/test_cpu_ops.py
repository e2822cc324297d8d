"""The C++ CPU kernels (kernels/cpu_ops.cpp) against kernels/reference.py, in float32, bfloat16 and float16:
the same rounding as the reference, so float32 matches to float32 accuracy and the others to one ulp or so.
Caches start as NaN, so a kernel that reads a slot no row owns shows it."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.kernels import reference as ref
from nanoserve.kernels.cpu_ops import cpu_op, library

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernels")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def test_the_kernels_build_here():
    assert library() is not None, "the CPU kernels failed to build (see the warning logged)"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (300, 256), (3, 1000)])  # 300 x 256: split over threads
def test_rms_norm_and_the_fused_residual_add(dtype, rows, n):
    x, residual = randn(rows, n, dtype=dtype), randn(rows, n, dtype=dtype, seed=1)
    weight = randn(n, dtype=dtype, seed=2)
    assert_close(cpu_op("rms_norm")(x, weight, 1e-6), ref.rms_norm_ref(x, weight, 1e-6), dtype)
    normed, summed = cpu_op("fused_add_rms_norm")(x, residual, weight, 1e-6)
    expected_normed, expected_summed = ref.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert_close(summed, expected_summed, dtype)
    assert_close(normed, expected_normed, dtype)


def test_rms_norm_of_a_strided_view():
    qkv = randn(5, 3 * 64 + 16)
    x, weight = qkv[:, 16:16 + 64], randn(64, seed=2)
    assert_close(cpu_op("rms_norm")(x, weight, 1e-5), ref.rms_norm_ref(x, weight, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(4, 2, 32, 9), (6, 2, 24, 1), (16, 8, 128, 70)])
def test_rotary_of_qkv_views(dtype, heads, kv_heads, head_dim, tokens):
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q, k as strided views, as the model has
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim // 2, generator=torch.Generator().manual_seed(3))
    q_out, k_out = cpu_op("rotary")(q, k, angles.cos(), angles.sin())
    q_expected, k_expected = ref.rotary_ref(q, k, angles.cos(), angles.sin())
    assert_close(q_out, q_expected, dtype)
    assert_close(k_out, k_expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", ["model", ref.FP8])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_store_kvcache_writes_what_the_reference_does(dtype, cache_dtype, scales):
    """k and v as views of one qkv row (strided, as the layers pass them), into shuffled slots; an fp8 cache holds
    x / scale saturated (values past 448 included) bit for bit as reference.to_cache makes it."""
    cache_dtype = dtype if cache_dtype == "model" else cache_dtype
    tokens, kv_heads, head_dim = 11, 2, 24
    qkv = randn(tokens, 4 * kv_heads * head_dim, dtype=dtype) * 300
    k = qkv[:, 2 * kv_heads * head_dim:3 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 3 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(8 * 4, generator=torch.Generator().manual_seed(1))[:tokens]
    caches = [torch.zeros(8, 4, kv_heads, head_dim, dtype=cache_dtype) for _ in range(4)]
    cpu_op("store_kvcache")(k, v, caches[0], caches[1], slots, *scales)
    ref.store_kvcache_ref(k, v, caches[2], caches[3], slots, *scales)
    for got, expected in zip(caches[:2], caches[2:]):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_store_kvcache_rejects_a_slot_past_the_cache():
    k = randn(2, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot_mapping out of range"):
        cpu_op("store_kvcache")(k, k, cache, cache.clone(), torch.tensor([3, 8]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (9, 1536), (300, 200), (2, 3, 40)])
def test_silu_and_mul(dtype, shape):
    x = randn(*shape, dtype=dtype) * 4  # the exponential's range, both tails
    assert_close(cpu_op("silu_and_mul")(x), ref.silu_and_mul_ref(x), dtype)


def paged_batch(q_lens, seq_lens, block_size, kv_heads, group, head_dim, dtype, seed):
    """(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) with each context through shuffled blocks;
    unowned slots are NaN."""
    rng = random.Random(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(needed + [1]) + 1, dtype=torch.int32)
    for b, (n, ctx) in enumerate(zip(needed, seq_lens)):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = tables[b][pos // block_size].long() * block_size + pos % block_size
        kv = randn(2, ctx, kv_heads, head_dim, dtype=dtype, seed=seed * 1000 + b)
        ref.store_kvcache_ref(kv[0], kv[1], k_cache, v_cache, slots)
    starts = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    q = randn(int(starts[-1]), kv_heads * group, head_dim, dtype=dtype, seed=seed + 7)
    return q, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32)


def check_decode(q_lens, seq_lens, block_size, kv_heads, group, head_dim, dtype, seed=0):
    q, k_cache, v_cache, tables, starts, lens = paged_batch(q_lens, seq_lens, block_size, kv_heads, group, head_dim,
                                                            dtype, seed)
    out = torch.full_like(q, float("nan"))
    cpu_op("paged_decode_attention")(out, q, k_cache, v_cache, tables, starts, lens, head_dim ** -0.5)
    expected = torch.full_like(q, float("nan"))
    ref.decode_attention_ref(expected, q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, starts, lens,
                             head_dim ** -0.5)
    decode_rows = [starts[b].item() for b, n in enumerate(q_lens) if n == 1 and seq_lens[b] > 0]
    untouched = torch.ones(len(q), dtype=torch.bool)
    untouched[decode_rows] = False
    assert_close(out[decode_rows], expected[decode_rows], dtype)
    assert out[untouched].isnan().all(), "rows that are not decodes are left alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim", [
    (16, 2, 2, 64), (1, 1, 1, 16), (4, 2, 4, 24), (32, 1, 8, 128), (128, 4, 1, 80), (16, 3, 3, 40)])
def test_paged_decode_attention_matches_the_reference(dtype, block_size, kv_heads, group, head_dim):
    q_lens = [1, 5, 1, 1, 3, 1]  # prefills among the decodes, untouched
    seq_lens = [1, 9, 70, 130, 3, 300]
    check_decode(q_lens, seq_lens, block_size, kv_heads, group, head_dim, dtype)


def test_paged_decode_attention_skips_empty_rows():
    """CUDA-graph padding rows have seq_len 0: nothing is read or written for them."""
    check_decode([1, 1, 1], [0, 17, 0], 16, 2, 2, 32, torch.float32)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 1, 1, 2, 7]), st.integers(0, 200)), min_size=1, max_size=12),
       st.sampled_from([1, 8, 16, 64]), st.sampled_from([(1, 1), (2, 2), (2, 4)]), st.sampled_from([16, 32, 72]),
       st.integers(0, 2 ** 16))
def test_paged_decode_attention_random_batches(rows, block_size, heads, head_dim, seed):
    seq_lens = [max(ctx, q_len) if q_len > 1 or ctx else 0 for q_len, ctx in rows]
    check_decode([q for q, _ in rows], seq_lens, block_size, *heads, head_dim, torch.float32, seed)


def test_paged_decode_attention_rejects_a_cache_of_another_dtype():
    q, k_cache, v_cache, tables, starts, lens = paged_batch([1], [5], 4, 1, 1, 16, torch.float32, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_op("paged_decode_attention")(torch.empty_like(q), q, k_cache.bfloat16(), v_cache.bfloat16(), tables,
                                         starts, lens, 0.25)


def test_rotary_rejects_a_k_whose_head_dim_differs_from_q():
    q, k, angles = randn(3, 4, 32), randn(3, 2, 16), torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match="head_dim alike"):
        cpu_op("rotary")(q, k, angles.cos(), angles.sin())
