"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_server_error",
               503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_field_error(message: str, names: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams ("top_p: must be in ...") as a 400 naming the OpenAI parameter: names
    maps a sampling parameter to the request's own name for it (e.g. logprobs -> top_logprobs)."""
    field, _, rest = message.partition(":")
    param = (names or {}).get(field, field)
    return bad_request(f"{param}:{rest}" if rest else message, param if rest else None)
