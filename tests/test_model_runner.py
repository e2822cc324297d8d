"""ModelRunner against HF transformers on the same random weights: hand-made steps (SchedulerOutputs with their
diffs) covering batched prefill, decode, chunked prefill, a cached prefix, mixed prefill+decode batches, and
the CUDA-graph bucket/padding logic (emulated eagerly on CPU)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from device import engine_defaults
from hf_reference import hf_model

from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graph import CUDAGraphRunner, decode_buckets, fits_graph, pick_bucket
from nanoserve.engine.model_runner import ModelRunner, pick_device
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams

ARCHS = ("qwen3", "qwen2", "llama")


# ---- helpers (also used by test_tensor_parallel.py, test_cuda_graph.py, test_models.py) ----
def make_config(model_dir: str, block_size: int = 4, num_blocks: int | None = 96, **engine_args) -> EngineConfig:
    """On the test device (tests/device.py), in float32: HF's reference runs in float32 on the CPU."""
    args = dict(dtype="float32", kvcache_block_size=block_size, num_kvcache_blocks=num_blocks, max_model_len=256,
                max_num_seqs=16)
    return EngineConfig.from_kwargs(model_dir, **{**engine_defaults(), **args, **engine_args})


def make_runner(model_dir: str, block_size: int = 4, num_blocks: int | None = 96, **engine_args) -> ModelRunner:
    config = make_config(model_dir, block_size, num_blocks, **engine_args)
    runner = ModelRunner(config, pick_device(config, 0))
    runner.init_kv_cache()
    return runner


