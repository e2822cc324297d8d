"""Tool calling on /v1/chat/completions. `required` and a named function constrain the output with structured
outputs (a JSON schema built from the tools, as vLLM builds it), so the calls always parse and validate; `auto`
lets the model write its calls in its own format, read back by the parser `nanoserve serve --tool-call-parser`
names: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen's templates) or `llama3_json` (Llama 3's
`{"name", "parameters"}`, `;`-separated, after an optional `<|python_tag|>`)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from nanoserve.serving.openai_api.errors import bad_request

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def message_dict(self, index: int | None = None) -> dict:
        """OpenAI's tool call (in a stream's delta: with its index)."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def function_schema(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one call or more (one when parallel_tool_calls is false), each
    {"name": one of the tools, "parameters": that tool's arguments}."""
    calls = [{"properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": function_schema(f)},
              "required": ["name", "parameters"]} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "maxItems": 1} if not parallel else schema


def constrained_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls of an output constrained by required_schema (named None) or by one function's parameters."""
    if named is not None:
        return [ToolCall(named, text)]
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in json.loads(text)]


class Parser:
    """Reads a model's own tool-call format out of its text: (content, calls)."""
    def content_end(self, text: str) -> int:
        """How much of a stream's text so far is content for sure (a call may start after it)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(Parser):
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        return len(text) - _partial_suffix(text, self.START)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = [_call(body, "arguments") for body in self.CALL.findall(text[start:])]
        if any(call is None for call in calls):
            return text, []  # not valid calls: the text is the answer
        return text[:start].strip() or None, calls


class Llama3JsonParser(Parser):
    TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return 0
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(json.dumps(value), "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\n;":
                position += 1
        return None, calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str | None) -> Parser | None:
    return None if name is None else PARSERS[name]()


def _call(body: str, *argument_keys: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                         ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that begins marker (held back: the marker may be coming)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def check_tool_choice(choice: str | dict, functions: list[dict], parser: Parser | None) -> str | dict:
    """tool_choice ("none", "auto", "required", or {"type": "function", "function": {"name"}}) as it is; a 400
    naming it when the server cannot honour it."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {f["name"] for f in functions}:
            raise bad_request("tool_choice", f"no tool is named {name!r}")
        return choice
    if choice in ("auto", "required") and not functions:
        raise bad_request("tool_choice", f"{choice!r} needs tools")
    if choice == "auto" and parser is None:
        raise bad_request("tool_choice", '"auto" needs a tool-call parser (nanoserve serve --tool-call-parser '
                                         f'{{{",".join(TOOL_CALL_PARSERS)}}}); "required" or a named function work '
                                         'without one')
    return choice
