"""The detokenizer's outputs to the requests that wait for them (the receiver thread's work): text and
ids appended to each ReqState, a finished request's caller woken, a Stats answer handed to its question,
and every waiting caller failed once the engine is dead."""

from __future__ import annotations

import contextlib
import logging
import time

from engine import hooks
from engine.errors import EngineDeadError
from engine.frontend.request_state import ReqState
from engine.frontend.request_table import RequestTable
from engine.frontend.scheduler_queries import SchedulerQueries
from engine.ipc.messages import BatchTextOut, BeamTextOut, FinishReason, RequestMeta, Stats

logger = logging.getLogger(__name__)


def _done_hook(state: ReqState, error: str | None) -> None:
    """engine_request_done, from the receiver thread: a plugin error is logged, never raised there."""
    try:
        hooks.call(
            "engine_request_done",
            rid=state.rid,
            meta_info=state.meta_info(),
            error=error,
            seq=state.seq,
        )
    except BaseException as exc:  # noqa: BLE001 - the receiver must go on, or callers hang
        logger.error("engine: %s", exc)


class OutputDispatch:
    def __init__(self, table: RequestTable, queries: SchedulerQueries) -> None:
        self._table = table
        self._queries = queries

    def dispatch(self, message) -> None:
        if isinstance(message, BeamTextOut):
            state = self._table.states.get(message.rid)
            if state is not None:
                state.beam_out = message
                self._finish(
                    state,
                    message.hypotheses[0].finish
                    if message.hypotheses
                    else FinishReason("length", length=0),
                    message.meta,
                    time.perf_counter(),
                )
                if state.listener is not None:
                    with contextlib.suppress(Exception):
                        state.listener(state, "", [])
            return
        if isinstance(message, Stats):
            self._queries.answer(message)
            return
        assert isinstance(message, BatchTextOut)
        now = time.perf_counter()
        states = self._table.states
        headers = message.headers or [None] * len(message.rids)
        logprobs = message.logprobs or [None] * len(message.rids)
        for rid, delta, token, finish, meta, header, logprob in zip(
            message.rids,
            message.text_deltas,
            message.token_ids,
            message.finished,
            message.meta,
            headers,
            logprobs,
        ):
            state = states.get(rid)
            if state is None:
                continue
            if header is not None:
                state.header = header
            if delta:
                state.text_parts.append(delta)
            if token >= 0:
                if not state.output_ids:
                    state.first_token_at = now
                state.output_ids.append(token)
                if logprob is not None:
                    state.output_logprobs.append(logprob.logprob)
                    state.output_top.append(logprob.top)
            if finish is not None:
                self._finish(state, finish, meta, now)
            if state.listener is not None and (delta or token >= 0 or finish is not None):
                with contextlib.suppress(Exception):  # nor may a listener
                    state.listener(state, delta, [token] if token >= 0 else [])

    def _finish(
        self, state: ReqState, finish: FinishReason, meta: RequestMeta | None, now: float
    ) -> None:
        state.finish_reason, state.meta, state.finished_at = finish, meta, now
        self._table.remove_finished(state)
        if hooks.has("engine_request_done"):  # before the caller wakes: its spans end first
            _done_hook(state, None)
        state.done.set()
        if state.on_finish is not None:
            with contextlib.suppress(Exception):  # a progress callback must not stop the receiver
                state.on_finish(state)

    def fail_all(self, reason: str) -> None:
        """The engine is dead (a child died, the receiver failed, or it was shut down): every waiting
        caller, and every waiting question to the scheduler, gets EngineDeadError."""
        states = self._table.mark_dead(reason)
        dead = self._table.dead
        done_hook = hooks.has("engine_request_done")
        for state in states:
            state.error = EngineDeadError(dead)
            state.finished_at = time.perf_counter()
            if done_hook:
                _done_hook(state, dead)
            state.done.set()
            if state.listener is not None:
                with contextlib.suppress(Exception):
                    state.listener(state, None, None)
        self._queries.fail_all(dead)
