"""The server's errors: OpenAI's error object (Anthropic's on the Messages API routes, ``/v1/messages...``), and which
exception answers with which status."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.errors import EngineDeadError, EngineOverloadedError, RequestFailedError

logger = logging.getLogger("pagedllm.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_route(path: str) -> bool:
    """Does this path belong to the Anthropic Messages API (which answers errors in Anthropic's shape)?"""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")


class ClientGone(Exception):
    """The client closed the connection before the response started."""


def error_json(status: int, message: str, param: str | None = None, err_type: str | None = None,
               path: str = "") -> JSONResponse:
    """The error response for a request to ``path``: Anthropic's error object on its routes, else OpenAI's."""
    if anthropic_route(path):
        return JSONResponse(status_code=status, content=anthropic_error(status, message))
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "invalid_request_error"),
                           "param": param, "code": status}},
    )


def _path(request) -> str:
    return request.scope.get("path", "")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_json(400, f"Invalid JSON in request body: {first.get('msg')}", path=_path(request))
        return error_json(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param, path=_path(request))

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_json(exc.status, exc.message, exc.param, exc.err_type, _path(request))

    @app.exception_handler(ValueError)
    async def _value_error(request, exc: ValueError):
        return error_json(400, str(exc), path=_path(request))

    @app.exception_handler(RequestFailedError)
    async def _failed(request, exc: RequestFailedError):
        return error_json(500, f"the engine failed on this request: {exc}", path=_path(request))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request, exc: EngineOverloadedError):
        resp = error_json(exc.status, str(exc), None, "overloaded", _path(request))
        resp.headers["Retry-After"] = str(max(1, round(exc.retry_after or 1.0)))
        return resp

    @app.exception_handler(ClientGone)
    async def _gone(_, exc: ClientGone):
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc: EngineDeadError):
        return error_json(503, str(exc), path=_path(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_json(exc.status_code, str(exc.detail), path=_path(request))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("unhandled error")
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}", path=_path(request))
