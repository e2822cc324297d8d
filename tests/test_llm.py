"""The offline engine against HF transformers: greedy tokens must be equal, whatever the batching."""
import random

import pytest
import torch
from hf_reference import hf_greedy, hf_logprobs

from nanoserve import SamplingParams

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def random_prompts(lengths, vocab=1000, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# 1 token, odd, exactly one block, exactly two blocks, longer
MIXED_LENGTHS = [1, 5, BLOCK, 2 * BLOCK, 37]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_greedy_matches_hf_for_mixed_batch(tiny_models, make_llm, arch):
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir, kvcache_block_size=BLOCK)
    prompts = random_prompts(MIXED_LENGTHS)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model_dir, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"
        assert out.num_prompt_tokens == len(prompt)


def test_output_independent_of_batch_composition(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    prompts = random_prompts([3, 11, 20, 9], seed=1)
    together = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone


def test_chunked_prefill_matches_hf(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = random_prompts([45, 3, 30, 17], seed=2)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.token_ids == hf_greedy(qwen3_dir, prompt, GREEDY.max_tokens)


def test_forced_preemption_matches_hf(qwen3_dir, make_llm):
    # 6 sequences of ~2-4 blocks each compete for 12 blocks: decode must preempt and recompute.
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=12)
    prompts = random_prompts([10, 14, 9, 12, 15, 11], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(qwen3_dir, prompt, params.max_tokens)


def test_prefix_cache_cuts_computed_prompt_tokens(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    shared = random_prompts([3 * BLOCK], seed=4)[0]
    prompts = [shared + tail for tail in random_prompts([5, 2, 9], seed=5)]
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    computed_before = llm.stats()["prompt_tokens_computed"]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= 2 * 3 * BLOCK
    assert stats["prompt_tokens_computed"] - computed_before <= sum(len(p) for p in prompts[1:]) - 2 * 3 * BLOCK
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(qwen3_dir, prompt, GREEDY.max_tokens)
    assert all(out.num_cached_tokens == 3 * BLOCK for out in rest)


def test_fully_cached_prompt_still_computes_a_token(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    prompt = random_prompts([2 * BLOCK], seed=6)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.token_ids == second.token_ids == hf_greedy(qwen3_dir, prompt, GREEDY.max_tokens)
    assert second.num_cached_tokens == BLOCK  # the last block is never taken from the cache


def test_prefix_caching_off_gives_same_tokens(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, enable_prefix_caching=False)
    prompt = random_prompts([2 * BLOCK + 3], seed=7)[0]
    outs = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert outs[0].token_ids == outs[1].token_ids == hf_greedy(qwen3_dir, prompt, GREEDY.max_tokens)
    assert llm.stats()["prefix_cache_hit_tokens"] == 0


def test_text_prompt_and_stop_conditions(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir)
    reference = llm.generate("The license says", GREEDY, use_tqdm=False)[0]
    stop_token = reference.token_ids[4]
    by_token = llm.generate("The license says", SamplingParams(temperature=0.0, max_tokens=12,
                                                               stop_token_ids=[stop_token]), use_tqdm=False)[0]
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == reference.token_ids[:reference.token_ids.index(stop_token) + 1]
    stop_text = reference.text[len(reference.text) // 2:][:3]
    if stop_text:
        by_text = llm.generate("The license says", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop_text],
                                                                  ignore_eos=True), use_tqdm=False)[0]
        assert by_text.finish_reason == "stop"
        assert by_text.text == reference.text[:reference.text.index(stop_text)]


def test_eos_stops_unless_ignored(qwen3_dir, make_llm, monkeypatch):
    from nanoserve.engine import llm_engine

    prompt = random_prompts([6], seed=8)[0]
    reference = hf_greedy(qwen3_dir, prompt, 12)
    monkeypatch.setattr(llm_engine, "eos_token_ids", lambda config, tokenizer: {reference[3]})
    llm = make_llm(qwen3_dir)  # the 4th greedy token acts as EOS: for the stop check and min_tokens' ban
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == reference[:4]
    ignored = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ignored[0].finish_reason == "length" and ignored[0].token_ids == reference
    min_tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
                              use_tqdm=False)[0]
    assert len(min_tokens.token_ids) >= 6 and reference[3] not in min_tokens.token_ids[:6]


def test_cumulative_logprob_matches_hf(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir)
    prompt = random_prompts([7], seed=9)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    reference = hf_logprobs(qwen3_dir, prompt, out.token_ids)
    expected = sum(float(lp[t]) for lp, t in zip(reference, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    for step, (lp, token) in enumerate(zip(reference, out.token_ids)):
        top3 = torch.topk(lp, 3).indices.tolist()
        assert set(top3) <= set(out.logprobs[step]), "top-3 logprobs missing"
        assert out.logprobs[step][token] == pytest.approx(float(lp[token]), abs=1e-3)


def test_streaming_engine_api_and_abort(qwen3_dir, make_llm):
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK).engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", random_prompts([20], seed=10)[0], params)
    engine.add_request("b", "Hello there", params)
    text, token_ids, outputs = "", [], []
    for step in range(100):
        if step == 3:
            assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
            assert engine.abort_request("a")
            assert not engine.abort_request("missing")
        outputs = engine.step()
        for out in outputs:
            if out.request_id == "b":
                text += out.text_delta
                token_ids += out.new_token_ids
            else:
                assert out.finish_reason == ("abort" if out.finished else None)
        if not engine.has_unfinished_requests():
            break
    assert out.finished and out.finish_reason == "length" and len(token_ids) == 30
    assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_abort_all_recovers_from_a_step_that_failed_half_way(qwen3_dir, make_llm):
    """The forward raises after the runner applied the step's diffs: abort_all() leaves the scheduler and the
    runner in step again, and the next requests get HF's tokens."""
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    engine, prompts = llm.engine, random_prompts([5, 9], seed=13)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, GREEDY)
    engine.step()
    engine.step()  # a prefill and a decode: the runner's batch holds both rows

    def failing(inputs):
        raise RuntimeError("the forward failed")
    runner = engine.executor.runner
    runner.hidden_states = failing
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    del runner.hidden_states  # the method again
    assert sorted(engine.abort_all()) == ["a0", "a1"] and not engine.has_unfinished_requests()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out.token_ids for out in outputs] == [hf_greedy(qwen3_dir, p, GREEDY.max_tokens) for p in prompts]


def test_streamed_prompt_logprobs_survive_a_step_that_failed_after_the_first_token(qwen3_dir, make_llm):
    """The step that sampled the first token fails in the output processor, after the prompt logprobs were
    filled in and before the output was made: after fail_and_recover the stream still gets them, once, equal to
    an undisturbed run's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    prompt = random_prompts([7], seed=5)[0]
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK, async_scheduling=False).engine  # (a step that samples)
    expected = run_engine(engine, [("calm", prompt, params, True)])["calm"][0].prompt_logprobs
    engine.add_request("hit", prompt, params, stream=True)
    detokenizer = engine.output_processor.requests["hit"].detokenizer
    add_token = detokenizer.add_token

    def fails_once(token_id):
        detokenizer.add_token = add_token
        raise RuntimeError("the detokenizer failed")
    detokenizer.add_token = fails_once
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        engine.step()
    assert engine.fail_and_recover([]) == []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    sent = [out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None]
    assert expected is not None and sent == [expected]


def run_engine(engine, requests) -> dict[str, list]:
    """requests: (request_id, prompt, params, stream); steps until all finish -> outputs per request."""
    for request_id, prompt, params, stream in requests:
        engine.add_request(request_id, prompt, params, stream=stream)
    outputs = {request_id: [] for request_id, *_ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_final_only_requests_equal_streamed_ones_in_one_batch(qwen3_dir, make_llm):
    """stream=False: one output at the end with every token and the whole text, equal to what the same request
    streams, while streamed, stopping and length-limited requests share the batch."""
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK).engine
    prompts = random_prompts([5, 9, 13, 3], seed=12)
    reference = run_engine(engine, [(f"ref{i}", p, GREEDY, True) for i, p in enumerate(prompts)])
    stop_token = reference["ref1"][4].new_token_ids[0]
    stop_text = "".join(out.text_delta for out in reference["ref2"])[6:9]
    cases = [  # (params, logprobs?) per prompt
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_text] if stop_text else []),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    ]
    requests = [(f"{kind}{i}", p, sp, kind == "s") for i, (p, sp) in enumerate(zip(prompts, cases)) for kind in "sf"]
    outputs = run_engine(engine, requests)
    for i in range(len(prompts)):
        streamed, (final,) = outputs[f"s{i}"], outputs[f"f{i}"]  # final-only: exactly one output
        assert final.finished and final.finish_reason == streamed[-1].finish_reason
        assert final.new_token_ids == [t for out in streamed for t in out.new_token_ids]
        assert final.text_delta == "".join(out.text_delta for out in streamed)
        assert final.num_output_tokens == streamed[-1].num_output_tokens == len(final.new_token_ids)
        assert final.new_logprobs == [lp for out in streamed for lp in out.new_logprobs]
        if i < 2:  # looked at only near a stop: no cumulative logprob (as vLLM without logprobs)
            assert final.cumulative_logprob is None
        else:  # stop strings and logprobs are looked at every step
            assert final.cumulative_logprob == pytest.approx(streamed[-1].cumulative_logprob)
    assert len(outputs["f0"][0].new_token_ids) == 7 and outputs["f1"][0].finish_reason == "stop"
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborted_final_only_request_returns_what_it_generated(qwen3_dir, make_llm, async_scheduling):
    engine = make_llm(qwen3_dir, async_scheduling=async_scheduling).engine
    engine.add_request("f", "Hello there", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                       stream=False)
    for _ in range(4):
        assert engine.step() == []
    engine.abort_request("f")
    (out,) = engine.step()
    generated = 3 if async_scheduling else 4  # async: the 4th step's token was still on the device, and is dropped
    assert out.finish_reason == "abort" and len(out.new_token_ids) == out.num_output_tokens == generated
    assert out.text_delta == engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([5] * 10, SamplingParams(max_tokens=5000), "max_tokens"),
    ([10**9], SamplingParams(max_tokens=4), "prompt"),
    ([5] * 300, SamplingParams(max_tokens=4), "prompt"),  # longer than max_model_len
    ("word " * 400, SamplingParams(max_tokens=4), "prompt"),
])
def test_bad_requests_are_rejected(qwen3_dir, make_llm, prompt, params, field):
    llm = make_llm(qwen3_dir, max_model_len=256)
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_request_that_never_fits_the_pool_is_rejected(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=4, max_model_len=512)
    with pytest.raises(ValueError):
        llm.generate([[5] * 20], SamplingParams(max_tokens=40), use_tqdm=False)


def test_unknown_engine_argument(qwen3_dir):
    from nanoserve import LLM

    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(qwen3_dir, max_num_seq=4)


@pytest.mark.parametrize("device, gpu_index", [("cpu", None), ("cuda", None), ("cuda:1", 1)])
def test_device_names_a_gpu(qwen3_dir, device, gpu_index):
    from nanoserve.config import EngineConfig

    config = EngineConfig.from_kwargs(qwen3_dir, device=device)
    assert (config.device_type, config.gpu_index) == (device.split(":")[0], gpu_index)
    assert config.attention_backend == ("torch" if device == "cpu" else "triton")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cpu:0"])
def test_bad_device_is_rejected(qwen3_dir, device):
    from nanoserve.config import EngineConfig

    with pytest.raises(ValueError, match="device"):
        EngineConfig.from_kwargs(qwen3_dir, device=device)


def test_default_max_tokens_does_not_truncate_at_16(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 64 - 3 and out.finish_reason == "length"


def test_triton_attention_backend_matches_torch(qwen3_dir, make_llm):
    """Under TRITON_INTERPRET=1 (set by conftest) the Triton kernels run on the CPU."""
    prompts = random_prompts([1, 19, 2 * BLOCK], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    by_backend = {}
    for backend in ("torch", "triton"):
        llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, attention_backend=backend, num_kvcache_blocks=32,
                       max_num_batched_tokens=24)  # 24 splits the prompts: chunked prefill on a cached prefix
        by_backend[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert by_backend["triton"] == by_backend["torch"]
    assert by_backend["torch"] == [hf_greedy(qwen3_dir, p, params.max_tokens) for p in prompts]
