"""The text model in a real tritonserver: streamed and non-streamed text against the offline engine, HTTP
generate, optional outputs, validation errors, cancellation. One server for the module."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from serving_utils import (collect, http_post, is_ready, metrics_when, open_sse, open_stream, sse_events, stream,
                           triton)

from transformers import AutoTokenizer

from nanoserve import LLM, SamplingParams

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "nanoserve"
ENGINE_ARGS = {"device": "cpu", "kvcache_block_size": 16, "num_kvcache_blocks": 256}
PROMPTS = ["Héllo wörld, naïve café — 你好 ", "The licence grants you", "  spaces   and\ttabs"]
N = 24
LONG = 131072  # max_model_len of long_server


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    with triton(tmp_path_factory.mktemp("serving"), qwen3_dir, [MODEL], **ENGINE_ARGS) as server:
        yield server
        # SIGTERM (on leaving the with) with a request in flight: tritonserver drains it before it unloads the
        # model; the client must close its stream after the FINAL for the server to exit.
        drained = {}
        client, events = open_stream(server, MODEL, text_input=PROMPTS[0], stream=True, return_finish_reason=True,
                                     sampling_parameters={"max_tokens": 200, "ignore_eos": True})
        assert events.get(timeout=60)[1] is None
        reader = threading.Thread(target=lambda: (drained.update(out=collect(events)), client.stop_stream()))
        reader.start()
    reader.join(60)
    client.close()
    assert drained["out"].error is None and drained["out"].responses[-1]["finish_reason"].tolist() == [b"length"]


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """The same weights with room for 131,072 tokens: a request without max_tokens still runs when a test cancels
    it, however fast the engine is."""
    from nanoserve.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("long")
    checkpoint = build_tiny_model(str(tmp / "tiny-long"), max_position_embeddings=LONG)
    with triton(tmp, checkpoint, [MODEL], **{**ENGINE_ARGS, "num_kvcache_blocks": LONG // 16}) as server:
        yield server


@pytest.fixture(scope="module")
def offline(qwen3_dir):
    """Greedy text of each prompt, from nanoserve.LLM in this process: the reference."""
    with LLM(qwen3_dir, **ENGINE_ARGS) as llm:
        params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
        return dict(zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)))


GREEDY = {"temperature": "0", "max_tokens": str(N), "ignore_eos": "true"}  # strings, as genai-perf sends them


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_deltas_concatenate_to_offline_text(server, offline, prompt):
    streamed = stream(server, MODEL, text_input=prompt, stream=True, sampling_parameters=GREEDY)
    whole = stream(server, MODEL, text_input=prompt, stream=False, exclude_input_in_output=True,
                   sampling_parameters=GREEDY)
    assert streamed.error is None and whole.error is None
    assert streamed.text == whole.text == offline[prompt].text
    assert all(streamed.texts[:-1])  # real deltas, only the last may be empty (a loaded box may merge all into one)
    assert len(whole.responses) == 1  # one data response (HTTP /generate needs that)


def test_non_streaming_prepends_prompt_by_default(server, offline):
    prompt = PROMPTS[0]
    whole = stream(server, MODEL, text_input=prompt, sampling_parameters=GREEDY)
    assert whole.texts == [prompt + offline[prompt].text]


def test_http_generate_and_generate_stream(server, offline):
    # Triton's generate endpoint turns "parameters" named like an input (max_tokens, temperature) into that
    # tensor, so those must be JSON numbers here; the others reach the model as request parameters.
    prompt = PROMPTS[1]
    parameters = {"temperature": 0, "max_tokens": N, "ignore_eos": True}
    status, body = http_post(server, f"/v2/models/{MODEL}/generate", {"text_input": prompt, "parameters": parameters})
    assert status == 200, body
    assert json.loads(body)["text_output"] == prompt + offline[prompt].text
    status, body = http_post(server, f"/v2/models/{MODEL}/generate_stream",
                             {"text_input": prompt, "stream": True, "parameters": parameters})
    assert status == 200, body
    events = sse_events(body)
    assert "".join(e["text_output"] for e in events) == offline[prompt].text


def test_trtllm_scalar_tensors(server, offline):
    prompt = PROMPTS[2]
    out = stream(server, MODEL, text_input=prompt, stream=True, max_tokens=np.array([N], np.int32),
                 temperature=np.array([0.0], np.float32), sampling_parameters={"ignore_eos": True})
    assert out.error is None and out.text == offline[prompt].text


def test_optional_outputs(server, offline, qwen3_dir):
    prompt = PROMPTS[0]
    flags = {f"return_{name}": True for name in ("finish_reason", "cumulative_logprob", "logprobs",
                                                 "num_input_tokens", "num_output_tokens")}
    ref = offline[prompt]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    for streaming in (True, False):
        out = stream(server, MODEL, text_input=prompt, stream=streaming, exclude_input_in_output=True,
                     sampling_parameters={**GREEDY, "logprobs": 2}, **flags)
        assert out.error is None
        last = out.responses[-1]
        assert last["finish_reason"].tolist() == [b"length"]
        assert last["num_input_tokens"].tolist() == [ref.num_prompt_tokens]
        assert sum(int(r["num_output_tokens"][0]) for r in out.responses) == N
        assert float(last["cumulative_logprob"][0]) == pytest.approx(ref.cumulative_logprob, abs=1e-3)
        # vllm_backend's format: per token {token_id: {"logprob", "rank", "decoded_token"}}, the sampled one first
        logprobs = [entry for r in out.responses for entry in json.loads(r["logprobs"][0])]
        assert [int(next(iter(e))) for e in logprobs] == ref.token_ids
        assert sum(next(iter(e.values()))["logprob"] for e in logprobs) == pytest.approx(ref.cumulative_logprob,
                                                                                       abs=1e-3)
        for entry, expected in zip(logprobs, ref.logprobs):
            sampled = next(iter(entry.values()))
            assert sampled["logprob"] == pytest.approx(next(iter(expected.values())), abs=1e-4)
            assert sampled["rank"] == 1 and sorted(v["rank"] for v in entry.values()) == [1, 2]  # greedy
            assert all(v["decoded_token"] == tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(
                int(t))]) for t, v in entry.items())
    out = stream(server, MODEL, text_input=prompt, sampling_parameters=GREEDY, return_logprobs=True)
    assert out.responses[-1]["logprobs"].tolist() == [b"null"]  # no logprobs parameter: null, as vllm_backend


SAMPLES = {"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": N, "ignore_eos": True, "prompt_logprobs": 2}


@pytest.fixture(scope="module")
def offline_samples(qwen3_dir):
    with LLM(qwen3_dir, **ENGINE_ARGS) as llm:
        return llm.generate(PROMPTS[1], SamplingParams(**SAMPLES), use_tqdm=False)[0]


def test_n_samples_stream_their_deltas_at_their_index(server, offline_samples):
    """n = 3, seeded: an entry per sample in every output, the offline engine's samples (seed + i each, all
    different). Streamed, each response has each sample's delta at its index, joining to the same texts. The
    prompt logprobs (vllm_backend's logprobs format, None for the first token) are the offline engine's, on the
    first streamed response."""
    flags = {"return_finish_reason": True, "return_num_output_tokens": True, "return_prompt_logprobs": True}
    whole = stream(server, MODEL, text_input=PROMPTS[1], exclude_input_in_output=True, sampling_parameters=SAMPLES,
                   **flags)
    streamed = stream(server, MODEL, text_input=PROMPTS[1], stream=True, sampling_parameters=SAMPLES, **flags)
    texts = [sample.text for sample in offline_samples.outputs]
    assert len(set(texts)) == 3 and whole.error is None and streamed.error is None
    [response] = whole.responses
    assert [t.decode() for t in response["text_output"]] == texts
    assert response["finish_reason"].tolist() == [b"length"] * 3 and response["num_output_tokens"].tolist() == [N] * 3
    assert all(len(r["text_output"]) == len(r["finish_reason"]) == 3 for r in streamed.responses)
    assert ["".join(r["text_output"][i].decode() for r in streamed.responses) for i in range(3)] == texts
    assert [sum(int(r["num_output_tokens"][i]) for r in streamed.responses) for i in range(3)] == [N] * 3
    carried = [json.loads(r["prompt_logprobs"][0]) for r in streamed.responses]
    assert all(c is None for c in carried[1:])
    for got in (carried[0], json.loads(response["prompt_logprobs"][0])):
        assert got[0] is None and len(got) == offline_samples.num_prompt_tokens
        for entry, expected in zip(got[1:], offline_samples.prompt_logprobs[1:]):
            assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(expected, abs=1e-4)


BAD_INPUTS = [  # (inputs, request parameters, the field the error must name)
    ({"stream": True}, None, "text_input"),
    ({"text_input": ""}, None, "text_input"),
    ({"text_input": b"caf\xc3("}, None, "text_input"),
    ({"text_input": "x " * 3000}, None, "text_input"),  # longer than max_model_len (2048)
    ({"text_input": "Hi", "sampling_parameters": "{max_tokens: 3"}, None, "sampling_parameters"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokenz": 3}}, None, "max_tokenz"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": "lots"}}, None, "max_tokens"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": -5}}, None, "max_tokens"),
    ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 10 ** 9}}, None, "max_tokens"),
    ({"text_input": "Hi", "sampling_parameters": {"top_p": 1.5}}, None, "top_p"),
    ({"text_input": "Hi", "temperature": np.array([1], np.int32)}, None, "temperature"),
    ({"text_input": "Hi"}, {"top_k": "many"}, "top_k"),
    ({"text_input": "Hi"}, {"unknown_knob": 1}, "unknown_knob"),
    ({"text_input": "Hi", "sampling_parameters": "[" * 100_000}, None, "sampling_parameters"),  # was a traceback
    ({"text_input": "Hi"}, {"stop_token_ids": "[" * 100_000}, "stop_token_ids"),
]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("as_text", [False, True])
def test_structured_outputs_json_follows_its_schema(server, as_text):
    """vllm_backend's sampling parameter: a JSON object, or the same as a JSON string."""
    spec = {"json": PERSON}
    out = stream(server, MODEL, text_input=PROMPTS[1], stream=True, return_finish_reason=True,
                 sampling_parameters={"temperature": 1.0, "seed": 5, "max_tokens": 100,
                                      "structured_outputs": json.dumps(spec) if as_text else spec})
    assert out.error is None and out.responses[-1]["finish_reason"].tolist() == [b"stop"]
    jsonschema.validate(json.loads(out.text), PERSON)


def test_bad_inputs_name_the_field_while_a_good_stream_completes(server, offline):
    # gRPC streams carry an error's message but not its code: the HTTP test below checks the code.
    prompt = PROMPTS[1]
    good = {}
    worker = threading.Thread(target=lambda: good.update(out=stream(
        server, MODEL, text_input=prompt, stream=True, sampling_parameters=GREEDY)))
    worker.start()
    for inputs, parameters, field in BAD_INPUTS:
        out = stream(server, MODEL, parameters=parameters, **inputs)
        assert out.error is not None and not out.responses, (inputs, parameters)
        assert field in out.error.message() and "Failed to process" not in out.error.message(), out.error.message()
        assert is_ready(server)
    worker.join(120)
    assert good["out"].error is None and good["out"].text == offline[prompt].text


@pytest.mark.parametrize("body, field", [
    ({"text_input": ""}, "text_input"),
    ({"parameters": {"max_tokens": 3}}, "text_input"),
    ({"text_input": "x " * 3000}, "text_input"),
    ({"text_input": "Hi", "sampling_parameters": "{max_tokens: 3"}, "sampling_parameters"),
    ({"text_input": "Hi", "parameters": {"unknown_knob": 1}}, "unknown_knob"),
    ({"text_input": "Hi", "parameters": {"max_tokens": -5}}, "max_tokens"),
    ({"text_input": "Hi", "parameters": {"top_p": 1.5}}, "top_p"),
    ({"text_input": "Hi", "parameters": {"min_tokens": "lots"}}, "min_tokens"),
    ({"text_input": "Hi", "sampling_parameters": "[" * 100_000}, "sampling_parameters"),  # was a 500 + traceback
    ({"text_input": "Hi", "sampling_parameters": json.dumps({"structured_outputs": {"regex": "(a"}})},
     "structured_outputs"),  # does not compile
    ({"text_input": "Hi", "sampling_parameters": json.dumps({"structured_outputs": {"regex": "a", "choice": ["a"]}})},
     "structured_outputs"),
])
def test_bad_inputs_over_http_are_invalid_arg(server, body, field):
    status, reply = http_post(server, f"/v2/models/{MODEL}/generate", body)
    assert status == 400, reply  # Triton maps INVALID_ARG to 400 Bad Request
    assert field in json.loads(reply)["error"]
    assert is_ready(server)


def test_cancel_frees_every_kv_block(long_server, offline):
    # No max_tokens: the default runs to max_model_len, not vLLM's 16. Cancel after 20 tokens.
    server = long_server
    client, events = open_stream(server, MODEL, text_input=PROMPTS[0], stream=True,
                                 sampling_parameters={"ignore_eos": True})
    for _ in range(20):
        assert events.get(timeout=60)[1] is None
    before = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 1)
    assert before["nanoserve_kv_blocks_used"] > 0
    client.stop_stream(cancel_requests=True)
    client.close()
    values = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 0)
    assert values["nanoserve_kv_blocks_used"] == 0
    assert values["nanoserve_requests_finished_total{reason=abort}"] == \
        before["nanoserve_requests_finished_total{reason=abort}"] + 1
    after = stream(server, MODEL, text_input=PROMPTS[0], stream=True, sampling_parameters=GREEDY)
    assert after.text == offline[PROMPTS[0]].text


