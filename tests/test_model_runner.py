"""ModelRunner against HF transformers on the same random weights: hand-built StepPlans covering batched
prefill, decode, chunked prefill, a cached prefix, mixed prefill+decode batches, and the CUDA-graph
bucket/padding logic (emulated eagerly on CPU)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hf_reference import hf_model

from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graph import CUDAGraphRunner, decode_buckets, fits_graph, pick_bucket
from nanoserve.engine.model_runner import BlockTableCache, ModelRunner, build_step_batch
from nanoserve.engine.plan import ScheduledSeq, StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.sampler import SamplingMetadata
from nanoserve.sampling_params import SamplingParams

ARCHS = ("qwen3", "qwen2", "llama")


# ---- helpers (also used by test_tensor_parallel.py) ----
def make_runner(model_dir: str, block_size: int = 4, num_blocks: int = 96, **engine_args) -> ModelRunner:
    args = dict(device="cpu", dtype="float32", kvcache_block_size=block_size, num_kvcache_blocks=num_blocks,
                max_model_len=256, max_num_seqs=16)
    return ModelRunner(EngineConfig.from_kwargs(model_dir, **{**args, **engine_args}))


class Blocks:
    """Hands out KV block ids in a scrambled order, so block tables are not contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free.pop())


def make_seq(name: str, token_ids: list[int]) -> Sequence:
    return Sequence(name, token_ids, SamplingParams(temperature=0.0), max_tokens=64)


def random_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_step(runner: ModelRunner, blocks: Blocks, items) -> torch.Tensor:
    """items: (seq, start_pos, num_new_tokens); returns logits for the rows that sample."""
    plan = StepPlan()
    for seq, start, n in items:
        blocks.cover(seq, start + n)
        plan.scheduled.append(ScheduledSeq(seq, start, n))
    logits = runner.run_model(plan)
    assert logits.dtype == torch.float32
    assert logits.shape[0] == len(plan.sampling_seqs)
    return logits


@torch.inference_mode()
def hf_last_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0, -1].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(ours, ref, atol=1e-4 * scale, rtol=1e-4)


def check_rows(model_dir: str, logits: torch.Tensor, seqs: list[Sequence]) -> None:
    assert logits.shape[0] == len(seqs)
    for row, seq in enumerate(seqs):
        assert_logits_close(logits[row], hf_last_logits(model_dir, seq.token_ids))


# ---- model output vs HF ----
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_then_decode(arch, tiny_models):
    model_dir = tiny_models[arch]
    runner = make_runner(model_dir)
    blocks = Blocks(96, 4)
    # 1 token, exactly one block, two blocks, an odd length
    seqs = [make_seq(f"s{i}", random_ids(n, seed=i)) for i, n in enumerate((1, 4, 8, 7))]
    logits = run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])
    check_rows(model_dir, logits, seqs)
    for _ in range(4):  # decode: append HF's greedy token, compare the next logits
        for row, seq in enumerate(seqs):
            seq.append_token(int(hf_last_logits(model_dir, seq.token_ids).argmax()))
        logits = run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in seqs])
        check_rows(model_dir, logits, seqs)
    runner.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_cached_prefix(arch, tiny_models):
    model_dir = tiny_models[arch]
    runner = make_runner(model_dir)
    blocks = Blocks(96, 4, seed=1)
    a = make_seq("a", random_ids(13, seed=10))
    assert run_step(runner, blocks, [(a, 0, 6)]).shape[0] == 0  # first chunk: nothing sampled
    check_rows(model_dir, run_step(runner, blocks, [(a, 6, 7)]), [a])
    # b shares a's first two full blocks (a prefix-cache hit) and computes only its own tail
    b = make_seq("b", a.token_ids[:8] + random_ids(5, seed=11))
    b.block_table = a.block_table[:2]
    check_rows(model_dir, run_step(runner, blocks, [(b, 8, 5)]), [b])
    b.append_token(7)
    check_rows(model_dir, run_step(runner, blocks, [(b, b.num_tokens - 1, 1)]), [b])
    runner.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prefill_chunks_and_decodes(arch, tiny_models):
    model_dir = tiny_models[arch]
    runner = make_runner(model_dir, block_size=16)
    blocks = Blocks(96, 16, seed=2)
    d1, d2 = make_seq("d1", random_ids(5, seed=20)), make_seq("d2", random_ids(17, seed=21))
    run_step(runner, blocks, [(d1, 0, 5), (d2, 0, 17)])
    d1.append_token(11)
    d2.append_token(12)
    p1 = make_seq("p1", random_ids(40, seed=22))  # two chunks: 0..19 now, the rest below
    p2 = make_seq("p2", random_ids(9, seed=23))
    logits = run_step(runner, blocks, [(d1, 5, 1), (p1, 0, 20), (d2, 17, 1), (p2, 0, 9)])
    check_rows(model_dir, logits, [d1, d2, p2])
    d1.append_token(13)
    logits = run_step(runner, blocks, [(p1, 20, 20), (d1, 6, 1)])
    check_rows(model_dir, logits, [p1, d1])
    runner.shutdown()


