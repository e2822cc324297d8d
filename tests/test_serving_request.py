"""Parsing and validation of Triton request tensors (every bad input names its field), and the response
thread's formatting and pacing: pure Python, no server."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanoserve.engine.outputs import PromptLogprobs, RequestOutput, joined, joined_all
from nanoserve.errors import ErrorKind, RequestError
from nanoserve.sampling_params import MAX_STOP_STRINGS
from nanoserve.serving.shared.contracts.token_model import TOKEN_INPUTS, is_final
from nanoserve.serving.shared.contracts.trtllm_scalars import SCALAR_INPUTS
from nanoserve.serving.shared.contracts.vllm_text import OPTIONAL_OUTPUTS, TEXT_INPUTS, TEXT_OUTPUTS
from nanoserve.serving.shared.engine_model import MAX_DRAIN_SECONDS
from nanoserve.serving.stub.control import CancelById, Drain, control_event
from nanoserve.serving.stub.engine_thread import StepResult
from nanoserve.serving.stub.ensemble import DetokenizeRequest, ended_token_arrays, token_arrays
from nanoserve.serving.stub.inbox import Inbox
from nanoserve.serving.stub.pacing import Pacer, merge_into
from nanoserve.serving.stub.request import MAX_JSON_BYTES, MAX_STOP_WORD_BYTES, parse_request
from nanoserve.serving.stub.responses import (STOP, Generated, Register, Reject, ResponseThread, Stream, text_arrays,
                                              vllm_logprobs)


def formatted(stream, output, every_step=False):
    """What the response thread sends for one output: the stream takes it, then text_arrays formats it."""
    stream.add([output])
    return text_arrays(stream, [output], str, every_step)


def text(value) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def getter(**tensors):
    return lambda name: tensors.get(name)


def parse(parameters="", tokens=False, **tensors):
    return parse_request(getter(**tensors), parameters, tokens=tokens)


def error_of(parameters="", tokens=False, **tensors) -> str:
    with pytest.raises(RequestError) as info:
        parse(parameters, tokens, **tensors)
    return str(info.value)


def test_defaults_never_truncate_silently():
    req = parse(text_input=text("Hello"))
    assert req.prompt == "Hello"
    assert req.sampling_params.max_tokens is None  # the engine's default: until a stop or max_model_len
    assert not req.stream and not req.exclude_input and req.outputs == frozenset()


def test_sampling_parameters_tensor_accepts_string_values():
    sp = json.dumps({"max_tokens": "32", "min_tokens": "4", "temperature": "0", "stop": ["\n\n"],
                     "ignore_eos": "true"})
    req = parse(text_input=text("Hi"), sampling_parameters=text(sp), stream=np.array([True]),
                exclude_input_in_output=np.array([True]))
    params = req.sampling_params
    assert (params.max_tokens, params.min_tokens, params.temperature) == (32, 4, 0.0)
    assert params.stop == ["\n\n"] and params.ignore_eos
    assert req.stream and req.exclude_input


def test_request_parameters_used_without_tensor_and_flags_taken_out():
    parameters = json.dumps({"max_tokens": 7, "top_p": "0.5", "stream": "true", "return_finish_reason": True,
                             "triton_enable_empty_final_response": True})
    req = parse(parameters, text_input=text("Hi"))
    assert req.sampling_params.max_tokens == 7 and req.sampling_params.top_p == 0.5
    assert req.stream and req.outputs == {"finish_reason"}


def test_sampling_parameters_tensor_wins_over_request_parameters():
    req = parse('{"max_tokens": 99}', text_input=text("Hi"), sampling_parameters=text('{"max_tokens": 3}'))
    assert req.sampling_params.max_tokens == 3


def test_trtllm_scalar_tensors():
    req = parse(text_input=text("Hi"), max_tokens=np.array([5], np.int32), temperature=np.array([0.5], np.float32),
                top_p=np.array([0.9], np.float32), top_k=np.array([40], np.int32), seed=np.array([7], np.uint64),
                frequency_penalty=np.array([0.25], np.float32), presence_penalty=np.array([-0.5], np.float32),
                stop_words=np.array([b"</s>", b"", "\u00e9t\u00e9".encode()], dtype=object))
    p = req.sampling_params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed) == (5, 0.5, 40, 7)
    assert p.top_p == pytest.approx(0.9) and p.frequency_penalty == 0.25 and p.presence_penalty == -0.5
    assert p.stop == ["</s>", "\u00e9t\u00e9"]


def test_return_flags_select_outputs_and_logprobs_stay_off_without_the_parameter():
    flags = {f"return_{name}": np.array([True]) for name in OPTIONAL_OUTPUTS}
    req = parse(text_input=text("Hi"), **flags)
    assert req.outputs == set(OPTIONAL_OUTPUTS)
    assert req.sampling_params.logprobs is None  # vllm_backend: the logprobs output is then null
    req = parse(text_input=text("Hi"), sampling_parameters=text('{"logprobs": 3}'), **flags)
    assert req.sampling_params.logprobs == 3


def test_token_prompt():
    req = parse(tokens=True, input_ids=np.array([[5, 6, 7]], np.int64))
    assert req.prompt == [5, 6, 7]
    assert "input_ids: empty" in error_of(tokens=True, input_ids=np.array([], np.int32))
    assert error_of(tokens=True).startswith("input_ids: missing")
    two = text('{"n": 2}')  # the token model (the ensemble's) generates one sequence per request
    assert error_of(tokens=True, input_ids=np.array([5]), sampling_parameters=two).startswith("n: ")
    assert parse(text_input=text("Hi"), sampling_parameters=two).sampling_params.n == 2


def test_input_ids_beyond_max_model_len_are_rejected_before_they_are_read():
    ids = np.zeros(10_000_000, np.int32)  # 40 MB: tolist() would make 10 M Python ints
    with pytest.raises(ValueError, match=r"^input_ids: 10000000 tokens leave no room .* max_model_len \(2048\)"):
        parse_request(getter(input_ids=ids), tokens=True, max_model_len=2048)
    assert parse_request(getter(input_ids=ids[:2047]), tokens=True, max_model_len=2048).prompt == [0] * 2047


def test_scalar_tensors_take_the_whole_seed_range():
    assert parse(text_input=text("Hi"), seed=np.array([2 ** 64 - 1], np.uint64)).sampling_params.seed == 2 ** 64 - 1


@pytest.mark.parametrize("tensors, parameters, field", [
    ({}, "", "text_input"),
    ({"text_input": text("")}, "", "text_input"),
    ({"text_input": text(b"caf\xc3")}, "", "text_input"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "", "text_input"),
    ({"input_ids": np.array([], np.int32)}, "", "input_ids"),
    ({"input_ids": np.array([1.5], np.float32)}, "", "input_ids"),
    ({"input_ids": np.array([1, 2], np.int32), "text_input": text("Hi")}, "", "input_ids"),
    ({"sampling_parameters": text("{max_tokens: 3")}, "", "sampling_parameters"),
    ({"sampling_parameters": text("[1, 2]")}, "", "sampling_parameters"),
    ({"sampling_parameters": text('{"max_token": 3}')}, "", "max_token"),
    ({"sampling_parameters": text('{"max_tokens": "many"}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": [3]}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": -1}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"max_tokens": -1}')}, "", "max_tokens"),
    ({"sampling_parameters": text('{"top_p": 1.5}')}, "", "top_p"),
    ({"sampling_parameters": text('{"top_p": "0"}')}, "", "top_p"),
    ({"sampling_parameters": text('{"temperature": "hot"}')}, "", "temperature"),
    ({"max_tokens": np.array([-3], np.int32)}, "", "max_tokens"),
    ({"max_tokens": np.array([2.0], np.float32)}, "", "max_tokens"),
    ({"temperature": np.array([b"x"], dtype=object)}, "", "temperature"),
    ({"top_p": np.array([0.0], np.float32)}, "", "top_p"),
    ({"stream": np.array([b"yes"], dtype=object)}, "", "stream"),
    ({"stop_words": np.array([b"\xff"], dtype=object)}, "", "stop_words"),
    ({}, "{not json", "parameters"),
    ({}, '{"unknown_knob": 1}', "unknown_knob"),
    ({}, '{"stream": "maybe"}', "stream"),
    # nested past Python's recursion limit: a RecursionError escaped execute() with a traceback
    ({"sampling_parameters": text("[" * 100_000)}, "", "sampling_parameters"),
    ({}, "[" * 100_000, "parameters"),
    ({"sampling_parameters": text(json.dumps({"stop_token_ids": "[" * 100_000}))}, "", "stop_token_ids"),
    ({}, json.dumps({"max_tokens": 3, "stop_token_ids": "[" * 100_000}), "stop_token_ids"),
    # the TRT-LLM scalar tensors have the same ranges as sampling_parameters
    ({"seed": np.array([-1], np.int64)}, "", "seed"),
    ({"top_k": np.array([-7], np.int32)}, "", "top_k"),
    ({"temperature": np.array([np.inf], np.float32)}, "", "temperature"),
    ({"temperature": np.array([np.nan], np.float32)}, "", "temperature"),
    ({"frequency_penalty": np.array([2.5], np.float32)}, "", "frequency_penalty"),
    # sizes are bounded before anything is decoded or parsed
    ({"sampling_parameters": text(" " * (MAX_JSON_BYTES + 1))}, "", "sampling_parameters"),
    ({}, " " * (MAX_JSON_BYTES + 1), "parameters"),
    ({"stop_words": np.array([b"x"] * (MAX_STOP_STRINGS + 1), dtype=object)}, "", "stop_words"),
    ({"stop_words": np.array([b"x" * (MAX_STOP_WORD_BYTES + 1)], dtype=object)}, "", "stop_words"),
    ({"sampling_parameters": text(json.dumps({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}))}, "", "stop"),
    ({"sampling_parameters": text(json.dumps({"stop_token_ids": [1] * 1000}))}, "", "stop_token_ids"),
])
def test_bad_input_names_the_field(tensors, parameters, field):
    if field != "text_input":
        tensors = {"text_input": text("Hello"), **tensors}
    with pytest.raises(RequestError) as info:
        parse(parameters, **tensors)
    error = info.value
    assert (error.field, error.kind) == (field, ErrorKind.INVALID) and str(error) == f"{field}: {error.message}"


def test_the_text_model_takes_token_ids_in_input_ids():
    req = parse(input_ids=np.array([[5, 0, 7]], np.int32), exclude_input_in_output=np.array([True]))
    assert req.prompt == [5, 0, 7] and req.exclude_input
    whole = Stream(None, parse(input_ids=np.array([5, 0, 7], np.int32)))
    output = outputs_of("a", [(9, " x")])[0]
    whole.add([output])
    decoded = text_arrays(whole, [output], str, decode=lambda ids: "<" + ",".join(map(str, ids)) + ">")
    assert decoded["text_output"].tolist() == [b"<5,0,7> x"]  # the prompt first, decoded


def test_contract_tables_match_design():
    inputs = {name: spec.config() for name, spec in TEXT_INPUTS.items()}
    assert inputs["text_input"]["data_type"] == "TYPE_STRING" and inputs["input_ids"]["data_type"] == "TYPE_INT32"
    assert all(i["optional"] for i in inputs.values())  # the prompt is text_input or input_ids
    for name in ("stream", "exclude_input_in_output", *(f"return_{o}" for o in OPTIONAL_OUTPUTS)):
        assert inputs[name]["data_type"] == "TYPE_BOOL"
    assert set(SCALAR_INPUTS) <= set(inputs) and inputs["stop_words"]["dims"] == [-1]
    outputs = {name: (spec.data_type, list(spec.dims)) for name, spec in TEXT_OUTPUTS.items()}
    assert outputs == {"text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
                       "cumulative_logprob": ("TYPE_FP32", [-1]), "logprobs": ("TYPE_STRING", [-1]),
                       "num_input_tokens": ("TYPE_UINT32", [1]), "num_output_tokens": ("TYPE_UINT32", [-1]),
                       "prompt_logprobs": ("TYPE_STRING", [1])}
    assert set(TOKEN_INPUTS) == set(inputs) - {"text_input"} and not TOKEN_INPUTS["input_ids"].optional


# ---- response formatting (the response thread, without Triton) -------------------------------------------
def outputs_of(request_id, pieces, reason="length"):
    """RequestOutputs of one request, one token per step: pieces = [(token_id, text_delta), ...]."""
    return [RequestOutput(request_id, [t], d, i == len(pieces) - 1, reason if i == len(pieces) - 1 else None, 3,
                          i + 1, -0.5 * (i + 1), [{t: -0.5}], new_logprob_ranks=[1]) for i, (t, d) in enumerate(pieces)]


def test_merge_into_joins_a_requests_steps():
    a, b = outputs_of("a", [(5, "He"), (6, ""), (7, "llo")]), outputs_of("b", [(9, " x")])
    pending = {}
    merge_into(pending, [a[0], b[0], a[1]])
    merge_into(pending, [a[2]])
    assert [len(outputs) for outputs in pending.values()] == [1, 1]
    merged = [outputs[0] for outputs in pending.values()]
    assert [m.request_id for m in merged] == ["a", "b"]
    assert merged[0].new_token_ids == [5, 6, 7] and merged[0].text_delta == "Hello"
    assert merged[0].new_logprobs == [{5: -0.5}, {6: -0.5}, {7: -0.5}] and merged[0].new_logprob_ranks == [1, 1, 1]
    assert merged[0].finished and merged[0].num_output_tokens == 3 and merged[0].cumulative_logprob == -1.5
    assert merged[1] is b[0]


@given(st.lists(st.tuples(st.integers(0, 50), st.text(max_size=3), st.integers(1, 5)), min_size=1, max_size=12),
       st.data())
def test_joined_deltas_are_the_whole_output(tokens, data):
    """However a sample's tokens are cut into consecutive outputs, joining them gives one output with all of its
    tokens, text, logprobs and ranks in order, the prompt logprobs of the first, and the last one's state."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(tokens) - 1), max_size=len(tokens) - 1))) \
        if len(tokens) > 1 else []
    pieces = [tokens[i:j] for i, j in zip([0, *cuts], [*cuts, len(tokens)])]
    prompt = PromptLogprobs([1, 2], [None, {2: -1.0}], [1, 1])
    outputs = [RequestOutput("r", [t for t, _, _ in piece], "".join(x for _, x, _ in piece), end == len(pieces),
                             "stop" if end == len(pieces) else None, 4, sum(map(len, pieces[:end])),
                             new_logprobs=[{t: -0.1 * t} for t, _, _ in piece],
                             new_logprob_ranks=[rank for _, _, rank in piece],
                             prompt_logprobs=prompt if end == 1 else None)
               for end, piece in enumerate(pieces, 1)]
    whole = outputs[0]
    for output in outputs[1:]:
        whole = joined(whole, output)
    assert whole.new_token_ids == [t for t, _, _ in tokens] and whole.text_delta == "".join(x for _, x, _ in tokens)
    assert whole.new_logprobs == [{t: -0.1 * t} for t, _, _ in tokens]
    assert whole.new_logprob_ranks == [rank for _, _, rank in tokens]
    assert whole.prompt_logprobs is prompt and whole.finished and whole.num_output_tokens == len(tokens)


