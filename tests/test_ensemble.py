"""The ensemble (preprocessing -> nanoserve_tokens -> postprocessing): its stateless detokenization against the
engine's IncrementalDetokenizer, then in a real tritonserver against the offline engine."""
import json
import random

import numpy as np
import pytest
from serving_utils import TIMEOUT, collect, http_post, is_ready, metrics_when, open_sse, open_stream, stream, triton
from test_detokenizer import SAMPLE, TOKENIZERS

from nanoserve import LLM, SamplingParams
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.outputs import RequestOutput
from nanoserve.serving.serve import liveness
from nanoserve.serving.shared.contracts.token_model import is_final
from nanoserve.serving.stub.ensemble import (CANCEL_CHECK_INTERVAL, CancelChecks, DecodeContext, DetokenizeRequest,
                                             context_size, decode_delta, special_token_ids, token_arrays)
from nanoserve.serving.stub.request import ParsedRequest
from nanoserve.serving.stub.responses import Stream


def ensemble_text(tokenizer, prompt_ids, output_ids, **params) -> str:
    """What the ensemble streams: token_arrays per generated token (the token model), then decode_delta on
    each response alone (the postprocessing model)."""
    stream = Stream(sender=None, request=ParsedRequest(list(prompt_ids), SamplingParams(**params), stream=True))
    text = ""
    for i, token in enumerate(output_ids):
        last = i == len(output_ids) - 1
        out = RequestOutput("r", [token], "", last, "length" if last else None, len(prompt_ids), i + 1)
        stream.add([out])
        arrays = token_arrays(stream, [out], special_token_ids(tokenizer))
        text += decode_delta(tokenizer, arrays["context_ids"].tolist(), arrays["output_ids"].tolist(),
                             final=is_final(arrays["finish_reason"][0]),
                             **json.loads(arrays["detokenize_params"][0]))
    return text


