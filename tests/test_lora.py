"""Multi-LoRA against HF transformers + peft: requests with different adapters (different ranks and targets, rsLoRA)
and without one share steps, and each gets peft's greedy tokens; the batched LoRA matmul against a per-token
reference; adapter slots (max_loras, LRU of max_cpu_loras) under a hypothesis-driven scheduler; the prefix cache
never shares blocks across adapters; bad adapters and unknown lora_name are ValueErrors naming the field."""
from __future__ import annotations

import json
import os
import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_checks import has_unfinished
from hf_reference import hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_adapters import make_adapter, peft_greedy
from test_scheduler import step

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.input_batch import InputBatch
from nanoserve.engine.lora import LoRAAdapter, LoRASlots
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.lora import LoRABatch, StackedLoRA

N = 8  # tokens generated per request


def greedy(lora_name=None, max_tokens=N) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, lora_name=lora_name)


def prompts(lengths, seed=0, vocab=1000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def reference(model_dir: str, adapter_dir: str | None, prompt: list[int]) -> list[int]:
    if adapter_dir is None:
        return hf_greedy(model_dir, prompt, N)
    return peft_greedy(model_dir, adapter_dir, prompt, N)


def lora_llm(make_llm, model_dir, adapter_dirs: dict, **engine_args):
    args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "kvcache_block_size": 4, **engine_args}
    llm = make_llm(model_dir, **args)
    for name, path in adapter_dirs.items():
        llm.add_lora(name, path)
    return llm


# ---- the batched matmul --------------------------------------------------------------------------------
@pytest.mark.parametrize("make_linear", [lambda: QKVParallelLinear(32, 8, 4, 2),
                                         lambda: MergedColumnParallelLinear(32, [24, 24]),
                                         lambda: RowParallelLinear(24, 32)], ids=["qkv", "gate_up", "row"])
def test_stacked_lora_adds_each_tokens_adapter_delta(make_linear):
    torch.manual_seed(0)
    linear, max_rank, slots = make_linear(), 6, 3
    torch.nn.init.normal_(linear.weight)
    lora = StackedLoRA(linear, slots, max_rank)
    parts = [(shard, size) for shard, (_, size) in zip(lora.shard_ids, lora.parts)]
    deltas = {}  # slot -> full delta matrix [out, in] = concat over parts of B @ A
    for slot, rank in zip(range(slots), (6, 2, 4)):
        pieces = []
        for shard, size in parts:
            a, b = torch.randn(rank, linear.weight.shape[1]), torch.randn(size, rank)
            lora.load(slot, shard, a, b)
            pieces.append(b @ a)
        deltas[slot] = torch.cat(pieces)
    lora.clear(2)  # a cleared slot adds nothing
    deltas[2] = torch.zeros_like(deltas[2])
    token_slots = np.array([0, -1, 1, 1, 2, 0, -1, 1])
    x = torch.randn(len(token_slots), linear.weight.shape[1])
    linear.lora = lora
    y = linear(x, LoRABatch.of_tokens(token_slots, torch.device("cpu")))
    expected = torch.stack([x[t] @ linear.weight.T + (x[t] @ deltas[s].T if s >= 0 else 0)
                            for t, s in enumerate(token_slots.tolist())])
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)
    assert LoRABatch.of_tokens(np.full(4, -1), torch.device("cpu")) is None


# ---- the engine against peft -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_mixed_adapter_batch_matches_peft(tiny_models, lora_adapters, make_llm, arch):
    """Two adapters of different ranks and targets and the base model in one batch, with chunked prefill mixing
    prompt chunks of one adapter with decodes of another."""
    model_dir, paths = tiny_models[arch], lora_adapters[arch]
    llm = lora_llm(make_llm, model_dir, paths, max_num_batched_tokens=16)
    batch = prompts([13, 5, 21, 9, 7, 13], seed=1)
    names = ["wide", "narrow", None, "narrow", "wide", None]
    batch[5] = batch[0]  # the same prompt for an adapter and for the base model
    outputs = llm.generate(batch, [greedy(name) for name in names], use_tqdm=False)
    for prompt, name, out in zip(batch, names, outputs):
        assert out.token_ids == reference(model_dir, paths.get(name), prompt), name
        if name is not None:
            assert out.token_ids != hf_greedy(model_dir, prompt, N), f"{name} did not change the tokens"


