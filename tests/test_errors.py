"""RequestError: the typed error from the checks to the reporters, and its text across the Triton wire (a gRPC
stream's error carries only its message), decoded in one place: vllm_text.decode_error."""
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.errors import FIELD, ErrorKind, RequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.shared.contracts.vllm_text import MARKERS, decode_error
from nanoserve.serving.shared.engine_model import UNAVAILABLE

fields = st.from_regex(FIELD, fullmatch=True)
texts = st.text(st.characters(codec="utf-8"), max_size=40)
plain = texts.filter(lambda text: not any(word in text for words in MARKERS.values() for word in words))


def with_marker(kind):
    return st.tuples(plain, st.sampled_from(MARKERS[kind]), plain).map("".join).filter(
        lambda message: not message.startswith("internal error") and not RequestError.parse(message).field)


# every error a client gets: bad input names its field (any message); nanoserve's own failures start with
# "internal error"; the others say what they are in the stub's or tritonserver's words
sent_errors = st.one_of(
    st.builds(RequestError, fields, texts),
    st.builds(RequestError, st.none(), texts.map("internal error: ".__add__), st.just(ErrorKind.INTERNAL)),
    st.builds(RequestError, st.none(), plain.map(UNAVAILABLE.__add__), st.just(ErrorKind.UNAVAILABLE)),
    *(st.builds(RequestError, st.none(), with_marker(kind), st.just(kind)) for kind in MARKERS),
)


@given(sent_errors)
def test_an_error_round_trips_through_its_text(error):
    decoded = decode_error(str(error))
    assert (decoded.field, decoded.message, decoded.kind) == (error.field, error.message, error.kind)


@given(texts)
def test_decoding_never_changes_the_text(message):
    """Whatever a Triton error says (tritonserver's own words too), the client reports that text."""
    assert str(decode_error(message)) == message


@given(fields, texts)
def test_the_text_is_field_colon_message(field, message):
    error = RequestError(field, message)
    assert str(error) == f"{field}: {message}" and isinstance(error, ValueError) and error.kind is ErrorKind.INVALID
    assert str(RequestError(None, message)) == message


def test_an_error_outlives_pickling_and_nesting():
    error = RequestError("top_p", "must be in (0, 1], got 2", ErrorKind.INVALID)
    assert pickle.loads(pickle.dumps(error)) == error
    assert error.within("sampling_parameters") == RequestError("sampling_parameters", "top_p: must be in (0, 1], got 2")


def test_a_plain_value_error_is_read_by_its_text():
    """Code that still raises a plain ValueError (the scheduler's admission checks) keeps the same convention."""
    plain = ValueError("prompt: 9 tokens leave no room")
    assert RequestError.of(plain) == RequestError("prompt", "9 tokens leave no room")
    assert RequestError.of(ValueError("LoRA adapter 'x': bad")) == RequestError(None, "LoRA adapter 'x': bad")


@pytest.mark.parametrize("params, field, message", [
    ({"top_p": 2.0}, "top_p", "must be in (0, 1], got 2.0"),
    ({"max_tokens": "many"}, "max_tokens", "expected an integer, got 'many'"),  # coercion names the field too
    ({"structured_outputs": {"json": "{"}}, "structured_outputs", None),  # a key's error is its parent's
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}}, "structured_outputs",
     "disable_any_whitespace: expected a boolean, got 'x'"),
    ({" ": 1}, "sampling_parameters", None),  # a key that is no field's name
    ({"a: b": 1}, "sampling_parameters", None),
])
def test_sampling_params_raise_the_field_as_an_attribute(params, field, message):
    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict(params)
    assert info.value.field == field and (message is None or info.value.message == message)
    assert decode_error(str(info.value)) == info.value


def test_renaming_changes_only_the_fields_it_names():
    names = {"prompt": "input_ids"}
    assert RequestError("prompt", "too long").renamed(names) == RequestError("input_ids", "too long")
    assert RequestError("top_p", "x").renamed(names) == RequestError("top_p", "x")
    assert RequestError(None, "x", ErrorKind.INTERNAL).renamed(names) == RequestError(None, "x", ErrorKind.INTERNAL)
