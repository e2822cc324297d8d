"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from nanoserve.errors import ErrorKind, RequestError

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_server_error",
               503: "service_unavailable"}
STATUS = {ErrorKind.INVALID: 400, ErrorKind.NOT_FOUND: 404, ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(field: str | None, message: str, param: str | None = None) -> APIError:
    """A 400 about the request's field ("field: message"), naming it as its param unless `param` says otherwise."""
    return APIError(400, str(RequestError(field, message)), param or field)


def api_error(error: ValueError, names: dict[str, str] | None = None) -> APIError:
    """A RequestError (or a ValueError, RequestError.of) as an HTTP error naming the OpenAI parameter: names maps a
    field to the request's own name for it (e.g. logprobs -> top_logprobs), and the message says that name."""
    error = RequestError.of(error).renamed(names or {})
    if error.kind is ErrorKind.NOT_FOUND:
        return APIError(404, str(error), "model", "model_not_found")
    return APIError(STATUS[error.kind], str(error), error.field)
