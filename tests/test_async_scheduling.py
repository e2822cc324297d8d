"""Async scheduling (the async_scheduling engine argument): the engine schedules and prepares step N+1 while step N
runs, counting N's tokens as placeholders. Every request's outputs are the synchronous engine's, field by field
and in order (aborts, n samples, stop strings, EOS, max_tokens, preemption, prefix caching, structured outputs,
prompt logprobs, max_tokens 0), and no KV block leaks."""
import dataclasses
from itertools import compress

import numpy as np
import pytest
from device import ON_CUDA, engine_defaults
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.simulated_device import ENV_STEP_MS
from nanoserve.sampling_params import SamplingParams

SHARED = "The licence grants you the right to use, copy and modify the software, provided that "  # > 1 block
REQUESTS = {
    "greedy": (SHARED + "you", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)),
    "shared": (SHARED + "they", SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)),  # prefix cache
    "seeded": ("Héllo wörld", SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=1)),
    "stop": ("def main():", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["e"])),
    "stop_ids": ("Once upon", SamplingParams(temperature=1.0, seed=5, max_tokens=30, stop_token_ids=[7, 11, 13])),
    # the tiny test model's EOS is token 2 (its config.json's eos_token_id), made likely here
    "eos": ("A", SamplingParams(temperature=1.0, seed=11, max_tokens=40, min_tokens=3, logit_bias={2: 10.0})),
    "samples": ("  spaces   and\ttabs", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12,
                                                          ignore_eos=True, prompt_logprobs=1)),
    "ids": ([5, 17, 99, 3], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    "grammar": ("Once upon", SamplingParams(temperature=0.7, seed=1, max_tokens=12,
                                            structured_outputs={"regex": "[a-z]+( [a-z]+)+"})),
    "scored": ("The licence", SamplingParams(max_tokens=0, prompt_logprobs=1)),
    "endless": ("Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
    "penalized": ("Héllo", SamplingParams(temperature=0.9, seed=2, max_tokens=16, ignore_eos=True,
                                          repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4)),
}
LATE = {  # added after the first requests have run a few steps: admitted beside running ones, a cached prefix
    "late": (SHARED + "we", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
    "late_whole": ("Héllo", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1)),
}


def engine_config(qwen3_dir, **overrides) -> EngineConfig:
    args = dict(max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=16, max_num_seqs=16)
    return EngineConfig.from_kwargs(qwen3_dir, **{**engine_defaults(), **args, **overrides})


def run(engine: LLMEngine, abort_after: int, late_at: int = 3) -> dict:
    """Every request stepped to the end ("endless" aborted once it has abort_after outputs, as a client would
    abort; LATE added after late_at steps): per request and sample, its outputs in order, each as a tuple of its
    fields."""
    for request_id, (prompt, params) in REQUESTS.items():
        engine.add_request(request_id, prompt, params)
    per_sample, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():  # (async_scheduling: every output from the next step)
            fields = tuple(getattr(output, name) for name in RequestOutput.__dataclass_fields__)
            per_sample.setdefault((output.request_id, output.index), []).append(fields)
        steps += 1
        if len(per_sample.get(("endless", 0), ())) == abort_after:
            engine.abort_request("endless")
        if steps == late_at:
            engine.add_request("late", *LATE["late"])
            engine.add_request("late_whole", *LATE["late_whole"], stream=False)
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_total_blocks, "a KV block leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.scheduled
    return per_sample


def outputs_of(config: EngineConfig, abort_after: int) -> dict:
    engine = LLMEngine(config)
    try:
        return run(engine, abort_after)
    finally:
        engine.shutdown()


# what preemption may change: a prompt computed again after a preemption gives its logits in a prefill, whose
# floats differ from a decode's in the last bits (the synchronous engine's logprobs under 14 blocks differ from
# its own under 64 the same way), and a resumed request's num_cached_tokens is its last admission's
FLOAT_FIELDS = ("cumulative_logprob", "new_logprobs")
INDEX = {name: index for index, name in enumerate(RequestOutput.__dataclass_fields__)}


def without_preemption_effects(outputs: dict) -> tuple[dict, dict]:
    """(every field but the ones preemption may change, those fields' floats rounded to 4 places)"""
    exact = {key: [tuple(value for name, value in zip(INDEX, output) if name not in FLOAT_FIELDS
                         and name != "num_cached_tokens") for output in sample] for key, sample in outputs.items()}
    floats = {key: [(round(output[INDEX["cumulative_logprob"]] or 0.0, 4),
                     [{token: round(logprob, 4) for token, logprob in entry.items()}
                      for entry in output[INDEX["new_logprobs"]]]) for output in sample]
              for key, sample in outputs.items()}
    return exact, floats


def assert_same_but_the_floats(outputs: dict, reference: dict) -> None:
    exact, floats = without_preemption_effects(outputs)
    reference_exact, reference_floats = without_preemption_effects(reference)
    assert exact == reference_exact
    for key, sample in floats.items():
        for (cumulative, entries), (reference_cumulative, reference_entries) in zip(sample, reference_floats[key]):
            assert cumulative == pytest.approx(reference_cumulative, abs=1e-3)
            for entry, reference_entry in zip(entries, reference_entries):
                assert entry.keys() == reference_entry.keys()
                assert list(entry.values()) == pytest.approx(list(reference_entry.values()), abs=1e-3)


@pytest.mark.parametrize("abort_after", [1, 6])
def test_async_outputs_are_the_synchronous_ones(qwen3_dir, abort_after):
    """Field by field on the CPU; on a GPU a matmul's floats may depend on the batch's size, which a row that
    computes in vain changes."""
    sync = outputs_of(engine_config(qwen3_dir, async_scheduling=False), abort_after)
    async_ = outputs_of(engine_config(qwen3_dir, async_scheduling=True), abort_after)
    if ON_CUDA:
        assert_same_but_the_floats(async_, sync)
    else:
        assert async_ == sync
    reasons = {request_id: outputs[-1][INDEX["finish_reason"]] for (request_id, _), outputs in sync.items()}
    assert reasons["endless"] == "abort" and reasons["stop"] == "stop" and reasons["eos"] == "stop"


@pytest.mark.parametrize("abort_after", [1, 6])
def test_async_outputs_under_preemption_are_the_synchronous_ones(qwen3_dir, abort_after):
    """14 KV blocks: requests are preempted (where, differs: a row that finished at step N still runs in N+1)."""
    sync = outputs_of(engine_config(qwen3_dir, num_kvcache_blocks=14, async_scheduling=False), abort_after)
    async_ = outputs_of(engine_config(qwen3_dir, num_kvcache_blocks=14, async_scheduling=True), abort_after)
    assert_same_but_the_floats(async_, sync)


def test_async_preempts_and_caches_prefixes(qwen3_dir):
    """The workload above does what it says: under 14 blocks it preempts, with 64 it hits the prefix cache."""
    for kv_blocks, stat in ((14, "num_preemptions"), (64, "prefix_cache_hit_tokens")):
        engine = LLMEngine(engine_config(qwen3_dir, num_kvcache_blocks=kv_blocks, async_scheduling=True))
        try:
            run(engine, 6)
            assert engine.stats()[stat] > 0
        finally:
            engine.shutdown()


def test_async_on_the_simulated_device_gives_each_step_the_tokens_before_it(qwen3_dir, monkeypatch):
    """On the simulated device (random ids, a device that runs one step at a time) a row's input at step N+1 is
    the id step N sampled for it, taken without waiting for N: the engine's sequences hold what was fed."""
    monkeypatch.setenv(ENV_STEP_MS, "0.01")
    engine = LLMEngine(engine_config(qwen3_dir, async_scheduling=True))
    fed = []
    runner = engine.executor.runner
    prepare = runner.batch.prepare

    def spy(out):
        inputs = prepare(out)
        fed.append((list(runner.batch.req_ids), out, inputs))
        return inputs
    try:
        runner.batch.prepare = spy
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        for index in range(4):
            engine.add_request(f"r{index}", [3 + index] * (5 + 7 * index), params)
        tokens = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        assert all(len(t) == 30 for t in tokens.values())
    finally:
        engine.shutdown()
    # the launched input ids (patched in place after prepare) are each row's prompt + output tokens
    expected = {f"r{index}": [3 + index] * (5 + 7 * index) + tokens[f"r{index}"] for index in range(4)}
    for req_ids, out, inputs in fed:
        counts, computed = out.num_scheduled_tokens, out.num_computed_tokens
        starts = np.cumsum(counts[counts > 0]) - counts[counts > 0]
        for request_id, start, first, count in zip(np.array(req_ids)[counts > 0], starts, computed[counts > 0],
                                                    counts[counts > 0]):
            assert inputs.input_ids[start:start + count].tolist() == expected[request_id][first:first + count]


def test_async_scheduling_refuses_what_it_cannot_run(qwen3_dir):
    with pytest.raises(ValueError, match="^async_scheduling: not with speculative decoding"):
        engine_config(qwen3_dir, async_scheduling=True, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="^async_scheduling: runs on one device"):
        engine_config(qwen3_dir, async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="^async_scheduling: expected a boolean"):
        engine_config(qwen3_dir, async_scheduling="maybe")
    assert engine_config(qwen3_dir, async_scheduling="true").async_scheduling is True
    assert engine_config(qwen3_dir, async_scheduling="off").async_scheduling is False


def test_async_scheduling_is_on_by_default_where_a_device_computes_apart_from_the_host(qwen3_dir, monkeypatch):
    """On cuda and the simulated device, but off (not an error) with speculative decoding or tensor parallelism;
    off on cpu, where the forward is the host's own work."""
    monkeypatch.delenv(ENV_STEP_MS, raising=False)
    assert engine_config(qwen3_dir, device="cpu").async_scheduling is False
    assert engine_config(qwen3_dir, device="cuda", async_scheduling="none").async_scheduling is True
    monkeypatch.setenv(ENV_STEP_MS, "2")
    assert engine_config(qwen3_dir, device="cpu").async_scheduling is True
    for not_one_device in ({"speculative_config": {"method": "ngram"}}, {"tensor_parallel_size": 2}):
        assert engine_config(qwen3_dir, device="cpu", **not_one_device).async_scheduling is False


# ---- the scheduler's placeholder accounting, against the synchronous scheduler ----
@dataclasses.dataclass
class Config:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int = 64
    kvcache_block_size: int = 4


def sequences(spec) -> list[Sequence]:
    return [Sequence(f"s{i}", list(range(1, 1 + prompt_len)), SamplingParams(), max_tokens)
            for i, (prompt_len, max_tokens, _) in enumerate(spec)]


@settings(max_examples=60, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 12), st.integers(1, 14)), min_size=1,
                     max_size=6),
       num_blocks=st.integers(8, 40), budget=st.integers(4, 32), max_num_seqs=st.integers(1, 4),
       caching=st.booleans())
