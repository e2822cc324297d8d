"""Triton store_kvcache / paged attention kernels against kernels/reference.py.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1 from conftest.py) in float32;
with NANOSERVE_TEST_DEVICE=cuda the same tests run compiled, in bfloat16 and float16, against a float32 reference.
Caches start as NaN so any read of an unwritten slot shows up, and outputs start as NaN so any unwritten element
does.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from device import TEST_DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.kernels import ops
from nanoserve.kernels import reference as ref
from nanoserve.kernels import torch_attention

DEVICE = TEST_DEVICE


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def assert_close(actual, expected, **tol):
    """Within the tolerance of actual's dtype, unless given."""
    torch.testing.assert_close(actual.float(), expected.float(), **(tol or tolerance(actual.dtype)))


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where nothing was stored
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padding 0
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    scale: float

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.seq_lens,
                self.scale)

    def reference(self):
        """paged_attention_ref in float32 on NaN-free caches (its dense gather would spread the NaNs)."""
        k, v = self.k_cache.float().nan_to_num(0.0), self.v_cache.float().nan_to_num(0.0)
        return ref.paged_attention_ref(self.q.float(), k, v, self.block_tables, self.query_start_loc,
                                       self.seq_lens, self.scale)

    def nan_out(self):
        return torch.full_like(self.q, float("nan"))


