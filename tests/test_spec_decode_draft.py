"""Speculative decoding with a draft model: configuration (checked against the target before anything loads), and
the engine with a draft against the engine without speculation and HF transformers: greedy and seeded outputs
equal token for token, the target as its own draft accepting every greedy proposal (its KV cache kept in step
with the target's through prefill chunks, prefix-cached blocks, preemption and steps that do not speculate), the
emitted tokens following the target's distribution under temperature, stops inside accepted runs, streaming,
abort, n, LoRA and structured outputs."""
import argparse
import json
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
from engine_checks import check_block_invariants, check_stops_inside_a_run, stream_and_abort_the_third
from gguf_files import write_gguf
from hf_reference import hf_greedy, hf_logprobs, hf_model
from test_spec_decode import CHI2_9999, chi_square
from transformers import AutoModelForCausalLM

from kernel_cache import cache_with_kernels
from nanoserve import SamplingParams
from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.models.gguf import checkpoint_dir
from nanoserve.serving.serve.engine_flags import add_engine_flags, given_engine_args
from nanoserve.tiny_model import build_tiny_model, cut_layers

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"target": a 3-layer random-weight model, "cut": its first layer alone (a draft that agrees sometimes),
    "other": a 1-layer model of other weights, "wide": one with a larger vocabulary, "renumbered": the target's
    vocabulary size with two tokens' ids swapped in its tokenizer}."""
    root = tmp_path_factory.mktemp("draft_models")
    target = build_tiny_model(str(root / "target"), "qwen3", num_hidden_layers=3)
    found = {"target": target, "cut": cut_layers(target, str(root / "cut"), 1),
             "other": build_tiny_model(str(root / "other"), "qwen3", seed=5, num_hidden_layers=1),
             "wide": build_tiny_model(str(root / "wide"), "qwen3", vocab_size=2048, num_hidden_layers=1)}
    renumbered = shutil.copytree(found["other"], str(root / "renumbered"))
    with open(os.path.join(renumbered, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    first, second = [token for token, token_id in vocab.items() if token_id in (300, 301)]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    with open(os.path.join(renumbered, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    found["renumbered"] = renumbered
    return found


def draft(model_dir, k=3, **fields):
    return {"model": model_dir, "num_speculative_tokens": k, **fields}


def random_prompts(seed=0, lengths=(1, 5, 9, 17, 30)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def generate(llm, prompts, params):
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def spec_stats(llm):
    return {key: value for key, value in llm.stats().items() if key.startswith("spec_decode")}


def test_cut_layers_keeps_the_first_layers(models):
    """The cut checkpoint is the target with its later decoder layers removed (transformers on both)."""
    # a copy of its own (hf_model's is shared by the other tests), since it is cut here
    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    cut = hf_model(models["cut"])
    target.model.layers = target.model.layers[:1]
    target.config.num_hidden_layers = 1
    ids = torch.tensor([random_prompts(seed=15, lengths=(12,))[0]])
    assert cut.config.num_hidden_layers == 1
    torch.testing.assert_close(cut(ids).logits, target(ids).logits)


# ---- configuration ----------------------------------------------------------------------------------------------
def test_a_model_means_the_draft_method(models):
    config = EngineConfig.from_kwargs(models["target"], device="cpu", speculative_config={"model": models["cut"]})
    assert config.speculative_config == SpeculativeConfig(method="draft_model", model=models["cut"])
    assert config.speculative_config.num_speculative_tokens == 4  # the documented defaults
    assert config.speculative_config.disable_by_batch_size == 32
    given = {"method": "draft_model", "model": models["cut"], "num_speculative_tokens": 2,
             "disable_by_batch_size": None}
    assert EngineConfig.from_kwargs(models["target"], device="cpu", speculative_config=given).speculative_config == \
        SpeculativeConfig(**given)


def test_command_line_flag_takes_a_draft(models):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    text = json.dumps({"model": models["cut"], "num_speculative_tokens": 2})
    given = given_engine_args(parser.parse_args(["--speculative-config", text]))
    config = EngineConfig.from_kwargs(models["target"], device="cpu", **given)
    assert (config.speculative_config.method, config.speculative_config.model) == ("draft_model", models["cut"])


def test_bad_drafts_name_the_field(models, tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    unsupported = shutil.copytree(models["cut"], str(tmp_path / "gpt2"))
    with open(os.path.join(unsupported, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(unsupported, "config.json"), "w") as f:
        json.dump({**config, "architectures": ["GPT2LMHeadModel"]}, f)
    unweighted = shutil.copytree(models["cut"], str(tmp_path / "unweighted"),
                                 ignore=shutil.ignore_patterns("*.safetensors"))
    cases = [
        ({"model": models["wide"]}, "speculative_config.model", "vocabulary has 2048 tokens"),
        ({"model": models["renumbered"]}, "speculative_config.model", "tokenizer differs"),
        ({"model": "/no/such/draft"}, "speculative_config.model", "/no/such/draft"),
        ({"model": "/no/such/draft.gguf"}, "speculative_config.model", "no such GGUF file"),
        ({"model": empty}, "speculative_config.model", empty),
        ({"model": models["cut"], "method": "ngram"}, "speculative_config.model", "ngram"),
        ({"method": "draft_model"}, "speculative_config.model", "needs a draft model"),
        ({"model": models["cut"], "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max", "ngram"),
        ({"model": models["cut"], "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", "0"),
        ({"model": 7}, "speculative_config.model", "7"),
        ({"model": unsupported}, "speculative_config.model", "architecture 'GPT2LMHeadModel' is not supported"),
        ({"model": unweighted}, "speculative_config.model", "no *.safetensors weights"),
    ]
    for value, field, detail in cases:
        with pytest.raises(ValueError) as error:
            EngineConfig.from_kwargs(models["target"], device="cpu", speculative_config=value)
        message = str(error.value)
        assert message.startswith(field + ":") and detail in message and "\n" not in message, (value, message)


def test_tensor_parallel_is_refused(models):
    with pytest.raises(ValueError, match=r"^speculative_config.model: .*tensor_parallel_size is 2"):
        EngineConfig.from_kwargs(models["target"], device="cpu", tensor_parallel_size=2,
                                 speculative_config={"model": models["cut"]})


def test_a_gguf_draft_is_converted_as_the_target_is(models, make_llm, tmp_path, monkeypatch):
    cache = cache_with_kernels(tmp_path / "cache")
    monkeypatch.setenv("NANOSERVE_CACHE", cache)  # where the file is converted
    gguf_path = write_gguf(models["target"], str(tmp_path / "target.gguf"), "qwen3")
    target, prompts = models["target"], random_prompts(seed=14)[1:3]
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(gguf_path))
    assert llm.engine.config.speculative_config.model == checkpoint_dir(gguf_path, cache)
    assert generate(llm, prompts, GREEDY) == base
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0  # float32 GGUF: the target's own weights


# ---- the engine: exact ------------------------------------------------------------------------------------------
def test_the_target_as_its_own_draft_accepts_every_greedy_proposal(models, make_llm):
    prompts = random_prompts()
    target = models["target"]
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target))
    assert generate(llm, prompts, GREEDY) == base
    for prompt, tokens in list(zip(prompts, base))[1:3]:
        assert tokens == hf_greedy(target, prompt, GREEDY.max_tokens)
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0
    # 24 tokens: the first from the prompt, then runs of 3 proposals and the token after them
    assert stats["spec_decode_num_drafts"] == len(prompts) * 6
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [len(prompts) * 6] * 2 + [len(prompts) * 5]


@pytest.mark.parametrize("name", ["cut", "other"])
def test_a_smaller_draft_gives_the_target_greedy_output(models, make_llm, name):
    prompts = random_prompts(seed=1)
    target = models["target"]
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, GREEDY)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models[name], k=4))
    assert generate(llm, prompts, GREEDY) == base
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # some rejected


def test_seeded_sampling_equals_no_speculation(models, make_llm):
    """A seeded row's token at each position is the target's draw for that position, whatever is proposed."""
    prompts = random_prompts(seed=2)
    target = models["target"]
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=20, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    for name in ("target", "cut"):
        llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models[name]))
        assert generate(llm, prompts, params) == base
        assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_emitted_tokens_follow_the_target_distribution(models, make_llm):
    """Under temperature the target as its own draft proposes its most likely token, accepted with its
    probability: the second output token (the first verified one), given the first, follows the target's
    distribution (after temperature and top-k) exactly, accepted or not."""
    target, prompt = models["target"], random_prompts(seed=3, lengths=(6,))[0]
    # max_tokens 3: after the first token, one proposal (and the token after it) fits
    params = SamplingParams(temperature=3.0, top_k=6, max_tokens=3, ignore_eos=True)
    llm = make_llm(target, kvcache_block_size=BLOCK, max_num_seqs=512,
                   speculative_config=draft(target, k=1, disable_by_batch_size=None), max_num_batched_tokens=4096)
    outputs = generate(llm, [prompt] * 6000, params)
    first = [tokens[0] for tokens in outputs]
    t1 = max(set(first), key=first.count)  # the group given the most common first token
    second = np.array([tokens[1] for tokens in outputs if tokens[0] == t1])
    assert len(second) > 1000
    logits = hf_logprobs(target, prompt, [t1, 0])[1] / params.temperature
    logits[logits < logits.topk(params.top_k).values[-1]] = -float("inf")
    probs = logits.softmax(dim=-1).double().numpy()
    assert chi_square(np.bincount(second, minlength=len(probs)), probs) < CHI2_9999
    stats = spec_stats(llm)
    rate = stats["spec_decode_acceptance_rate"]
    assert stats["spec_decode_num_drafts"] == len(outputs) and 0.05 < rate < 0.95  # both outcomes occur


# ---- stops inside an accepted run ---------------------------------------------------------------------------
def test_stop_token_max_tokens_and_stop_string_inside_a_run(models, make_llm):
    target, prompt = models["target"], random_prompts(seed=5)[2]
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target, k=6))
    reference = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    check_stops_inside_a_run(llm, prompt, reference)
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0


