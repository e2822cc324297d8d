"""The OpenAI API's parts without a server: request parsing (property-tested against SamplingParams), chat
rendering, the logprobs conversions, errors."""
import json
import logging

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from tokenizers import processors

from nanoserve.sampling_params import SamplingParams
from nanoserve.serving.openai_api.chat import render_chat
from nanoserve.serving.openai_api.errors import APIError, api_error
from nanoserve.serving.openai_api.formats import ChatFormat, CompletionFormat
from nanoserve.serving.openai_api.logprobs import chat_logprobs, completion_logprobs, top_prompt_logprobs
from nanoserve.serving.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.serving.openai_api.tools import check_tool_choice, make_parser
from nanoserve.serving.openai_api.triton import Chunk, triton_error
from nanoserve.tiny_model import build_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]
NUMBERS = st.one_of(st.none(), st.integers(-3, 40), st.floats(-3, 3, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "max_tokens": NUMBERS, "max_completion_tokens": NUMBERS, "temperature": NUMBERS, "top_p": NUMBERS,
    "top_k": NUMBERS, "min_p": NUMBERS, "seed": NUMBERS, "presence_penalty": NUMBERS, "n": NUMBERS,
    "logprobs": st.booleans(), "top_logprobs": NUMBERS, "stop": st.one_of(st.text(max_size=3), st.lists(
        st.text(max_size=3), max_size=2))}))
def test_chat_sampling_parameters_are_valid_or_a_400_naming_a_request_field(values):
    """Whatever a client sends: either sampling parameters the engine accepts, or a 400 (never a 500) whose
    param is one of the request's own fields."""
    try:
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **values)
    except ValidationError:
        return  # a type error: FastAPI answers 400 naming the field (tested against the server)
    try:
        params = request.sampling_parameters()
    except APIError as error:
        assert error.status == 400 and error.param in values, (error.message, values)
        assert error.message.startswith(error.param)
        return
    sampling = SamplingParams.from_dict(params)
    expected_max = values.get("max_completion_tokens")
    assert sampling.max_tokens == (values.get("max_tokens") if expected_max is None else expected_max)
    assert sampling.logprobs == ((values.get("top_logprobs") or 0) if values.get("logprobs") else None)


def test_completion_prompts_text_or_token_ids_checked_against_the_vocabulary():
    def prompts(prompt):
        return CompletionRequest(model="m", prompt=prompt).prompts(vocab_size=100)

    assert prompts("Hi") == ["Hi"] and prompts(["Hi", "yo"]) == ["Hi", "yo"]
    assert prompts([5, 0, 99]) == [[5, 0, 99]] and prompts([[5], [6, 7]]) == [[5], [6, 7]]
    assert prompts(["Hi", [6, 7]]) == ["Hi", [6, 7]]  # vLLM takes a mix too
    for prompt, message in (("", "prompt: empty"), (["a", ""], "prompt.1: empty"), ([], "prompt: expected"),
                            ([1, "a", 2], "prompt: expected"), ([[1], [-1]], "prompt: expected"),
                            ([True], "prompt: expected"), ([1.5], "prompt: expected"),
                            ([3, 100], r"prompt.1: token id 100 is outside the vocabulary \[0, 100\)"),
                            ([[1], [2, 3, 200]], "prompt.1.2: token id 200")):
        with pytest.raises(APIError, match=message) as error:
            prompts(prompt)
        assert error.value.param == "prompt" and error.value.status == 400


