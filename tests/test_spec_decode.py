"""Speculative decoding (n-gram proposals): configuration, the proposer, and the engine with speculation against
the engine without it and HF transformers (greedy and seeded outputs equal token for token), the stop rules and
logprobs inside accepted runs, streaming, abort, preemption, chunked prefill, prefix caching, n and LoRA; the
verification rule against the target distribution on a small vocabulary."""
import argparse
import random
import re

import numpy as np
import pytest
import torch
from engine_checks import check_block_invariants, check_stops_inside_a_run, stream_and_abort_the_third
from hf_reference import hf_greedy, hf_logprobs

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.model_runner import RunnerOutput, verify
from nanoserve.engine.speculative import NgramProposer
from nanoserve.engine.structured_output import Grammar
from nanoserve.layers.sampler import Sampler, SamplingMetadata
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.serving.serve.engine_flags import add_engine_flags, given_engine_args

BLOCK = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def repetitive_prompts(seed=0):
    """Prompts whose n-grams recur (proposals are made) and random ones (few are)."""
    rng = random.Random(seed)
    patterns = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 5, 7)]
    return [p * 4 for p in patterns] + [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 9, 30)]


class ReplayProposer:
    """Proposes what a reference run generated after the same tokens (so the proposals are accepted), but for the
    output positions in `wrong`, where it proposes another token: runs of accepted proposals of known length."""

    def __init__(self, prompts, outputs, wrong=()):
        self.references = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
        self.wrong = set(wrong)

    def propose(self, token_ids, max_tokens):
        for prompt, output in self.references:
            if token_ids[:len(prompt)] == prompt and token_ids[len(prompt):] == output[:len(token_ids) - len(prompt)]:
                start = len(token_ids) - len(prompt)
                proposal = output[start:start + max_tokens]
                return [t + 1 if start + i in self.wrong else t for i, t in enumerate(proposal)]
        return []


def generate(llm, prompts, params):
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


# ---- configuration ----------------------------------------------------------------------------------------------
def test_defaults_and_vllm_spelling(qwen3_dir):
    config = EngineConfig.from_kwargs(qwen3_dir, device="cpu", speculative_config={"method": "ngram"})
    assert config.speculative_config == SpeculativeConfig("ngram", 4, 3, 5, 32)
    always = {"method": "ngram", "disable_by_batch_size": None}
    assert EngineConfig.from_kwargs(qwen3_dir, device="cpu", speculative_config=always).speculative_config == \
        SpeculativeConfig(disable_by_batch_size=None)
    given = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "disable_by_batch_size": 8}
    assert EngineConfig.from_kwargs(qwen3_dir, device="cpu", speculative_config=given).speculative_config == \
        SpeculativeConfig(**given)
    assert EngineConfig.from_kwargs(qwen3_dir, device="cpu").speculative_config is None


def test_command_line_flag_and_model_json_string_take_json(qwen3_dir):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    given = given_engine_args(args)
    assert given == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5}}
    config = EngineConfig.from_kwargs(qwen3_dir, device="cpu", **given)
    assert config.speculative_config.num_speculative_tokens == 5


@pytest.mark.parametrize("value, field", [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"prompt_lookup_max": -1}, "speculative_config.prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
    ({"num_lookahead": 3}, "speculative_config.num_lookahead"),
    ({"model": "/draft", "num_speculative_tokens": 3}, "speculative_config.model"),
    ([1, 2], "speculative_config"),
    ("{not json", "speculative_config"),
])
def test_bad_values_name_the_field(qwen3_dir, value, field):
    with pytest.raises(ValueError) as error:
        EngineConfig.from_kwargs(qwen3_dir, device="cpu", speculative_config=value)
    assert str(error.value).startswith(field + ":") and "\n" not in str(error.value)


# ---- the proposer -----------------------------------------------------------------------------------------------
def test_ngram_proposer_takes_the_longest_then_latest_match():
    proposer = NgramProposer(2, 3)
    assert proposer.propose([1, 2, 3, 9, 8, 5, 2, 3, 7, 1, 2, 3], 2) == [9, 8]  # [1, 2, 3] beats a later [2, 3]
    assert proposer.propose([2, 3, 4, 2, 3, 5, 2, 3], 4) == [5, 2, 3]  # the latest [2, 3]
    assert proposer.propose([5, 6, 1, 9, 1], 3) == []  # [9, 1] never occurred before; 1 alone is too short
    assert proposer.propose([4, 4, 4, 4], 2) == [4]  # what follows the latest match is all there is
    assert proposer.propose([1, 2, 1, 2], 0) == []


