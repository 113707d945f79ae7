"""Server-Sent Events for the streaming routes: one driver, and a formatter per kind of answer
(OpenAI chat chunks, OpenAI completion chunks, SGLang's /generate events).

The driver closes the engine's stream however the response ends (its running requests are
aborted), turns an engine failure into an error event, and always ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Protocol

import msgspec

from engine.serve import errors, hidden_encoding, translate
from engine.serve.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs

DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    """One event. msgspec, as the non-streamed answers: it runs on the event loop, and a /generate
    event with logprobs holds all of them so far (many times json.dumps' speed on such events)."""
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"


class Formatter(Protocol):
    def chunk(self, chunk: dict) -> list[dict]: ...

    def close(self) -> list[dict]: ...


def _events_of(fmt: Formatter, chunk: dict) -> list[str]:
    return [sse(payload) for payload in fmt.chunk(chunk)]


async def events(stream, fmt: Formatter) -> AsyncIterator[str]:
    try:
        try:
            async for chunk in stream:
                if "hidden_states" in chunk["meta_info"]:  # up to megabytes to encode: off the loop
                    out = await asyncio.to_thread(_events_of, fmt, chunk)
                else:
                    out = _events_of(fmt, chunk)
                for event in out:
                    yield event
            tail = fmt.close()
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: say so in the stream
            tail = [errors.body(503, f"the request failed: {exc}")]
        for payload in tail:
            yield sse(payload)
        yield DONE
    finally:
        await stream.aclose()


class _OpenAIChunks:
    """What chat and completion chunks share: ids, usage at the end (include_usage) or in every chunk
    too (continuous_usage: vLLM's continuous_usage_stats, each choice's own counts so far), each
    chunk's own logprobs, and the matched stop string put back (keep_stop) on a choice's last chunk."""

    def __init__(
        self,
        rid: str,
        model: str,
        obj: str,
        prompts: int,
        n: int,
        include_usage: bool,
        logprobs: bool,
        text_of: TokenText,
        continuous_usage: bool = False,
        keep_stop: bool = False,
    ) -> None:
        self.base = {"id": rid, "object": obj, "created": translate.now(), "model": model}
        self.extra = {"usage": None} if include_usage else {}
        self.prompts, self.n, self.include_usage, self.logprobs, self.text_of = (
            prompts,
            n,
            include_usage,
            logprobs,
            text_of,
        )
        self.continuous_usage, self.keep_stop = continuous_usage, keep_stop
        self.finals: dict[int, dict] = {}
        self.tokens: dict[int, int] = {}  # each choice's tokens so far

    def position(self, chunk: dict) -> int:
        """The output position of this chunk's first token (counts the chunk's tokens)."""
        i = chunk["index"]
        start = self.tokens.get(i, 0)
        self.tokens[i] = start + len(chunk["output_ids"])
        return start

    def wants(self, chunk: dict, reason: str | None) -> bool:
        """Emit a chunk with text, a finish, or (logprobs asked) tokens whose text is still held back."""
        return (
            bool(chunk["text"])
            or reason is not None
            or (self.logprobs and bool(chunk["output_ids"]))
        )

    def text(self, chunk: dict, reason: str | None) -> str:
        return chunk["text"] + (
            translate.stop_string(chunk["meta_info"]) if self.keep_stop and reason else ""
        )

    def payload(self, choice: dict, meta: dict, completion_tokens: int | None = None) -> dict:
        """meta: the chunk's meta_info, whose counts are its usage with continuous_usage (a chat's role
        chunk, before any token, gives completion_tokens 0)."""
        if self.continuous_usage:
            return {
                **self.base,
                "choices": [choice],
                "usage": translate.usage_so_far(meta, completion_tokens),
            }
        return {**self.base, "choices": [choice], **self.extra}

    def last_fields(self, chunk: dict, reason: str | None) -> dict:
        """A choice's last chunk carries its hidden states (when asked for), as the answer would."""
        return hidden_encoding.choice_fields(chunk["meta_info"]) if reason is not None else {}

    def finished(self, chunk: dict, reason: str | None) -> None:
        if reason is not None:
            self.finals[chunk["index"]] = {"meta_info": chunk["meta_info"]}

    def close(self) -> list[dict]:
        if not self.include_usage:
            return []
        results = [self.finals[i] for i in sorted(self.finals)]
        return [
            {**self.base, "choices": [], "usage": translate.usage(results, self.prompts, self.n)}
        ]


def _own_logprobs(chunk: dict) -> dict:
    """The logprobs of this chunk's own tokens (a last chunk's meta_info holds the whole request's)."""
    meta, k = chunk["meta_info"], len(chunk["output_ids"])
    out = {"output_token_logprobs": (meta.get("output_token_logprobs") or [])[-k:] if k else []}
    if meta.get("output_top_logprobs") and k:
        out["output_top_logprobs"] = meta["output_top_logprobs"][-k:]
    return out


class ChatChunks(_OpenAIChunks):
    def __init__(
        self,
        rid: str,
        model: str,
        n: int,
        include_usage: bool,
        logprobs: bool,
        text_of,
        **options: bool,
    ) -> None:
        super().__init__(
            rid, model, "chat.completion.chunk", 1, n, include_usage, logprobs, text_of, **options
        )
        self.started: set[int] = set()

    def chunk(self, chunk: dict) -> list[dict]:
        i, reason = chunk["index"], translate.finish_reason(chunk["meta_info"])
        out = []
        if i not in self.started:
            self.started.add(i)
            out.append(
                self.payload(
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                    chunk["meta_info"],
                    0,
                )
            )
        start = self.position(chunk)
        if self.wants(chunk, reason):
            lp = chat_logprobs(_own_logprobs(chunk), self.text_of, start) if self.logprobs else None
            text = self.text(chunk, reason)
            delta = {"content": text} if text else {}
            out.append(
                self.payload(
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": reason,
                        **self.last_fields(chunk, reason),
                    },
                    chunk["meta_info"],
                )
            )
        self.finished(chunk, reason)
        return out


