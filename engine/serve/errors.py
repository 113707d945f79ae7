"""Errors in OpenAI's body ({"error": {"message", "type", "param", "code"}}); the handlers that turn
every failure into one are in engine/serve/handlers.py."""

from __future__ import annotations

from starlette.responses import JSONResponse

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    500: "internal_error",
}


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = {**({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
    return JSONResponse(
        body(status, message, param, code), status_code=status, headers=headers or None
    )
