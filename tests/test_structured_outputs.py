"""Structured outputs in the offline engine, on a random-weight model whose vocabulary has padding rows past the
tokenizer's (so only a constrained sampler can pass): sampled outputs at temperature 1 validate against their
JSON schema (jsonschema), fullmatch their regex, are one of their choices, parse under their grammar; greedy
constrained rows equal HF transformers under the same grammar, and unconstrained neighbours are unaffected;
preemption, failed steps, aborts; invalid specs name the field; parsing of structured_outputs (hypothesis)."""
import ast
import functools
import gc
import json
import random
import re
import weakref

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hf_reference import hf_model
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import SamplingParams, StructuredOutputsParams
from nanoserve.engine.structured_output import Grammar, StructuredOutputManager
from nanoserve.tiny_model import build_tokenizer, build_tiny_model

VOCAB = 1100  # the tokenizer has 1024 tokens: 76 padding rows, and a last bitmask word only partly used
SCHEMA = {  # every string and number bounded: a random model fills an unbounded one until max_tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                 "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["kind", "legs"]},
    },
    "required": ["name", "age", "admin", "color", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}(\.[a-z]{2})?"
CHOICES = ["red", "green", "blue", "naïve café"]
EBNF = 'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*" | "-"'
LARK = 'start: NUM " " OP " " NUM\nNUM: /[1-9][0-9]?/\nOP: "+" | "*" | "-"'
SEEDS = range(4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("padded")), "qwen3", vocab_size=VOCAB)


@pytest.fixture
def llm(model_dir, make_llm):
    return make_llm(model_dir, kvcache_block_size=8)


def sampled(structured_outputs, max_tokens=150, seeds=SEEDS) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured_outputs)
            for seed in seeds]


def prompts(count, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 12))] for _ in range(count)]


def test_sampled_outputs_follow_their_schema_regex_choice_and_grammar(llm):
    specs = [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"regex": REGEX}, {"choice": CHOICES},
             {"grammar": EBNF}, {"grammar": LARK}]
    params = [p for spec in specs for p in sampled(spec)]
    outputs = llm.generate(prompts(len(SEEDS)) * len(specs), params, use_tqdm=False)
    texts = {}
    for spec, out in zip([s for s in specs for _ in SEEDS], outputs):
        assert out.finish_reason == "stop", (spec, out.text)
        kind, value = next(iter(spec.items()))
        texts.setdefault(kind, []).append(out.text)
        if kind == "json":
            document = json.loads(out.text)
            jsonschema.validate(document, SCHEMA)
            assert out.text == json.dumps(document)  # bounded whitespace: one space after ":" and ","
        elif kind == "regex":
            assert re.fullmatch(value, out.text), out.text
        elif kind == "choice":
            assert out.text in CHOICES
        else:
            assert re.fullmatch(r"[1-9][0-9]? [-+*] [1-9][0-9]?", out.text), out.text
            ast.parse(out.text, mode="eval")
    assert len(set(texts["json"])) > 1 and len(set(texts["regex"])) > 1  # temperature 1 does sample
    assert texts["json"][:len(SEEDS)] == texts["json"][len(SEEDS):]  # a schema as JSON text is the same schema


def hf_constrained_greedy(model_dir, prompt, compiled, max_tokens) -> list[int]:
    """The reference: HF transformers' logits, every token outside the grammar's bitmask (unpacked here, bit by
    bit) masked, argmax; until the grammar ends."""
    model, matcher = hf_model(model_dir), xgr.GrammarMatcher(compiled)
    bitmask, ids = xgr.allocate_token_bitmask(1, VOCAB), list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            allowed = ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:VOCAB].bool()
            ids.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
            if not matcher.accept_token(ids[-1]) or matcher.is_terminated():
                break
    return ids[len(prompt):]


def test_greedy_constrained_rows_equal_hf_and_free_rows_ignore_them(llm, model_dir):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    specs = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, {"grammar": EBNF}]
    constrained = [SamplingParams(temperature=0.0, max_tokens=150, structured_outputs=spec) for spec in specs]
    batch_prompts = prompts(8, seed=1)
    params = [free, constrained[0], free, constrained[1], constrained[2], free, constrained[3], free]
    together = llm.generate(batch_prompts, params, use_tqdm=False)
    alone = llm.generate([p for p, sp in zip(batch_prompts, params) if sp is free], free, use_tqdm=False)
    assert [o.token_ids for o, sp in zip(together, params) if sp is free] == [o.token_ids for o in alone]
    manager = llm.engine.structured_outputs
    for prompt, sp, out in zip(batch_prompts, params, together):
        if sp is not free:
            compiled = manager.compile(sp.structured_outputs)
            assert out.token_ids == hf_constrained_greedy(model_dir, prompt, compiled, 150)