def test_execute_samples_greedy_tokens(tiny_models):
    pytest.importorskip("nanoserve.layers.sampler")
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir)
    blocks = Blocks(96, 4)
    seqs = [make_seq("x", random_ids(6, seed=30)), make_seq("y", random_ids(3, seed=31))]
    plan = StepPlan()
    for seq in seqs:
        blocks.cover(seq, seq.num_tokens)
        plan.scheduled.append(ScheduledSeq(seq, 0, seq.num_tokens))
    out = runner.execute(plan)
    assert out.token_ids == [int(hf_last_logits(model_dir, s.token_ids).argmax()) for s in seqs]
    runner.shutdown()


def test_kv_blocks_from_cpu_budget(tiny_models):
    runner = make_runner(tiny_models["qwen3"], num_blocks=None, cpu_kvcache_space_gib=0.001)
    # 2 (k, v) * 2 layers * block 4 * 2 kv heads * head_dim 16 * 4 bytes = 2048 bytes a block
    assert runner.config.num_kvcache_blocks == int(0.001 * 2 ** 30) // 2048
    assert tuple(runner.kv_cache.shape) == (2, 2, runner.config.num_kvcache_blocks, 4, 2, 16)
    layer = runner.attention_layers[1]
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, 1].data_ptr()
    runner.shutdown()


# ---- batch tensors ----
def test_prepare_builds_tensors_from_the_plan(tiny_models):
    runner = make_runner(tiny_models["qwen3"])
    x = make_seq("x", [5, 6, 7, 8, 9, 10])
    x.block_table = [3, 9]
    y = make_seq("y", [1, 2, 3, 4, 50])
    y.block_table = [1, 5, 8]  # wider than needed: padding follows the widest table
    z = make_seq("z", list(range(20, 30)))
    z.block_table = [2, 4, 6]
    plan = StepPlan([ScheduledSeq(x, 0, 6), ScheduledSeq(y, 4, 1), ScheduledSeq(z, 2, 5)])
    input_ids, positions, meta, sample_rows = runner.prepare(plan)
    assert input_ids.tolist() == [5, 6, 7, 8, 9, 10, 50, 22, 23, 24, 25, 26]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 2, 3, 4, 5, 6]
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 20, 10, 11, 16, 17, 18]
    assert meta.query_start_loc.tolist() == [0, 6, 7, 12]
    assert meta.seq_lens.tolist() == [6, 5, 7]
    assert meta.block_tables.tolist() == [[3, 9, 0], [1, 5, 8], [2, 4, 6]]
    assert sample_rows.tolist() == [5, 6]  # z's chunk stops before its last token
    assert (meta.max_query_len, meta.max_seq_len, meta.is_decode_only) == (6, 7, False)
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
    assert meta.query_start_loc.dtype == torch.int32 and meta.block_tables.dtype == torch.int32
    decode = StepPlan([ScheduledSeq(y, 4, 1), ScheduledSeq(x, 5, 1)])
    _, _, meta, sample_rows = runner.prepare(decode)
    assert meta.is_decode_only and sample_rows.tolist() == [0, 1]
    assert meta.block_tables.tolist() == [[1, 5, 8], [3, 9, 0]]
    runner.shutdown()