VANISHING_GRPC_CLIENT = """
import sys
sys.path.insert(0, sys.argv[2])
from serving_utils import open_stream
class Server: url_grpc = sys.argv[1]
client, events = open_stream(Server, "nanoserve", text_input="Hi", stream=True,
                             sampling_parameters={"ignore_eos": True})
assert events.get(timeout=60)[1] is None
print("streaming", flush=True)
sys.stdin.read()  # until killed
"""


def vanishing_grpc_client(server):
    """A client process that streams until SIGKILL: its HTTP/2 connection goes away without a cancel."""
    command = [sys.executable, "-c", VANISHING_GRPC_CLIENT, server.url_grpc, str(Path(__file__).parent)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "streaming"
    return lambda: (process.kill(), process.wait(30))


def vanishing_http_client(server):
    """A /generate_stream connection closed after its first event."""
    return open_sse(server, MODEL, {"text_input": "Hi", "parameters": {"stream": True, "ignore_eos": True}})


@pytest.mark.parametrize("vanishing_client", [vanishing_grpc_client, vanishing_http_client])
def test_a_client_that_goes_away_is_cancelled(long_server, vanishing_client):
    """No cancel request, only a connection gone: the request is aborted and its blocks freed, not generated to
    max_model_len for nobody."""
    server = long_server
    before = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 0)
    go_away = vanishing_client(server)
    metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 1)
    go_away()
    values = metrics_when(server, MODEL, lambda values: values["nanoserve_requests_running"] == 0)
    assert values["nanoserve_kv_blocks_used"] == 0
    assert values["nanoserve_requests_finished_total{reason=abort}"] == \
        before["nanoserve_requests_finished_total{reason=abort}"] + 1
    assert is_ready(server)


