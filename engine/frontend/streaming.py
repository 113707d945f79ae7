"""Streaming and asyncio on top of the tokenizer manager's per-request listener.

The receiver thread calls a request's listener after each output; here it becomes a chunk dict that
goes to a queue.SimpleQueue (sync streams) or, through call_soon_threadsafe, an asyncio.Queue. A
stream abandoned by its consumer, and an async call cancelled while it waits, abort their requests.

An async call submits on a worker thread, not on the event loop: tokenizing a long prompt, a chat
template or a grammar check would hold up every stream of the loop. Up to eight at once, each sent
when its own submission is done, so a long one holds up no other; a call cancelled while its
submission runs has its requests aborted once they are sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import queue
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Iterator

from engine.errors import EngineDeadError
from engine.frontend.request_state import ReqState, lp_tuples, top_tuples
from engine.frontend.tokenizer_manager import TokenizerManager

Event = tuple  # (state, chunk dict) or (state, None) when the engine died


def make_chunk(state: ReqState, delta: str, ids: list[int]) -> dict:
    """One streamed piece: the new text and ids of one request; meta_info in full on its last chunk."""
    if state.finish_reason is not None:
        meta = state.meta_info()
    else:
        meta = {
            "id": state.rid,
            "finish_reason": None,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.output_ids),
        }
        # the logprobs (and top alternatives) of this chunk's own tokens
        if state.return_logprob and ids:
            k = len(ids)
            meta["output_token_logprobs"] = lp_tuples(state.output_logprobs[-k:], ids)
            tops = state.output_top[-k:]
            if any(t is not None for t in tops):
                meta["output_top_logprobs"] = [top_tuples(t) for t in tops]
    return {"index": state.index, "text": delta, "output_ids": ids, "meta_info": meta}


def _listener(put: Callable[[Event], None]):
    def listen(state: ReqState, delta: str | None, ids: list[int] | None) -> None:
        put(
            (state, None)
            if delta is None and ids is None
            else (state, make_chunk(state, delta, ids))
        )

    return listen


def _abort_left(tm: TokenizerManager, remaining: dict[str, ReqState]) -> None:
    """Run by a finalizer (the garbage collector, in whatever thread, maybe one holding the tokenizer
    manager's locks): it queues the abort and takes no lock."""
    if remaining:
        tm.abort_soon(list(remaining.values()))


class Stream:
    """The chunks of one streaming call. Closing it (or ending its `with` block), or dropping it, aborts
    whatever still runs, even before the first chunk was read (a plain generator's clean-up would not
    run then)."""

    def __init__(self, tm: TokenizerManager, chunks, remaining: dict[str, ReqState]) -> None:
        self._chunks = chunks
        self._finalizer = weakref.finalize(self, _abort_left, tm, remaining)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> dict:
        return next(self._chunks)

    def close(self) -> None:
        """The abort first: another thread may be reading (blocked in next()), whose generator cannot
        be closed now; it then gets the abort's chunks and its loop ends."""
        self._finalizer()
        try:
            self._chunks.close()
        except ValueError:  # generator already executing: the reader's loop ends with the abort
            pass

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc_info) -> None:  # `break` never closes an iterator: a with block does
        self.close()


