"""Exception handlers for every failure the server answers, each as an OpenAI error body: nothing may
reach a client as a 500 with a traceback."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError
from engine.serve.errors import OpenAIError, response
from engine.serve.protocol import FIELD_NAMES
from engine.serve.translate import openai_error


def _path(error: dict) -> list[str]:
    """An error's location as the client wrote it: field names and list indices, without the
    "body" prefix, pydantic's union member tags ("str", "list[TextPart]", "TextPart") or dict keys;
    an unknown field keeps its own name."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    last = len(loc) - 1
    return [
        str(p)
        for i, p in enumerate(loc)
        if isinstance(p, int)
        or p in FIELD_NAMES
        or (i == last and error.get("type") == "extra_forbidden")
    ]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    # a union reports each member's failure: the deepest is the member the client meant (a content
    # list whose part has a bad text fails as a string too, less usefully)
    first = max(errors, key=lambda e: len(_path(e))) if errors else {}
    loc = _path(first)
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    if kind == "missing":
        if param is None:
            return "the request body is missing (send a JSON object)", None
        return f"missing required parameter: {param}", param
    reason = (
        str(first["ctx"]["error"])
        if kind == "value_error" and "error" in first.get("ctx", {})
        else first.get("msg", "invalid")
    )
    return f"invalid value for {param or 'the request body'}: {reason}", param


def install(app: FastAPI) -> None:
    """Exception handlers that turn every failure into an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return response(400, message, param)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError):  # the engine's own checks name the field
        if request.url.path.startswith("/v1/"):
            mapped = openai_error(exc, getattr(request.state, "openai_names", None))
            return response(400, mapped.message, mapped.param)
        return response(400, str(exc))

    @app.exception_handler(TimeoutError)
    # the scheduler did not answer a stats request
    async def _timeout(request: Request, exc: TimeoutError):
        return response(503, f"the engine did not answer in time: {exc}")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return response(503, f"the engine is not running: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} not allowed on {request.url.path}",
        }
        # 405: Allow
        return response(status, message.get(status, str(exc.detail)), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):  # a bug: say so, without a traceback
        return response(500, f"internal error: {type(exc).__name__}")