def test_concurrent_streams_match_offline(server, offline):
    prompts = PROMPTS * 2
    results = [None] * len(prompts)

    def run(i):
        results[i] = stream(server, MODEL, text_input=prompts[i], stream=True, sampling_parameters=GREEDY).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [offline[p].text for p in prompts]


def test_input_ids_prompt_equals_its_text_and_bad_ids_name_the_input(server, offline, qwen3_dir):
    """nanoserve's input_ids input: the text model runs the ids as the same prompt's text_input would; not streamed
    with the input, the decoded prompt comes first; an id outside the vocabulary, or both inputs, is INVALID_ARG
    naming input_ids."""
    prompt = PROMPTS[1]
    ids = np.array(AutoTokenizer.from_pretrained(qwen3_dir).encode(prompt), dtype=np.int32)
    streamed = stream(server, MODEL, input_ids=ids, stream=True, sampling_parameters=GREEDY)
    whole = stream(server, MODEL, input_ids=ids, sampling_parameters=GREEDY, return_num_input_tokens=True)
    assert streamed.error is None and streamed.text == offline[prompt].text
    assert whole.text == prompt + offline[prompt].text
    assert whole.responses[-1]["num_input_tokens"].tolist() == [len(ids)]
    for inputs in ({"input_ids": np.array([1, 10 ** 9], np.int32)}, {"input_ids": ids, "text_input": prompt}):
        failed = stream(server, MODEL, sampling_parameters=GREEDY, **inputs)
        assert failed.error is not None and failed.error.message().startswith("input_ids:"), failed.error