def test_unknown_fields_are_ignored_with_a_warning_and_openais_unsupported_ones_refused(caplog):
    request = CompletionRequest(model="m", prompt="x", vendor_extra=1, another={"a": 1})
    with caplog.at_level(logging.WARNING, logger="nanoserve.openai"):
        request.check()
    [record] = caplog.records
    assert "another, vendor_extra" in record.getMessage()
    for body, name in (({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "suffix": "y"}, "suffix")):
        with pytest.raises(APIError) as error:
            CompletionRequest(model="m", **body).check()
        assert error.value.param == name and error.value.message.startswith(f"{name}:")
    with pytest.raises(APIError) as error:
        ChatCompletionRequest(model="m", messages=MESSAGES, functions=[]).check()
    assert error.value.param == "functions"
    with pytest.raises(ValidationError):  # inside a message, an unknown field is still a 400 naming it
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x", "bogus": 1}])


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a\ud800b"}, "prompt"), ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop.1"),
    ({"prompt": "x", "structured_outputs": {"json": {"properties": {"\ud800": {}}}}},
     "structured_outputs.json.properties"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(fields, param):
    """JSON's "\\ud800" escape decodes to a string that UTF-8 cannot encode: refused before it reaches Triton."""
    with pytest.raises(APIError) as error:
        CompletionRequest(model="m", **fields).check_utf8()
    assert error.value.param == param and error.value.status == 400
    CompletionRequest(model="m", prompt="emoji \U0001f600 é").check_utf8()  # one beyond U+FFFF is fine


def test_the_surrogate_check_takes_any_depth_json_parses():
    schema = "\ud800"
    for _ in range(950):  # Python's JSON parser stops near 1,000 levels
        schema = {"a": schema}
    with pytest.raises(APIError) as error:
        CompletionRequest(model="m", prompt="x", structured_outputs={"json": schema}).check_utf8()
    assert error.value.param == "structured_outputs.json" + ".a" * 950


def test_chat_template_and_a_bos_the_tokenizer_adds_anyway():
    tokenizer = build_tokenizer()
    assert render_chat(tokenizer, MESSAGES) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single=f"{tokenizer.bos_token} $A",
                                                                        special_tokens=[(tokenizer.bos_token, bos)])
    ids = tokenizer.encode(render_chat(tokenizer, MESSAGES), add_special_tokens=True)
    assert ids[0] == bos and ids.count(bos) == 1  # the engine's encoding of the prompt: one BOS
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(APIError, match="messages: the chat template failed: roles must alternate"):
        render_chat(tokenizer, MESSAGES)
    tokenizer.chat_template = None
    with pytest.raises(APIError, match="no chat template"):
        render_chat(tokenizer, MESSAGES)


ENTRY = {"7": {"logprob": -2.0, "rank": 6, "decoded_token": "é"},  # vllm_backend's: the sampled token first
         "3": {"logprob": -0.1, "rank": 1, "decoded_token": " a"},
         "4": {"logprob": -0.5, "rank": 2, "decoded_token": "b"}}


def test_logprobs_in_openais_shapes():
    [token] = chat_logprobs([ENTRY], top_n=1)
    assert token == {"token": "é", "logprob": -2.0, "bytes": [0xc3, 0xa9],
                     "top_logprobs": [{"token": " a", "logprob": -0.1, "bytes": [32, 97]}]}
    assert completion_logprobs([ENTRY, ENTRY], text_offset=5, top_n=2) == {
        "tokens": ["é", "é"], "token_logprobs": [-2.0, -2.0], "text_offset": [5, 6],
        "top_logprobs": [{"é": -2.0, " a": -0.1, "b": -0.5}] * 2, "end": 7}
    assert completion_logprobs([ENTRY], text_offset=0, top_n=1)["top_logprobs"] == [{"é": -2.0, " a": -0.1}]
    assert top_prompt_logprobs([None, ENTRY], top_n=1) == [None, {k: ENTRY[k] for k in ("7", "3")}]


def test_stream_events_and_the_whole_response_agree():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, stream=True, logprobs=True,
                                    stream_options={"include_usage": True})
    chunks = [Chunk(["Hé"], [None], [2], [[ENTRY, ENTRY]], 5), Chunk(["llo"], ["length"], [1], [[ENTRY]], 5, True)]
    streamed = ChatFormat(request, ["prompt"])
    events = streamed.start() + [e for chunk in chunks for e in streamed.events(chunk)] + streamed.end()
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "Héllo"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    whole = ChatFormat(request, ["prompt"]).full(chunks)["choices"][0]
    assert whole["message"]["content"] == "Héllo" and whole["finish_reason"] == "length"
    assert len(whole["logprobs"]["content"]) == 3


