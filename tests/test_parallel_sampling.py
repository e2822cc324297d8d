"""Parallel sampling (n) and prompt logprobs in the engine and the offline API: the samples against each one run
alone and against HF, the prompt computed once (the scheduler's counts), aborts and preemption leaking no block;
prompt logprobs against HF transformers' log_softmax of the prompt logits, whatever the chunking."""
import pytest
import torch
from hf_reference import hf_greedy, hf_model
from test_llm import BLOCK, random_prompts

from nanoserve import SamplingParams

PROMPT = random_prompts([37], seed=21)[0]  # four full blocks of 8 and 5 more tokens
SHARED = 4 * BLOCK  # the full prompt blocks later samples share


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_differ_and_the_prompt_is_computed_once(qwen3_dir, make_llm, prefix_caching):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, enable_prefix_caching=prefix_caching)
    [out] = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert [sample.index for sample in out.outputs] == [0, 1, 2]
    assert len({tuple(sample.token_ids) for sample in out.outputs}) == 3
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text  # the first's
    stats = llm.stats()
    # the first sample computes the prompt; the others share its full blocks and compute the 5 tokens after them
    assert stats["prompt_tokens_computed"] == len(PROMPT) + 2 * (len(PROMPT) - SHARED)
    assert stats["prefix_cache_hit_tokens"] == 2 * SHARED


def test_seeded_samples_equal_each_seed_run_alone(qwen3_dir, make_llm):
    """Sample i has seed + i (vLLM's rule): the same tokens as a request with that seed alone, every time."""
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    params = SamplingParams(n=3, seed=1234, temperature=1.0, top_k=50, max_tokens=10, ignore_eos=True)
    samples = [s.token_ids for s in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    alone = [llm.generate([PROMPT], SamplingParams(seed=1234 + i, temperature=1.0, top_k=50, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)[0].token_ids for i in range(3)]
    assert samples == alone and len(set(map(tuple, samples))) == 3
    again = [s.token_ids for s in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    assert again == samples


def test_greedy_samples_equal_hf_even_when_preempted(qwen3_dir, make_llm):
    """Two prompts of n=3 greedy samples in a pool too small for all six: samples are preempted and recomputed,
    and every one equals HF's greedy continuation."""
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, num_kvcache_blocks=14)
    prompts = random_prompts([19, 12], seed=22)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(qwen3_dir, prompt, params.max_tokens)
        assert [s.token_ids for s in out.outputs] == [expected] * 3


def test_streamed_samples_and_abort_free_every_block(qwen3_dir, make_llm):
    """Streamed outputs carry their sample's index; `finished` comes once, on the last sample to end. Aborting
    the request ends every running sample at once (make_llm checks that no block is left)."""
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK).engine
    engine.add_request("short", PROMPT, SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("long", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError, match="^request_id: 'long' is already running"):
        engine.add_request("long", PROMPT, SamplingParams())
    outputs = []
    while not any(o.request_id == "short" and o.finished for o in outputs):
        outputs += engine.step()
    short = [o for o in outputs if o.request_id == "short"]
    assert {o.index for o in short} == {0, 1} and [o.finished for o in short].count(True) == 1
    assert [o.finish_reason for o in short if o.finish_reason] == ["length", "length"]
    assert short[-1].finished and engine.stats()["num_running"] == 3
    assert engine.abort_request("long") and not engine.abort_request("long")
    aborted = engine.step()
    assert sorted(o.index for o in aborted) == [0, 1, 2] and [o.finished for o in aborted] == [False, False, True]
    assert {o.finish_reason for o in aborted} == {"abort"} and not engine.has_unfinished_requests()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


@torch.inference_mode()
def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at each prompt position but the last: row j - 1 is the distribution of token j."""
    return torch.log_softmax(hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check_prompt_logprobs(reference: torch.Tensor, prompt: list[int], prompt_logprobs: list, top_n: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j, entry in enumerate(prompt_logprobs[1:], start=1):
        expected = reference[j - 1]
        top = expected.topk(top_n).indices.tolist()
        assert set(entry) == set(top) | {prompt[j]}
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(float(expected[token_id]), abs=1e-4)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_equal_hf(qwen3_dir, make_llm, engine_args):
    """prompt_logprobs=3: per prompt token after the first, the top 3 and the token itself, as HF's log_softmax;
    in chunks of 16 tokens too, beside other requests, and for a prompt whose blocks are in the prefix cache (its
    positions are computed anyway)."""
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, **engine_args)
    other = random_prompts([20], seed=23)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    first, plain = llm.generate([PROMPT, other], [params, SamplingParams(max_tokens=4)], use_tqdm=False)
    cached = llm.generate([PROMPT], params, use_tqdm=False)[0]
    reference = hf_prompt_logprobs(qwen3_dir, PROMPT)
    for out in (first, cached):
        check_prompt_logprobs(reference, PROMPT, out.prompt_logprobs, 3)
        assert out.token_ids == hf_greedy(qwen3_dir, PROMPT, 4)
    assert plain.prompt_logprobs is None and cached.num_cached_tokens == 0


def test_prompt_logprobs_stream_with_the_first_output_and_n(qwen3_dir, make_llm):
    """Streamed, the prompt logprobs come once, with the first output (sample 0's); ranks count the tokens at
    least as likely; a one-token prompt has none but its None."""
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK, max_num_batched_tokens=16).engine
    engine.add_request("p", PROMPT, SamplingParams(n=2, prompt_logprobs=0, max_tokens=3, ignore_eos=True))
    engine.add_request("one", PROMPT[:1], SamplingParams(prompt_logprobs=2, max_tokens=2), stream=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert [(o.request_id, o.index) for o in carrying] == [("p", 0), ("one", 0)]
    streamed, single = carrying
    assert streamed is next(o for o in outputs if o.request_id == "p")
    reference = hf_prompt_logprobs(qwen3_dir, PROMPT)
    check_prompt_logprobs(reference, PROMPT, [None, *streamed.prompt_logprobs.logprobs], 0)
    assert streamed.prompt_logprobs.token_ids == PROMPT[1:]
    expected_ranks = [int((row >= row[token]).sum()) for row, token in zip(reference, PROMPT[1:])]
    assert streamed.prompt_logprobs.ranks == expected_ranks
    assert single.prompt_logprobs.token_ids == [] and single.finished


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(qwen3_dir, make_llm):
    """max_tokens=0: the prompt is computed (its logprobs equal HF's, in chunks, streamed and not, with n) and the
    sequence finishes with "length" without a sampled token; a later request runs beside it; no block leaks."""
    engine = make_llm(qwen3_dir, kvcache_block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4).engine
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    engine.add_request("whole", PROMPT, scored, stream=False)
    engine.add_request("streamed", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1, n=2))
    engine.add_request("plain", PROMPT[:5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    reference = hf_prompt_logprobs(qwen3_dir, PROMPT)
    for request_id in ("whole", "streamed"):
        mine = [o for o in outputs if o.request_id == request_id]
        assert all(o.new_token_ids == [] and o.num_output_tokens == 0 and o.finish_reason == "length"
                   for o in mine)
        assert [o.index for o in mine] == ([0] if request_id == "whole" else [0, 1]) and mine[-1].finished
        check_prompt_logprobs(reference, PROMPT, [None, *mine[0].prompt_logprobs.logprobs], 1)
    assert [o.new_token_ids for o in outputs if o.request_id == "plain"][-1] != []
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]