def engine_run(tokenizer, output_ids, skip_special_tokens=True, stop=(), include_stop_str_in_output=False):
    """(text, ids generated): the engine's IncrementalDetokenizer, ending the request at a stop string."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, stop, include_stop_str_in_output)
    text = ""
    for i, token in enumerate(output_ids):
        text += detokenizer.add([token])
        if detokenizer.finished:
            return text, output_ids[:i + 1]
    return text + detokenizer.flush(), output_ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_stateless_detokenization_matches_the_engine(kind, skip_special_tokens):
    tokenizer = TOKENIZERS[kind]()
    rng = random.Random(0)
    prompt = tokenizer.encode(SAMPLE[:20])
    for trial in range(150):
        if trial % 2:  # real text: split characters, spaces, newlines
            start = rng.randrange(len(SAMPLE))
            output = tokenizer.encode(SAMPLE[start:] + SAMPLE)[:rng.randrange(1, 80)]
        else:  # random ids: invalid UTF-8, byte-token runs, special tokens
            output = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        params = {"skip_special_tokens": skip_special_tokens}
        expected, generated = engine_run(tokenizer, output, **params)
        assert ensemble_text(tokenizer, prompt, generated, **params) == expected


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_stop_strings_through_the_ensemble_match_the_engine(kind):
    """Stop strings cut the ensemble's text where the engine cuts the text model's, and nothing that could still
    become a stop string is streamed before (the stop strings: pieces of the text itself, up to 12 characters)."""
    tokenizer = TOKENIZERS[kind]()
    rng = random.Random(1)
    prompt = tokenizer.encode(SAMPLE[:20])
    for trial in range(150):
        start = rng.randrange(len(SAMPLE))
        output = tokenizer.encode(SAMPLE[start:] + SAMPLE)[:rng.randrange(1, 80)]
        whole = tokenizer.decode(output)
        stops = []
        for _ in range(rng.randrange(1, 3)):
            at = rng.randrange(max(len(whole), 1))
            stops.append(whole[at:at + rng.randrange(1, 13)] if rng.random() < 0.8 else "never-in-the-text")
        params = {"stop": [s for s in stops if s] or ["never-in-the-text"],
                  "include_stop_str_in_output": rng.random() < 0.3}
        expected, generated = engine_run(tokenizer, output, **params)
        assert ensemble_text(tokenizer, prompt, generated, **params) == expected, (stops, whole)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_a_long_run_of_skipped_special_tokens_keeps_the_context(kind):
    """Skipped special tokens add no text, so the context window holds its text ids on top of them: after a run
    longer than the window (a model that keeps emitting end tokens under ignore_eos, then text; the first run
    thousands of them), no space is lost and no withheld text is dropped."""
    tokenizer = TOKENIZERS[kind]()
    specials = sorted(special_token_ids(tokenizer))
    rng = random.Random(2)
    prompt = tokenizer.encode(SAMPLE[:20])
    for trial in range(20):
        start = rng.randrange(len(SAMPLE) - 40)
        text_ids = tokenizer.encode(SAMPLE[start:start + 40], add_special_tokens=False)
        cut = rng.randrange(1, len(text_ids))
        run = [rng.choice(specials) for _ in range(rng.randrange(40, 120) if trial else 2500)]
        output = text_ids[:cut] + run + text_ids[cut:]
        stop_params = {"stop": ["never-in-the-text", SAMPLE[start + 30:start + 36]]} if trial % 2 else {}
        expected, generated = engine_run(tokenizer, output, **stop_params)
        assert ensemble_text(tokenizer, prompt, generated, **stop_params) == expected


def test_the_context_window_holds_its_size_in_ids_that_decoding_keeps():
    params = SamplingParams()
    size, special = context_size(params), frozenset({0, 1})
    text_ids = list(range(2, size + 12))
    with_run = text_ids[:-4] + [0, 1] * 15 + text_ids[-4:]  # the run 4 ids from the end: inside the window
    endless = [7] * 5 + [0, 1] * 2500 + [8]  # a run of skipped ids far longer than any window
    for ids, params, expected in [(with_run, params, text_ids[-size:-4] + [0] + text_ids[-4:]),
                                  (with_run, SamplingParams(skip_special_tokens=False), with_run[-size:]),
                                  (endless, params, [7] * 5 + [0, 8])]:
        context = DecodeContext.of(params, special)
        for start in range(0, len(ids), 3):  # in responses of 3 ids
            context.add(ids[start:start + 3])
            assert len(context.tail) <= 4 * size + 2
        assert context.window() == expected


def test_the_postprocessing_asks_each_stream_at_most_every_interval_and_never_after_a_cancel():
    now = [0.0]
    checks = CancelChecks(clock=lambda: now[0])
    assert checks.due("a", final=False) and not checks.due("a", final=False)  # asked, then not before the interval
    assert checks.due("b", final=False)
    now[0] += CANCEL_CHECK_INTERVAL
    assert checks.due("a", final=False)
    checks.cancelled("a")
    now[0] += 100 * CANCEL_CHECK_INTERVAL
    assert not checks.due("a", final=False) and checks.due("b", final=False)
    assert not checks.due("b", final=True) and checks.next_check == {"a": float("inf")}  # forgotten at the end


def detokenize_inputs(**overrides):
    inputs = {"output_ids": np.array([5, 6], np.int32), "context_ids": np.array([4], np.int32),
              "finish_reason": np.array([b""], dtype=object),
              "detokenize_params": np.array([b'{"stop": ["ab"], "skip_special_tokens": false}'], dtype=object)}
    return {**inputs, **overrides}


JUNK = [  # postprocessing inputs sent directly, and the input the error must name
    ({"output_ids": np.array([-5, 3], np.int32)}, "output_ids"),
    ({"context_ids": np.zeros(3000, np.int32)}, "context_ids"),
    ({"context_ids": np.array([1.5], np.float32)}, "context_ids"),
    ({"finish_reason": np.array([], dtype=object)}, "finish_reason"),
    ({"finish_reason": np.array([b"done"], dtype=object)}, "finish_reason"),
    ({"finish_reason": np.array([b"\xff"], dtype=object)}, "finish_reason"),
    ({"detokenize_params": np.array([b"{not json"], dtype=object)}, "detokenize_params"),
    ({"detokenize_params": np.array([b"[1]"], dtype=object)}, "detokenize_params"),
    ({"detokenize_params": np.array([b'{"stop": 5}'], dtype=object)}, "detokenize_params"),
    ({"detokenize_params": np.array([b'{"stop": [""]}'], dtype=object)}, "detokenize_params"),
    ({"detokenize_params": np.array([b'{"zzz": 1}'], dtype=object)}, "detokenize_params"),
    ({"detokenize_params": np.array([b'{"skip_special_tokens": "no"}'], dtype=object)}, "detokenize_params"),
    ({"request_id": np.array([b"a", b"b"], dtype=object)}, "request_id"),
]


def test_postprocessing_inputs_are_checked():
    parsed = DetokenizeRequest.parse(detokenize_inputs().get, max_ids=2048)
    assert (parsed.context_ids, parsed.new_ids, parsed.finish_reason) == ([4], [5, 6], "")
    assert parsed.params == {"stop": ["ab"], "skip_special_tokens": False}
    for overrides, field in JUNK:
        with pytest.raises(ValueError) as error:
            DetokenizeRequest.parse(detokenize_inputs(**overrides).get, max_ids=2048)
        assert str(error.value).startswith(f"{field}:"), (overrides, str(error.value))


# ---- in tritonserver -------------------------------------------------------------------------------------
ENSEMBLE_MODELS = ["ensemble", "preprocessing", "nanoserve_tokens", "postprocessing"]
ENGINE_ARGS = {"device": "cpu", "kvcache_block_size": 16, "num_kvcache_blocks": 256}
PROMPTS = ["Héllo wörld, naïve café — 你好 ", "  spaces   and\ttabs\n"]
N = 32
GREEDY = {"max_tokens": np.array([N], np.int32), "temperature": np.array([0.0], np.float32),
          "sampling_parameters": {"ignore_eos": True}}
LONG = {"sampling_parameters": {"ignore_eos": True, "max_tokens": 1500}}  # far longer than the test runs it


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with triton(tmp_path_factory.mktemp("ensemble"), qwen3_dir, ENSEMBLE_MODELS, **ENGINE_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    with LLM(qwen3_dir, **ENGINE_ARGS) as llm:
        yield llm


def offline(llm, prompt):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]


def engine_metrics(server, condition):
    return metrics_when(server, "nanoserve_tokens", condition)


def idle(values) -> bool:
    return values["nanoserve_requests_running"] == 0 and values["nanoserve_requests_waiting"] == 0


@pytest.mark.triton_server
@pytest.mark.parametrize("prompt", PROMPTS)
def test_ensemble_streams_the_offline_text(server, llm, prompt):
    expected = offline(llm, prompt).text
    streamed = stream(server, "ensemble", text_input=prompt, stream=True, **GREEDY)
    assert streamed.error is None and streamed.text == expected
    assert streamed.responses[-1]["finish_reason"].tolist() == [b"length"]
    whole = stream(server, "ensemble", text_input=prompt, **GREEDY)
    assert whole.texts == [expected]


@pytest.mark.triton_server
def test_a_stream_responds_before_its_end_and_its_cancel_reaches_the_engine(server):
    """The first response of a long stream is not its last. Cancelling the stream aborts the engine's request
    (blocks freed, counted as an abort), which Triton's ensemble scheduler alone never does."""
    before = engine_metrics(server, idle)
    client, events = open_stream(server, "ensemble", text_input=PROMPTS[0], stream=True, **LONG)
    first, error = events.get(timeout=TIMEOUT)
    assert error is None and not first.get_response().parameters["triton_final_response"].bool_param
    engine_metrics(server, lambda values: values["nanoserve_requests_running"] == 1)
    client.stop_stream(cancel_requests=True)
    client.close()
    after = engine_metrics(server, idle)
    assert after["nanoserve_kv_blocks_used"] == 0
    assert after["nanoserve_requests_finished_total{reason=abort}"] == \
        before["nanoserve_requests_finished_total{reason=abort}"] + 1


