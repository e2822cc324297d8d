"""The OpenAI-compatible API of `nanoserve serve`, driven with the official `openai` client: chat and completion,
streamed and not, equal the offline engine's greedy text; logprobs equal the engine's; a client that goes away
frees its request's KV blocks; bad parameters are 4xx naming them. One server (with --ensemble) for the module."""
import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import jsonschema
import openai
import pytest
from serving_utils import metrics, metrics_when
from transformers import AutoTokenizer
from test_parallel_sampling import hf_prompt_logprobs
from triton_server import nanoserve_serve

from nanoserve import LLM, SamplingParams
from nanoserve.engine.tokenize import token_decoder
from nanoserve.serving.openai_api.chat import render_chat

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "tiny"  # --served-model-name
N = 12
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo, naïve café?"}]
GREEDY = dict(temperature=0, max_tokens=N, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(qwen3_dir, tmp_path_factory):
    with nanoserve_serve(qwen3_dir, tmp_path_factory.mktemp("openai"), "--served-model-name", MODEL, "--ensemble",
                         "--num-kvcache-blocks", "128", "--report-custom-metrics",
                         "--tool-call-parser", "hermes") as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt(qwen3_dir):
    return render_chat(AutoTokenizer.from_pretrained(qwen3_dir), MESSAGES)


@pytest.fixture(scope="module")
def offline(qwen3_dir, prompt):
    llm = LLM(qwen3_dir, device="cpu")
    try:
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2),
                            use_tqdm=False)[0]
    finally:
        llm.shutdown()


def test_banner_comes_when_ready_and_models_lists_only_text_models(served, client):
    assert any(line.startswith("nanoserve: ready:") for line in served.output)
    assert any(served.openai_url in line for line in served.output)
    # the ensemble's models (ensemble, nanoserve_tokens, pre/postprocessing) are Triton models, not text ones
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_and_completion_streamed_and_not_equal_the_offline_engine(client, prompt, offline):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == offline.text and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == N and chat.usage.prompt_tokens == offline.num_prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == offline.num_prompt_tokens + N
    completion = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert completion.choices[0].text == offline.text and completion.usage.completion_tokens == N
    streamed = client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == offline.text


def test_logprobs_equal_the_engines(client, prompt, offline):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == N and "".join(t.token for t in content) == offline.text
    for token, expected, token_id in zip(content, offline.logprobs, offline.token_ids):
        assert token.logprob == pytest.approx(expected[token_id], abs=1e-4)
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(sorted(expected.values(), reverse=True),
                                                                         abs=1e-4)
        assert bytes(token.bytes).decode() == token.token
    legacy = client.completions.create(model=MODEL, prompt=prompt, logprobs=1, **GREEDY).choices[0].logprobs
    assert legacy.token_logprobs == pytest.approx([e[t] for e, t in zip(offline.logprobs, offline.token_ids)],
                                                  abs=1e-4)
    assert legacy.text_offset == [sum(map(len, legacy.tokens[:i])) for i in range(N)]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_stop_and_seed(client, prompt, offline):
    stop = offline.text[len(offline.text) // 2:][:3]
    out = client.completions.create(model=MODEL, prompt=prompt, stop=[stop], **GREEDY).choices[0]
    assert out.finish_reason == "stop" and out.text == offline.text[:offline.text.index(stop)]
    sampled = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=1.0, seed=seed)
               .choices[0].text for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_and_structured_outputs(client, prompt):
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    choices = ["yes", "no", "maybe"]
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=4, max_tokens=20,
                                           extra_body={"structured_outputs": {"choice": choices}})
    assert completion.choices[0].text in choices and completion.choices[0].finish_reason == "stop"