def test_block_table_cache_follows_changed_tables():
    cache = BlockTableCache(num_rows=4, width=2)
    a, b, c = [3, 1, 4], [1], [5, 9]
    assert cache.gather([a, b], [1, 2], 3).tolist() == [[3, 1, 4], [1, 0, 0]]
    a.append(7)  # mutated in place: the saved copy must not follow it silently
    b[0] = 6
    assert cache.gather([b, a], [2, 1], 4).tolist() == [[6, 0, 0, 0], [3, 1, 4, 7]]
    assert cache.gather([c, [2]], [3, 1], 2).tolist() == [[5, 9], [2, 0]]  # key 1 shrank
    # more new keys than free rows: the cache resets and still answers correctly
    tables = [[i, i + 1] for i in range(4)]
    assert cache.gather(tables, [10, 11, 12, 13], 2).tolist() == tables


# ---- CUDA graph bucket choice and padded replay (CPU emulation of the graphs) ----
def test_decode_buckets_and_fallback():
    assert decode_buckets(256)[:7] == [1, 2, 4, 8, 16, 32, 48] and decode_buckets(256)[-1] == 256
    assert decode_buckets(100)[-3:] == [80, 96, 100]
    assert decode_buckets(3) == [1, 2, 3]
    buckets = decode_buckets(64)
    assert [pick_bucket(buckets, b) for b in (1, 3, 5, 16, 17, 64, 65)] == [1, 4, 8, 16, 32, 64, None]
    assert fits_graph(buckets, max_blocks=8, batch_size=20, table_width=8, decode_only=True)
    assert not fits_graph(buckets, 8, 65, 8, True)  # batch bigger than the largest graph
    assert not fits_graph(buckets, 8, 20, 9, True)  # block table wider than the captured one
    assert not fits_graph(buckets, 8, 20, 4, False)  # a prefill step
    assert not fits_graph(buckets, 8, 0, 4, True)


class _EagerGraph:
    """Stands in for a captured torch.cuda.CUDAGraph: replay runs the model on the static buffers."""

    def __init__(self, runner: CUDAGraphRunner, bucket: int):
        self.runner, self.bucket = runner, bucket

    def replay(self):
        r, b = self.runner, self.bucket
        r.outputs[:b] = r.model(r.input_ids[:b], r.positions[:b], r._metadata(b))


def test_graph_replay_pads_rows_harmlessly(tiny_models):
    model_dir = tiny_models["llama"]
    runner = make_runner(model_dir, max_num_seqs=8)
    graphs = CUDAGraphRunner(runner.model, 8, runner.max_blocks_per_seq, 256, 64, torch.float32, runner.device)
    graphs.block_tables.fill_(5)  # stale ids from "earlier steps" in padded rows and unused columns
    graphs.graphs = {b: _EagerGraph(graphs, b) for b in graphs.buckets}
    runner.graphs = graphs
    replays = []
    graphs.run = _spy(graphs.run, replays)
    blocks = Blocks(96, 4, seed=3)
    seqs = [make_seq(f"g{i}", random_ids(n, seed=40 + i)) for i, n in enumerate((3, 9, 5))]
    run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])
    assert replays == []  # prefill runs eagerly
    for _ in range(2):
        for seq in seqs:
            seq.append_token(int(hf_last_logits(model_dir, seq.token_ids).argmax()))
        logits = run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in seqs])  # bucket 4, one padded row
        check_rows(model_dir, logits, seqs)
    assert replays == [3, 3]
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 0
    runner.shutdown()


def _spy(run, calls):
    def wrapped(input_ids, positions, meta):
        calls.append(input_ids.shape[0])
        return run(input_ids, positions, meta)
    return wrapped


def test_step_batch_is_plain_host_data():
    seq = make_seq("h", [1, 2, 3])
    seq.block_table = [0]
    batch = build_step_batch(StepPlan([ScheduledSeq(seq, 0, 3)]), 4)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "sample_rows"):
        assert isinstance(getattr(batch, name), np.ndarray), name


