"""Tensor parallelism on CPU (gloo): tp=2 gives the logits of tp=1, the engine over two ranks HF's tokens, and
shutdown leaves no process behind."""
from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import torch
from hf_reference import hf_greedy
from test_model_runner import Blocks, make_config, make_runner, make_seq, random_ids, run_step
from test_parallel_sampling import check_prompt_logprobs, hf_prompt_logprobs

from nanoserve import SamplingParams
from nanoserve.distributed import is_distributed
from nanoserve.engine.executor import Executor


def _steps(runner) -> list[torch.Tensor]:
    """Batched prefill, two decode steps, then a chunked prefill mixed with decodes."""
    blocks = Blocks(96, 4, seed=7)
    seqs = [make_seq(f"tp{i}", random_ids(n, seed=60 + i)) for i, n in enumerate((1, 4, 11))]
    out = [run_step(runner, blocks, [(s, 0, s.num_tokens) for s in seqs])]
    for step in range(2):
        for row, seq in enumerate(seqs):
            seq.token_ids.append(int(out[-1][row].argmax()))
        out.append(run_step(runner, blocks, [(s, s.num_tokens - 1, 1) for s in seqs]))
    long = make_seq("long", random_ids(14, seed=70))
    out.append(run_step(runner, blocks, [(long, 0, 6), (seqs[0], seqs[0].num_tokens - 1, 1)]))
    seqs[0].token_ids.append(3)
    out.append(run_step(runner, blocks, [(seqs[0], seqs[0].num_tokens - 1, 1), (long, 6, 8)]))
    return out


class AllRanks:
    """run_model on every rank through the executor; rank 0's logits."""

    def __init__(self, executor: Executor):
        self.executor = executor

    def run_model(self, out):
        return self.executor.call("run_model", out)


def test_tp2_matches_tp1_and_shuts_down_cleanly(tiny_models):
    model_dir = tiny_models["qwen3"]  # 4 heads, 2 kv heads: one kv head per rank
    single = make_runner(model_dir)
    expected = _steps(single)
    single.shutdown()

    executor = Executor(make_config(model_dir, tensor_parallel_size=2))
    try:
        runner = executor.runner
        assert is_distributed() and runner.attention_layers[0].num_kv_heads == 1
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.packed_weight.shape[0] == (2 + 1 + 1) * 16  # this rank's shard, as the CPU matmul reads it
        assert executor.num_kv_blocks == 96
        got = _steps(AllRanks(executor))
        procs = list(executor.procs)
        assert all(p.is_alive() for p in procs)
        if sys.platform.startswith("linux"):  # named for top / ps -e
            assert [Path(f"/proc/{p.pid}/comm").read_text().strip() for p in procs] == ["ns-tp1"]
    finally:
        executor.shutdown()
    for ours, ref in zip(got, expected):
        torch.testing.assert_close(ours, ref, atol=1e-4 * max(1.0, float(ref.abs().max())), rtol=1e-4)
    assert not any(p.is_alive() for p in procs)
    assert multiprocessing.active_children() == []
    assert not is_distributed()


def test_tp2_engine_matches_hf(qwen3_dir, make_llm):
    """The engine over two ranks: the workers' batches follow the scheduler's diffs (the tokens rank 0 sampled
    reach them with the next step), with chunked prefill and decodes in one batch; two samples of a prompt that
    asks for prompt logprobs (every rank computes their logits)."""
    llm = make_llm(qwen3_dir, tensor_parallel_size=2, kvcache_block_size=4, max_num_batched_tokens=16)
    prompts = [random_ids(n, seed=80 + n) for n in (3, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    samples = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2, prompt_logprobs=2)
    outputs = llm.generate(prompts, [params, samples, params], use_tqdm=False)
    assert [out.token_ids for out in outputs] == [hf_greedy(qwen3_dir, p, 6) for p in prompts]
    assert outputs[1].outputs[1].token_ids == outputs[1].token_ids
    check_prompt_logprobs(hf_prompt_logprobs(qwen3_dir, prompts[1]), prompts[1], outputs[1].prompt_logprobs, 2)