def random_step_outputs(draw_steps) -> list[list[RequestOutput]]:
    """Steps of requests "a" (n = 1) and "b" (n = 2): per step, which samples got a token (and its text)."""
    steps, counts = [], {}
    for step, picks in enumerate(draw_steps):
        outputs = []
        for request_id, index, delta, with_prompt in picks:
            counts[request_id, index] = counts.get((request_id, index), 0) + 1
            outputs.append(RequestOutput(request_id, [step], delta, False, None, 3, counts[request_id, index],
                                         -0.5 * step, [{step: -0.5}], new_logprob_ranks=[step % 3 + 1], index=index,
                                         prompt_logprobs=PromptLogprobs([1], [None], [1]) if with_prompt else None))
        steps.append(outputs)
    return steps


def fields(outputs) -> list[tuple]:
    return [(o.request_id, o.index, o.new_token_ids, o.text_delta, o.new_logprobs, o.new_logprob_ranks,
             o.num_output_tokens, o.prompt_logprobs is not None) for o in outputs]


@given(st.lists(st.lists(st.sampled_from([("a", 0), ("b", 0), ("b", 1)]), unique=True, max_size=3).flatmap(
    lambda picks: st.tuples(*[st.tuples(st.just(r), st.just(i), st.text(max_size=2), st.booleans())
                              for r, i in picks]).map(list)), min_size=1, max_size=8))
