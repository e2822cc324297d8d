"""The stub's request intake (serving/stub/intake.py): every request is answered or handed on, in arrival order,
with the token ids the engine's own tokenization gives. The served tests (test_serving.py and others) run it
inside tritonserver."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nanoserve.engine.tokenize import encode_prompt_texts, max_prompt_bytes, prompt_bytes_error
from nanoserve.errors import ErrorKind, RequestError
from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.stub.control import Drain
from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.intake import Admission, Intake
from nanoserve.serving.stub.request import ParsedRequest
from nanoserve.serving.stub.responses import Register, Reject, Stream

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def max_bytes(tokenizer):
    return max_prompt_bytes(tokenizer, MAX_MODEL_LEN)


def outcome(tokenizer, text: str, max_bytes: int):
    """The reference: the tokenizer's own encode of a text that fits, the error of one that does not."""
    return prompt_bytes_error(text, max_bytes) or tokenizer.encode(text, add_special_tokens=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(min_size=1, max_size=400), max_size=6))
def test_a_batch_is_tokenized_as_each_prompt_alone(tokenizer, max_bytes, texts):
    batch = encode_prompt_texts(tokenizer, texts, max_bytes)
    alone = [outcome(tokenizer, text, max_bytes) for text in texts]
    assert [str(x) if isinstance(x, RequestError) else x for x in batch] == \
           [str(x) if isinstance(x, RequestError) else x for x in alone]


class Recorder:
    """The response thread's inbox and the engine core, as the intake sees them: what each received, in order."""

    def __init__(self):
        self.seen = []

    def put(self, event):
        self.seen.append(("event", event))

    def add(self, request_id, prompt_ids, sampling_params):
        self.seen.append(("add", request_id, prompt_ids, sampling_params.max_tokens))


def admission(request_id: str, prompt, max_tokens: int = 4) -> Admission:
    parsed = ParsedRequest(prompt, SamplingParams(max_tokens=max_tokens))
    return Admission(request_id, Stream(sender=request_id, request=parsed))


def run_intake(requests: list, tokenizer, max_bytes: int) -> list:
    """What the inbox and engine receive for `requests`, each already the admit's answer (an Admission or an
    event), put as separate requests and entered before stop() returns."""
    recorder = Recorder()
    intake = Intake(lambda request, arrival: request, recorder, recorder, tokenizer, max_bytes)
    for request in requests:
        intake.put(request)
    intake.stop()
    return recorder.seen


def test_requests_are_answered_and_handed_on_in_arrival_order(tokenizer, max_bytes):
    drain, refused = Drain("drainer", 5.0), Reject("bad", RequestError("top_p", "must be in (0, 1], got 2.0"))
    requests = [admission("a", "Hello there"), refused, admission("b", [5, 6, 7], max_tokens=2), drain,
                admission("c", "é" * (max_bytes // 2 + 1)), admission("d", "the end")]
    seen = run_intake(requests, tokenizer, max_bytes)
    kinds = [(kind, type(rest[0]).__name__) if kind == "event" else (kind, rest[0]) for kind, *rest in seen]
    assert kinds == [("event", "Register"), ("add", "a"), ("event", "Reject"), ("event", "Register"), ("add", "b"),
                     ("event", "Drain"), ("event", "Register"), ("event", "StepResult"), ("event", "Register"),
                     ("add", "d")]
    adds = {entry[1]: entry[2:] for entry in seen if entry[0] == "add"}
    assert adds == {"a": (tokenizer.encode("Hello there"), 4), "b": ([5, 6, 7], 2),
                    "d": (tokenizer.encode("the end"), 4)}
    assert seen[2][1] is refused and seen[5][1] is drain
    # registered, then rejected as the engine rejects (the response thread names the input the prompt came in)
    [(request_id, error)] = seen[7][1].rejected
    assert request_id == "c" and error.field == "prompt" and "cannot fit" in error.message
    registered = [event for kind, event, *_ in seen if kind == "event" and isinstance(event, Register)]
    assert [event.request_id for event in registered] == ["a", "b", "c", "d"]  # each before the engine's add


class BrokenTokenizer:
    def __call__(self, *args, **kwargs):
        raise RuntimeError("tokenizer bug")


def test_a_tokenizer_that_fails_fails_those_requests_only():
    recorder = Recorder()
    intake = Intake(lambda request, arrival: request, recorder, recorder, BrokenTokenizer(), None)
    intake.enter([(admission("text", "a prompt"), 0.0), (admission("ids", [1, 2]), 0.0)])
    intake.put(admission("later", [3]))
    intake.stop()
    rejected = [event.rejected for kind, event, *_ in recorder.seen if isinstance(event, StepResult)]
    assert [[(request_id, error.kind) for request_id, error in r] for r in rejected] == [[("text", ErrorKind.INTERNAL)]]
    assert [entry[1] for entry in recorder.seen if entry[0] == "add"] == ["ids", "later"]


def expected_entries(item, tokenizer, max_bytes: int) -> list:
    """What one admit answer becomes, alone: an event as it is, or Register then the engine's add (or, for a text
    that cannot fit, Register then its rejection)."""
    if not isinstance(item, Admission):
        return [("event", item)]
    prompt = item.stream.request.prompt
    ids = prompt if not isinstance(prompt, str) else outcome(tokenizer, prompt, max_bytes)
    register = ("register", item.request_id)
    if isinstance(ids, RequestError):
        return [register, ("rejected", item.request_id, str(ids))]
    return [register, ("add", item.request_id, list(ids))]


def observed(seen: list) -> list:
    entries = []
    for kind, event, *rest in seen:
        if kind == "add":
            entries.append(("add", event, list(rest[0])))
        elif isinstance(event, Register):
            entries.append(("register", event.request_id))
        elif isinstance(event, StepResult):
            entries += [("rejected", request_id, str(error)) for request_id, error in event.rejected]
        else:
            entries.append(("event", event))
    return entries


answers = st.one_of(
    st.builds(lambda text: ("text", text), st.text(min_size=1, max_size=60)),
    st.builds(lambda n: ("huge", n), st.integers(1, 3)),
    st.builds(lambda ids: ("ids", ids), st.lists(st.integers(0, 500), min_size=1, max_size=8)),
    st.just(("reject", None)), st.just(("drain", None)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(answers, max_size=12), cuts=st.lists(st.integers(0, 12), max_size=4))
def test_any_batching_hands_on_each_request_in_arrival_order(tokenizer, max_bytes, kinds, cuts):
    """Requests split into batches however the intake happens to take them: every request's entries, in arrival
    order, are those it gets alone."""
    items = []
    for index, (kind, value) in enumerate(kinds):
        if kind == "text":
            items.append(admission(f"r{index}", value))
        elif kind == "huge":
            items.append(admission(f"r{index}", "é" * (value * max_bytes)))
        elif kind == "ids":
            items.append(admission(f"r{index}", value))
        elif kind == "reject":
            items.append(Reject(f"r{index}", RequestError("top_p", "bad")))
        else:
            items.append(Drain(f"r{index}", float(index)))
    recorder = Recorder()
    intake = Intake(lambda request, arrival: request, recorder, recorder, tokenizer, max_bytes)
    bounds = sorted({0, len(items), *(cut for cut in cuts if cut <= len(items))})
    for start, end in zip(bounds, bounds[1:]):
        intake.enter([(item, 0.0) for item in items[start:end]])
    intake.stop()
    assert observed(recorder.seen) == [entry for item in items for entry in expected_entries(item, tokenizer,
                                                                                              max_bytes)]