PROMPT_LOGPROBS = [None, {"9": {"logprob": -1.5, "rank": 3, "decoded_token": "ay"},
                          "3": {"logprob": -0.1, "rank": 1, "decoded_token": " a"}}]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_puts_the_prompt_tokens_first_for_each_prompt_and_sample(stream):
    """Two prompts, n=2: choice p * 2 + s; each starts with its prompt's text and, with logprobs, its tokens (the
    first null), then the generated ones, the offsets running on; streamed, the first event of each choice."""
    request = CompletionRequest(model="m", prompt=["Say", "Say"], echo=True, logprobs=1, n=2, stream=stream,
                                prompt_logprobs=0)
    fmt = CompletionFormat(request, [[8, 9], [8, 9]], ["Say", "Say"], ["S", "S"])
    chunks = [Chunk(["x", "é"], [None, "length"], [1, 1], [[ENTRY], [ENTRY]], 2, prompt_logprobs=PROMPT_LOGPROBS,
                    prompt_index=1),
              Chunk(["", "é"], ["length", "length"], [0, 1], [[], [ENTRY]], 2, True, PROMPT_LOGPROBS),
              Chunk(["y"], ["length"], [1], [[ENTRY]], 2, True, prompt_index=1)]
    if stream:
        events = [e for chunk in chunks for e in fmt.events(chunk)]
        choices = {}
        for choice in (c for e in events for c in e["choices"]):
            whole = choices.setdefault(choice["index"], {"text": "", "logprobs": None, "prompt_logprobs": []})
            whole["text"] += choice["text"]
            whole["prompt_logprobs"].append(choice.get("prompt_logprobs"))
            if whole["logprobs"] is None:
                whole["logprobs"] = choice["logprobs"]
            elif choice["logprobs"]:
                whole["logprobs"] = {k: whole["logprobs"][k] + choice["logprobs"][k] for k in choice["logprobs"]}
        assert [p for p in choices[2]["prompt_logprobs"] if p is not None] == [[None, {"9": PROMPT_LOGPROBS[1]["9"]}]]
    else:
        body = fmt.full(chunks)
        choices = {c["index"]: c for c in body["choices"]}
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
        assert choices[0]["prompt_logprobs"] == [None, {"9": PROMPT_LOGPROBS[1]["9"]}]
    assert sorted(choices) == [0, 1, 2, 3]
    assert [choices[i]["text"] for i in range(4)] == ["Say", "Sayé", "Sayxy", "Sayé"]
    assert choices[2]["logprobs"] == {"tokens": ["S", "ay", "é", "é"], "token_logprobs": [None, -1.5, -2.0, -2.0],
                                      "top_logprobs": [None, {"ay": -1.5, " a": -0.1}] + [{"é": -2.0, " a": -0.1}] * 2,
                                      "text_offset": [0, 1, 3, 4]}
    assert choices[0]["logprobs"]["tokens"] == ["S", "ay"]  # nothing generated


@pytest.mark.parametrize("message, status, param, http_message", [
    ("top_p: must be in (0, 1], got 1.5", 400, "top_p", None),
    ("text_input: empty prompt", 400, "prompt", "prompt: empty prompt"),  # the API's name for the input
    ("input_ids: 9 tokens leave no room", 400, "prompt", "prompt: 9 tokens leave no room"),
    ("logprobs: at most max_logprobs (5), got 9", 400, "top_logprobs", "top_logprobs: at most max_logprobs (5), got 9"),
    ("internal error: the engine step failed (see the server log)", 500, None, None),
    ("the model is being unloaded", 503, None, None),
    ("the model is unavailable: the engine thread died (RuntimeError: x)", 503, None, None),
    ("the server is shutting down: its exit timeout ends this request", 503, None, None),
    ("the server is shutting down: the model takes no new request", 503, None, None),
    ("Request for unknown model: 'x' is not found", 404, "model", None),
    ("[request id: 7] unexpected shape for input 'text_input'", 400, None, None),  # tritonserver's own check
])
def test_triton_errors_become_http_errors(message, status, param, http_message):
    """A Triton error's text is decoded once (vllm_text.decode_error); the HTTP error takes its status from the
    kind and its param from the field, by the API's names (here a chat request's logprobs -> top_logprobs)."""
    error = api_error(triton_error(message, {"logprobs": "top_logprobs"}))
    assert (error.status, error.param, error.message) == (status, param, http_message or message)


def test_response_format_maps_to_structured_outputs():
    def structured(**fields):
        return ChatCompletionRequest(model="m", messages=MESSAGES, **fields).sampling_parameters().get(
            "structured_outputs")

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert structured(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}) == \
        {"json": schema}
    assert structured(response_format={"type": "json_object"}) == {"json_object": True}
    assert structured(response_format={"type": "text"}) is None
    assert structured(structured_outputs={"regex": "[ab]+"}) == {"regex": "[ab]+"}
    for fields in ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                   {"response_format": {"type": "json_schema"}}):
        with pytest.raises(APIError) as error:
            structured(**fields)
        assert error.value.status == 400 and error.value.param == "response_format"
    with pytest.raises(APIError) as error:
        structured(structured_outputs={"regex": "a", "choice": ["a"]})
    assert error.value.param == "structured_outputs" and error.value.message.startswith("structured_outputs:")


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time", "description": "the time"}}
HERMES = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
         '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'


