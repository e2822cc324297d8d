"""SamplingParams validation: every bad value raises ValueError whose message starts with the field name;
JSON-ish strings (as genai-perf / Triton parameters send them) are parsed."""
import math

import pytest

from nanoserve.sampling_params import (MAX_N, MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                       MAX_STOP_TOKEN_IDS, MAX_TOP_K, SamplingParams)
from nanoserve.serving.stub.request import json_object

INVALID = [  # field, value
    ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "32"),
    ("min_tokens", -1), ("min_tokens", None), ("min_tokens", 2.0),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.5"),
    ("temperature", None), ("temperature", True), ("temperature", 10 ** 400), ("temperature", 100.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.5), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.0), ("top_k", None), ("top_k", MAX_TOP_K + 1), ("top_k", 10 ** 30),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.inf),
    ("seed", -1), ("seed", 1.0), ("seed", "7"), ("seed", MAX_SEED + 1), ("seed", 10 ** 100),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", 1e-30), ("repetition_penalty", 1e30),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("frequency_penalty", 3.0),
    ("frequency_penalty", "x"),
    ("ignore_eos", 1), ("ignore_eos", "true"), ("ignore_eos", None),
    ("include_stop_str_in_output", 0), ("skip_special_tokens", "no"),
    ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a": 1}), ("stop", ""),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", "x" * (MAX_STOP_STRING_CHARS + 1)),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("stop_token_ids", "12"), ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ("logprobs", -1), ("logprobs", True), ("logprobs", 2.0),
    ("n", MAX_N + 1), ("n", 0), ("n", 2.0), ("n", True), ("prompt_logprobs", -1), ("prompt_logprobs", 1.5),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(f"{field}:"), str(error.value)


def test_defaults_are_valid():
    params = SamplingParams()
    assert params.max_tokens is None and params.temperature == 1.0 and params.stop == [] and not params.greedy


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(temperature=0), dict(temperature=0.0), dict(top_p=1.0),
    dict(top_p=1e-6), dict(top_k=-1), dict(top_k=0), dict(top_k=5), dict(min_p=0.0), dict(min_p=1.0),
    dict(seed=0), dict(seed=MAX_SEED), dict(repetition_penalty=0.5), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(logprobs=0), dict(logprobs=10 ** 6), dict(stop_token_ids=(1, 2)),
    dict(min_tokens=5, max_tokens=5), dict(stop=None), dict(stop_token_ids=None), dict(top_k=MAX_TOP_K),
    dict(temperature=100), dict(repetition_penalty=0.01), dict(repetition_penalty=100),
    dict(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS), dict(stop_token_ids=[0] * MAX_STOP_TOKEN_IDS),
    dict(n=1), dict(n=MAX_N), dict(prompt_logprobs=0),
])
def test_valid_values(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(min_tokens=101), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(stop_token_ids=[3, 1000]), "stop_token_ids"),
])
def test_model_dependent_ranges_name_the_field(kwargs, field):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError) as error:
        params.check_against_model(max_model_len=100, vocab_size=1000, max_logprobs=20)
    assert str(error.value).startswith(f"{field}:"), str(error.value)


def test_model_dependent_ranges_accept_their_limits():
    SamplingParams(min_tokens=100, logprobs=20, prompt_logprobs=20, stop_token_ids=[0, 999]).check_against_model(
        100, 1000, 20)


def test_each_sample_of_a_request_gets_the_next_seed():
    """vLLM's ParentRequest rule: sample i has seed + i (wrapping at 2**64); prompt logprobs only on sample 0."""
    params = SamplingParams(n=3, seed=MAX_SEED - 1, prompt_logprobs=2, temperature=0.5)
    samples = [params.for_sample(i) for i in range(3)]
    assert [s.seed for s in samples] == [MAX_SEED - 1, MAX_SEED, 0]
    assert [s.prompt_logprobs for s in samples] == [2, None, None] and {s.n for s in samples} == {1}
    assert all(s.temperature == 0.5 for s in samples)
    assert SamplingParams(n=2).for_sample(1).seed is None
    single = SamplingParams(seed=5)
    assert single.for_sample(0) is single


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens:"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_stop_forms():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy


