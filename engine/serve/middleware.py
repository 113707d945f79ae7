"""Two plain ASGI middlewares: a bound on request bodies (413 before the body is parsed) and the
API key (401, compared in constant time). Both answer in OpenAI's error body."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException

from engine.serve.errors import response

OPEN_PATHS = ("/health",)  # for probes; /metrics too only with --open-metrics (vLLM leaves it open)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        seen = 0
        refused = False

        async def limited_receive():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # chunked bodies have no content-length
                    refused = True
                    raise _TooLarge(
                        413,
                        f"the request body is larger than --max-request-bytes ({self.max_bytes} bytes)",
                    )
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            if refused:
                await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send) -> None:
        resp = response(
            413, f"the request body is larger than --max-request-bytes ({self.max_bytes} bytes)"
        )
        await resp(scope, receive, send)


class _TooLarge(HTTPException):
    """Raised while the route reads the body: FastAPI passes HTTPExceptions on unchanged, so the
    error handlers answer 413 (any other exception there would become a 400)."""


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["path"] in self.open_paths
            or scope["method"] == "OPTIONS"
        ):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.strip().partition(b" ")
        # schemes ignore case
        if scheme.lower() != b"bearer" or not hmac.compare_digest(
            token.lstrip(b" "), self.expected
        ):
            message = (
                "missing API key: send Authorization: Bearer <key>"
                if not given
                else "invalid API key"
            )
            return await response(401, message)(scope, receive, send)
        await self.app(scope, receive, send)