def test_n_choices_streamed_and_not(client, prompt):
    """n = 3, seeded: three choices with their indexes and different texts; streamed, each chunk's choices name
    their index and join to the same texts; a streamed chat sends each choice's role first."""
    params = dict(model=MODEL, prompt=prompt, n=3, seed=5, temperature=1.0, max_tokens=N,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**params)
    texts = [choice.text for choice in whole.choices]
    assert [choice.index for choice in whole.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert whole.usage.completion_tokens == 3 * N
    streamed = [""] * 3
    for chunk in client.completions.create(**params, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=2, stream=True)
    assert [choice.index for chunk in chat for choice in chunk.choices if choice.delta.role] == [0, 1]


@pytest.mark.parametrize("params, param", [
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"n": 129}, "n"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),  # past max_model_len: the engine's INVALID_ARG, passed through
    ({"logit_bias": {"100000000": 5}}, "logit_bias"),  # outside the vocabulary: the engine's INVALID_ARG
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),  # the engine's INVALID_ARG, named as the request named it
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs"),
    ({"extra_body": {"stream_options": {"include_usage": True}}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
])
def test_bad_parameters_are_400_naming_them(client, params, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, **params})
    assert error.value.body["param"].startswith(param) and error.value.body["message"].startswith(param)


def test_metrics_on_the_api_port_are_tritonservers_with_the_vllm_gauges(served):
    """Where vLLM serves them, and where the Gateway API Inference Extension's endpoint picker scrapes them."""
    with urllib.request.urlopen(served.openai_url.removesuffix("/v1") + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        page = response.read().decode()
    gauges = [line for line in page.splitlines() if line.startswith(("vllm:num_requests_waiting{",
                                                                     "vllm:kv_cache_usage_perc{"))]
    # the text model and the ensemble's token model (--report-custom-metrics switches both)
    assert len(gauges) == 4 and any(f'model_name="{MODEL}"' in line for line in gauges)
    with urllib.request.urlopen(served.url_metrics, timeout=30) as response:
        assert set(gauges) <= set(response.read().decode().splitlines())


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"prompt": "\ud800"}, "prompt"),  # JSON's "\ud800" escape: a string UTF-8 cannot encode
    ("/completions", {"prompt": [1, 2, 10 ** 9]}, "prompt"),  # outside the vocabulary
    ("/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/completions", {"prompt": "x " * 100_000}, "prompt"),  # the engine's INVALID_ARG on text_input, named "prompt"
    ("/completions", {"prompt": "x", "best_of": 2}, "best_of"),  # OpenAI's, not implemented
    ("/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}, "messages.0.content"),
])
def test_a_bad_prompt_or_parameter_is_400(served, path, body, param):
    request = urllib.request.Request(served.openai_url + path, json.dumps({"model": MODEL, **body}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    body = json.load(error.value)["error"]
    assert error.value.code == 400 and body["param"] == param and body["message"].startswith(param), body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="ensemble", prompt="Hi", max_tokens=2)
    assert error.value.body["param"] == "model" and "ensemble" in error.value.body["message"]


def test_a_client_gone_mid_stream_or_while_waiting_frees_the_engines_blocks(served):
    before = metrics(served, MODEL).get('nanoserve_requests_finished_total{reason=abort}', 0)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with raw_post(served, "/chat/completions", body) as post:
        assert post.read_until(b"data: {").startswith(b"HTTP/1.1 200")
        metrics_when(served, MODEL, lambda m: m["nanoserve_kv_blocks_used"] > 0)
    # closed after the first event: the Triton request is cancelled, the engine aborts it and frees its blocks
    metrics_when(served, MODEL, lambda m: m.get('nanoserve_requests_finished_total{reason=abort}', 0) == before + 1
                 and m["nanoserve_kv_blocks_used"] == 0, timeout=60)
    with raw_post(served, "/chat/completions", {**body, "stream": False}):  # not streamed: closed while waiting
        metrics_when(served, MODEL, lambda m: m["nanoserve_requests_running"] == 1)
    metrics_when(served, MODEL, lambda m: m.get('nanoserve_requests_finished_total{reason=abort}', 0) == before + 2
                 and m["nanoserve_kv_blocks_used"] == 0, timeout=60)


class raw_post:
    """A POST on a plain socket, closed (the client gone) when the with block ends."""

    def __init__(self, served, path: str, body: dict):
        url = urllib.parse.urlsplit(served.openai_url + path)
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((url.hostname, url.port))
        self.sock.sendall(f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)

    def read_until(self, marker: bytes) -> bytes:
        received = b""
        while marker not in received:
            data = self.sock.recv(4096)
            assert data, received
            received += data
        return received

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()


TEXT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman and his curious cat."


def post(served, path: str, body: dict) -> dict:
    """A POST to the API's root (vLLM's /tokenize is not under /v1): the JSON answer."""
    url = served.openai_url.removesuffix("/v1") + path
    request = urllib.request.Request(url, json.dumps({"model": MODEL, **body}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def scored(qwen3_dir):
    """The prompt's token ids and HF's log_softmax at each prompt position (row j - 1: the distribution of j)."""
    ids = AutoTokenizer.from_pretrained(qwen3_dir).encode(TEXT, add_special_tokens=True)
    return ids, hf_prompt_logprobs(qwen3_dir, ids)


def check_echo(logprobs, ids: list[int], reference, top_n: int) -> None:
    """vLLM's echo: the prompt's tokens first, the first without a logprob; each equal to HF's."""
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        [float(reference[j - 1][ids[j]]) for j in range(1, len(ids))], abs=1e-4)
    for j, top in enumerate(logprobs.top_logprobs[1:len(ids)], start=1):
        assert len(top) in (top_n, top_n + 1) and logprobs.tokens[j] in top  # the token and the top_n
        best = float(reference[j - 1].max()) if top_n else float(reference[j - 1][ids[j]])
        assert max(top.values()) == pytest.approx(best, abs=1e-4)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_echo_logprobs_equal_hf_cold_and_with_the_prompt_in_the_prefix_cache(client, scored):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1) and vLLM's max_tokens 0 scoring, for text
    and token-id prompts, batched too; the prompt's blocks are in the prefix cache after the first request."""
    ids, reference = scored
    cold = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = cold.choices[0]
    assert len(choice.logprobs.tokens) == len(ids) + 1 and choice.text.startswith(TEXT)
    check_echo(choice.logprobs, ids, reference, 1)
    for prompt in (TEXT, ids):  # the prompt's blocks are cached now: the scores must not change
        warm = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
        [choice] = warm.choices
        assert choice.text == TEXT and choice.finish_reason == "length" and warm.usage.completion_tokens == 0
        assert len(choice.logprobs.tokens) == len(ids) and warm.usage.prompt_tokens == len(ids)
        check_echo(choice.logprobs, ids, reference, 2)
    batched = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], echo=True, logprobs=0, max_tokens=0)
    assert [c.index for c in batched.choices] == [0, 1] and batched.usage.prompt_tokens == len(ids) + 5
    for choice, length in zip(batched.choices, (len(ids), 5)):
        assert len(choice.logprobs.tokens) == length
        check_echo(choice.logprobs, ids[:length], reference, 0)