# ---- the engine: exact ------------------------------------------------------------------------------------------
def test_greedy_equals_no_speculation_and_hf(qwen3_dir, make_llm):
    prompts = repetitive_prompts()
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    assert generate(llm, prompts, GREEDY) == base
    for prompt, tokens in zip(prompts, base):
        assert tokens == hf_greedy(qwen3_dir, prompt, GREEDY.max_tokens)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 <= stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]


def test_accepted_runs_are_exact_and_counted(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=1)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={5, 6, 13})
    assert generate(llm, prompts, GREEDY) == base
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.6 * stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_acceptance_rate"] == \
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert stats["spec_decode_num_drafts"] <= stats["spec_decode_num_draft_tokens"]
    # each step emits its accepted run and one more token: far fewer steps than tokens
    assert stats["spec_decode_num_drafts"] < len(prompts) * GREEDY.max_tokens / 2


def test_seeded_sampling_equals_no_speculation(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=2)
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=20, ignore_eos=True, seed=i) for i in
              range(len(prompts))]
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={3, 8})
    assert generate(llm, prompts, params) == base
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_penalties_and_min_tokens_apply_at_every_proposed_position(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.2, min_tokens=10)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={4})
    assert generate(llm, prompts, params) == base


def test_logprobs_of_every_emitted_token(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=4)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={2})
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        reference = hf_logprobs(qwen3_dir, prompt, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 12
        for entry, lp, token in zip(out.logprobs, reference, out.token_ids):
            assert set(torch.topk(lp, 3).indices.tolist()) <= set(entry)
            assert entry[token] == pytest.approx(float(lp[token]), abs=1e-3)
        assert out.cumulative_logprob == pytest.approx(sum(float(lp[t]) for lp, t in zip(reference, out.token_ids)),
                                                       abs=1e-3)


# ---- stops inside an accepted run -------------------------------------------------------------------------------
def test_stop_token_max_tokens_and_stop_string_inside_a_run(qwen3_dir, make_llm):
    prompt = repetitive_prompts(seed=5)[1]
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config={**NGRAM, "num_speculative_tokens": 6})
    reference = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.engine.scheduler.proposer = ReplayProposer([prompt], [reference.token_ids])
    check_stops_inside_a_run(llm, prompt, reference)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_streamed_outputs_concatenate_and_abort_frees_blocks(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=6)[:3]
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    base = generate(llm, prompts, GREEDY)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={7})
    assert stream_and_abort_the_third(llm.engine, prompts, GREEDY, base) < GREEDY.max_tokens  # runs of tokens


# ---- the scheduling features ------------------------------------------------------------------------------------
def test_chunked_prefill_and_preemption(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM, max_num_batched_tokens=16,
                   num_kvcache_blocks=14, max_num_seqs=4)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={2, 9})
    assert generate(llm, prompts, params) == base
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_prefix_cache_holds_only_accepted_tokens(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=8)[:3]
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    base = generate(llm, prompts, GREEDY)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={1, 5, 10, 17})
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, GREEDY, stream=False)
    while engine.has_unfinished_requests():
        engine.step()
        computed = {seq.request_id: scheduler.num_computed_tokens(seq) for seq in scheduler.running}
        check_block_invariants(engine.block_manager, scheduler.running, computed)
    # the outputs' own blocks are in the cache: a prompt repeating prompt + output takes them
    again = [p + o for p, o in zip(prompts, base)]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert generate(llm, again, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) == \
        generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), again,
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.stats()["prefix_cache_hit_tokens"] - hits >= sum(len(p) // BLOCK * BLOCK - BLOCK for p in again)


def test_parallel_samples(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=9)[:2]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=16, ignore_eos=True, seed=11)
    base = make_llm(qwen3_dir, kvcache_block_size=BLOCK).generate(prompts, params, use_tqdm=False)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in p.outputs] for p in got] == [[c.token_ids for c in p.outputs] for p in base]


