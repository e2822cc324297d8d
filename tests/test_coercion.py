"""One truth table for values that may arrive as strings, and every place that reads such values uses it: engine
arguments (LLM(...), model.json, `nanoserve serve` flags), config.pbtxt parameters, sampling parameters and the
request's BOOL flags."""
import json

import numpy as np
import pytest

from nanoserve.coercion import FALSE_WORDS, TRUE_WORDS, from_text, optional_bool, to_bool

TABLE = [  # (value, boolean or None for an error)
    (True, True), (False, False), (np.bool_(True), True), (np.bool_(False), False), (1, True), (0, False),
    (np.int32(1), True), (np.int64(0), False),
    ("true", True), ("TRUE", True), (" True ", True), ("1", True), ("yes", True), ("Yes", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False), ("off", False), (" off\n", False),
    ("", None), ("maybe", None), ("2", None), ("-1", None), ("1.0", None), ("t", None), ("y", None),
    (2, None), (-1, None), (1.0, None), (0.0, None), (None, None), (b"true", None), ([True], None),
]


@pytest.mark.parametrize("value, expected", TABLE)
def test_the_truth_table(value, expected):
    if expected is None:
        with pytest.raises(ValueError, match=r"^flag_name: expected a boolean \(true/false, 1/0, yes/no, on/off\)"):
            to_bool("flag_name", value)
    else:
        assert to_bool("flag_name", value) is expected


def test_the_words_are_lowercase_and_disjoint():
    assert all(word == word.strip().lower() for word in TRUE_WORDS + FALSE_WORDS)
    assert not set(TRUE_WORDS) & set(FALSE_WORDS)


def test_an_absent_value_takes_the_default():
    assert optional_bool("x", None) is False and optional_bool("x", "") is False and optional_bool("x", "  ") is False
    assert optional_bool("x", None, default=True) is True and optional_bool("x", "off", default=True) is False
    with pytest.raises(ValueError, match="^x: "):
        optional_bool("x", "maybe")


@pytest.mark.parametrize("kind, text, expected", [
    ("int", " 16 ", 16), ("int | None", "null", None), ("int | None", "None", None), ("float", "0.5", 0.5),
    ("float | None", "none", None), ("bool", "yes", True), ("bool", "0", False), ("list[int]", "[1, 2]", [1, 2]),
    ("list[str]", '["a"]', '["a"]'),  # a stop string, even one that looks like JSON
    ("str | None", "none", "none"),  # a string field keeps its text
    ("str", " x ", " x "),
])
def test_from_text_parses_a_string_by_the_field_type(kind, text, expected):
    assert from_text("field", kind, text) == expected


@pytest.mark.parametrize("kind, text, message", [
    ("int", "16.5", "field: expected an integer, got '16.5'"), ("int", "many", "field: expected an integer"),
    ("float", "warm", "field: expected a number, got 'warm'"), ("bool", "maybe", "field: expected a boolean"),
    ("int", "null", "field: expected an integer"),  # not optional: null is no value
    ("list[int]", "[1, ", "field: expected a JSON list[int]"),
])
def test_from_text_errors_name_the_field(kind, text, message):
    with pytest.raises(ValueError, match=f"^{message}".replace("(", r"\(").replace("[", r"\[")):
        from_text("field", kind, text)


def test_non_strings_pass_through_for_the_field_s_own_check():
    assert from_text("field", "int", 3.5) == 3.5 and from_text("field", "bool", 2) == 2


@pytest.mark.parametrize("word, expected", [(w, True) for w in TRUE_WORDS] + [(w, False) for w in FALSE_WORDS])
def test_every_reader_takes_the_same_words(word, expected):
    """Each place that reads a boolean that may be a string: the same answer for every word of the table."""
    from nanoserve.config import coerce_engine_arg
    from nanoserve.sampling_params import SamplingParams
    from nanoserve.serving.shared.model_json import reports_vllm_metrics
    from nanoserve.serving.stub.request import parse_request
    from nanoserve.serving.stub.shutdown import ServerArgs

    assert coerce_engine_arg("enforce_eager", word.upper()) is expected  # engine arguments, model.json, flags
    assert SamplingParams.from_dict({"ignore_eos": word}).ignore_eos is expected  # sampling parameters
    assert reports_vllm_metrics(word, {}) is expected  # config.pbtxt parameter REPORT_CUSTOM_METRICS
    assert reports_vllm_metrics("true", {"disable_log_stats": word}) is not expected  # model.json
    assert (ServerArgs.parse(["--allow-http", word]) is not None) is expected  # tritonserver's own flags
    tensors = {"text_input": np.array([b"Hi"], dtype=object)}  # request flags, here as HTTP request parameters
    assert parse_request(tensors.get, json.dumps({"stream": word, "max_tokens": 2})).stream is expected