@pytest.mark.slow
def test_tensor_parallel_shards_the_adapters_like_their_layers(qwen3_dir, lora_adapters, make_llm):
    """Two ranks (gloo): column-parallel layers keep their rows of B, row-parallel ones their columns of A, and
    the tokens are still peft's."""
    paths = lora_adapters["qwen3"]
    llm = lora_llm(make_llm, qwen3_dir, paths, tensor_parallel_size=2, max_num_batched_tokens=16)
    batch = prompts([11, 4, 7], seed=4)
    names = ["wide", None, "narrow"]
    outputs = llm.generate(batch, [greedy(name) for name in names], use_tqdm=False)
    assert [out.token_ids for out in outputs] == [reference(qwen3_dir, paths.get(name), prompt)
                                                  for prompt, name in zip(batch, names)]
    layer = llm.engine.executor.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora.b.shape[1] == (2 + 1 + 1) * 16  # this rank's q, k and v heads
    assert layer.mlp.down_proj.lora.a.shape[2] == 128 // 2


def test_one_slot_swaps_adapters_and_reloads_from_disk(qwen3_dir, lora_adapters, make_llm):
    """max_loras=1, max_cpu_loras=1: a request whose adapter cannot get the slot waits (the ones behind it,
    base or with the slot's adapter, go ahead), and every swap reads the adapter again."""
    paths = lora_adapters["qwen3"]
    llm = lora_llm(make_llm, qwen3_dir, paths, max_loras=1, max_cpu_loras=1)
    batch = prompts([6, 9, 4, 11, 7], seed=2)
    names = ["wide", "narrow", None, "wide", "narrow"]
    outputs = llm.generate(batch, [greedy(name) for name in names], use_tqdm=False)
    for prompt, name, out in zip(batch, names, outputs):
        assert out.token_ids == reference(qwen3_dir, paths.get(name), prompt), name
    store = llm.engine.executor.runner.loras
    assert list(store.cpu) == [llm.engine.loras["narrow"].id]


def test_prefix_cache_is_not_shared_across_adapters(qwen3_dir, lora_adapters, make_llm):
    llm = lora_llm(make_llm, qwen3_dir, lora_adapters["qwen3"])
    prompt = prompts([17], seed=3)[0]  # 4 full blocks of 4 tokens before the last token

    def cached_tokens(name):
        out = llm.generate([prompt], greedy(name, max_tokens=2), use_tqdm=False)[0]
        assert out.token_ids == reference(qwen3_dir, lora_adapters["qwen3"].get(name), prompt)[:2]
        return out.num_cached_tokens

    assert [cached_tokens(name) for name in ("wide", "narrow", None, "wide", "narrow", None)] == [0, 0, 0, 16, 16, 16]


# ---- errors --------------------------------------------------------------------------------------------
def test_unknown_lora_name_is_a_value_error_naming_it(qwen3_dir, lora_adapters, make_llm):
    llm = lora_llm(make_llm, qwen3_dir, {"wide": lora_adapters["qwen3"]["wide"]})
    with pytest.raises(ValueError, match=r"^lora_name: unknown LoRA adapter 'nope' \(known: wide\)"):
        llm.engine.add_request("r1", [5, 6], greedy("nope"))
    with pytest.raises(ValueError, match="^lora_name: an adapter named 'wide' is already"):
        llm.add_lora("wide", lora_adapters["qwen3"]["narrow"])
    plain = make_llm(qwen3_dir)
    with pytest.raises(ValueError, match="^lora_name: unknown LoRA adapter 'wide'.*without enable_lora"):
        plain.engine.add_request("r2", [5, 6], greedy("wide"))
    with pytest.raises(ValueError, match="^enable_lora:"):
        plain.add_lora("wide", lora_adapters["qwen3"]["wide"])
    with pytest.raises(ValueError, match="^lora_name: expected"):
        SamplingParams(lora_name="")
    assert not llm.engine.has_unfinished_requests() and not plain.engine.has_unfinished_requests()


def _edit_config(path: str, **changes) -> str:
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, **changes}, f)
    return path