def test_lora(tiny_models, lora_adapters, make_llm):
    model_dir = tiny_models["qwen3"]
    prompts = repetitive_prompts(seed=10)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, lora_name=name)
              for name in ("wide", None, "narrow", "wide", None, "narrow")]
    outputs = []
    for spec in (None, NGRAM):
        llm = make_llm(model_dir, kvcache_block_size=BLOCK, enable_lora=True, max_loras=2, max_lora_rank=8,
                       speculative_config=spec)
        llm.add_lora("wide", lora_adapters["qwen3"]["wide"])
        llm.add_lora("narrow", lora_adapters["qwen3"]["narrow"])
        if spec is not None:
            llm.engine.scheduler.proposer = ReplayProposer(prompts, outputs[0], wrong={3})
        outputs.append(generate(llm, prompts, params))
    assert outputs[0] == outputs[1]


def test_structured_outputs_are_speculated_within_their_grammar(qwen3_dir, make_llm):
    """Proposals follow the grammar: ones it rejects are cut before verification, the mask applies at each
    proposed position (the matcher rolled back after), and the output equals decoding without speculation."""
    regex = {"regex": "[a-z]+( [a-z]+){1,20}"}
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["yes yes yes", "no"]}),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = repetitive_prompts(seed=11)[:3]
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM)
    # wrong at output positions 2 and 7: a token the grammar may allow (then the target rejects it) or not (cut)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={2, 7})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == base
    assert re.fullmatch(regex["regex"], got[0].text) and got[1].text in ("yes yes yes", "no")
    before = llm.stats()["spec_decode_num_accepted_tokens"]
    assert generate(llm, prompts[:1], params[:1]) == base[:1]  # the regex request alone
    assert llm.stats()["spec_decode_num_accepted_tokens"] > before