class AsyncStream:
    """The async form of Stream: `async for chunk in stream`, `await stream.aclose()`, `async with`."""

    def __init__(self, tm: TokenizerManager, chunks, remaining: dict[str, ReqState]) -> None:
        self._chunks = chunks
        self._finalizer = weakref.finalize(self, _abort_left, tm, remaining)

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> dict:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """As Stream.close: the abort first; another task's `async for` ends with it."""
        self._finalizer()
        try:
            await self._chunks.aclose()
        except RuntimeError:  # asynchronous generator is already running (another task reads it)
            pass

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def sync_stream(tm: TokenizerManager, submit: dict) -> Stream:
    """Submit now (bad input raises here), then iterate over the chunks."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    states, _ = tm.submit(**submit, listener=_listener(events.put))
    remaining = {s.rid: s for s in states}
    return Stream(tm, _sync_chunks(tm, events, remaining), remaining)


def _sync_chunks(
    tm: TokenizerManager, events: queue.SimpleQueue, remaining: dict[str, ReqState]
) -> Iterator[dict]:
    try:
        while remaining:
            state, chunk = events.get()
            if chunk is None:
                raise state.error
            if chunk["meta_info"]["finish_reason"] is not None:
                remaining.pop(state.rid, None)
            yield chunk
    finally:  # the consumer stopped early (or the generator was collected): the requests must not run on
        _abort_left(tm, remaining)


# calls tokenized at once (threads start as needed): more long ones at once queue the rest
SUBMIT_WORKERS = 8
# each tokenizer manager's pool of submitting threads
_submitters: "weakref.WeakKeyDictionary[TokenizerManager, ThreadPoolExecutor]" = (
    weakref.WeakKeyDictionary()
)
_submitters_lock = threading.Lock()


def _submitter(tm: TokenizerManager) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that submit tm's async calls (made on first use; they end with tm). Several, so
    that a call with a long tokenizing (a huge prompt, a batch of thousands) holds up no other call:
    each is sent when its own tokenizing is done."""
    with _submitters_lock:
        if tm.dead is not None:  # shut down (stop_submitter ran or is about to): no new pool for it
            raise EngineDeadError(tm.dead)
        executor = _submitters.get(tm)
        if executor is None:
            executor = _submitters[tm] = concurrent.futures.ThreadPoolExecutor(
                SUBMIT_WORKERS, thread_name_prefix="engine-submit"
            )
        return executor


def stop_submitter(tm: TokenizerManager) -> None:
    """The engine shut down: its submit threads end (a call still queued runs, to EngineDeadError)."""
    with _submitters_lock:
        executor = _submitters.pop(tm, None)
    if executor is not None:
        executor.shutdown(wait=False)


def _abort_sent(tm: TokenizerManager, done: concurrent.futures.Future) -> None:
    """The caller was cancelled while its submission ran: abort what it sent."""
    if not done.cancelled() and done.exception() is None:
        states, _ = done.result()
        _abort_left(tm, {s.rid: s for s in states})


async def _async_submit(
    tm: TokenizerManager, submit: dict
) -> tuple[asyncio.Queue, list[ReqState], bool]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    listener = _listener(lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
    # the caller's (its current span parents the request's, when traced)
    context = contextvars.copy_context()
    try:
        future = _submitter(tm).submit(context.run, lambda: tm.submit(**submit, listener=listener))
    except RuntimeError as exc:  # the pool was shut down by a shutdown() racing this call
        raise EngineDeadError(tm.dead or "the engine was shut down") from exc
    try:
        states, is_batch = await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if not future.cancel():  # running or done: its requests are (or will be) sent
            future.add_done_callback(lambda done: _abort_sent(tm, done))
        raise
    return events, states, is_batch


async def _async_chunks(
    tm: TokenizerManager, events: asyncio.Queue, remaining: dict[str, ReqState]
) -> AsyncIterator[tuple]:
    try:
        while remaining:
            state, chunk = await events.get()
            if chunk is None:
                raise state.error
            if chunk["meta_info"]["finish_reason"] is not None:
                remaining.pop(state.rid, None)
            yield state, chunk
    finally:  # cancelled, or the consumer stopped: the requests must not run on
        _abort_left(tm, remaining)


async def async_collect(tm: TokenizerManager, submit: dict) -> list[dict] | dict:
    """Wait for every request of one call without blocking the event loop."""
    events, states, is_batch = await _async_submit(tm, submit)
    async for _ in _async_chunks(tm, events, {s.rid: s for s in states}):
        pass
    # off the event loop: a result's lists of logprobs are built here, and the output hook may take its time
    results = await asyncio.to_thread(lambda: [tm.output(s.result(), s.seq) for s in states])
    return results if is_batch else results[0]


async def async_stream(tm: TokenizerManager, submit: dict) -> AsyncStream:
    """Submit (bad input raises here), then an async iterator over the chunks."""
    events, states, _ = await _async_submit(tm, submit)
    remaining = {s.rid: s for s in states}
    return AsyncStream(tm, _chunks_only(_async_chunks(tm, events, remaining)), remaining)


async def _chunks_only(events: AsyncIterator[tuple]) -> AsyncIterator[dict]:
    async for _, chunk in events:
        yield chunk