def test_echo_streamed_equals_not_streamed_and_prompt_logprobs_extension(client, served, scored):
    ids, reference = scored
    params = dict(model=MODEL, prompt=[TEXT, TEXT], echo=True, logprobs=1, max_tokens=3, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**params)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3] and len({c.text for c in whole.choices}) == 1
    texts, tokens = [""] * 4, [[] for _ in range(4)]
    for chunk in client.completions.create(**params, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    assert texts == [c.text for c in whole.choices] and tokens == [c.logprobs.tokens for c in whole.choices]
    body = post(served, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1})
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for j, entry in enumerate(prompt_logprobs[1:], start=1):
        assert entry[str(ids[j])]["logprob"] == pytest.approx(float(reference[j - 1][ids[j]]), abs=1e-4)
        assert min(value["rank"] for value in entry.values()) == 1


def test_tokenize_and_detokenize_as_vllm(served, qwen3_dir, scored):
    ids, _ = scored
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    tokens = post(served, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert tokens["tokens"] == ids and tokens["count"] == len(ids) and isinstance(tokens["max_model_len"], int)
    assert "".join(tokens["token_strs"]) == tokenizer.decode(ids)
    assert post(served, "/tokenize", {"prompt": TEXT})["token_strs"] is None
    chat = post(served, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert chat == tokenizer.encode(render_chat(tokenizer, MESSAGES), add_special_tokens=True)
    assert post(served, "/detokenize", {"tokens": ids}) == {"prompt": tokenizer.decode(ids)}
    with pytest.raises(urllib.error.HTTPError) as error:
        post(served, "/detokenize", {"tokens": [1, 10 ** 9]})
    assert error.value.code == 400 and json.load(error.value)["error"]["message"].startswith("tokens.1:")


def test_a_field_openai_does_not_define_is_ignored(client, prompt, offline):
    completion = client.completions.create(model=MODEL, prompt=prompt, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "vendor_field": {"x": 1}}})
    assert completion.choices[0].text == offline.text