# ---- from_dict, and the JSON text serving parses ------------------------------------------------------------

def from_json(text: str) -> SamplingParams:
    return SamplingParams.from_dict(json_object("sampling_parameters", text))


def test_strings_from_json_are_parsed():
    params = from_json(
        '{"max_tokens": "32", "temperature": "0.5", "ignore_eos": "true", "top_k": " 4 ", "seed": "null",'
        ' "stop_token_ids": "[3, 4]", "skip_special_tokens": "False", "logprobs": "2", "min_p": "1e-2"}')
    assert params.max_tokens == 32 and params.temperature == 0.5 and params.ignore_eos is True
    assert params.top_k == 4 and params.seed is None and params.stop_token_ids == [3, 4]
    assert params.skip_special_tokens is False and params.logprobs == 2 and params.min_p == 0.01


def test_native_json_types():
    params = from_json('{"max_tokens": 8, "temperature": 0, "stop": ["\\n\\n", "END"],'
                                      ' "include_stop_str_in_output": true, "seed": 3}')
    assert params.max_tokens == 8 and params.greedy and params.stop == ["\n\n", "END"]
    assert params.include_stop_str_in_output and params.seed == 3


def test_stop_string_is_taken_literally():
    """A stop value is any text, so a string is one stop string (not parsed as JSON)."""
    assert SamplingParams.from_dict({"stop": "true"}).stop == ["true"]
    assert SamplingParams.from_dict({"stop": "32"}).stop == ["32"]


def test_empty_json_gives_defaults():
    assert from_json("") == SamplingParams() == from_json("  {} ")


@pytest.mark.parametrize("params,field", [
    ({"max_tokens": "32.5"}, "max_tokens"), ({"max_tokens": "abc"}, "max_tokens"), ({"max_tokens": "-1"}, "max_tokens"),
    ({"max_tokens": 32.0}, "max_tokens"), ({"temperature": "warm"}, "temperature"),
    ({"temperature": "-1"}, "temperature"), ({"temperature": "nan"}, "temperature"),
    ({"temperature": "inf"}, "temperature"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"ignore_eos": "2"}, "ignore_eos"),
    ({"top_p": "0"}, "top_p"), ({"top_p": "1.5"}, "top_p"), ({"seed": "1.5"}, "seed"),
    ({"stop_token_ids": "[1, "}, "stop_token_ids"), ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"stop_token_ids": '["a"]'}, "stop_token_ids"), ({"stop": 5}, "stop"), ({"stop": [1]}, "stop"),
    ({"min_tokens": "null"}, "min_tokens"), ({"temperature": None}, "temperature"), ({"n": "129"}, "n"),
    ({"bogus": 1}, "bogus"), ({"max_tokens": 8, "zzz": 1, "aaa": 2}, "aaa"),
    ({"": 1}, "sampling_parameters"), ({" ": 1}, "sampling_parameters"),  # a blank name is quoted
])
def test_from_dict_errors_name_the_field(params, field):
    with pytest.raises(ValueError) as error:
        SamplingParams.from_dict(params)
    assert str(error.value).startswith(f"{field}:"), str(error.value)


@pytest.mark.parametrize("text", ['{"max_tokens": ', "not json", "{'max_tokens': 3}", '{"a" 1}'])
def test_invalid_json(text):
    with pytest.raises(ValueError, match=r"^sampling_parameters: invalid JSON"):
        from_json(text)


@pytest.mark.parametrize("text", ["[1, 2]", '"text"', "3", "null"])
def test_json_that_is_not_an_object(text):
    with pytest.raises(ValueError, match=r"^sampling_parameters: expected a JSON object"):
        from_json(text)


def test_json_infinity_is_rejected():
    with pytest.raises(ValueError, match=r"^temperature:"):
        from_json('{"temperature": Infinity}')


def test_every_field_has_a_documented_range():
    """docs/serving.md's table names every numeric field (booleans have no range)."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    table = docs.split("| parameter | default | range |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    documented = {name for line in table for name in line.split("|")[1].replace("`", " ").replace(",", " ").split()}
    numeric = {f.name for f in SamplingParams.__dataclass_fields__.values() if "bool" not in str(f.type)}
    assert numeric <= documented, numeric - documented