@pytest.mark.triton_server
def test_closing_an_sse_stream_of_the_ensemble_aborts_the_engine_request(server):
    before = engine_metrics(server, idle)
    body = {"text_input": PROMPTS[1], "stream": True, "sampling_parameters": json.dumps(LONG["sampling_parameters"])}
    close = open_sse(server, "ensemble", body)
    engine_metrics(server, lambda values: values["nanoserve_requests_running"] == 1)
    close()
    after = engine_metrics(server, idle)
    assert after["nanoserve_kv_blocks_used"] == 0
    assert after["nanoserve_requests_finished_total{reason=abort}"] == \
        before["nanoserve_requests_finished_total{reason=abort}"] + 1
    assert is_ready(server)


@pytest.mark.triton_server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_streaming_client_streams_the_ensemble(server, llm, protocol):
    """client/stream.py sends only the vllm_backend flags a model declares: the ensemble has `stream` only. It
    closes its gRPC stream without cancelling it after the last response: a cancel then would leave the request,
    and its model, alive in tritonserver 2.51, and the module's server would not stop on SIGTERM (its teardown
    checks the exit code). A client that cancelled after the last response failed that check in 1 of 3 runs."""
    from client import stream as client

    params = client.sampling_parameters(max_tokens=N, temperature=0.0, ignore_eos=True)
    run = client.stream_grpc if protocol == "grpc" else client.stream_http
    url = server.url_grpc if protocol == "grpc" else server.url_http
    for _ in range(4):
        result = run(url, "ensemble", PROMPTS[0], params)
        assert result.text == offline(llm, PROMPTS[0]).text
        assert result.finish_reason == "length" and result.num_output_tokens is None  # the ensemble has no count
    if protocol == "grpc":  # many short streams, each closed just after its last response
        for _ in range(40):
            assert run(url, "ensemble", "Hi", client.sampling_parameters(max_tokens=2)).finish_reason == "length"