def test_pacer_sends_what_merging_every_step_gives(draw_steps):
    """The pacer keeps a request's outputs as they come and joins them once when it sends: the same outputs, in
    the same order, as merging them into one per sample at every step (merge_into)."""
    eager = {}
    for outputs in random_step_outputs(draw_steps):
        merge_into(eager, outputs)
    pacer, sent = Pacer(), {}
    pacer.add(random_step_outputs(draw_steps), lambda request_id, outputs: None)
    pacer.flush(lambda request_id, outputs: sent.setdefault(request_id, outputs), lambda *a: False, force=True)
    assert list(sent) == list(eager) and all(fields(sent[r]) == fields(eager[r]) for r in eager)
    assert not pacer.pending


def test_joined_all_is_joined_pair_by_pair():
    outputs = outputs_of("a", [(5, "He"), (6, ""), (7, "llo")])
    outputs[1].prompt_logprobs = PromptLogprobs([1], [None], [1])
    pairwise = outputs_of("a", [(5, "He"), (6, ""), (7, "llo")])
    pairwise[1].prompt_logprobs = outputs[1].prompt_logprobs
    whole = joined(joined(pairwise[0], pairwise[1]), pairwise[2])
    assert fields([joined_all(outputs)]) == fields([whole]) and joined_all(outputs) is outputs[2]