def test_streamed_outputs_concatenate_and_abort_frees_blocks(models, make_llm):
    target, prompts = models["target"], random_prompts(seed=6)[:3]
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models["target"]))
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, GREEDY)
    assert stream_and_abort_the_third(llm.engine, prompts, GREEDY, base) < GREEDY.max_tokens / 2  # runs of 4


# ---- the draft's KV cache through the scheduling features -------------------------------------------------------
def test_chunked_prefill_and_preemption(models, make_llm):
    """Prompt chunks fill the draft's cache as they fill the target's; a preempted row recomputes both."""
    target, prompts = models["target"], random_prompts(seed=7, lengths=(3, 9, 20, 33, 40, 12))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target), max_num_batched_tokens=16,
                   num_kvcache_blocks=14, max_num_seqs=4)
    assert generate(llm, prompts, params) == base
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0


def test_prompt_chunks_with_prompt_logprobs_beside_proposals(models, make_llm):
    """A long prompt wanting prompt logprobs is computed in chunks in steps where other rows propose: its
    logprobs and every row's tokens equal the engine's without speculation."""
    target = models["target"]
    prompts = random_prompts(seed=16, lengths=(5, 9, 50))
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)]
    # chunks of 18, 30 and 2 tokens: the last beside the two decoding rows' proposals
    engine_args = {"kvcache_block_size": BLOCK, "max_num_batched_tokens": 32}
    base = make_llm(target, **engine_args).generate(prompts, params, use_tqdm=False)
    llm = make_llm(target, **engine_args, speculative_config=draft(target))
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append((int(out.num_draft_tokens.sum()), out.num_prefill_tokens))
        return out
    scheduler.schedule = recording_schedule
    got = llm.generate(prompts, params, use_tqdm=False)
    assert any(drafted and prefill for drafted, prefill in steps)
    assert [out.token_ids for out in got] == [out.token_ids for out in base]
    mine, theirs = got[2].prompt_logprobs, base[2].prompt_logprobs
    assert len(mine) == len(theirs) == 50 and mine[0] is None
    for entry, expected in zip(mine[1:], theirs[1:]):
        assert entry.keys() == expected.keys()
        assert all(entry[t] == pytest.approx(expected[t], abs=1e-4) for t in entry)
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0


