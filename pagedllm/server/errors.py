"""The server's errors: OpenAI's error object, and which exception answers with which status."""

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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")


class ClientGone(Exception):
    """The client closed the connection before the response started."""


def error_json(status: int, message: str, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "invalid_request_error"),
                           "param": param, "code": status}},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_json(400, f"Invalid JSON in request body: {first.get('msg')}")
        return error_json(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_json(exc.status, exc.message, exc.param, exc.err_type)

    @app.exception_handler(ValueError)
    async def _value_error(_, exc: ValueError):
        return error_json(400, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _failed(_, exc: RequestFailedError):
        return error_json(500, f"the engine failed on this request: {exc}")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_, exc: EngineOverloadedError):
        resp = error_json(exc.status, str(exc), None, "overloaded")
        resp.headers["Retry-After"] = str(max(1, round(exc.retry_after or 1.0)))
        return resp

    @app.exception_handler(ClientGone)
    async def _gone(_, exc: ClientGone):
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return error_json(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}")