@pytest.mark.triton_server
def test_token_model_streams_the_offline_ids(server, llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    out = stream(server, "nanoserve_tokens", input_ids=np.array(prompt_ids, np.int32), stream=True, **GREEDY)
    assert out.error is None
    ids = [int(t) for r in out.responses for t in r["output_ids"]]
    assert ids == offline(llm, prompt_ids).token_ids
    starts = np.cumsum([0] + [len(r["output_ids"]) for r in out.responses])[:-1]
    assert [r["context_ids"].tolist() for r in out.responses] == [ids[:start][-16:] for start in starts]
    assert not set(ids) & special_token_ids(llm.tokenizer)  # else a run of them is cut to one in the context


@pytest.mark.triton_server
def test_a_control_request_cancels_the_token_model_request_it_names(server):
    """What the postprocessing sends: parameter cancel_request_id names a request by the request_id output of its
    responses; the control is answered with an empty final response, and the request ends with finish_reason
    "abort". An empty id is an error."""
    before = engine_metrics(server, idle)
    client, events = open_stream(server, "nanoserve_tokens", input_ids=np.array([5, 6], np.int32), stream=True,
                                 **LONG)
    first, error = events.get(timeout=TIMEOUT)
    assert error is None
    request_id = first.as_numpy("request_id")[0].decode()
    control = stream(server, "nanoserve_tokens", parameters={"cancel_request_id": request_id},
                     input_ids=np.zeros(0, np.int32))
    assert control.error is None and control.responses == [] and control.num_empty_final == 1
    cancelled = collect(events)
    client.stop_stream()
    client.close()
    assert cancelled.error is None and cancelled.responses[-1]["finish_reason"].tolist() == [b"abort"]
    after = engine_metrics(server, idle)
    assert after["nanoserve_requests_finished_total{reason=abort}"] == \
        before["nanoserve_requests_finished_total{reason=abort}"] + 1
    bad = stream(server, "nanoserve_tokens", parameters={"cancel_request_id": ""}, input_ids=np.zeros(0, np.int32))
    assert "cancel_request_id" in bad.error.message()


@pytest.mark.triton_server
@pytest.mark.parametrize("include", [False, True])
def test_ensemble_cuts_at_a_stop_string_as_the_text_model(server, llm, include):
    full = offline(llm, PROMPTS[0]).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    expected = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert expected.finish_reason == "stop" and len(expected.text) < len(full)
    for streaming in (True, False):
        inputs = {**GREEDY, "sampling_parameters": {"ignore_eos": True, "include_stop_str_in_output": include}}
        out = stream(server, "ensemble", text_input=PROMPTS[0], stream=streaming,
                     stop_words=np.array([stop.encode()], dtype=np.object_), **inputs)
        assert out.error is None and out.text == expected.text
        assert out.responses[-1]["finish_reason"].tolist() == [b"stop"]


@pytest.mark.triton_server
def test_ensemble_keeps_special_tokens_when_asked(server, llm):
    """skip_special_tokens travels from the token model to the detokenizer with every response."""
    special = set(llm.tokenizer.all_special_ids)
    base = {"max_tokens": N, "temperature": 3.0, "ignore_eos": True}  # flat enough to sample one
    seed = next(seed for seed in range(200)  # a sampled output with a special token in it
                if special & set(llm.generate(PROMPTS[0], SamplingParams(**base, seed=seed),
                                              use_tqdm=False)[0].token_ids))
    texts = {}
    for skip in (False, True):
        params = SamplingParams(**base, seed=seed, skip_special_tokens=skip)
        expected = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].text
        out = stream(server, "ensemble", text_input=PROMPTS[0], stream=True,
                     sampling_parameters={**base, "seed": seed, "skip_special_tokens": skip})
        assert out.error is None and out.text == expected
        texts[skip] = out.text
    assert len(texts[False]) > len(texts[True])  # the special tokens' text is in