def test_triton_kernels_match_hf(tiny_models, monkeypatch):
    """The CUDA path's kernels (attention, KV store, norms, rotary, SiLU) run on CPU through the Triton
    interpreter (TRITON_INTERPRET=1, set in conftest)."""
    pytest.importorskip("nanoserve.kernels.ops")
    from nanoserve.layers import activation, norm, rotary

    def kernel_always(name, reference, x):
        kernel = activation.cuda_op(name)
        assert kernel is not None, name
        return kernel

    for module in (activation, norm, rotary):
        monkeypatch.setattr(module, "pick", kernel_always)
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir, attention_backend="triton")
    blocks = Blocks(96, 4, seed=8)
    seqs = [make_seq(f"k{i}", random_ids(n, seed=80 + i)) for i, n in enumerate((1, 8, 7))]
    check_rows(model_dir, run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs]), seqs)
    for seq in seqs:
        seq.append_token(int(hf_last_logits(model_dir, seq.token_ids).argmax()))
    late = make_seq("late", random_ids(6, seed=90))
    logits = run_step(runner, blocks, [(seqs[0], 1, 1), (late, 0, 6), (seqs[1], 8, 1), (seqs[2], 7, 1)])
    check_rows(model_dir, logits, [seqs[0], late, seqs[1], seqs[2]])
    logits = run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in (seqs[0], late)])  # decode only
    check_rows(model_dir, logits, [seqs[0], late])
    runner.shutdown()


def test_warmup_forward_at_the_largest_batch(tiny_models):
    """The warm-up that sizes the KV cache on CUDA (here on CPU): a scratch cache, then unbound."""
    runner = make_runner(tiny_models["qwen2"], max_num_batched_tokens=64, max_model_len=32, max_num_seqs=4)
    scratch = runner._warmup()  # 2 sequences of 32 tokens: 16 blocks of 4
    assert scratch == 16 * 2048  # a block (k and v, 2 layers, 4 slots, 2 kv heads, head_dim 16) is 2048 bytes
    assert runner.attention_layers[0].k_cache.numel() == 0
    runner.shutdown()


def test_flash_attn_needs_big_blocks(tiny_models):
    with pytest.raises(ValueError, match="multiple of 256"):
        make_runner(tiny_models["qwen3"], attention_backend="flash_attn", block_size=16)


# ---- decode fast path: a scheduler-made decode plan ----
def test_decode_batch_from_arrays_equals_the_general_build():
    from types import SimpleNamespace

    from nanoserve.engine.block_manager import BlockManager
    from nanoserve.engine.scheduler import Scheduler

    config = SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128, kvcache_block_size=4,
                             enable_prefix_caching=True)
    scheduler = Scheduler(config, BlockManager(200, 4))
    seqs = [make_seq(f"d{i}", random_ids(n, seed=60 + i)) for i, n in enumerate((1, 3, 4, 9, 16, 2))]
    for seq in seqs:
        scheduler.add(seq)
    decode_plans = 0
    for step in range(12):  # tables grow past several block boundaries
        plan = scheduler.schedule()
        fast = build_step_batch(plan, 4, BlockTableCache(16, 8))
        general = build_step_batch(StepPlan(list(plan.scheduled)), 4, BlockTableCache(16, 8))
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                     "sample_rows"):
            a, b = getattr(fast, name), getattr(general, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (step, name, a, b)
        assert (fast.max_query_len, fast.max_seq_len) == (general.max_query_len, general.max_seq_len)
        decode_plans += plan.decode is not None
        scheduler.postprocess(plan, [7 + step] * len(plan.sampling_seqs))
    assert decode_plans == 11


def test_sampling_metadata_is_reused_for_the_same_sequences(tiny_models):
    runner = make_runner(tiny_models["qwen3"])
    seqs = [Sequence(f"m{i}", [1, 2, 3], SamplingParams(temperature=0.5, top_k=4), max_tokens=8) for i in range(3)]
    meta = runner.sampling_metadata(seqs)
    assert runner.sampling_metadata(list(seqs)) is meta  # same sequences, nothing step-dependent: reused
    assert runner.sampling_metadata(seqs[:2]) is not meta  # a sequence left: rebuilt
    runner.eos_token_id = [2, 5]
    assert runner.sampling_metadata(seqs[:2]).eos_token_id == [2, 5]  # the EOS ids changed: rebuilt
    seeded = [Sequence("s", [1, 2], SamplingParams(temperature=0.5, seed=3), max_tokens=8)]
    first = runner.sampling_metadata(seeded)
    seeded[0].append_token(9)
    second = runner.sampling_metadata(seeded)  # the seeded row's step seed follows its tokens
    assert second.seeded != first.seeded and second.seeded == SamplingMetadata.from_seqs(seeded, [2, 5]).seeded
    runner.shutdown()
