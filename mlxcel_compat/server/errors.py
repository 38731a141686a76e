"""llama.cpp-shaped errors: ``{"error": {"code": N, "message": "...", "type": "..."}}``.

Each class carries its HTTP status and llama.cpp type string; one handler renders them all.
"""

from __future__ import annotations

from typing import Any, Callable

import orjson
from starlette.responses import Response


class ApiError(Exception):
    status_code = 500
    type = "server_error"

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.status_code, "message": self.message, "type": self.type, **self.extra}}


class InvalidRequest(ApiError):
    status_code = 400
    type = "invalid_request_error"


class ContextExceeded(ApiError):
    status_code = 400
    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int, at_least: bool = False) -> None:
        """``at_least``: the prompt was refused before tokenizing, from a proven lower bound on its
        tokens (``n_prompt_tokens`` is then that bound)."""
        count = f"at least {n_prompt_tokens}" if at_least else str(n_prompt_tokens)
        super().__init__(
            f"request ({count} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it",
            n_prompt_tokens=n_prompt_tokens,
            n_ctx=n_ctx,
        )


class PayloadTooLarge(ApiError):
    """A request body over ``--max-body-bytes`` (llama.cpp has no such error; its shape is kept)."""

    status_code = 413
    type = "invalid_request_error"


class AuthenticationError(ApiError):
    status_code = 401
    type = "authentication_error"


class NotFound(ApiError):
    status_code = 404
    type = "not_found_error"


class NotSupported(ApiError):
    status_code = 501
    type = "not_supported_error"


class Unavailable(ApiError):
    status_code = 503
    type = "unavailable_error"


class ServerError(ApiError):
    status_code = 500
    type = "server_error"


def event_error(event: Any) -> ApiError:
    """The engine's ``ErrorEvent`` as an error of its own status and type (500 for an engine
    error, 503 when the server is shutting down)."""
    exc = ApiError(event.message, **event.extra)
    exc.status_code = event.code
    exc.type = event.type
    return exc


JSON_CONTENT_TYPE = "application/json; charset=utf-8"


def json_response(data: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """orjson-encoded response; non-finite floats become null, as nlohmann serialises them."""
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status_code, media_type=JSON_CONTENT_TYPE, headers=headers)


# An API whose errors have another shape (Anthropic's) maps its paths to a body builder;
# the middleware renders every error on those paths with it (see app.py).
ErrorShape = Callable[[ApiError], dict[str, Any]]


def error_response(exc: ApiError, shape: ErrorShape | None = None) -> Response:
    return json_response(shape(exc) if shape is not None else exc.to_json(), status_code=exc.status_code)


def raw_error_response(status: int, body: dict[str, Any]) -> Response:
    """For llama.cpp's few fixed bodies whose key order differs (404, 401)."""
    return json_response(body, status_code=status)