def test_required_and_named_tool_choices_constrain_the_output_with_the_tools_schema():
    def values(**fields):
        return ChatCompletionRequest(model="m", messages=MESSAGES, tools=[WEATHER, TIME], **fields).sampling_values()

    named = values(tool_choice={"type": "function", "function": {"name": "weather"}})[0]["structured_outputs"]
    assert named == {"json": WEATHER["function"]["parameters"]}
    required = values(tool_choice="required")[0]["structured_outputs"]["json"]
    jsonschema.Draft202012Validator.check_schema(required)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "time", "parameters": {}}],
                        required)
    for wrong in ([], [{"name": "weather", "parameters": {"city": "Rome"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    single = values(tool_choice="required", parallel_tool_calls=False)[0]["structured_outputs"]["json"]
    assert single["maxItems"] == 1
    assert "structured_outputs" not in values()[0] and "structured_outputs" not in values(tool_choice="none")[0]
    with pytest.raises(APIError) as error:
        values(tool_choice="required", response_format={"type": "json_object"})
    assert error.value.param == "tool_choice"


def test_tool_choice_needs_what_it_names():
    parser = make_parser("hermes")
    assert check_tool_choice("auto", [WEATHER["function"]], parser) == "auto"
    named = {"type": "function", "function": {"name": "weather"}}
    assert check_tool_choice(named, [WEATHER["function"]], None) == named
    for choice, functions, parser_, message in (
            ("auto", [WEATHER["function"]], None, "needs a tool-call parser"),
            ("required", [], parser, "needs tools"),
            ({"type": "function", "function": {"name": "x"}}, [WEATHER["function"]], parser, "no tool is named 'x'")):
        with pytest.raises(APIError, match=message) as error:
            check_tool_choice(choice, functions, parser_)
        assert error.value.param == "tool_choice"


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", HERMES, "Let me look.", [("weather", {"city": "Oslo"}), ("time", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "time", '
     '"parameters": {}}', None, [("weather", {"city": "Paris"}), ("time", {})]),
    ("llama3_json", "Paris is nice.", "Paris is nice.", []),
    ("llama3_json", '{"name": "weather", "parameters": ', '{"name": "weather", "parameters": ', []),
])
def test_tool_call_parsers(name, text, content, calls):
    parsed_content, parsed = make_parser(name).parse(text)
    assert parsed_content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed] == calls


def test_hermes_streams_content_until_a_call_may_begin():
    parser = make_parser("hermes")
    assert parser.content_end("Hello <tool") == len("Hello ")
    assert parser.content_end("Hello <tool_call>{") == len("Hello ")
    assert parser.content_end("a < b") == len("a < b")
    assert make_parser("llama3_json").content_end(' {"na') == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_calls_whole_and_streamed(stream):
    """auto with hermes: the content before the calls, then the calls with finish_reason "tool_calls"; a named
    choice: the constrained text is the call's arguments; a cut-off call stays content."""
    def run(fmt, pieces, last_reason="stop"):
        chunks = [Chunk([piece], [last_reason if i == len(pieces) - 1 else None], [1], [None], 5, i == len(pieces) - 1)
                  for i, piece in enumerate(pieces)]
        if not stream:
            return fmt.full(chunks)["choices"][0]
        events = [e for chunk in chunks for e in fmt.events(chunk)]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
        message = {"content": "".join(d.get("content", "") for d in deltas) or None}
        if calls:
            assert [call["index"] for call in calls] == list(range(len(calls)))
            message["tool_calls"] = calls
        return {"message": message, "finish_reason": [c["finish_reason"] for e in events for c in e["choices"]][-1]}

    request = ChatCompletionRequest(model="m", messages=MESSAGES, tools=[WEATHER, TIME], stream=stream)
    auto = run(ChatFormat(request, ["p"], "auto", make_parser("hermes")), [HERMES[:7], HERMES[7:20], HERMES[20:]])
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"].strip() == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in auto["message"]["tool_calls"]] \
        == [("weather", {"city": "Oslo"}), ("time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in auto["message"]["tool_calls"])
    named = run(ChatFormat(request, ["p"], {"type": "function", "function": {"name": "weather"}}),
                ['{"city": ', '"Paris"}'])
    assert named["finish_reason"] == "tool_calls" and named["message"]["content"] is None
    assert named["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    cut = run(ChatFormat(request, ["p"], "required"), ['[{"name": "wea'], "length")
    assert cut == {"message": {"content": '[{"name": "wea'}, "finish_reason": "length"} if stream else \
        cut["message"]["content"] == '[{"name": "wea'


def test_tool_messages_and_tools_reach_the_chat_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
        "{% endfor %}{% else %}{{ m.content }}{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %}{% endif %};"
        "{% endfor %}")
    request = ChatCompletionRequest(model="m", tools=[WEATHER], messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = render_chat(tokenizer, [m.template_dict() for m in request.messages],
                       tools=[t.model_dump(exclude_none=True) for t in request.tools])
    assert text == '[tool weather]user:Hi;assistant:weather{"city": "Oslo"};tool:sunny@c1;'