def test_text_arrays_streaming_and_not():
    pieces = [(5, "He"), (6, ""), (7, "llo")]
    flags = {"return_num_output_tokens": np.array([True]), "return_finish_reason": np.array([True])}
    streaming = Stream(None, parse(text_input=text("Hi "), stream=np.array([True]), **flags))
    sent = [formatted(streaming, o) for o in outputs_of("a", pieces)]
    assert [a["text_output"][0] for a in sent] == [b"He", b"", b"llo"]  # token-level flag: every token sent
    assert [a["finish_reason"][0] for a in sent] == [b"None", b"None", b"length"]  # as vllm_backend
    whole = Stream(None, parse(text_input=text("Hi "), **flags))
    sent = []
    for output in outputs_of("a", pieces):
        sent.append(formatted(whole, output))
    assert sent[:2] == [None, None] and sent[2]["text_output"][0] == b"Hi Hello"  # prompt prepended
    assert sent[2]["num_output_tokens"].tolist() == [3]
    quiet = Stream(None, parse(text_input=text("Hi "), stream=np.array([True])))
    assert formatted(quiet, outputs_of("a", [(6, ""), (7, "x")])[0]) is None  # held back: nothing sent


def test_logprobs_in_vllm_backends_format():
    """Per token {token_id: {"logprob", "rank", "decoded_token"}}: the sampled token first (its own rank, or its
    place among the top ones), then the top n by rank; null without the logprobs parameter."""
    generated = Generated([7, 5], [{7: -2.0, 3: -0.1, 4: -0.5}, {5: -0.2, 9: -1.0}], [6, 1])
    assert vllm_logprobs(generated, 2, lambda t: f"<{t}>") == [
        {"7": {"logprob": -2.0, "rank": 6, "decoded_token": "<7>"},
         "3": {"logprob": -0.1, "rank": 1, "decoded_token": "<3>"},
         "4": {"logprob": -0.5, "rank": 2, "decoded_token": "<4>"}},
        {"5": {"logprob": -0.2, "rank": 1, "decoded_token": "<5>"},
         "9": {"logprob": -1.0, "rank": 2, "decoded_token": "<9>"}}]
    flags = {"return_logprobs": np.array([True]), "stream": np.array([True])}
    asked = Stream(None, parse(text_input=text("Hi"), sampling_parameters=text('{"logprobs": 0}'), **flags))
    sent = formatted(asked, outputs_of("a", [(5, "x")])[0])
    assert json.loads(sent["logprobs"][0]) == [{"5": {"logprob": -0.5, "rank": 1, "decoded_token": "5"}}]
    not_asked = Stream(None, parse(text_input=text("Hi"), **flags))
    assert formatted(not_asked, outputs_of("a", [(5, "x")])[0])["logprobs"].tolist() == [b"null"]


# ---- the response thread's pacing (driven round by round, with a fake clock and fake Triton objects) -------
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TritonError = SimpleNamespace(INVALID_ARG="INVALID_ARG", INTERNAL="INTERNAL", CANCELLED="CANCELLED",
                                  UNAVAILABLE="UNAVAILABLE")

    @staticmethod
    def Tensor(name, array):
        return name, array

    @staticmethod
    def InferenceResponse(output_tensors=(), error=None):
        return {name: array for name, array in output_tensors}


class FakeSender:
    """Records (text, final) per response; each send takes send_seconds of the fake clock."""

    def __init__(self, clock, send_seconds):
        self.clock, self.send_seconds, self.sent = clock, send_seconds, []

    def send(self, response, flags=0):
        self.clock.now += self.send_seconds
        self.sent.append((response["text_output"][0].decode(), bool(flags)))

    def is_cancelled(self):
        self.checks = getattr(self, "checks", 0) + 1
        return getattr(self, "cancelled", False)


def response_thread(clock, send_budget, metrics=None, every_step=False):
    metrics = metrics or SimpleNamespace(record_engine=lambda stats: None, record_generated=lambda n: None,
                                         record_first_token=lambda *a: None, record_inter_token=lambda s: None,
                                         record_token_gaps=lambda gaps: None,
                                         record_finished=lambda *a: None, unpublished=False, publish=lambda n: None)
    return ResponseThread(FakePb, Inbox(clock), SimpleNamespace(abort=lambda request_id: None, failure=None), metrics,
                          lambda stream, outputs: text_arrays(stream, outputs, str, every_step),
                          send_budget=send_budget, every_step=every_step, clock=clock)