@pytest.mark.parametrize("damage, message", [
    (lambda p: _edit_config(p, r=16), r"max_lora_rank: the adapter's rank r=16 exceeds max_lora_rank \(8\)"),
    (lambda p: _edit_config(p, use_dora=True, r=4), r"use_dora=True is not supported"),
    (lambda p: _edit_config(p, r=2, lora_alpha=4), r"'s LoRA weights have shapes .*, expected"),
    (lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")) or p, "no adapter_model.safetensors"),
    (lambda p: shutil.rmtree(p) or p, "no adapter_config.json"),
], ids=["rank", "dora", "shapes", "no weights", "no directory"])
def test_adapters_the_engine_cannot_run_are_rejected_when_added(qwen3_dir, lora_adapters, make_llm, tmp_path, damage,
                                                                 message):
    path = damage(shutil.copytree(lora_adapters["qwen3"]["wide"], tmp_path / "adapter"))
    llm = make_llm(qwen3_dir, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"^LoRA adapter 'bad': .*" + message):
        llm.add_lora("bad", str(path))


def test_an_adapter_of_the_embeddings_is_rejected(qwen3_dir, make_llm, tmp_path):
    path = make_adapter(qwen3_dir, str(tmp_path / "embed"), rank=4, targets=("embed_tokens", "q_proj"))
    llm = make_llm(qwen3_dir, enable_lora=True)
    with pytest.raises(ValueError, match="unsupported LoRA weight .*embed_tokens"):
        llm.add_lora("embed", path)


@pytest.mark.parametrize("args, message", [
    ({"max_loras": 0}, "max_loras: must be a positive integer"),
    ({"max_lora_rank": 513}, r"max_lora_rank: must be in \[1, 512\]"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras: must be >= max_loras \(4\)"),
])
def test_lora_engine_arguments_have_ranges(qwen3_dir, args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(qwen3_dir, device="cpu", enable_lora=True, **args)
    config = EngineConfig.from_kwargs(qwen3_dir, device="cpu", enable_lora="true", max_loras="3")
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 3, 16, 3)


# ---- the scheduler's adapter slots -----------------------------------------------------------------------
POOL = [LoRAAdapter(i, f"a{i}", f"/adapters/a{i}") for i in (1, 2, 3)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_loras=st.integers(1, 2), requests=st.lists(st.tuples(st.sampled_from([None, *POOL]), st.integers(1, 9),
                                                                st.integers(1, 4)), min_size=1, max_size=8))
def test_scheduler_runs_at_most_max_loras_adapters_and_loads_only_idle_slots(max_loras, requests):
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=32, kvcache_block_size=2,
                             enable_prefix_caching=True)
    scheduler = Scheduler(config, BlockManager(24, 2), LoRASlots(max_loras))
    scheduler.mirror = InputBatch(4, 32, 2)
    for i, (adapter, prompt_len, max_tokens) in enumerate(requests):
        prompt = [3 + i % 2] * prompt_len  # equal prompts of different adapters: the prefix cache must not mix them
        scheduler.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, adapter))
    device = [None] * max_loras  # what a runner's slots hold, from the diffs
    for _ in range(200):
        if not has_unfinished(scheduler):
            break
        out = step(scheduler)
        for slot, adapter in out.lora_loads:
            device[slot] = adapter
        # a slot is reloaded only when no row uses it any more: every row's slot holds the row's adapter
        mirror = scheduler.mirror  # its rows finished in this step leave with the next diffs
        rows = dict(zip(mirror.req_ids, mirror.slots.tolist()))
        for seq in scheduler.running:
            lora_slot = int(mirror.lora_slot[rows[seq.request_id]])
            assert (lora_slot == -1) if seq.lora is None else (device[lora_slot] == seq.lora), seq
        assert len({seq.lora for seq in scheduler.running if seq.lora is not None}) <= max_loras
        holders = {}  # KV block -> the adapters of the sequences holding it
        for seq in scheduler.running:
            for block_id in seq.block_table:
                holders.setdefault(block_id, set()).add(seq.lora)
        assert all(len(adapters) == 1 for adapters in holders.values()), holders
    assert not has_unfinished(scheduler)


def test_samples_and_structured_outputs_run_with_their_requests_adapter(qwen3_dir, lora_adapters, make_llm):
    """n = 2 greedy samples with an adapter both equal peft's tokens (a forked sample keeps the adapter), and a
    request with an adapter and a choice grammar gives one of the choices."""
    paths = lora_adapters["qwen3"]
    llm = lora_llm(make_llm, qwen3_dir, paths)
    [prompt] = prompts([7], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, lora_name="wide", n=2)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    expected = reference(qwen3_dir, paths["wide"], prompt)
    assert [sample.token_ids for sample in out.outputs] == [expected, expected]
    choices = ["alpha", "beta"]
    [out] = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=20, lora_name="narrow",
                                                  structured_outputs={"choice": choices}), use_tqdm=False)
    assert out.text in choices