def test_a_grammar_cuts_proposals_it_rejects_and_is_left_as_it_was(qwen3_dir, make_llm):
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK)
    tokenizer = llm.engine.tokenizer
    manager = llm.engine.structured_outputs
    grammar = Grammar(manager.compile(StructuredOutputsParams(regex="ab(cd)+")))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d", "x")]
    a, b, c, d, x = ids
    assert grammar.valid_prefix([a, b, c, d, c]) == 5
    assert grammar.valid_prefix([a, b, x, c]) == 2
    assert grammar.valid_prefix([b]) == 0
    eos = next(iter(llm.engine.output_processor.eos_token_ids))
    assert grammar.valid_prefix([a, b, c, d, eos, a]) == 4  # the end is the target's to decide
    assert not grammar.advance(a) and grammar.num_accepted == 1  # nothing of the above was kept
    bitmask = manager.bitmask([grammar, None], np.array([2, 1]), np.array([b, c, 5]))
    assert bitmask.rows == [0, 1, 2] and bitmask.bitmask.shape[0] == 5
    allowed = [{j for j in range(manager.vocab_size) if bitmask.bitmask[row, j // 32] >> (j % 32) & 1}
               for row in bitmask.rows]
    assert allowed == [{b}, {c}, {d}]
    assert not grammar.advance(b) and not grammar.advance(c)  # rolled back after filling


def test_disable_by_batch_size(qwen3_dir, make_llm):
    prompts = repetitive_prompts(seed=12)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    base = generate(llm, prompts, GREEDY)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base)
    assert generate(llm, prompts, GREEDY) == base
    assert llm.stats()["spec_decode_num_drafts"] == 0  # 6 requests run at once, always
    generate(llm, prompts[:1], GREEDY)
    assert llm.stats()["spec_decode_num_drafts"] > 0


# ---- the verification rule against the target distribution ------------------------------------------------------
def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# the chi-square distribution's 0.9999 quantile at 5 degrees of freedom (top-k 6 leaves 6 tokens): a correct
# sampler fails with probability 1e-4, and the seeds are fixed, so the test is deterministic
CHI2_9999 = 25.74


def test_emitted_tokens_follow_the_target_distribution():
    """Rows verifying one proposal d (p0's second most likely token) over a vocabulary of 8: the first emitted
    token follows p0 (d accepted with probability p0(d), else a draw from p0 without d), and the second, emitted
    only after an acceptance, follows p1 (after temperature and top-k, per position)."""
    torch.manual_seed(0)
    logits0, logits1 = torch.randn(8) * 1.5, torch.randn(8) * 1.5
    num_rows, temperature, top_k = 40000, 0.7, 6
    draft = int(logits0.argsort(descending=True)[1])
    logits = torch.stack([logits0, logits1]).repeat(num_rows, 1)
    meta = SamplingMetadata(num_rows=2 * num_rows, all_greedy=False, temperatures=temperature, top_ks=top_k,
                            max_top_k=top_k)
    sampled = Sampler(seed=1)(logits, meta)
    out = verify(RunnerOutput(sampled.token_ids.numpy(), sampled.sampled_logprobs.numpy()),
                 np.ones(num_rows, dtype=np.int64), np.full(num_rows, draft, dtype=np.int64))
    starts = np.cumsum(out.num_tokens) - out.num_tokens
    first, accepted = out.token_ids[starts], out.num_tokens == 2
    second = out.token_ids[starts[accepted] + 1]

    def target(row_logits):
        kept = row_logits / temperature
        kept[kept < kept.topk(top_k).values[-1]] = -float("inf")
        return kept.softmax(dim=-1).double().numpy()

    p0, p1 = target(logits0), target(logits1)
    assert chi_square(np.bincount(first, minlength=8), p0) < CHI2_9999
    assert chi_square(np.bincount(second, minlength=8), p1) < CHI2_9999
    assert (first[accepted] == draft).all() and (first[~accepted] != draft).all()
    # acceptance ~ Binomial(num_rows, p0(draft)): within 4.5 standard deviations
    assert abs(accepted.sum() - num_rows * p0[draft]) < 4.5 * np.sqrt(num_rows * p0[draft] * (1 - p0[draft]))


def test_triton_attention_backend_verifies_runs(qwen3_dir, make_llm):
    """The Triton kernels (the GPU's attention; on the CPU through TRITON_INTERPRET=1) on steps that verify runs."""
    prompts = repetitive_prompts(seed=13)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, attention_backend="triton", num_kvcache_blocks=32,
                   speculative_config=NGRAM)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base, wrong={4})
    assert generate(llm, prompts, params) == base
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_scored_prompt_finishes_beside_verified_proposals(qwen3_dir, make_llm):
    """max_tokens 0 (lm-eval's echo scoring): a prompt whose last chunk is computed in a step that verifies
    another row's proposals still finishes, with its prompt logprobs, and the other rows stay exact."""
    prompts = repetitive_prompts(seed=3)[:2]
    base = generate(make_llm(qwen3_dir, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(qwen3_dir, kvcache_block_size=BLOCK, speculative_config=NGRAM, max_num_batched_tokens=32)
    llm.engine.scheduler.proposer = ReplayProposer(prompts, base)
    engine, update, scored_in_draft_steps = llm.engine, llm.engine.scheduler.update, []

    def recording_update(out, *args):
        result = update(out, *args)
        if len(out.num_draft_tokens) and out.num_draft_tokens.any():
            scored_in_draft_steps.extend(seq.request_id for seq in result.scored)
        return result
    engine.scheduler.update = recording_update
    for i, prompt in enumerate(prompts):
        engine.add_request(f"spec-{i}", prompt, GREEDY, stream=False)
    outputs = []
    while not (engine.scheduler.running and engine.scheduler.running[0].num_output_tokens):
        outputs += engine.step()  # until the first row decodes: its proposals are verified from then on
    scored_prompt = [random.Random(9).randrange(3, 1000) for _ in range(40)]  # two chunks
    engine.add_request("scored", scored_prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), stream=False)
    drafted_before = llm.stats()["spec_decode_num_drafts"]
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert llm.stats()["spec_decode_num_drafts"] > drafted_before
    assert scored_in_draft_steps == ["scored"]  # its last chunk ran in a step that verified proposals
    final = {out.request_id: out for out in outputs if out.finished}
    assert [final[f"spec-{i}"].new_token_ids for i in range(2)] == base
    scored = final["scored"]
    assert scored.new_token_ids == [] and scored.finish_reason == "length"
    reference = hf_logprobs(qwen3_dir, scored_prompt[:1], scored_prompt[1:])
    mine = scored.prompt_logprobs.logprobs
    assert len(mine) == len(scored_prompt) - 1
    for token, position, expected in zip(scored_prompt[1:], mine, reference):
        assert abs(position[token] - float(expected[token])) < 1e-4