def run_streams(send_budget, send_seconds, step_seconds=0.05, num_streams=4, num_steps=8):
    """num_streams streaming requests through num_steps engine steps, one round per step."""
    clock = FakeClock()
    thread = response_thread(clock, send_budget)
    senders = [FakeSender(clock, send_seconds) for _ in range(num_streams)]
    for i, sender in enumerate(senders):
        thread.handle_events([Register(str(i), Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    pieces = [(t, f"w{t} ") for t in range(num_steps)]
    per_request = [outputs_of(str(i), pieces) for i in range(num_streams)]
    for step in range(num_steps):
        clock.now += step_seconds
        thread.handle_events([StepResult(outputs=[outputs[step] for outputs in per_request], time=clock.now)])
    assert thread.handle_events([STOP]) and not thread.pacer.pending and not thread.streams
    return senders, "".join(d for _, d in pieces)


def test_every_step_is_sent_while_sending_is_cheap():
    senders, text_ = run_streams(send_budget=0.2, send_seconds=0.001)
    for sender in senders:
        assert len(sender.sent) == 8 and sender.sent[-1][1]
        assert "".join(delta for delta, _ in sender.sent) == text_


def test_steps_are_merged_when_sending_would_exceed_the_budget():
    # a flush of 4 streams takes 0.04 s: with a budget of 0.2 the next comes 0.2 s later, i.e. every 4 steps
    senders, text_ = run_streams(send_budget=0.2, send_seconds=0.01)
    for sender in senders:
        deltas = [delta for delta, _ in sender.sent]
        assert "".join(deltas) == text_  # nothing lost or repeated
        assert deltas[0] == "w0 "  # the first response is never held back
        assert 2 <= len(deltas) <= 4 and sender.sent[-1] == (deltas[-1], True)  # FINAL at once, with the rest
        assert [final for _, final in sender.sent].count(True) == 1


def test_steps_handled_together_count_each_generated_token_once():
    clock = FakeClock()
    thread = response_thread(clock, send_budget=0.1)
    generated = []
    thread.metrics.record_generated = generated.append
    sender = FakeSender(clock, send_seconds=0.0)
    thread.handle_events([Register("a", Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    steps = [StepResult(outputs=[output], time=clock.now) for output in outputs_of("a", [(5, "a"), (6, "b"), (7, "c")])]
    thread.handle_events(steps)  # the engine was three steps ahead: one merged response
    assert generated == [3] and sender.sent == [("abc", True)]


def test_every_step_sends_each_step_even_held_back_text_at_any_sending_cost():
    """vllm_backend's streaming (send_every_step): one response per engine step, an empty delta when the step's
    text is held back, even for steps handled in one round and when sending is slow."""
    clock = FakeClock()
    thread = response_thread(clock, send_budget=0.1, every_step=True)
    sender = FakeSender(clock, send_seconds=0.05)
    thread.handle_events([Register("a", Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    outputs = outputs_of("a", [(5, "He"), (6, ""), (7, ""), (8, "llo")])
    thread.handle_events([StepResult(outputs=[outputs[0]], time=clock.now)])
    thread.handle_events([StepResult(outputs=[output], time=clock.now) for output in outputs[1:]])
    assert sender.sent == [("He", False), ("", False), ("", False), ("llo", True)] and not thread.pacer.pending


def test_non_streaming_sends_one_response_whatever_the_pacing():
    clock = FakeClock()
    thread = response_thread(clock, send_budget=0.1)
    sender = FakeSender(clock, send_seconds=0.05)
    thread.handle_events([Register("a", Stream(sender, parse(text_input=text("Hi "))))])
    for output in outputs_of("a", [(5, "He"), (6, ""), (7, "llo")]):
        clock.now += 0.01
        thread.handle_events([StepResult(outputs=[output], time=clock.now)])
    assert sender.sent == [("Hi Hello", True)] and not thread.streams


def sample_output(index, token_id, delta, reason=None, finished=False):
    """One step's output of sample `index` of request "a" (n = 2), its first token."""
    return RequestOutput("a", [token_id], delta, finished, reason, 3, 1, -0.5, index=index)


def test_n_samples_send_one_entry_each_streamed_or_not():
    """n = 2: every output tensor has an entry per sample, at its index. Streamed, each response carries each
    sample's delta (empty for one with nothing new) and its finish reason once it has ended; merged steps join
    per sample. Not streamed: each sample's whole text, the prompt prepended to each."""
    steps = [[sample_output(0, 5, "A"), sample_output(1, 6, "B")], [sample_output(0, 7, "C", "length")],
             [sample_output(1, 8, "D", "stop", finished=True)]]
    flags = {"return_finish_reason": np.array([True]), "return_num_output_tokens": np.array([True])}
    sent = {}
    for mode, every_step in [("every_step", True), ("merged", False), ("whole", False)]:
        thread, sender = response_thread(FakeClock(), send_budget=0.1, every_step=every_step), RecordingSender()
        streamed = {"stream": np.array([True])} if mode != "whole" else {}
        request = parse(text_input=text("Hi "), sampling_parameters=text('{"n": 2}'), **flags, **streamed)
        thread.handle_events([Register("a", Stream(sender, request))])
        thread.handle_events([StepResult(outputs=steps[0], time=1.0)])
        thread.handle_events([StepResult(outputs=outputs, time=2.0) for outputs in steps[1:]])  # one round
        sent[mode] = [([t.decode() for t in r["text_output"]], [f.decode() for f in r["finish_reason"]],
                       r["num_output_tokens"].tolist(), bool(final)) for r, final in sender.sent]
        assert not thread.streams and not thread.pacer.pending
    assert sent["every_step"] == [(["A", "B"], ["None", "None"], [1, 1], False),
                                  (["C", ""], ["length", "None"], [1, 0], False),
                                  (["", "D"], ["length", "stop"], [0, 1], True)]
    assert sent["merged"] == [(["A", "B"], ["None", "None"], [1, 1], False),
                              (["C", "D"], ["length", "stop"], [1, 1], True)]
    assert sent["whole"] == [(["Hi AC", "Hi BD"], ["length", "stop"], [2, 2], True)]


def test_prompt_logprobs_come_once_in_vllm_backends_format():
    """return_prompt_logprobs: a JSON list, None for the first prompt token, then per token itself and the top
    prompt_logprobs tokens, with its rank; streamed, on the response that carries them, null on the others."""
    thread, sender = response_thread(FakeClock(), send_budget=0.1, every_step=True), RecordingSender()
    request = parse(text_input=text("Hi"), stream=np.array([True]), return_prompt_logprobs=np.array([True]),
                    sampling_parameters=text('{"prompt_logprobs": 1}'))
    thread.handle_events([Register("a", Stream(sender, request))])
    outputs = outputs_of("a", [(5, "x"), (6, "y")])
    outputs[0].prompt_logprobs = PromptLogprobs([4, 9], [{4: -0.1, 2: -3.0}, {9: -2.0, 1: -0.5}], [1, 3])
    thread.handle_events([StepResult(outputs=[output], time=1.0 + i) for i, output in enumerate(outputs)])
    first, last = (json.loads(response["prompt_logprobs"][0]) for response, _ in sender.sent)
    assert first == [None, {"4": {"logprob": -0.1, "rank": 1, "decoded_token": "4"}},
                     {"9": {"logprob": -2.0, "rank": 3, "decoded_token": "9"},
                      "1": {"logprob": -0.5, "rank": 1, "decoded_token": "1"}}]
    assert last is None


class ErrorPb(FakePb):
    class TritonError:
        INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"

        def __init__(self, message, code):
            self.message, self.code = message, code

    @staticmethod
    def InferenceResponse(output_tensors=(), error=None):
        return {"error": error, **{name: array for name, array in output_tensors}}


class RecordingSender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


def test_a_failed_engine_ends_every_request_with_unavailable_and_is_reported_once():
    thread = response_thread(FakeClock(), send_budget=1.0)
    thread.pb, reported = ErrorPb, []
    thread.on_engine_failure = reported.append
    senders = [RecordingSender() for _ in range(3)]
    for i, sender in enumerate(senders[:2]):
        thread.handle_events([Register(str(i), Stream(sender, parse(text_input=text("Hi"))))])
    assert thread.streams.keys() == {"0", "1"} and reported == []
    thread.engine_core.failure = "the engine thread died (RuntimeError: boom)"
    thread.handle_events([])
    thread.handle_events([Register("2", Stream(senders[2], parse(text_input=text("Hi"))))])  # raced the failure
    assert thread.streams == {} and reported == ["the engine thread died (RuntimeError: boom)"]
    for sender in senders:
        [(response, flags)] = sender.sent
        assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response["error"].code == "UNAVAILABLE"
        assert "the engine thread died" in response["error"].message


@pytest.mark.parametrize("prompt, error, code, message", [
    # the engine's errors about the prompt name the input the client sent it in
    ({"text_input": text("Hi")}, RequestError("prompt", "too long"), "INVALID_ARG", "text_input: too long"),
    ({"input_ids": np.array([1, 2], np.int32)}, RequestError("prompt", "too long"), "INVALID_ARG",
     "input_ids: too long"),
    ({"text_input": text("Hi")}, RequestError("max_tokens", "too many"), "INVALID_ARG", "max_tokens: too many"),
    ({"text_input": text("Hi")}, RequestError(None, "gone", ErrorKind.UNAVAILABLE), "UNAVAILABLE", "gone"),
])
def test_the_stub_reports_an_error_by_its_field_and_kind(prompt, error, code, message):
    thread, sender = response_thread(FakeClock(), send_budget=1.0), RecordingSender()
    thread.pb = ErrorPb
    thread.handle_events([Register("a", Stream(sender, parse(**prompt)))])
    thread.handle_events([StepResult(rejected=[("a", error)])])
    [(response, flags)] = sender.sent
    assert (response["error"].code, response["error"].message, flags) == (code, message, 1)
    thread.handle_events([Register("b", Stream(sender, parse(**prompt))), StepResult(failed=[("b", "internal x")])])
    thread.handle_events([Reject(sender, RequestError("stream", "expected a boolean"))])  # before it was parsed
    assert [(r["error"].code, r["error"].message) for r, _ in sender.sent[1:]] == [
        ("INTERNAL", "internal x"), ("INVALID_ARG", "stream: expected a boolean")]


def test_send_budget_must_be_a_share():
    for budget in (0, -1, 1.5):
        with pytest.raises(ValueError, match="send_budget"):
            response_thread(FakeClock(), budget)


def test_cancellation_checks_take_turns_across_many_streams():
    from nanoserve.serving.stub.responses import CANCEL_CHECKS_PER_ROUND

    clock = FakeClock()
    aborted = []
    thread = response_thread(clock, send_budget=0.1)
    thread.engine_core = SimpleNamespace(abort=aborted.append, failure=None)
    senders = [FakeSender(clock, 0.0) for _ in range(2 * CANCEL_CHECKS_PER_ROUND + 3)]  # 3 rounds for everyone
    for i, sender in enumerate(senders):
        thread.handle_events([Register(str(i), Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    senders[-1].cancelled = True
    for round_ in range(3):
        clock.now += thread.cancel_check_interval
        before = sum(getattr(s, "checks", 0) for s in senders)
        thread.handle_events([])
        assert sum(getattr(s, "checks", 0) for s in senders) - before <= CANCEL_CHECKS_PER_ROUND
    assert all(getattr(s, "checks", 0) >= 1 for s in senders)  # every stream was asked within 3 rounds
    assert aborted == [str(len(senders) - 1)]


# ---- metrics: batched, published before a client can see its last response ------------------------------
class FakeMetric:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def increment(self, value):
        self.calls.append(("increment", self.name, value))

    def set(self, value):
        self.calls.append(("set", self.name, value))

    def observe(self, value):
        self.calls.append(("observe", self.name, value))


def fake_pb_with_metrics(calls):
    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):
            return FakeMetric(calls, self.name + "".join(f"{{{k}={v}}}" for k, v in labels.items()
                                                         if k in ("reason", "position")))

    return SimpleNamespace(MetricFamily=MetricFamily)


def engine_stats(running, used):
    return {"prefix_cache_hit_tokens": 0, "prompt_tokens_computed": 8, "num_running": running, "num_waiting": 0,
            "num_total_blocks": 16, "num_free_blocks": 16 - used, "num_preemptions": 0}


def test_metrics_send_counters_and_changed_gauges_only_when_published():
    from nanoserve.serving.stub.metrics import Metrics

    calls = []
    metrics = Metrics(fake_pb_with_metrics(calls), "m", "1")
    for step in range(3):
        metrics.record_engine(engine_stats(running=2, used=4 + step))
        metrics.record_generated(2)
    metrics.record_finished("length", 0.5, 8, 6)
    assert calls == [] and metrics.unpublished
    metrics.publish()
    assert [c for c in calls if c[0] == "observe"] == [("observe", "nanoserve_e2e_request_latency_seconds", 0.5),
                                                      ("observe", "nanoserve_prompt_length_tokens", 8),
                                                      ("observe", "nanoserve_generation_length_tokens", 6)]
    sent = {(kind, name): value for kind, name, value in calls if kind != "observe"}
    assert sent[("increment", "nanoserve_generation_tokens_total")] == 6  # one call for three steps
    assert sent[("increment", "nanoserve_requests_finished_total{reason=length}")] == 1
    assert sent[("set", "nanoserve_kv_blocks_used")] == 6 and sent[("set", "nanoserve_requests_running")] == 2
    calls.clear()
    metrics.record_engine(engine_stats(running=2, used=6))
    metrics.publish()
    assert calls == [] and not metrics.unpublished  # unchanged gauges cost no call


def test_spec_decode_counters_follow_the_engine_under_both_names():
    from nanoserve.serving.stub.metrics import Metrics

    calls = []
    metrics = Metrics(fake_pb_with_metrics(calls), "m", "1", vllm_names=True, num_speculative_tokens=2)
    spec = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 5, "spec_decode_num_accepted_tokens": 4,
            "spec_decode_num_accepted_tokens_per_pos": [3, 1]}
    metrics.record_engine({**engine_stats(running=1, used=2), **spec})
    metrics.record_engine({**engine_stats(running=1, used=2), **spec, "spec_decode_num_drafts": 4})
    metrics.publish()
    sent = {name: value for kind, name, value in calls if kind == "increment"}
    for prefix in ("nanoserve_", "vllm:"):
        assert sent[f"{prefix}spec_decode_num_drafts_total"] == 4
        assert sent[f"{prefix}spec_decode_num_draft_tokens_total"] == 5
        assert sent[f"{prefix}spec_decode_num_accepted_tokens_total"] == 4
        assert sent[f"{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position=0}}"] == 3
        assert sent[f"{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position=1}}"] == 1
    calls.clear()
    Metrics(fake_pb_with_metrics(calls), "m", "1", vllm_names=True).record_engine(
        {**engine_stats(running=1, used=2), **spec})  # speculation off: no such families, nothing recorded


def test_a_backlog_of_samples_is_published_a_slice_per_round_until_gone():
    from nanoserve.serving.stub.metrics import PUBLISH_INTERVAL, SAMPLES_PER_ROUND, Metrics

    calls, clock = [], FakeClock()
    metrics = Metrics(fake_pb_with_metrics(calls), "m", "1", vllm_names=True)
    thread = response_thread(clock, send_budget=1.0, metrics=metrics)
    metrics.record_token_gaps([0.01] * SAMPLES_PER_ROUND)  # two samples each: vLLM's two inter-token histograms
    metrics.record_generated(5)
    thread.handle_events([])
    assert len([c for c in calls if c[0] == "observe"]) == SAMPLES_PER_ROUND and metrics.unpublished
    assert ("increment", "vllm:generation_tokens_total", 5) in calls  # counters and gauges go at once
    thread.handle_events([])  # the next round, without waiting for PUBLISH_INTERVAL
    assert len([c for c in calls if c[0] == "observe"]) == 2 * SAMPLES_PER_ROUND and not metrics.unpublished
    metrics.record_token_gaps([0.01])
    thread.handle_events([])
    assert len([c for c in calls if c[0] == "observe"]) == 2 * SAMPLES_PER_ROUND  # the interval again
    clock.now += PUBLISH_INTERVAL
    thread.handle_events([])
    assert len([c for c in calls if c[0] == "observe"]) == 2 * SAMPLES_PER_ROUND + 2


def test_token_gaps_are_recorded_once_per_stream_and_step():
    """vLLM's per-token gaps: each stream's token after its first, the time since the step of its previous one;
    a stream's second sample in the same step adds no gap."""
    from nanoserve.serving.stub.metrics import Metrics

    calls, clock = [], FakeClock()
    metrics = Metrics(fake_pb_with_metrics(calls), "m", "1", vllm_names=True)
    thread = response_thread(clock, send_budget=1.0, metrics=metrics)
    for request_id in "ab":
        thread.handle_events([Register(request_id, Stream(FakeSender(clock, 0.0), parse(
            text_input=text("Hi"), stream=np.array([True]), sampling_parameters=text('{"n": 2}'))))])
    times = [1.0, 1.25, 1.75]
    for step, time_ in enumerate(times):
        outputs = [RequestOutput(r, [step], "x", False, None, 3, step + 1, index=i) for r in "ab" for i in (0, 1)]
        thread.handle_events([StepResult(outputs=outputs, time=time_)])
    metrics.publish()
    gaps = [value for kind, name, value in calls if name == "vllm:inter_token_latency_seconds"]
    assert sorted(gaps) == [0.25, 0.25, 0.5, 0.5]


def test_closed_metrics_hold_no_family_or_metric():
    """finalize() closes the Metrics so that python_backend deletes every family while the stub can still tell
    tritonserver (a family collected in the stub's teardown segfaults it)."""
    import gc
    import weakref

    from nanoserve.serving.stub.metrics import Metrics

    metrics = Metrics(fake_pb_with_metrics([]), "m", "1")
    metrics.record_engine(engine_stats(running=1, used=2))
    shown = (metric for quantity_metrics in metrics._targets.values() for metric in quantity_metrics)
    alive = [weakref.ref(obj) for obj in [*metrics._families, *shown, *metrics.finished.values()]]
    metrics.close()
    gc.collect()
    assert len(alive) == 14 + 13 + 3 and all(ref() is None for ref in alive)


def test_the_last_request_in_flight_publishes_before_its_final_response():
    from nanoserve.serving.stub.metrics import PUBLISH_INTERVAL, Metrics

    calls, clock = [], FakeClock()
    thread = response_thread(clock, send_budget=1.0, metrics=Metrics(fake_pb_with_metrics(calls), "m", "1"))

    class RecordingSender(FakeSender):
        def send(self, response, flags=0):
            calls.append(("response", bool(flags), None))
            super().send(response, flags)

    senders = [RecordingSender(clock, 0.0) for _ in range(2)]
    for i, sender in enumerate(senders):
        thread.handle_events([Register(str(i), Stream(sender, parse(text_input=text("Hi"), stream=np.array([True]))))])
    outputs = [outputs_of(str(i), [(5, "a"), (6, "b"), (7, "c")][:2 + i]) for i in range(2)]
    thread.handle_events([StepResult(outputs=[o[0] for o in outputs], time=clock.now, stats=engine_stats(2, 4))])
    clock.now += PUBLISH_INTERVAL / 10
    thread.handle_events([StepResult(outputs=[o[1] for o in outputs], time=clock.now, stats=engine_stats(1, 2))])
    generated = [c for c in calls if c[:2] == ("increment", "nanoserve_generation_tokens_total")]
    assert generated == [("increment", "nanoserve_generation_tokens_total", 2)]  # the 2nd step waits
    clock.now += PUBLISH_INTERVAL / 10
    calls.clear()
    thread.handle_events([StepResult(outputs=[outputs[1][2]], time=clock.now, stats=engine_stats(0, 0))])
    final = calls.index(("response", True, None))
    published = {(kind, name): value for kind, name, value in calls[:final] if kind in ("increment", "set")}
    observed = [name for kind, name, _ in calls[:final] if kind == "observe"]
    assert observed.count("nanoserve_e2e_request_latency_seconds") == 2  # both requests' samples
    assert published[("increment", "nanoserve_generation_tokens_total")] == 3  # steps 2 and 3
    assert published[("increment", "nanoserve_requests_finished_total{reason=length}")] == 2
    assert published[("set", "nanoserve_kv_blocks_used")] == 0
    assert published[("set", "nanoserve_requests_running")] == 0
    assert not thread.metrics.unpublished and thread._wait_time() is None  # idle: sleeps until the next event


def test_a_token_stream_that_responded_ends_early_with_abort_not_an_error():
    """Triton 2.51's ensemble never releases a request one of whose steps failed while a postprocessing of an
    earlier response still ran: a token-model stream that already responded ends with a final response (no new
    ids, finish_reason "abort") that the postprocessing parses as any other; one that has not responded yet may
    still end with the error."""
    thread = response_thread(FakeClock(), send_budget=1.0)
    thread.pb, thread.ended_arrays = ErrorPb, ended_token_arrays
    thread.formatter = lambda stream, outputs: token_arrays(stream, outputs)
    senders = [RecordingSender() for _ in range(2)]
    for i, sender in enumerate(senders):
        request = parse(tokens=True, input_ids=np.array([5, 6, 7], np.int32), stream=np.array([True]))
        thread.handle_events([Register(str(i), Stream(sender, request))])
    thread.handle_events([StepResult(outputs=outputs_of("0", [(9, ""), (10, "")])[:1], time=100.0)])
    thread.engine_core.failure = "the engine thread died (RuntimeError: boom)"
    thread.handle_events([])
    (first, _), (last, flags) = senders[0].sent
    assert first["error"] is None and first["output_ids"].tolist() == [9]
    assert last["error"] is None and flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    parsed = DetokenizeRequest.parse(last.get, max_ids=64)
    assert (parsed.new_ids, parsed.finish_reason, parsed.request_id) == ([], "abort", "0")
    assert is_final(parsed.finish_reason) and parsed.params == json.loads(first["detokenize_params"][0])
    [(response, flags)] = senders[1].sent
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response["error"].code == "UNAVAILABLE"


# ---- control requests: cancel_request_id and drain_seconds ------------------------------------------------
def test_a_control_is_named_by_its_parameter_and_a_bad_value_names_it():
    assert control_event('{"cancel_request_id": "m-3"}', "s", now=5.0) == CancelById("s", "m-3")
    assert control_event('{"drain_seconds": 2.5}', "s", now=5.0) == Drain("s", 7.5)
    for not_a_control in ['{"max_tokens": 4}', "not json", "", '{"drain": 1}']:
        assert control_event(not_a_control, "s", now=0.0) is None  # the request parser's to judge
    for bad in ['{"cancel_request_id": ""}', '{"cancel_request_id": 7}']:
        with pytest.raises(ValueError, match="cancel_request_id"):
            control_event(bad, "s", now=0.0)


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.booleans(), st.none(),
                 st.text(max_size=4), st.lists(st.integers(), max_size=2)))
def test_drain_seconds_is_a_number_in_its_range_or_an_error_naming_it(value):
    try:
        event = control_event(json.dumps({"drain_seconds": value}), "s", now=0.0)
    except ValueError as e:
        assert str(e).startswith("drain_seconds: expected seconds in [0, 3600]")
        assert not (type(value) in (int, float) and 0 <= value <= MAX_DRAIN_SECONDS)
    else:
        assert type(value) in (int, float) and 0 <= value <= MAX_DRAIN_SECONDS and event.deadline == value


def drain_answers(sender) -> int:
    """Final responses without outputs or error."""
    return sum(1 for response, flags in sender.sent if response == {"error": None} and flags)


def test_a_drain_is_answered_when_the_last_stream_ends():
    clock = FakeClock()
    thread = response_thread(clock, send_budget=1.0)
    thread.pb = ErrorPb
    sender, drain = RecordingSender(), RecordingSender()
    thread.handle_events([Register("a", Stream(sender, parse(text_input=text("Hi"), stream=np.array([True])))),
                          Drain(drain, deadline=clock.now + 10)])
    outputs = outputs_of("a", [(5, "x"), (6, "y")])
    thread.handle_events([StepResult(outputs=outputs[:1], time=clock.now)])
    assert drain.sent == []  # the stream still runs
    clock.now += 5
    thread.handle_events([StepResult(outputs=outputs[1:], time=clock.now)])
    assert sender.sent[-1][1] and sender.sent[-1][0]["error"] is None  # it ended as it would have
    assert drain_answers(drain) == 1 and not thread.drains
    idle = RecordingSender()
    thread.handle_events([Drain(idle, deadline=clock.now + 10)])
    assert drain_answers(idle) == 1  # nothing in flight: answered at once


def test_at_the_drain_deadline_streams_end_token_ones_with_abort():
    """What is left at the deadline is aborted in the engine (blocks freed) and ended: a token stream that
    responded with finish_reason "abort" (the ensemble then ends cleanly), the others with UNAVAILABLE."""
    clock = FakeClock()
    thread = response_thread(clock, send_budget=1.0)
    thread.pb, thread.ended_arrays = ErrorPb, ended_token_arrays
    thread.formatter = lambda stream, outputs: token_arrays(stream, outputs)
    aborted = []
    thread.engine_core = SimpleNamespace(abort=aborted.append, failure=None)
    senders, drain = [RecordingSender() for _ in range(2)], RecordingSender()
    for i, sender in enumerate(senders):
        request = parse(tokens=True, input_ids=np.array([5, 6, 7], np.int32), stream=np.array([True]))
        thread.handle_events([Register(str(i), Stream(sender, request))])
    thread.handle_events([StepResult(outputs=outputs_of("0", [(9, ""), (10, "")])[:1], time=clock.now),
                          Drain(drain, deadline=clock.now + 10)])
    clock.now += 9.9
    thread.handle_events([])
    assert drain.sent == [] and aborted == []
    clock.now += 0.1
    thread.handle_events([])
    assert sorted(aborted) == ["0", "1"] and not thread.streams and drain_answers(drain) == 1
    last, flags = senders[0].sent[-1]
    assert flags and last["error"] is None
    assert DetokenizeRequest.parse(last.get, max_ids=64).finish_reason == "abort"
    [(response, flags)] = senders[1].sent
    assert flags and response["error"].code == "UNAVAILABLE" and "drain" in response["error"].message