def test_logit_bias_forces_or_bans_a_token(client, prompt, offline, qwen3_dir):
    token_text = token_decoder(AutoTokenizer.from_pretrained(qwen3_dir))
    forced = client.completions.create(model=MODEL, prompt=prompt, logit_bias={"7": 100}, logprobs=0, **GREEDY)
    assert forced.choices[0].logprobs.tokens == [token_text(7)] * N
    first, second = sorted(offline.logprobs[0], key=offline.logprobs[0].get, reverse=True)[:2]
    assert first == offline.token_ids[0]
    banned = client.completions.create(model=MODEL, prompt=prompt, logit_bias={str(first): -100}, logprobs=0,
                                       max_tokens=1, temperature=0)
    assert banned.choices[0].logprobs.tokens == [token_text(second)]


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": NOTHING}}]
SCHEMAS = {"weather": WEATHER, "clock": NOTHING}


def streamed_tool_calls(client, **params) -> tuple[list[dict], str | None]:
    """The tool calls of a streamed chat (deltas joined as OpenAI's clients join them) and its finish reason."""
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_calls_validate_against_the_tools_schema(client, tool_choice):
    """The random tiny model, constrained: its calls always parse and validate, streamed or not."""
    params = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  temperature=0, max_tokens=200)
    choice = client.chat.completions.create(**params).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    streamed, reason = streamed_tool_calls(client, **params)
    assert streamed == calls and reason == "tool_calls" and len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    if isinstance(tool_choice, dict):
        assert calls[0]["name"] == "weather"


def test_auto_tool_calls_are_parsed_from_the_models_own_text(client):
    """--tool-call-parser hermes on scripted outputs (structured_outputs makes the model write them); a tool
    result sent back in the conversation reaches the template."""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    params = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100)
    choice = client.chat.completions.create(**params, extra_body={"structured_outputs": {"choice": [call]}}).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [made] = choice.message.tool_calls
    assert made.function.name == "weather" and json.loads(made.function.arguments) == {"city": "Oslo", "days": 2}
    streamed, reason = streamed_tool_calls(client, **params, extra_body={"structured_outputs": {"choice": [call]}})
    assert reason == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
        [("weather", {"city": "Oslo", "days": 2})]
    plain = client.chat.completions.create(**params, extra_body={"structured_outputs": {"choice": ["Sunny."]}})
    assert plain.choices[0].message.content == "Sunny." and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": made.id, "type": "function", "function": {"name": "weather", "arguments": made.function.arguments}}]},
        {"role": "tool", "tool_call_id": made.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=4)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
