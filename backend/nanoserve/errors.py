"""A request's error as a typed value: the field it is about, what is wrong with it, and its kind. The check that
finds it raises it; the stub reports it as a Triton error on the client's input tensor, the OpenAI API as an HTTP
error naming its parameter, `LLM` as the exception itself.

Its text is "field: message" (the message alone without a field): what users read, and what a Triton error
carries across gRPC, where a stream's error has no code (serving/shared/contracts/vllm_text.py decodes it).
"""
from __future__ import annotations

import re
from enum import Enum

FIELD = re.compile(r"[A-Za-z_]\w*(?:\.\w+)*", re.ASCII)  # "top_p", "text_input", "prompt.0", "messages.0.content"


class ErrorKind(Enum):
    """Each kind's value is the name of its TritonError code."""
    INVALID = "INVALID_ARG"  # bad input: HTTP 400
    NOT_FOUND = "NOT_FOUND"  # no such model: HTTP 404
    UNAVAILABLE = "UNAVAILABLE"  # the model failed, is unloading, or the server is shutting down: HTTP 503
    CANCELLED = "CANCELLED"  # the client cancelled the request
    INTERNAL = "INTERNAL"  # nanoserve's own failure: HTTP 500


class RequestError(ValueError):
    """A ValueError (every `except ValueError` still catches bad input) that says its field and kind."""

    def __init__(self, field: str | None, message: str, kind: ErrorKind = ErrorKind.INVALID):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message, self.kind = field or None, message, ErrorKind(kind)

    def within(self, parent: str) -> "RequestError":
        """This error about a part of `parent` ("json" of structured_outputs) as one about parent itself."""
        return RequestError(parent, str(self), self.kind)

    def renamed(self, names: dict[str, str]) -> "RequestError":
        """This error with its field as `names` calls it (the engine's "prompt" is the stub's text_input)."""
        return RequestError(names.get(self.field, self.field), self.message, self.kind)

    @classmethod
    def parse(cls, text: str) -> "RequestError":
        """The bad input whose text this is: "field: message", or the message alone when it starts with no field."""
        field, separator, message = text.partition(": ")
        return cls(field, message) if separator and FIELD.fullmatch(field) else cls(None, text)

    @classmethod
    def of(cls, error: ValueError) -> "RequestError":
        """A ValueError as a RequestError: itself, or one raised as a plain ValueError by its text."""
        return error if isinstance(error, RequestError) else cls.parse(str(error))

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestError) and (self.field, self.message, self.kind) == \
            (other.field, other.message, other.kind)

    def __hash__(self) -> int:
        return hash((self.field, self.message, self.kind))

    def __repr__(self) -> str:
        return f"RequestError({self.field!r}, {self.message!r}, {self.kind})"

    def __reduce__(self):  # pickling rebuilds it from its parts, not from its text
        return RequestError, (self.field, self.message, self.kind)
