"""Errors at the HTTP edge, all in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`install_error_handlers(app)` maps every exception that can reach a client to that shape; `documented(...)`
gives a route's `responses=` so the OpenAPI description lists exactly the statuses it can answer (and not
FastAPI's 422: validation errors are 400s here). A message never carries a traceback, a Python repr or a
worker's identity (actor ids, addresses, Ray namespaces): those go to the log only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray.exceptions import RayError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    StreamOptions,
    TextPart,
)
from gateway.api.protocol_extensions import StructuredOutputs
from gateway.api.protocol_tools import (
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from gateway.api.responses_api.protocol import REQUEST_MODELS as RESPONSES_REQUEST_MODELS
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import ResizeConflict, ResizeRefused
from gateway.requests.admission import Overloaded
from gateway.requests.events import RequestFailed

logger = logging.getLogger(__name__)

# OpenAI's `type` for each status we answer.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again", "required": True,
                                "schema": {"type": "integer", "minimum": 1}}}

# Every error status a route may list, with what it means here; routes pick theirs with documented().
ERROR_RESPONSES: dict[int, dict[str, Any]] = {
    400: {"description": "Invalid request: not JSON, a field of the wrong type or out of range, a prompt "
                         "or message the model cannot take, or one longer than the context"},
    401: {"description": "Missing or wrong key (Authorization: Bearer <key>)"},
    403: {"description": "Admin routes without --admin-key, on a server not bound to loopback"},
    404: {"description": "The model named in the request is not the one this server serves"},
    409: {"description": "The pools cannot change now: another change is being applied, or the transfer "
                         "backend fixes the workers at start"},
    413: {"description": "The request body is larger than the server accepts"},
    415: {"description": "The request body is not sent as application/json"},
    429: {"description": "No decode KV capacity within the queue timeout, or the waiting line is full",
          "headers": _RETRY_AFTER},
    503: {"description": "No worker could finish the request: one failed, none is alive, or a deadline "
                         "passed (code: worker_failed, no_worker, deadline_exceeded)",
          "headers": {"Retry-After": {"description": "seconds to wait before trying again",
                                      "schema": {"type": "integer", "minimum": 1}}}},
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: each of `statuses` with OpenAI's error body."""
    return {status: {**ERROR_RESPONSES[status], "model": ErrorResponse} for status in statuses}


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# Names of request fields: a validation error's location keeps these (and list indices) and drops
# pydantic's union-member tags such as "str" or "list[int]".
# Every model a request body nests, so that a nested field's path is whole ("tools[0].function.parameters").
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, PoolLayout, Tool,
    FunctionDefinition, ToolCall, FunctionCall, NamedToolChoice, FunctionName, ResponseFormat,
    JsonSchemaFormat, StructuredOutputs, *RESPONSES_REQUEST_MODELS)
_FIELD_NAMES = frozenset(  # a location spells a field by its alias when it has one (`schema`)
    name for model in _REQUEST_MODELS for key, field in model.model_fields.items()
    for name in (key, field.alias) if name)


def _param(loc: tuple[int | str, ...]) -> str:
    """("body", "messages", 0, "content", "str") → "messages[0].content"."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELD_NAMES:
            param += f".{part}" if param else part
    return param


def validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error(400, "invalid request body")
    # Of a union's alternatives, the one that got furthest says the most: the deepest error, and of those one
    # from an alternative of the right type ("at least 1 item" rather than "not a string" for prompt []).
    first = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")))
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return error(400, f"the request body is not valid JSON ({reason})" if reason else
                     "the request body is not valid JSON")
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":  # a field the model does not know: name it, where it is
        loc = tuple(first.get("loc", ("",)))
        where = _param(loc[:-1])
        param = f"{where}.{loc[-1]}" if where else str(loc[-1])
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if not param:
        return error(400, f"the request body must be a JSON object with the request's fields: {message}")
    return error(400, f"{param}: {message}", param=param)


def _parse_failure(cause: BaseException) -> str:
    # json.loads fails with these besides JSONDecodeError (which arrives as a RequestValidationError).
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply"
    return "the request body could not be parsed as JSON"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            return error(400, _parse_failure(exc.__cause__))
        return error(exc.status_code, str(exc.detail), headers=dict(exc.headers) if exc.headers else None)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(RayError)
    async def worker_failed(_: Request, exc: RayError) -> JSONResponse:
        # The exception's text names actors, nodes and addresses: log it, do not send it.
        logger.error("a worker failed: %s", exc)
        return error(503, "a worker failed while serving the request", code="worker_failed")

    @app.exception_handler(RequestFailed)
    async def request_failed(_: Request, exc: RequestFailed) -> JSONResponse:
        # Its message is written for the client (see RequestFailed).
        if exc.status != 503:
            return error(exc.status, str(exc), code=exc.code)
        return error(503, str(exc), code=exc.code, headers={"Retry-After": "1"})

    @app.exception_handler(ResizeRefused)
    async def resize_refused(_: Request, exc: ResizeRefused) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(ResizeConflict)
    async def resize_conflict(_: Request, exc: ResizeConflict) -> JSONResponse:
        return error(409, str(exc))

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return error(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug: Starlette re-raises the exception after this response, so the server logs its traceback.
        return error(500, "internal server error")


def without_validation_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` less the 422 FastAPI adds to every route with a body (ours answer 400 instead)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # built once, then cached by FastAPI; the edits below are idempotent
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    return openapi