def test_prefix_cached_blocks_hold_the_drafts_kv(models, make_llm):
    """A prompt that repeats an earlier prompt and its output takes their blocks from the prefix cache: the
    draft's KV there is right, so the target as its own draft still accepts every proposal."""
    target, prompts = models["target"], random_prompts(seed=8)[2:]
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target))
    engine, scheduler = llm.engine, llm.engine.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, GREEDY, stream=False)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out.new_token_ids for out in engine.step() if out.finished})
        computed = {seq.request_id: scheduler.num_computed_tokens(seq) for seq in scheduler.running}
        check_block_invariants(engine.block_manager, scheduler.running, computed)
    again = [p + outputs[f"p{i}"] for i, p in enumerate(prompts)]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert generate(llm, again, GREEDY) == generate(make_llm(target, kvcache_block_size=BLOCK), again, GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] - hits >= sum(len(p) // BLOCK * BLOCK - BLOCK for p in again)
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0


def test_steps_without_proposals_keep_the_draft_in_step(models, make_llm):
    """disable_by_batch_size: while 5 requests run nothing is proposed, but the draft computes every token; once
    only one is left it proposes, from a cache that holds all its tokens."""
    target, prompts = models["target"], random_prompts(seed=12)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 8, 32)]
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target, disable_by_batch_size=2))
    assert generate(llm, prompts, params) == generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    stats = spec_stats(llm)
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0