def make_batch(q_lens, seq_lens, *, block_size, dtype, num_kv_heads=2, group=1, head_dim=32,
               seed=0) -> PagedBatch:
    """Random K/V for every context position, stored through shuffled block ids (3 blocks stay unused)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_needed + [1]) + 1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for b, (n, s) in enumerate(zip(blocks_needed, seq_lens)):
        table = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
        block_tables[b, :n] = table
        pos = torch.arange(s)
        slots = table[pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        ref.store_kvcache_ref(k, v, k_cache, v_cache, slots)
    query_start_loc = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    q = torch.randn(int(query_start_loc[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    dev = DEVICE
    return PagedBatch(q.to(dev), k_cache.to(dev), v_cache.to(dev), block_tables.to(dev), query_start_loc.to(dev),
                      torch.tensor(seq_lens, dtype=torch.int32, device=dev), head_dim ** -0.5)


# (q_lens, seq_lens): odd lengths, block boundaries crossed, a cached prefix wherever q_len < seq_len
SCENARIOS = {
    "decode": ([1, 1, 1, 1, 1], [1, 7, 33, 100, 257]),
    "prefill": ([2, 7, 33, 130], [2, 7, 33, 130]),
    "prefix": ([5, 33, 64], [37, 100, 300]),
    "mixed": ([1, 7, 1, 33, 20, 1], [100, 7, 1, 70, 300, 257]),
}


# ---------------------------------------------------------------------------------------------- store

@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_store_kvcache_writes_only_given_slots(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, kv_heads, head_dim, num_tokens = 5, 2, 32, 40
    # k/v as strided views of a fused projection output, in float32 while the cache may be bf16
    fused = torch.randn(num_tokens, 3 * kv_heads * head_dim + 8, generator=gen)
    k = fused[:, 8:8 + kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = fused[:, -kv_heads * head_dim:].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padded tokens
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)

    ops.store_kvcache(k, v, k_cache, v_cache, slots)
    ref.store_kvcache_ref(k, v, k_exp, v_exp, slots)
    torch.testing.assert_close(k_cache, k_exp, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_exp, atol=0, rtol=0, equal_nan=True)
    written = int((slots >= 0).sum()) * kv_heads * head_dim
    assert int((~k_cache.isnan()).sum()) == written and int((~v_cache.isnan()).sum()) == written


def test_store_kvcache_empty_and_all_padded(dtype):
    cache = torch.full((2, 16, 1, 16), float("nan"), dtype=dtype, device=DEVICE)
    kv = torch.randn(3, 1, 16, dtype=dtype, device=DEVICE)
    ops.store_kvcache(kv[:0], kv[:0], cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE))
    ops.store_kvcache(kv, kv, cache, cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert cache.isnan().all()


# ------------------------------------------------------------------------------------ paged attention

# the mixed batch at every block size x GQA ratio; each pure batch once per block size
CASES = [("mixed", bs, g) for bs in (16, 32, 256) for g in (1, 4, 8)] + [
    ("decode", 16, 4), ("prefill", 16, 8), ("prefix", 16, 1),
    ("decode", 32, 1), ("prefill", 32, 4), ("prefix", 32, 8),
    ("decode", 256, 8), ("prefill", 256, 1), ("prefix", 256, 4),
]


@pytest.mark.parametrize("scenario,block_size,group", CASES)
def test_paged_attention_matches_reference(scenario, block_size, group, dtype):
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=1 if group == 8 else 2,
                       group=group, seed=block_size + group, dtype=dtype)
    out = ops.paged_attention(*batch.args(), out=batch.nan_out())
    assert out.isfinite().all(), "an output element was not written"
    assert_close(out, batch.reference())


def test_paged_attention_split_k_on_and_off_agree(dtype):
    batch = make_batch(*SCENARIOS["mixed"], block_size=16, num_kv_heads=2, group=4, seed=3, dtype=dtype)
    one = ops.paged_attention(*batch.args(), num_splits=1, out=batch.nan_out())
    tol = tolerance(dtype) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # only summation order differs
    for splits in (2, 7):
        many = ops.paged_attention(*batch.args(), num_splits=splits, out=batch.nan_out())
        assert_close(many, one, **tol)
    assert_close(one, batch.reference())


def test_paged_attention_hints_and_default_out(dtype):
    batch = make_batch(*SCENARIOS["decode"], block_size=16, num_kv_heads=2, group=2, seed=4, dtype=dtype)
    out = ops.paged_attention(*batch.args(), max_query_len=1, max_seq_len=max(SCENARIOS["decode"][1]))
    assert_close(out, batch.reference())
    batch = make_batch(*SCENARIOS["prefix"], block_size=32, num_kv_heads=2, group=2, seed=5, dtype=dtype)
    assert_close(ops.paged_attention(*batch.args(), max_query_len=64, max_seq_len=300), batch.reference())


def test_paged_attention_odd_shapes(dtype):
    """Non-power-of-two head_dim, GQA group and block size (the engine tests use block size 8)."""
    batch = make_batch([1, 9, 3], [20, 9, 45], block_size=8, num_kv_heads=2, group=3, head_dim=24, seed=6,
                       dtype=dtype)
    out = ops.paged_attention(*batch.args(), num_splits=3, out=batch.nan_out())
    assert out.isfinite().all()
    assert_close(out, batch.reference())


def test_paged_attention_float16():
    """The 16-bit path (P rounded before the PV product). bf16 runs on GPUs only: the interpreter's tl.dot
    does not support it."""
    batch = make_batch(*SCENARIOS["mixed"], block_size=16, num_kv_heads=2, group=4, seed=9, dtype=torch.float16)
    for splits in (1, 3):
        out = ops.paged_attention(*batch.args(), num_splits=splits, out=batch.nan_out())
        assert out.isfinite().all()
        assert_close(out, batch.reference(), atol=1e-2, rtol=1e-2)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # dtype: immutable
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 70)), min_size=1, max_size=4),
    block_size=st.sampled_from([8, 16, 32]),
    group=st.sampled_from([1, 2, 4]),
    splits=st.sampled_from([1, 3]),
)
def test_paged_attention_random_batches(seqs, block_size, group, splits, dtype):
    q_lens = [q for q, _ in seqs]
    seq_lens = [q + prefix for q, prefix in seqs]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=2, group=group, head_dim=16,
                       dtype=dtype)
    out = ops.paged_attention(*batch.args(), num_splits=splits, out=batch.nan_out())
    assert out.isfinite().all()
    assert_close(out, batch.reference())


# ------------------------------------------------------------------------------------- decode entry

@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("block_size", [16, 256])
def test_paged_decode_attention_with_padded_rows(num_splits, block_size, dtype):
    seq_lens = [33, 0, 1, 260, 0, 100]  # 0: CUDA-graph padding rows
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size=block_size, num_kv_heads=2, group=4, seed=7,
                       dtype=dtype)
    padded = batch.seq_lens == 0
    batch.block_tables[padded] = 1 << 30  # garbage a padded row must never follow
    q = batch.q  # [batch, heads, head_dim]: one token per sequence
    out = ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                     batch.scale, num_splits, out=torch.full_like(q, float("nan")))
    assert (out[padded] == 0).all()
    real = ~padded
    k, v = batch.k_cache.float().nan_to_num(0.0), batch.v_cache.float().nan_to_num(0.0)
    expected = ref.paged_decode_ref(q[real].float(), k, v, batch.block_tables[real], batch.seq_lens[real],
                                    batch.scale)
    assert_close(out[real], expected)


def test_paged_decode_attention_all_rows_padded(dtype):
    batch = make_batch([1, 1], [0, 0], block_size=16, seed=8, dtype=dtype)
    out = ops.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                     batch.scale, 4)
    assert (out == 0).all()


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_attention_graph_padded_decode_batch(num_splits, dtype):
    """What a CUDA-graph replay passes: query_start_loc = arange, max_query_len 1, max_seq_len the static
    bound, and padded rows (seq_len 0, stale block ids) after the real ones."""
    seq_lens = [33, 260, 1, 0, 0]
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size=16, num_kv_heads=2, group=4, seed=10,
                       dtype=dtype)
    padded = batch.seq_lens == 0
    batch.block_tables[padded] = 1 << 30
    out = ops.paged_attention(*batch.args(), max_query_len=1, max_seq_len=4096, num_splits=num_splits,
                              out=batch.nan_out())
    assert (out[padded] == 0).all()
    real = ~padded
    k, v = batch.k_cache.float().nan_to_num(0.0), batch.v_cache.float().nan_to_num(0.0)
    expected = ref.paged_decode_ref(batch.q[real].float(), k, v, batch.block_tables[real], batch.seq_lens[real],
                                    batch.scale)
    assert_close(out[real], expected)


# ----------------------------------------------------------------------- torch backend (per-step plan)

def new_token_slots(batch: PagedBatch, q_lens) -> torch.Tensor:
    """The cache slots of each sequence's last q_len positions: this step's new tokens."""
    block_size = batch.k_cache.shape[1]
    slots = []
    for b, (q_len, ctx) in enumerate(zip(q_lens, batch.seq_lens.tolist())):
        pos = torch.arange(ctx - q_len, ctx)
        slots.append(batch.block_tables[b].cpu()[pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots).to(batch.q.device)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size,group", [(16, 1), (16, 4), (32, 8), (256, 2)])
def test_planned_torch_attention_matches_reference(scenario, block_size, group):
    q_lens, seq_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=1 if group == 8 else 2,
                       group=group, seed=block_size + group, dtype=torch.float32)
    k_cache, v_cache = batch.k_cache.nan_to_num(0.0), batch.v_cache.nan_to_num(0.0)
    slots = new_token_slots(batch, q_lens)
    k_new, v_new = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    plan = torch_attention.plan_paged_attention(slots, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    expected = batch.reference()
    for _ in range(2):  # one plan serves every layer
        out = torch_attention.paged_attention_planned(batch.q, k_new, v_new, k_cache, v_cache, plan, batch.scale)
        assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad_every", [0, 3])
def test_planned_store_kvcache_matches_reference(pad_every):
    gen = torch.Generator().manual_seed(pad_every)
    k, v = torch.randn(2, 12, 2, 8, generator=gen).to(DEVICE)
    slots = torch.randperm(4 * 16, generator=gen)[:12].to(DEVICE)
    if pad_every:
        slots[::pad_every] = -1
    cache = torch.full((4, 16, 2, 8), float("nan"), device=DEVICE)
    caches = [cache.clone() for _ in range(4)]
    plan = torch_attention.plan_paged_attention(slots, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
                                                torch.tensor([0, 12], dtype=torch.int32, device=DEVICE),
                                                torch.tensor([12], dtype=torch.int32, device=DEVICE))
    assert plan.all_slots_valid == (pad_every == 0)
    torch_attention.store_kvcache_planned(k, v, caches[0], caches[1], plan)
    ref.store_kvcache_ref(k, v, caches[2], caches[3], slots)
    for got, expected in zip(caches[:2], caches[2:]):
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)


def test_similar_lengths_bounds_padding():
    seq_lens = [100, 7, 1, 70, 300, 257, 120, 124]
    for max_pad in (1.25, 1.5):
        groups = ref._similar_lengths(list(range(len(seq_lens))), seq_lens, max_pad)
        assert sorted(r for g in groups for r in g) == list(range(len(seq_lens)))
        for g in groups:
            lens = [seq_lens[r] for r in g]
            assert max(lens) <= max_pad * min(lens)