@pytest.mark.triton_server
def test_ensemble_chat_template(server, llm):
    messages = [{"role": "user", "content": "Où est la café?"}]
    ids = llm.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    out = stream(server, "ensemble", text_input="Où est la café?", apply_chat_template=True, stream=True, **GREEDY)
    assert out.error is None and out.text == offline(llm, ids).text


@pytest.mark.triton_server
def test_ensemble_bad_input_names_the_field(server):
    for inputs, field in [({"text_input": ""}, "text_input"), ({"text_input": b"\xff"}, "text_input"),
                          ({"text_input": "Hi", "sampling_parameters": {"top_p": 2}}, "top_p"),
                          ({"text_input": "x " * 3000}, "input_ids")]:
        out = stream(server, "ensemble", **inputs)
        assert out.error is not None and field in out.error.message(), out.error
    assert is_ready(server)


HTTP_DATATYPES = {"O": "BYTES", "f": "FP32", "i": "INT32"}


@pytest.mark.triton_server
def test_postprocessing_called_with_junk_is_invalid_arg_naming_the_input(server):
    """Over HTTP (Triton maps INVALID_ARG to 400); before, these were INTERNAL with raw Python exceptions."""
    for overrides, field in JUNK:
        if overrides.get("finish_reason", np.array([b""])).tolist() == [b"\xff"]:
            continue  # JSON cannot carry invalid UTF-8
        inputs = [{"name": name, "datatype": HTTP_DATATYPES[a.dtype.kind], "shape": list(a.shape),
                   "data": [v.decode() if isinstance(v, bytes) else v for v in a.tolist()]}
                  for name, a in detokenize_inputs(**overrides).items()]
        status, body = http_post(server, "/v2/models/postprocessing/infer", {"inputs": inputs})
        assert status == 400 and field in json.loads(body)["error"], (overrides, status, body)
    assert is_ready(server)


@pytest.mark.triton_server
def test_liveness_asks_no_model_of_the_ensemble(server):
    """The token model takes another request than the liveness question, and the ensemble and its pre- and
    postprocessing are not nanoserve text models: `nanoserve serve` asks the ensemble by name instead."""
    assert liveness.text_models(server.url_http) == []