class CompletionChunks(_OpenAIChunks):
    def __init__(
        self,
        rid: str,
        model: str,
        prompts: int,
        n: int,
        include_usage: bool,
        logprobs: bool,
        text_of,
        **options: bool,
    ) -> None:
        super().__init__(
            rid, model, "text_completion", prompts, n, include_usage, logprobs, text_of, **options
        )
        self.offsets: dict[int, TextOffsets] = {}  # each choice's, from chunk to chunk

    def chunk(self, chunk: dict) -> list[dict]:
        i, reason = chunk["index"], translate.finish_reason(chunk["meta_info"])
        out = []
        start = self.position(chunk)
        if self.wants(chunk, reason):
            lp = None
            if self.logprobs:
                lp = completion_logprobs(
                    _own_logprobs(chunk),
                    self.text_of,
                    self.offsets.setdefault(i, TextOffsets()),
                    start,
                )
            out.append(
                self.payload(
                    {
                        "index": i,
                        "text": self.text(chunk, reason),
                        "logprobs": lp,
                        "finish_reason": reason,
                        **self.last_fields(chunk, reason),
                    },
                    chunk["meta_info"],
                )
            )
        self.finished(chunk, reason)
        return out


class NativeEvents:
    """SGLang's /generate stream: each event holds the request so far: its text, ids and logprobs (a chunk's
    short meta_info carries its own tokens' logprobs; the last chunk's, the whole request's)."""

    LISTS = ("output_token_logprobs", "output_top_logprobs")

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.ids: dict[int, list[int]] = {}
        self.lists: dict[int, dict[str, list]] = {}

    def chunk(self, chunk: dict) -> list[dict]:
        i, meta = chunk["index"], chunk["meta_info"]
        self.text[i] = self.text.get(i, "") + chunk["text"]
        self.ids[i] = self.ids.get(i, []) + chunk["output_ids"]
        if meta["finish_reason"] is None:
            so_far = self.lists.setdefault(i, {})
            meta = dict(meta)
            for key in self.LISTS:
                if key in meta or key in so_far:  # a chunk without tokens carries none of its own
                    # the event is encoded before the next
                    so_far.setdefault(key, []).extend(meta.get(key, []))
                    meta[key] = so_far[key]
        else:
            meta = hidden_encoding.encode_meta(meta)  # the last chunk's hidden states, as JSON
        return [{"index": i, "text": self.text[i], "output_ids": self.ids[i], "meta_info": meta}]

    def close(self) -> list[dict]:
        return []