class Blocks:
    """Plays the scheduler for hand-made steps: hands out KV block ids in a scrambled order (so block tables are
    not contiguous) and turns each step's (seq, start, num_new_tokens) items into a SchedulerOutput of diffs
    against the rows the runner holds. Rows missing from a step leave the batch; new ones join at the end."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size
        self.rows: list[Sequence] = []
        self.sampled: list[Sequence] = []  # the last step's sampling rows, in order (its logits' order)
        self._sampled_lengths: list[int] = []

    def cover(self, seq: Sequence, num_tokens: int) -> list[int]:
        start = len(seq.block_table)
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self.free.pop())
        return seq.block_table[start:]

    def output(self, items) -> SchedulerOutput:
        work = {seq.request_id: (start, n) for seq, start, n in items}
        out = SchedulerOutput(new_token_ids=np.array(
            [seq.token_ids[n] if seq.num_tokens > n else 0 for seq, n in zip(self.sampled, self._sampled_lengths)],
            dtype=np.int64))  # the token the test appended to each sampling row (0: none)
        unfed = {seq.request_id for seq, n in zip(self.sampled, self._sampled_lengths) if seq.num_tokens == n}
        # a row leaves when it is not in the step, or when it sampled and got no token (then it joins again)
        out.finished_ids = [seq.request_id for seq in self.rows
                            if seq.request_id not in work or seq.request_id in unfed]
        self.rows = [seq for seq in self.rows if seq.request_id not in out.finished_ids]
        for seq, start, n in items:
            if seq in self.rows:
                new_ids = self.cover(seq, start + n)
                if new_ids:
                    out.new_block_ids.append((self.rows.index(seq), new_ids))
            else:
                self.cover(seq, start + n)
                self.rows.append(seq)
                out.new_seqs.append(NewSequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens,
                                                seq.sampling_params, list(seq.block_table)))
        out.num_computed_tokens = np.array([work[seq.request_id][0] for seq in self.rows], dtype=np.int64)
        out.num_scheduled_tokens = np.array([work[seq.request_id][1] for seq in self.rows], dtype=np.int64)
        out.samples = out.num_computed_tokens + out.num_scheduled_tokens == [seq.num_tokens for seq in self.rows]
        out.num_batched_tokens = int(out.num_scheduled_tokens.sum())
        self.sampled = [seq for seq, samples in zip(self.rows, out.samples) if samples]
        self._sampled_lengths = [seq.num_tokens for seq in self.sampled]
        return out


def make_seq(name: str, token_ids: list[int]) -> Sequence:
    return Sequence(name, token_ids, SamplingParams(temperature=0.0), max_tokens=64)


def random_ids(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_step(runner, blocks: Blocks, items) -> torch.Tensor:
    """items: (seq, start_pos, num_new_tokens) in row order; returns the logits of the rows that sample, in the
    order of blocks.sampled. `runner` is anything with run_model(SchedulerOutput)."""
    logits = runner.run_model(blocks.output(items))
    assert logits.dtype == torch.float32
    assert logits.shape[0] == len(blocks.sampled)
    return logits


@torch.inference_mode()
def hf_last_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0, -1].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(ours.cpu(), ref, atol=1e-4 * scale, rtol=1e-4)


def check_rows(model_dir: str, logits: torch.Tensor, seqs: list[Sequence]) -> None:
    assert logits.shape[0] == len(seqs)
    for row, seq in enumerate(seqs):
        assert_logits_close(logits[row], hf_last_logits(model_dir, seq.token_ids))


def greedy_next(model_dir: str, seq: Sequence) -> None:
    seq.token_ids.append(int(hf_last_logits(model_dir, seq.token_ids).argmax()))


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
            greedy_next(model_dir, seq)
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
    b.token_ids.append(7)
    check_rows(model_dir, run_step(runner, blocks, [(b, b.num_tokens - 1, 1)]), [b])
    runner.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prefill_chunks_and_decodes(arch, tiny_models):
    model_dir = tiny_models[arch]
    runner = make_runner(model_dir, block_size=16)
    blocks = Blocks(96, 16, seed=2)
    d1, d2 = make_seq("d1", random_ids(5, seed=20)), make_seq("d2", random_ids(17, seed=21))
    run_step(runner, blocks, [(d1, 0, 5), (d2, 0, 17)])
    d1.token_ids.append(11)
    d2.token_ids.append(12)
    p1 = make_seq("p1", random_ids(40, seed=22))  # two chunks: 0..19 now, the rest below
    p2 = make_seq("p2", random_ids(9, seed=23))
    logits = run_step(runner, blocks, [(d1, 5, 1), (p1, 0, 20), (d2, 17, 1), (p2, 0, 9)])
    check_rows(model_dir, logits, [d1, d2, p2])
    d1.token_ids.append(13)
    logits = run_step(runner, blocks, [(p1, 20, 20), (d1, 6, 1)])
    assert blocks.sampled == [d1, p1]  # row order: d1 joined the batch first
    check_rows(model_dir, logits, [d1, p1])
    runner.shutdown()


def test_execute_samples_greedy_tokens(tiny_models):
    model_dir = tiny_models["qwen3"]
    runner = make_runner(model_dir)
    blocks = Blocks(96, 4)
    seqs = [make_seq("x", random_ids(6, seed=30)), make_seq("y", random_ids(3, seed=31))]
    out = runner.execute(blocks.output([(seq, 0, seq.num_tokens) for seq in seqs]))
    assert out.token_ids.tolist() == [int(hf_last_logits(model_dir, s.token_ids).argmax()) for s in seqs]
    runner.shutdown()


def test_kv_blocks_from_cpu_budget(tiny_models):
    config = make_config(tiny_models["qwen3"], num_blocks=None, cpu_kvcache_space_gib=0.001)
    runner = ModelRunner(config, pick_device(config, 0))
    # 2 (k, v) * 2 layers * block 4 * 2 kv heads * head_dim 16 * 4 bytes = 2048 bytes a block
    assert runner.init_kv_cache() == int(0.001 * 2 ** 30) // 2048
    assert config.num_kvcache_blocks is None  # returned, not written into the config
    assert tuple(runner.kv_cache.shape) == (2, 2, int(0.001 * 2 ** 30) // 2048, 4, 2, 16)
    layer = runner.attention_layers[1]
    assert layer.k_cache.data_ptr() == runner.kv_cache[0, 1].data_ptr()
    runner.shutdown()


# ---- CUDA graph bucket choice and padded replay (CPU emulation of the graphs) ----
def test_decode_buckets_and_fallback():
    assert decode_buckets(256)[:7] == [1, 2, 4, 8, 16, 32, 48] and decode_buckets(256)[-1] == 256
    assert decode_buckets(100)[-3:] == [80, 96, 100]
    assert decode_buckets(3) == [1, 2, 3]
    buckets = decode_buckets(64)
    assert [pick_bucket(buckets, b) for b in (1, 3, 5, 16, 17, 64, 65)] == [1, 4, 8, 16, 32, 64, None]
    assert fits_graph(buckets, max_blocks=8, batch_size=20, table_width=8)
    assert not fits_graph(buckets, 8, 65, 8)  # batch bigger than the largest graph
    assert not fits_graph(buckets, 8, 20, 9)  # block table wider than the captured one
    assert not fits_graph(buckets, 8, 0, 4)  # (a prefill step: CUDAGraphRunner.can_run, test_cuda_graph.py)


class _EagerGraph:
    """Stands in for a captured torch.cuda.CUDAGraph: replay runs the model on the static buffers."""

    def __init__(self, runner: CUDAGraphRunner, bucket: int):
        self.runner, self.bucket = runner, bucket

    def replay(self):
        self.runner._forward(self.bucket)


def test_graph_replay_pads_rows_harmlessly(tiny_models):
    model_dir = tiny_models["llama"]
    runner = make_runner(model_dir, max_num_seqs=8)
    graphs = CUDAGraphRunner(runner.model, runner.backend, 8, runner.max_blocks_per_seq, 256, 64, torch.float32,
                             runner.device)
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
            greedy_next(model_dir, seq)
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
        greedy_next(model_dir, seq)
    late = make_seq("late", random_ids(6, seed=90))
    logits = run_step(runner, blocks, [(seqs[0], 1, 1), (late, 0, 6), (seqs[1], 8, 1), (seqs[2], 7, 1)])
    check_rows(model_dir, logits, blocks.sampled)
    assert blocks.sampled == [seqs[0], seqs[1], seqs[2], late]
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
