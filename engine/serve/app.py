"""The ASGI app: OpenAI-compatible routes, SGLang's native ones, health and metrics.

Every route only translates (engine/serve/translate.py) and calls the same Engine the offline API
uses. A client that goes away aborts its requests: streams through the response's cancellation,
plain requests through a watcher on the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.serve import errors, translate
from engine.serve.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest


@dataclass
class ServeOptions:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    cors_origins: tuple[str, ...] = ()


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
    """The engine request ids the server has running, so a shutdown past its timeout can abort them
    (their streams then end with finish_reason "abort" and [DONE], instead of being cut)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rids: set[str] = set()

    @contextlib.contextmanager
    def track(self, bases: list[str], n: int | list[int]):
        """The engine names copies of an n > 1 request <rid>-0 ... <rid>-<n-1>."""
        ns = n if isinstance(n, list) else [n] * len(bases)
        rids = [b if k == 1 else f"{b}-{j}" for b, k in zip(bases, ns) for j in range(k)]
        self.rids.update(rids)
        try:
            yield
        finally:
            self.rids.difference_update(rids)

    def abort_all(self) -> int:
        rids = list(self.rids)
        if rids:
            self.engine.abort(rids)
        return len(rids)


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def build_app(engine, options: ServeOptions) -> FastAPI:
    app = FastAPI(title="engine", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    errors.install(app)
    app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip
    name = options.served_model_name
    text_of = translate.TokenText(engine.tokenizer)
    inflight = app.state.inflight = InFlight(engine)

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise errors.OpenAIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                                     param="model", code="model_not_found")  # fmt: skip

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it

    # ------------------------------------------------------------------ OpenAI

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "engine",
                                            "max_model_len": engine.server_info.get("context_length")}]}  # fmt: skip

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return {"id": name, "object": "model", "created": 0, "owned_by": "engine"}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = translate.sampling_params(body, engine.server_info.get("context_length"))
        want_logprobs, top = translate.logprob_options(body)
        rid = translate.new_id("chatcmpl")
        args = dict(messages=translate.chat_messages(body), sampling_params=params, rid=rid,
                    return_logprob=want_logprobs, top_logprobs_num=top)  # fmt: skip
        if body.stream:
            stream = await engine.async_generate(**args, stream=True)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _chat_events(stream, rid, name, body.n, include_usage, want_logprobs, text_of)
            return _sse_response(_tracked(events, inflight, [rid], body.n))
        with inflight.track([rid], body.n):
            out = await until_disconnect(request, engine.async_generate(**args))
        results = out if isinstance(out, list) else [out]
        choices = []
        for i, r in enumerate(results):
            choice = {"index": i, "message": {"role": "assistant", "content": r["text"]},
                      "finish_reason": translate.finish_reason(r["meta_info"]), "logprobs": None}  # fmt: skip
            if want_logprobs:
                choice["logprobs"] = translate.chat_logprobs(r["meta_info"], text_of)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": translate.now(), "model": name,
                "choices": choices, "usage": translate.usage(results, 1, body.n)}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = translate.sampling_params(body, engine.server_info.get("context_length"))
        want_logprobs, top = translate.logprob_options(body)
        rid = translate.new_id("cmpl")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            inputs, prompts = {"prompt": prompt, "rid": [f"{rid}-p{i}" for i in range(len(prompt))]}, len(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            inputs, prompts = {"input_ids": prompt, "rid": [f"{rid}-p{i}" for i in range(len(prompt))]}, len(prompt)
        elif isinstance(prompt, list):
            inputs, prompts = {"input_ids": prompt, "rid": rid}, 1
        else:
            inputs, prompts = {"prompt": prompt, "rid": rid}, 1
        args = dict(**inputs, sampling_params=params, return_logprob=want_logprobs, top_logprobs_num=top)
        bases = inputs["rid"] if isinstance(inputs["rid"], list) else [inputs["rid"]]
        if body.stream:
            stream = await engine.async_generate(**args, stream=True)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _completion_events(stream, rid, name, prompts, body.n, include_usage, want_logprobs, text_of)
            return _sse_response(_tracked(events, inflight, bases, body.n))
        with inflight.track(bases, body.n):
            out = await until_disconnect(request, engine.async_generate(**args))
        results = out if isinstance(out, list) else [out]
        choices = [{"index": i, "text": r["text"], "finish_reason": translate.finish_reason(r["meta_info"]),
                    "logprobs": translate.completion_logprobs(r["meta_info"], text_of) if want_logprobs else None}
                   for i, r in enumerate(results)]  # fmt: skip
        return {"id": rid, "object": "text_completion", "created": translate.now(), "model": name,
                "choices": choices, "usage": translate.usage(results, prompts, body.n)}  # fmt: skip

    # ------------------------------------------------------------------ SGLang's native routes

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if (body.text is None) == (body.input_ids is None):
            raise errors.OpenAIError(400, "give exactly one of text and input_ids", param="text")
        batch = isinstance(body.text, list) or (isinstance(body.input_ids, list) and bool(body.input_ids)
                                                 and isinstance(body.input_ids[0], list))  # fmt: skip
        count = len(body.text if body.text is not None else body.input_ids) if batch else 1
        rid = body.rid
        if rid is None:
            base = translate.new_id("gen")
            rid = [f"{base}-p{i}" for i in range(count)] if batch else base
        bases = rid if isinstance(rid, list) else [rid]
        sp = body.sampling_params
        ns = [int(p.get("n", 1)) if isinstance(p.get("n", 1), int) else 1
              for p in (sp if isinstance(sp, list) else [sp or {}] * len(bases))]  # fmt: skip
        args = dict(prompt=body.text, input_ids=body.input_ids, sampling_params=sp, rid=rid,
                    return_logprob=body.return_logprob, top_logprobs_num=body.top_logprobs_num,
                    logprob_start_len=body.logprob_start_len)  # fmt: skip
        if body.stream:
            stream = await engine.async_generate(**args, stream=True)
            return _sse_response(_tracked(_native_events(stream), inflight, bases, ns))
        with inflight.track(bases, ns if len(ns) == len(bases) else 1):
            return await until_disconnect(request, engine.async_generate(**args))

    @app.post("/flush_cache")
    async def flush_cache():
        freed = await asyncio.to_thread(engine.flush_cache)
        return {"flushed_tokens": freed}

    @app.get("/stats")
    async def stats():
        """engine.get_stats(): pool and cache use, queues, counters (docs/memory.md)."""
        return await asyncio.to_thread(engine.get_stats)

    @app.get("/server_info")
    async def server_info():
        return {**engine.server_info, "served_model_name": name, "pids": engine.pids}

    # ------------------------------------------------------------------ health and metrics

    @app.get("/health")
    async def health():
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return errors.response(503, "the engine is not running")

    @app.get("/metrics")
    async def metrics():
        from engine.plugins.metrics import render

        data, content_type = await asyncio.to_thread(render)
        return Response(data, media_type=content_type)

    return app


async def _tracked(events: AsyncIterator[str], inflight: InFlight, bases: list[str], n: int | list[int]) -> AsyncIterator[str]:
    with inflight.track(bases, n):
        async for event in events:
            yield event


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip


async def _chunks(stream) -> AsyncIterator[dict]:
    """The engine's chunks; the stream is closed (its running requests aborted) however this ends."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        await stream.aclose()


async def _chat_events(stream, rid: str, model: str, n: int, include_usage: bool, logprobs: bool, text_of) -> AsyncIterator[str]:
    created = translate.now()
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if include_usage else {}
    started: set[int] = set()
    finals: dict[int, dict] = {}
    try:
        async for chunk in _chunks(stream):
            i, meta = chunk["index"], chunk["meta_info"]
            if i not in started:
                started.add(i)
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}], **extra})  # fmt: skip
            reason = translate.finish_reason(meta)
            if chunk["text"] or reason is not None:
                lp = translate.chat_logprobs(_chunk_logprobs(chunk), text_of) if logprobs and chunk["output_ids"] else None
                delta = {"content": chunk["text"]} if chunk["text"] else {}
                yield sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                           **extra})  # fmt: skip
            if reason is not None:
                finals[i] = {"meta_info": meta}
        if include_usage:
            results = [finals[i] for i in sorted(finals)]
            yield sse({**base, "choices": [], "usage": translate.usage(results, 1, n)})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the engine died mid-stream: say so in the stream
        yield sse(errors.body(503, f"the request failed: {exc}"))
        yield "data: [DONE]\n\n"


async def _completion_events(stream, rid: str, model: str, prompts: int, n: int, include_usage: bool,
                             logprobs: bool, text_of) -> AsyncIterator[str]:  # fmt: skip
    base = {"id": rid, "object": "text_completion", "created": translate.now(), "model": model}
    extra = {"usage": None} if include_usage else {}
    finals: dict[int, dict] = {}
    offsets: dict[int, int] = {}
    try:
        async for chunk in _chunks(stream):
            i, meta = chunk["index"], chunk["meta_info"]
            reason = translate.finish_reason(meta)
            lp = None
            if logprobs and chunk["output_ids"]:
                lp = translate.completion_logprobs(_chunk_logprobs(chunk), text_of, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + len(chunk["text"])
            if chunk["text"] or reason is not None:
                yield sse({**base, "choices": [{"index": i, "text": chunk["text"], "logprobs": lp, "finish_reason": reason}],
                           **extra})  # fmt: skip
            if reason is not None:
                finals[i] = {"meta_info": meta}
        if include_usage:
            results = [finals[i] for i in sorted(finals)]
            yield sse({**base, "choices": [], "usage": translate.usage(results, prompts, n)})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001
        yield sse(errors.body(503, f"the request failed: {exc}"))
        yield "data: [DONE]\n\n"


def _chunk_logprobs(chunk: dict) -> dict:
    """The logprobs of this chunk's own tokens (a last chunk's meta_info holds the whole request's)."""
    meta, k = chunk["meta_info"], len(chunk["output_ids"])
    out = {"output_token_logprobs": (meta.get("output_token_logprobs") or [])[-k:]}
    if meta.get("output_top_logprobs"):
        out["output_top_logprobs"] = meta["output_top_logprobs"][-k:]
    return out


async def _native_events(stream) -> AsyncIterator[str]:
    """SGLang's /generate stream: each event holds the request's text and ids so far."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    try:
        async for chunk in _chunks(stream):
            i = chunk["index"]
            text[i] = text.get(i, "") + chunk["text"]
            ids[i] = ids.get(i, []) + chunk["output_ids"]
            yield sse({"index": i, "text": text[i], "output_ids": ids[i], "meta_info": chunk["meta_info"]})
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001
        yield sse(errors.body(503, f"the request failed: {exc}"))
        yield "data: [DONE]\n\n"