def test_parallel_samples(models, make_llm):
    target, prompts = models["target"], random_prompts(seed=9)[1:3]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=16, ignore_eos=True, seed=11)
    base = make_llm(target, kvcache_block_size=BLOCK).generate(prompts, params, use_tqdm=False)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models["cut"]))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in p.outputs] for p in got] == [[c.token_ids for c in p.outputs] for p in base]
    assert spec_stats(llm)["spec_decode_num_drafts"] > 0
    # the later samples take the first's prompt blocks: the draft's KV there is right too
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    single = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, greedy.for_sample(0))
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(target))
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [[c.token_ids for c in p.outputs] for p in got] == [[tokens, tokens] for tokens in single]
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0


def test_penalties_and_logprobs_at_every_proposed_position(models, make_llm):
    target, prompts = models["target"], random_prompts(seed=4)[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.2, min_tokens=10, logprobs=3)
    base = make_llm(target, kvcache_block_size=BLOCK).generate(prompts, params, use_tqdm=False)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models["cut"]))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [out.token_ids for out in got] == [out.token_ids for out in base]
    for mine, theirs in zip(got, base):
        assert len(mine.logprobs) == len(mine.token_ids)
        for entry, expected in zip(mine.logprobs, theirs.logprobs):
            assert entry.keys() == expected.keys()
            assert all(entry[t] == pytest.approx(expected[t], abs=1e-4) for t in entry)
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_lora_and_structured_outputs(tiny_models, lora_adapters, make_llm):
    """The draft proposes without adapters, and within the grammar for a row that has one; the target's output is
    unchanged."""
    model_dir = tiny_models["qwen3"]
    prompts = random_prompts(seed=10)[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, lora_name=name)
              for name in ("wide", None, "narrow")]
    params.append(SamplingParams(temperature=0.0, max_tokens=12,
                                 structured_outputs={"choice": ["yes yes yes", "no"]}))
    outputs = []
    for spec in (None, draft(model_dir)):
        llm = make_llm(model_dir, kvcache_block_size=BLOCK, enable_lora=True, max_loras=2, max_lora_rank=8,
                       speculative_config=spec)
        llm.add_lora("wide", lora_adapters["qwen3"]["wide"])
        llm.add_lora("narrow", lora_adapters["qwen3"]["narrow"])
        outputs.append(generate(llm, prompts, params))
    assert outputs[0] == outputs[1]
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["target", "cut"])
def test_structured_outputs_are_speculated_within_their_grammar(models, make_llm, name):
    """A draft proposes for rows with a grammar too, its proposals unchecked: the mask covers each verified
    position up to the first proposal the grammar rejects (or that would end it), where the target's token, drawn
    within the grammar, rejects it. The target as its own draft proposes what the grammar allows; its first layer
    alone proposes tokens the grammar rejects. The output equals decoding without speculation, inside the regex."""
    target, prompts = models["target"], random_prompts(seed=15)[:3]
    regex = "[a-z]+( [a-z]+){1,20}"
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": regex})
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(target, kvcache_block_size=BLOCK, speculative_config=draft(models[name]))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == base and all(re.fullmatch(regex, o.text) for o in got)
    stats = spec_stats(llm)
    assert stats["spec_decode_num_draft_tokens"] > 0
    if name == "target":  # its unmasked greedy proposals are accepted wherever the grammar allows them
        assert stats["spec_decode_num_accepted_tokens"] > 0