def test_preemption_keeps_each_grammar_in_step(model_dir, make_llm):
    """Seeded rows get the same tokens whatever the batch: with a pool so small that requests are preempted
    and recomputed again and again, in chunks beside rows that sample, the outputs must equal those of a pool
    that never preempts."""
    params = sampled({"json": SCHEMA}, max_tokens=120, seeds=range(3)) + sampled({"regex": REGEX}, seeds=[7])
    batch_prompts = prompts(len(params), seed=2)
    roomy = make_llm(model_dir, kvcache_block_size=8)
    expected = [o.token_ids for o in roomy.generate(batch_prompts, params, use_tqdm=False)]
    tight = make_llm(model_dir, kvcache_block_size=8, num_kvcache_blocks=20, max_num_batched_tokens=16)
    outputs = tight.generate(batch_prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == expected
    for out in outputs[:3]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_step_that_fails_in_the_output_processor_is_caught_up(llm):
    """The sampled tokens were appended but no matcher saw them: after recovery each matcher catches up, and the
    request ends as if nothing had happened."""
    [params] = sampled({"json": SCHEMA}, seeds=[3])
    [prompt] = prompts(1, seed=3)
    [expected] = llm.generate([prompt], params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("r", prompt, params, stream=False)
    for _ in range(6):
        engine.step()
    process = engine.output_processor.process

    def fail_once(*args, **kwargs):
        engine.output_processor.process = process
        raise RuntimeError("injected")

    engine.output_processor.process = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.fail_and_recover(set())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].new_token_ids == expected.token_ids and outputs[-1].finish_reason == "stop"


def test_matchers_leave_with_their_requests(llm):
    engine = llm.engine
    params = sampled({"json": SCHEMA}, seeds=[1])[0]
    for request_id in ("aborted", "finished"):
        engine.add_request(request_id, [5, 6, 7], params, stream=True)
    grammars = {seq.request_id: weakref.ref(seq.grammar) for seq in engine.scheduler.waiting}
    engine.step()
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert not engine.output_processor.constrained
    assert grammars and all(ref() is None for ref in grammars.values())


INVALID_SPECS = [  # (spec, the error's start after "structured_outputs: ")
    ({"json": {"type": "no-such-type"}}, "invalid json schema"),
    ({"json": {"$ref": "#/missing"}}, "invalid json schema"),
    ({"regex": "(unclosed"}, "invalid regex"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
    ({"grammar": "start: ("}, "invalid grammar"),
    ({"choice": ["\ud800"]}, "invalid choice"),
]


def test_specs_that_do_not_compile_name_the_field_and_leave_others_alone(llm):
    for spec, message in INVALID_SPECS:
        with pytest.raises(ValueError, match=f"^structured_outputs: {message}"):
            llm.generate([[5, 6]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    [out] = llm.generate([[5, 6]], sampled({"choice": CHOICES}, seeds=[0]), use_tqdm=False)
    assert out.text in CHOICES


# ---- the manager: vocabulary, bitmask -------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(build_tokenizer(), VOCAB, {2})


def allowed_ids(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = ((bitmask[row].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:VOCAB]
    return set(bits.nonzero().flatten().tolist())


def test_bitmask_never_allows_padding_rows_or_special_tokens():
    tokenizer = build_tokenizer()
    anything = Grammar(manager().compile(StructuredOutputsParams(regex=r"[\s\S]+")))
    finished = Grammar(manager().compile(StructuredOutputsParams(choice=["a"])))
    assert finished.matcher.accept_string("a")
    mask = manager().bitmask([None, anything, finished])
    assert mask.rows == [1, 2] and mask.bitmask.shape == (3, -(-VOCAB // 32))
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert special == {0, 1, 2}
    text_tokens = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).isascii()} - special
    assert text_tokens <= allowed_ids(mask.bitmask, 1) <= set(range(len(tokenizer))) - special  # no padding
    assert allowed_ids(mask.bitmask, 2) == {2}  # the grammar is complete: only EOS
    assert manager().bitmask([None, None]) is None


def test_catch_up_accepts_the_tokens_a_matcher_missed():
    tokenizer = build_tokenizer()
    token_ids = tokenizer.encode('{"kind": "dog", "legs": 4}')
    spec = StructuredOutputsParams(json=SCHEMA["properties"]["pet"])
    whole, behind = (Grammar(manager().compile(spec)) for _ in range(2))
    for token_id in token_ids:
        whole.advance(token_id)
    behind.advance(token_ids[0])
    behind.catch_up(token_ids)
    assert behind.num_accepted == whole.num_accepted == len(token_ids)
    mask = manager().bitmask([whole, behind])
    assert allowed_ids(mask.bitmask, 0) == allowed_ids(mask.bitmask, 1) == {2}


def test_json_object_is_any_object_with_bounded_whitespace():
    compiled = manager().compile(StructuredOutputsParams(json_object=True))

    def accepts(text):
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts("{}") and accepts('{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts("[1]") and not accepts('"a"') and not accepts('{"a":   1}') and not accepts('{\n"a": 1}')


# ---- parsing structured_outputs ---------------------------------------------------------------------------------

TEXT = st.text(max_size=12)
KINDS = {"json": st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer"])}),
         "regex": TEXT.filter(bool), "choice": st.lists(TEXT, min_size=1, max_size=4), "grammar": TEXT.filter(bool),
         "json_object": st.just(True)}


@settings(max_examples=150, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(KINDS)), max_size=3, unique=True), data=st.data(),
       nulls=st.lists(st.sampled_from(sorted(KINDS)), max_size=2), whitespace=st.sampled_from([None, True, False]),
       as_text=st.booleans())
def test_structured_outputs_parse_to_exactly_one_kind_or_name_the_field(kinds, data, nulls, whitespace, as_text):
    """An object (or its JSON text, as a string sampling parameter) with exactly one kind parses to that kind
    and value, whatever else is null; anything else is a ValueError naming structured_outputs."""
    value = {kind: data.draw(KINDS[kind]) for kind in kinds}
    value.update({kind: None for kind in nulls if kind not in value})
    if whitespace is not None:
        value["disable_any_whitespace"] = whitespace
    try:
        params = SamplingParams.from_dict({"structured_outputs": json.dumps(value) if as_text else value})
    except ValueError as error:
        assert len(kinds) != 1 and str(error).startswith("structured_outputs: give exactly one of"), str(error)
        return
    assert len(kinds) == 1
    spec = params.structured_outputs
    assert spec.kind == kinds[0] and getattr(spec, kinds[0]) == value[kinds[0]]
    assert spec.disable_any_whitespace is (whitespace is not False)  # bounded unless turned off


@pytest.mark.parametrize("value", [
    [], "not json", '["a list"]', {"json": "[1]"}, {"json": "{oops"}, {"json": 5}, {"regex": ""}, {"regex": 5},
    {"choice": []}, {"choice": "red"}, {"choice": ["a", 1]}, {"grammar": ""}, {"json_object": "yes"},
    {"json_object": True, "disable_any_whitespace": "no"}, {"whitespace_pattern": " "}, {},
])
def test_malformed_structured_outputs_name_the_field(value):
    with pytest.raises(ValueError, match="^structured_outputs: "):
        SamplingParams(structured_outputs=value)


@settings(max_examples=100, deadline=None)
@given(choices=st.lists(st.text(max_size=8), min_size=1, max_size=4))
def test_a_choice_grammar_accepts_each_choice_exactly(choices):
    """The choices go into EBNF string literals: whatever their characters, each is accepted as it is."""
    compiled = manager().compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    matcher = xgr.GrammarMatcher(compiled)
    assert not (matcher.accept_string(max(choices, key=len) + "\x01") and matcher.is_completed())


def test_each_of_n_samples_follows_the_grammar_with_a_matcher_of_its_own(llm):
    """n = 4 samples of one request, one prompt computed once: each sample advances its own matcher, so every
    sample's text is a whole sentence of the grammar (a shared matcher would see the others' tokens)."""
    [out] = llm.generate(prompts(1, seed=5), SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=30,
                                                              structured_outputs={"regex": REGEX}), use_tqdm=False)
    assert [sample.index for sample in out.outputs] == [0, 1, 2, 3]
    for sample in out.outputs:
        assert sample.finish_reason == "stop" and re.fullmatch(REGEX, sample.text), sample.text
    assert len({sample.text for sample in out.outputs}) > 1