def test_placeholder_accounting_matches_the_synchronous_scheduler(spec, num_blocks, budget, max_num_seqs, caching):
    """Each sequence stops (as EOS would) after the number of tokens its spec says. The async scheduler, one step
    ahead, ends with every sequence holding the same tokens as the synchronous one, and every block free; at
    every schedule() its columns hold each running row's real tokens plus its placeholders."""
    results = []
    for async_scheduling in (False, True):
        config = Config(max_num_seqs, budget)
        blocks = BlockManager(num_blocks, config.kvcache_block_size, caching)
        scheduler = Scheduler(config, blocks, async_scheduling=async_scheduling)
        seqs = sequences(spec)
        stop_at = {seq.request_id: stop for seq, (_, _, stop) in zip(seqs, spec)}
        for seq in seqs:
            if -(-(seq.num_prompt_tokens + seq.max_tokens) // config.kvcache_block_size) > num_blocks:
                return  # could never fit (add_request refuses it)
            scheduler.add(seq)
        drive(scheduler, stop_at, async_scheduling)
        assert blocks.num_free_blocks == num_blocks
        results.append([(seq.token_ids, seq.finish_reason) for seq in seqs])
    assert results[0] == results[1]


def drive(scheduler: Scheduler, stop_at: dict[str, int], async_scheduling: bool) -> None:
    """Run the scheduler to the end, as the engine does; a sampled token is the sequence's length then."""
    in_flight = False
    for _ in range(1000):
        if not (scheduler.running or scheduler.waiting or in_flight):
            return
        out = scheduler.schedule()
        if not async_scheduling:
            finish(scheduler, scheduler.update(out, token_ids(compress(scheduler.running, out.samples))), stop_at)
            continue
        check_placeholders(scheduler)
        if in_flight:
            update_earliest(scheduler, stop_at)
        in_flight = bool(out.num_batched_tokens)
        if not in_flight:  # nothing to run: updated at once
            update_earliest(scheduler, stop_at)
    raise AssertionError("the scheduler did not finish")


def check_placeholders(scheduler: Scheduler) -> None:
    """Each running row's length column is its real tokens plus one per scheduled step that samples it."""
    for row, seq in enumerate(scheduler.running):
        placeholders = sum(any(s is seq for s in compress(step.seqs, step.out.samples)) for step in scheduler.scheduled)
        assert scheduler.columns[1, row] == seq.num_tokens + placeholders


def update_earliest(scheduler: Scheduler, stop_at: dict[str, int]) -> None:
    step = scheduler.scheduled[0]
    sampled, keep = scheduler.update_scheduled(token_ids(compress(step.seqs, step.out.samples)))
    assert [seq for seq, kept in zip(compress(step.seqs, step.out.samples), keep) if kept] == sampled.seqs
    finish(scheduler, sampled, stop_at)


def token_ids(seqs) -> np.ndarray:
    return np.array([seq.num_tokens for seq in seqs], dtype=np.int64)


def finish(scheduler: Scheduler, sampled, stop_at: dict[str, int]) -> None:
    # (the synchronous scheduler's arrays are views of its columns, which finish() shifts)
    for seq, num_tokens, max_num_tokens in zip(sampled.seqs, sampled.num_tokens.tolist(),
                                               sampled.max_num_tokens.tolist()):
        if seq.num_output_tokens >= stop_at[seq.request_id]:
            scheduler.finish(seq, "stop")
        elif num_tokens >= max_num_tokens:
            scheduler.finish(seq, "length")
    for seq in sampled.scored:
        scheduler.finish(seq, "length")



def test_async_outputs_with_lora_adapters_are_the_synchronous_ones(qwen3_dir, lora_adapters):
    """One adapter slot for two adapters and the base model: adapters are loaded into the slot while the step
    before runs."""
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(engine_config(qwen3_dir, enable_lora=True, max_loras=1, max_lora_rank=8,
                                         async_scheduling=async_scheduling))
        try:
            for name, path in lora_adapters["qwen3"].items():
                engine.add_lora(name, path)
            for index, lora_name in enumerate(["wide", None, "narrow", "wide", "narrow"]):
                engine.add_request(f"r{index}", "Héllo wörld", SamplingParams(
                    temperature=0, max_tokens=6 + index, ignore_eos=True, logprobs=1, lora_name=lora_name))
            outputs = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    outputs.setdefault(output.request_id, []).append(
                        (output.new_token_ids, output.new_logprobs, output.finish_reason))
            results.append(outputs)
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
        finally:
            engine.shutdown()
    assert results[1] == results[0]
