"""The ASGI app: OpenAI-compatible routes, SGLang's native ones, the worker routes a gateway asks
(engine/serve/worker_api.py: health, info, loads, cache flush) and metrics.

Every route only translates (engine/serve/translate.py) and calls the same Engine the offline API
uses. A client that goes away aborts its requests: streams through the response's cancellation,
plain requests through a watcher on the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from engine.serve import (
    beams,
    errors,
    handlers,
    hidden_encoding,
    logprobs,
    sse,
    translate,
    worker_api,
)
from engine.serve.middleware import OPEN_PATHS, ApiKeyMiddleware, BodyLimitMiddleware
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

log = logging.getLogger("engine.serve")


@dataclass
class ServeOptions:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    cors_origins: tuple[str, ...] = ()
    open_metrics: bool = False  # /metrics without the API key, for scrapers that cannot send one


async def json_off_loop(build: Callable[[], Any]) -> Response:
    """The answer built and encoded on a worker thread. On the event loop, where /health and every stream
    wait, a body of megabytes (a long prompt's logprobs, 20 top each) took seconds in FastAPI's encoder.
    msgspec writes a non-finite float as null, where the standard encoder's strict mode raised."""
    return await asyncio.to_thread(
        lambda: Response(msgspec.json.encode(build()), media_type="application/json")
    )


class ClientGone(Exception):
    """The client disconnected before its answer was ready: its requests were aborted."""


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run work unless the client disconnects first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class InFlight:
    """The request ids the server has running, so a shutdown past its timeout can abort them (their
    streams then end with finish_reason "abort" and [DONE], instead of being cut). An id given for
    n > 1 stands for all its copies (the engine's abort expands it); counted, so a request reusing
    a running one's id does not untrack it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rids: Counter[str] = Counter()

    @contextlib.contextmanager
    def track(self, rids: list[str]):
        self.rids.update(rids)
        try:
            yield
        finally:
            self.rids.subtract(rids)
            self.rids += Counter()  # drop the zeros

    def abort_all(self) -> list[str]:
        """Abort every tracked request the engine has (it drops an abort for one not yet sent)."""
        rids = list(self.rids)
        if rids:
            self.engine.abort(rids)
        return rids


def build_app(engine, options: ServeOptions) -> FastAPI:
    app = FastAPI(title="engine", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    handlers.install(app)
    app.add_middleware(
        ApiKeyMiddleware,
        api_key=options.api_key,
        open_paths=OPEN_PATHS + (("/metrics",) if options.open_metrics else ()),
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    name = options.served_model_name
    text_of = logprobs.TokenText(engine.tokenizer)
    inflight = app.state.inflight = InFlight(engine)

    async def open_stream(args: dict, rids: list[str]):
        """Submit a stream, tracked from the start (the response tracks it again while it runs)."""
        with inflight.track(rids):
            return await engine.async_generate(**args, stream=True)

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise errors.OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it

    # ------------------------------------------------------------------ OpenAI

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "engine",
                    "max_model_len": engine.server_info.get("context_length"),
                }
            ],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return {"id": name, "object": "model", "created": 0, "owned_by": "engine"}

    def opening(
        body: ChatCompletionRequest | CompletionRequest, request: Request, prefix: str
    ) -> tuple[dict, bool, int, str]:
        """What both OpenAI routes do first: the model, the sampling parameters, logprobs, an id,
        and the names the engine's errors must use for this body (handlers.install reads them)."""
        request.state.openai_names = translate.openai_names(body)
        check_model(body.model)
        ignored = body.ignored_fields()
        if ignored:  # as vLLM does for the fields it does not know
            log.warning(
                "engine serve: %s %s: ignored parameter(s) %s (they change nothing here: docs/server.md)",
                request.method,
                request.url.path,
                ", ".join(ignored),
            )
        params = translate.sampling_params(body, engine.server_info.get("context_length"))
        want_logprobs, top = translate.logprob_options(body)
        return params, want_logprobs, top, translate.new_id(prefix)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        params, want_logprobs, top, rid = opening(body, request, "chatcmpl")
        if beams.wants_beams(body):
            args = dict(
                messages=translate.chat_messages(body),
                rid=rid,
                **beams.beam_kwargs(body, params),
                **body.layer_kwargs(),
            )
            return await beam_response(request, body, args, rid, "chat.completion", [rid])
        args = dict(
            messages=translate.chat_messages(body),
            sampling_params=params,
            rid=rid,
            return_logprob=want_logprobs,
            top_logprobs_num=top,
            **body.layer_kwargs(),
        )
        if body.stream:
            stream = await open_stream(args, [rid])
            fmt = sse.ChatChunks(
                rid,
                name,
                body.n,
                include_usage(body),
                want_logprobs,
                text_of,
                **stream_options(body),
            )
            return _sse_response(stream, fmt, inflight, [rid])
        with inflight.track([rid]):
            out = await until_disconnect(request, engine.async_generate(**args))

        def answer() -> dict:
            results = out if isinstance(out, list) else [out]
            choices = []
            for i, r in enumerate(results):
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": text(body, r)},
                    "finish_reason": translate.finish_reason(r["meta_info"]),
                    "logprobs": None,
                }
                if want_logprobs:
                    choice["logprobs"] = logprobs.chat_logprobs(r["meta_info"], text_of)
                choices.append({**choice, **hidden_encoding.choice_fields(r["meta_info"])})
            return {
                "id": rid,
                "object": "chat.completion",
                "created": translate.now(),
                "model": name,
                "choices": choices,
                "usage": translate.usage(results, 1, body.n),
            }

        return await json_off_loop(answer)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        params, want_logprobs, top, rid = opening(body, request, "cmpl")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            inputs, prompts = (
                {"prompt": prompt, "rid": [f"{rid}-p{i}" for i in range(len(prompt))]},
                len(prompt),
            )
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            inputs, prompts = (
                {"input_ids": prompt, "rid": [f"{rid}-p{i}" for i in range(len(prompt))]},
                len(prompt),
            )
        elif isinstance(prompt, list):
            inputs, prompts = {"input_ids": prompt, "rid": rid}, 1
        else:
            inputs, prompts = {"prompt": prompt, "rid": rid}, 1
        bases = inputs["rid"] if isinstance(inputs["rid"], list) else [inputs["rid"]]
        if beams.wants_beams(body):
            args = dict(**inputs, **beams.beam_kwargs(body, params), **body.layer_kwargs())
            return await beam_response(request, body, args, rid, "text_completion", bases)
        args = dict(
            **inputs,
            sampling_params=params,
            return_logprob=want_logprobs,
            top_logprobs_num=top,
            **body.layer_kwargs(),
        )
        if body.stream:
            stream = await open_stream(args, bases)
            fmt = sse.CompletionChunks(
                rid,
                name,
                prompts,
                body.n,
                include_usage(body),
                want_logprobs,
                text_of,
                **stream_options(body),
            )
            return _sse_response(stream, fmt, inflight, bases)
        with inflight.track(bases):
            out = await until_disconnect(request, engine.async_generate(**args))

        def answer() -> dict:
            results = out if isinstance(out, list) else [out]
            choices = [
                {
                    "index": i,
                    "text": text(body, r),
                    "finish_reason": translate.finish_reason(r["meta_info"]),
                    "logprobs": logprobs.completion_logprobs(r["meta_info"], text_of)
                    if want_logprobs
                    else None,
                    **hidden_encoding.choice_fields(r["meta_info"]),
                }
                for i, r in enumerate(results)
            ]
            return {
                "id": rid,
                "object": "text_completion",
                "created": translate.now(),
                "model": name,
                "choices": choices,
                "usage": translate.usage(results, prompts, body.n),
            }

        return await json_off_loop(answer)

    async def beam_response(
        request: Request, body, args: dict, rid: str, kind: str, bases: list[str]
    ) -> dict:
        # completions' logprobs: 0 asks for them too
        if body.logprobs is not None and body.logprobs is not False:
            raise errors.OpenAIError(
                400, "logprobs is not supported with use_beam_search", param="logprobs"
            )
        with inflight.track(bases):
            out = await until_disconnect(request, engine.async_beam_search(**args))
        choices, used = beams.beam_choices(
            out if isinstance(out, list) else [out], body.n, chat=kind == "chat.completion"
        )
        return {
            "id": rid,
            "object": kind,
            "created": translate.now(),
            "model": name,
            "choices": choices,
            "usage": used,
        }

    # ------------------------------------------------------------------ SGLang's native routes

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise errors.OpenAIError(400, "give exactly one of text and input_ids", param="text")
        batch = isinstance(body.text, list) or (
            isinstance(body.input_ids, list)
            and bool(body.input_ids)
            and isinstance(body.input_ids[0], list)
        )
        count = len(body.text if body.text is not None else body.input_ids) if batch else 1
        rid = body.rid
        if rid is None:
            base = translate.new_id("gen")
            rid = [f"{base}-p{i}" for i in range(count)] if batch else base
        bases = rid if isinstance(rid, list) else [rid]
        args = dict(
            prompt=body.text,
            input_ids=body.input_ids,
            sampling_params=body.sampling_params,
            rid=rid,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num,
            logprob_start_len=body.logprob_start_len,
            **body.layer_kwargs(),
        )
        if body.stream:
            stream = await open_stream(args, bases)
            return _sse_response(stream, sse.NativeEvents(), inflight, bases)
        with inflight.track(bases):
            out = await until_disconnect(request, engine.async_generate(**args))
        return await json_off_loop(lambda: hidden_encoding.encode_result(out))

    @app.get("/stats")
    async def stats():
        """engine.get_stats(): pool and cache use, queues, counters (docs/memory.md)."""
        return await asyncio.to_thread(engine.get_stats)

    # ------------------------------------------------------------------ worker routes and metrics

    worker_api.install(app, engine, name)

    @app.get("/metrics")
    async def metrics():
        from engine.plugins.metrics import render

        data, content_type = await asyncio.to_thread(render)
        return Response(data, media_type=content_type)

    return app


def include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def stream_options(body: ChatCompletionRequest | CompletionRequest) -> dict[str, bool]:
    """The stream formatters' options beyond OpenAI's: vLLM's continuous usage, the kept stop string."""
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    return {"continuous_usage": continuous, "keep_stop": translate.keeps_stop(body)}


def text(body: ChatCompletionRequest | CompletionRequest, result: dict) -> str:
    """A finished answer's text, with the matched stop string when the body asks to keep it."""
    return result["text"] + (
        translate.stop_string(result["meta_info"]) if translate.keeps_stop(body) else ""
    )


class _Stream(StreamingResponse):
    """Closes its event generator however the response ends (a client gone while a send waited
    included), so the requests are aborted now rather than when the garbage collector runs."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse_response(stream, fmt, inflight: "InFlight", rids: list[str]) -> StreamingResponse:
    async def tracked() -> AsyncIterator[str]:
        with inflight.track(rids):
            async for event in sse.events(stream, fmt):
                yield event

    return _Stream(
        tracked(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