def test_triton_attention_backend(models, make_llm):
    """The Triton kernels (the GPU's attention; on the CPU through TRITON_INTERPRET=1) for the draft's steps."""
    target, prompts = models["target"], random_prompts(seed=13)[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(target, kvcache_block_size=BLOCK, attention_backend="triton", num_kvcache_blocks=32,
                   speculative_config=draft(target))
    assert generate(llm, prompts, params) == base
    assert spec_stats(llm)["spec_decode_acceptance_rate"] == 1.0


def test_the_draft_cache_takes_its_share_of_the_budget(models, make_llm):
    """cpu_kvcache_space_gib holds both caches: the target as its own draft halves the blocks."""
    target = models["target"]
    alone = make_llm(target, cpu_kvcache_space_gib=0.01).stats()["num_total_blocks"]
    both = make_llm(target, cpu_kvcache_space_gib=0.01, speculative_config=draft(target)).stats()["num_total_blocks"]
    assert both == alone // 2


def test_graphs_replay_the_drafts_proposals_and_the_verify_steps(models, make_llm, monkeypatch):
    """Where the target replays CUDA graphs (fake ones on the CPU, whose replay runs the captured forward
    eagerly), the draft's one-token forwards replay the draft's decode graphs and the target's verify steps its
    verify graphs; the greedy tokens stay the target's."""
    from test_cuda_graph import capture, spy_query_lens, use_triton_kernels

    use_triton_kernels(monkeypatch)
    target, prompts = models["target"], random_prompts(seed=14)[1:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = generate(make_llm(target, kvcache_block_size=BLOCK), prompts, params)
    llm = make_llm(target, kvcache_block_size=BLOCK, attention_backend="triton", num_kvcache_blocks=32,
                   max_num_seqs=2, speculative_config=draft(target))
    runner = llm.engine.executor.runner
    runner.graphs, runner.draft.graphs = runner.graph_runner(), runner.draft_graph_runner()
    query_lens = {}
    for name, graphs in (("target", runner.graphs), ("draft", runner.draft.graphs)):
        capture(graphs, monkeypatch)
        query_lens[name] = spy_query_lens(graphs, monkeypatch)
    assert generate(llm, prompts, params) == base
    assert max(query_lens["target"]) > 1  # verify steps replayed
    assert query_lens["draft"] and set(query_lens["draft"]) == {1}  # the draft's decode forwards replayed

